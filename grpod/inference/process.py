"""`InferenceProcess`: one vLLM OpenAI server, launched, watched and stopped by grpod.

The server (`python -m grpod.inference.server`, vLLM's stock server plus grpod's routes) runs in a
process group of its own, created at launch. That group is grpod's only handle on it: vLLM's
EngineCore (and Worker, `cpu_executor`) processes inherit it and keep it when they are orphaned, and stopping
signals exactly that group, never a name or a pattern, never a process outside it.

Guarantees:
- `start` returns only once `/health` answers 200; otherwise it raises `InferenceStartError`
  (timeout, or early exit with its code) with the tail of this launch's log, after stopping
  everything it launched. A fixed port that is taken fails before launching (`PortInUseError`).
- `stop` sends SIGTERM to the group, SIGKILL after `stop_grace_s`, and returns only once no
  process of the group remains, the port is free and (on an NVIDIA GPU) the group's processes
  hold no accelerator memory; each wait raises `ReleaseTimeoutError` after `release_timeout_s`.
- The group leader is reaped only after the whole group is gone. Until then its PID (= the PGID)
  cannot be recycled by the kernel, so a signal to the group can never reach a stranger.
- Each launch gets a scratch directory as its TMPDIR and ZMQ socket base, where vLLM leaves its
  IPC sockets and `vllm_dist_*` rendezvous files; `stop` removes it with the group's vLLM-named
  /dev/shm segments (only those its processes map: seen once it is healthy, and again at stop).
- The server stops with the daemon that launched it: once that process is gone (SIGKILL, OOM)
  it sends its group SIGTERM, and SIGKILL after `stop_grace_s`, as `stop` would have
  (`grpod.service.children.stop_group_with_parent`). An agent's engines do not: they serve on
  while the agent restarts, whose start stops them by their launch record.
- A launch is recorded in `<run>/vllm.launch.json` (pgid, scratch directory) until its stop
  completes. If a previous grpod of the same run directory was killed (SIGKILL, OOM) and its vLLM
  is still there (still stopping, or not stopping on SIGTERM), the next `start` stops that group
  first — only the processes that are in the recorded group AND carry the recorded scratch
  directory in their environment, so a recycled PID can never make it signal a stranger.
- Every launch gets a random token (`GRPOD_LAUNCH_TOKEN`) that grpod's server echoes on every
  answer; the clients `client()` makes check it, so readiness, health probes and the alignment
  probe only ever count answers from this launch. A server grpod did not launch answering on the
  port (a vLLM left by another, killed grpod that bound it after the free-port check) is a
  `PortTakenError` naming the process that holds the port, never adopted.
- Dev routes (`/pause`, `/collective_rpc`, ...) never listen on a non-loopback address without
  an API key (`UnsafeBindError`).
"""

from __future__ import annotations

import getpass
import ipaddress
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import anyio
import anyio.lowlevel
import psutil
import structlog

from grpod.config import ConfigError, InferenceConfig, ModelConfig
from grpod.inference import release
from grpod.inference.client import ForeignServerError, InferenceClient
from grpod.inference.routes import FORK_ENGINE_CORE_ENV, LAUNCH_TOKEN_ENV, SERVED_MODEL_NAME
from grpod.inference.threads_ext import THREADS_EXTENSION
from grpod.service.children import parent_env

log = structlog.get_logger(__name__)


LOG_TAIL_LINES = 30
# A start-up probe that hangs is abandoned and retried, so an early exit is still noticed promptly.
HEALTH_PROBE_TIMEOUT_S = 5.0
# Between start-up probes (not inference.health_interval_s, the serving engine's watch): until
# vLLM listens a probe is a refused connect (well under a millisecond), and each 0.1 s of the poll
# is start-up time lost on average by half. The tiny model's server listens ~9 s after launch here.
STARTUP_POLL_S = 0.1


PORT_ADVICE = (
    "grpod never adopts a server it did not launch (a vLLM left running by another grpod that was "
    "killed?): stop that process, or choose another inference.port (0 = a free one)"
)


class InferenceStartError(RuntimeError):
    """vLLM did not become healthy; the message carries the reason and the tail of its log.

    `pgid` is the process group of the failed launch (None if nothing was launched); by the time
    the error reaches the caller that group has been stopped. `exit_code`: vLLM's, when it exited
    (2 is its argument parser's: it refused its command line).
    """

    def __init__(self, message: str, *, pgid: int | None = None, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.pgid = pgid
        self.exit_code = exit_code


class PortInUseError(InferenceStartError):
    """The configured fixed port is already taken by another process."""


class PortTakenError(InferenceStartError):
    """Another process (not this launch) took the port while vLLM was starting."""


class UnsafeBindError(ValueError):
    """Dev endpoints would face a network without an API key."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def server_argv(
    cfg: InferenceConfig,
    model: ModelConfig,
    model_path: Path | str,
    port: int,
    gpu: bool,
    *,
    lora_modules: dict[str, str] | None = None,
    enable_lora: bool = False,
    max_lora_rank: int = 16,
    lora_target_modules: list[str] | None = None,
    worker_extension: str | None = None,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The command line of grpod's vLLM server for one launch (`extra_args`: a bridge mode's own,
    before the user's `inference.extra_args`)."""
    lora = bool(enable_lora or lora_modules)
    args = [
        sys.executable, "-m", "grpod.inference.server",
        "--model", str(model_path),
        "--served-model-name", *served_model_names(model, lora=lora),
        "--host", cfg.host,
        "--port", str(port),
        "--dtype", model.dtype,
        "--max-model-len", str(model.max_seq_len),
        # The trainer divides its logits by the sampling temperature; vLLM must report the
        # same temperature-processed logprobs (its default is the raw, pre-temperature ones).
        "--logprobs-mode", "processed_logprobs",
        # vLLM's neutral sampling defaults, not the model's generation_config.json (see
        # grpod.inference.sampling): the trainer replicates plain temperature sampling only.
        "--generation-config", "vllm",
        "--disable-access-log-for-endpoints", "/health",
        # vLLM's token-in / token-out route, which reports the weight version of every sampled id
        # (multi-turn episodes use it: a weight update in flight splits a turn between versions).
        "--enable-scale-out",
    ]  # fmt: skip
    if gpu:
        args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    else:
        args += ["--kv-cache-memory-bytes", cfg.kv_cache_bytes]
    block_size = block_size_for(cfg, gpu)
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    if cfg.enforce_eager:
        args.append("--enforce-eager")
    if not gpu and cpu_executor(cfg) == "uni":
        args += ["--distributed-executor-backend", "uni"]
    if lora:
        args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
        if lora_target_modules:
            # Only the modules the adapters adapt are wrapped. Without it vLLM wraps every
            # module that supports LoRA, lm_head included for Llama-family models, and on CPU
            # its LoRA logits path fails on prompt logprobs (SmolLM2: einsum size mismatch,
            # engine dead at the first probe).
            args += ["--lora-target-modules", *lora_target_modules]
    if lora_modules:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    if not worker_extension and not gpu and cpu_executor(cfg) == "uni":
        worker_extension = THREADS_EXTENSION  # a mode without an extension: the thread setting alone
    if worker_extension:
        args += ["--worker-extension-cls", worker_extension]
    return args + list(extra_args or []) + list(cfg.extra_args)


def served_model_names(model: ModelConfig, *, lora: bool = False) -> list[str]:
    """`policy` first (what grpod's own requests name), then, serving full weights, the model
    as `model.path` spells it and as an absolute path, so an environment configured with the
    model's path reaches the policy. In LoRA modes those names would reach the base model
    without the adapter, so only `policy` and the adapters' names are served there."""
    names = [SERVED_MODEL_NAME]
    if not lora:
        for alias in (str(model.path), str(Path(model.path).resolve())):
            if alias not in names:
                names.append(alias)
    return names


def server_env(cfg: InferenceConfig) -> dict[str, str]:
    """Variables added to grpod's environment for the server.

    The API key travels in `VLLM_API_KEY` (read by vLLM and grpod's server alike) rather than
    `--api-key`, so it does not show in the process list.
    """
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "PYTHONUNBUFFERED": "1",
    }
    if cfg.api_key:
        env["VLLM_API_KEY"] = cfg.api_key
    env.update(cfg.env)
    return env


# A log line longer than this is cut in error messages (vLLM logs its whole config on one line).
LOG_LINE_CHARS = 300
LAUNCH_MARK = b"=== grpod launch "  # heads what each launch writes to its log
TAIL_READ_BYTES = 256 << 10


# A CPU engine's KV block under inference.block_size = "auto": the shortest vLLM's CPU attention
# takes (a multiple of 32). SmolLM2, groups of 8, 16-token completions: 84 -> 122 tokens/s
# against vLLM's 128 (bench/engine_batch.py --block-sizes 128 32).
CPU_BLOCK_SIZE = 32


def block_size_for(cfg: InferenceConfig, gpu: bool) -> int | None:
    """The --block-size grpod passes (None: vLLM's default). vLLM's CPU default block (128 tokens)
    is longer than most prompts, and its prefix cache shares whole blocks only, so each of a
    group's completions would compute the shared prompt again. ConfigError for a block a CPU
    engine cannot run."""
    if cfg.block_size == "auto":
        return None if gpu else CPU_BLOCK_SIZE
    if not gpu and cfg.block_size % CPU_BLOCK_SIZE:
        raise ConfigError(
            f"inference.block_size = {cfg.block_size}: a CPU engine's block must be a multiple of "
            f"{CPU_BLOCK_SIZE} (vLLM's CPU attention); \"auto\" picks {CPU_BLOCK_SIZE}"
        )
    return cfg.block_size


def cpu_executor(cfg: InferenceConfig) -> str:
    """How a CPU engine runs vLLM's worker: "uni" (inside EngineCore) or "mp" (a Worker process).

    "auto" picks "uni" unless the engine's cores are pinned: vLLM applies VLLM_CPU_OMP_THREADS_BIND
    only in a Worker process of its own (its CPU platform turns "uni" into "mp" for that reason).
    "uni" saves one process start and, with EngineCore forked instead of spawned, a second import
    of vLLM and torch: a tiny model's server answered /health after 17 s instead of 40 s on this
    2-core machine (bench/peers/README.md). CPU per engine step is the same either way
    (bench/profile_step.py).
    """
    if cfg.cpu_executor != "auto":
        return cfg.cpu_executor
    pinned = cfg.engines > 1 or bool(cfg.cpu_binds) or "VLLM_CPU_OMP_THREADS_BIND" in cfg.env
    return "mp" if pinned else "uni"


def executor_env(cfg: InferenceConfig, gpu: bool) -> dict[str, str]:
    """A CPU engine whose worker runs inside EngineCore (`cpu_executor` "uni") needs vLLM's switch
    for that (VLLM_ENABLE_V1_MULTIPROCESSING=0; vLLM's API server still runs EngineCore in a
    process of its own). Such an engine's EngineCore is forked from the API server rather than
    spawned (`grpod.inference.server._fork_engine_core`)."""
    if gpu or cpu_executor(cfg) != "uni":
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", FORK_ENGINE_CORE_ENV: "1"}


# A CPU engine's bound on oneDNN's cache of compiled primitives (default_env).
ONEDNN_CACHE_ENTRIES = 128


def default_env(cfg: InferenceConfig, gpu: bool) -> dict[str, str]:
    """grpod's defaults for a CPU engine, each overridden by the same variable in `inference.env`:

    - OMP_NUM_THREADS for an engine whose worker runs inside EngineCore (vLLM would set 1): the
      machine's cores less the one vLLM's own CPU binding leaves to the rest (the trainer, here);
    - TORCHDYNAMO_DISABLE=1 with `inference.enforce_eager`: such an engine runs without
      torch.compile, except for one sampler op vLLM compiles on the first request that asks for
      logprobs (the rank of each token; every grpod request asks): 2-3 CPU-s at each launch on
      this machine, the whole of the first alignment probe (2.1 s -> 0.09 s without it). Not on
      GPU: unmeasured there;
    - ONEDNN_PRIMITIVE_CACHE_CAPACITY=128 (`ONEDNN_CACHE_ENTRIES`): oneDNN keeps a compiled
      primitive for each batch shape the CPU build's packed linears meet, 1024 of them by default;
      filling them grew the embedded default's engine from 1185 to 1758 MiB in 1000 steps. At 128
      it stayed at 1290-1306 MiB at the same steps/s (bench/results/onednn_cache.json; SmolLM2:
      102-107 tokens/s either way).
    """
    if gpu:
        return {}
    env = {}
    if cpu_executor(cfg) == "uni":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) - 1))
    if cfg.enforce_eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(ONEDNN_CACHE_ENTRIES)
    return env


def engine_env(cfg: InferenceConfig, index: int, gpu: bool) -> dict[str, str]:
    """Engine `index`'s own cores or GPU. One engine keeps vLLM's own choice; several are spread
    (engine i on core i, or GPU i, modulo what the machine has) unless listed in the config."""
    if gpu:
        if cfg.gpu_ids:
            return {"CUDA_VISIBLE_DEVICES": cfg.gpu_ids[index]}
        return {"CUDA_VISIBLE_DEVICES": str(index % max(release.nvidia_gpu_count(), 1))} if cfg.engines > 1 else {}
    if cpu_executor(cfg) == "uni":
        return {}
    if cfg.cpu_binds:
        return {"VLLM_CPU_OMP_THREADS_BIND": cfg.cpu_binds[index]}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1))} if cfg.engines > 1 else {}


class LaunchLog:
    """The server's log file, appended to by every launch, each headed by LAUNCH_MARK; what the
    latest launch wrote is readable (`tail`), also after `grpod.service.logs.LogLimit` cut the
    file's head."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open_for_launch(self, argv: list[str]):
        """The file to hand the child as stdout/stderr, headed by the command line."""
        f = self.path.open("ab")
        f.write(LAUNCH_MARK + f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {shlex.join(argv)}\n".encode())
        f.flush()
        return f

    def tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last `lines` lines the latest launch wrote (its header on, if among them), each cut
        to LOG_LINE_CHARS; read from the file's last TAIL_READ_BYTES."""
        try:
            with self.path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_READ_BYTES))
                data = f.read()
        except OSError:
            return []
        data = data[max(0, data.rfind(LAUNCH_MARK)):]
        text = data.decode(errors="replace")
        cut = (line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS] + " [...]" for line in text.splitlines())
        return list(deque(cut, maxlen=lines))

    def excerpt(self) -> str:
        return f"last lines of {self.path}:\n" + "\n".join(self.tail())


class LaunchRecord:
    """`<run>/vllm.launch.json`: the process group and scratch directory of the launch running
    now, and once it is healthy its processes (pid and start time), kept until its stop completes,
    so the next start of the same run can stop what a killed predecessor left — only the processes
    in that group that carry that scratch directory in their environment or are one of those
    recorded, so a recycled PID never makes it signal a stranger. (vLLM's EngineCore renames
    itself, which overwrites the environment /proc shows: found by its record, not its env.)"""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, pgid: int, scratch: Path, members: list[psutil.Process] = ()) -> None:
        known = [identity for identity in map(_identity, members) if identity is not None]
        self.path.write_text(json.dumps({"pgid": pgid, "scratch": str(scratch), "members": known}))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    async def stop_left_behind(self, grace_s: float, kill_wait_s: float) -> None:
        try:
            record = json.loads(self.path.read_text())
            pgid, scratch = int(record["pgid"]), str(record["scratch"])
            known = {(int(pid), float(started)) for pid, started in record.get("members", [])}
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError):
            log.warning("launch_record_unreadable", path=str(self.path))
            self.clear()
            return
        ours = [p for p in release.group_members(pgid)
                if release.process_env(p, "VLLM_RPC_BASE_PATH") == scratch or _identity(p) in known]
        if ours:
            log.warning("inference_left_behind", pgid=pgid, processes=len(ours), scratch=scratch)
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
                for proc in ours:
                    try:
                        proc.send_signal(sig)
                    except psutil.NoSuchProcess:
                        pass
                _, alive = await anyio.to_thread.run_sync(lambda wait_s=wait_s: psutil.wait_procs(ours, timeout=wait_s))
                if not alive:
                    break
        shutil.rmtree(scratch, ignore_errors=True)
        self.clear()


def _identity(proc: psutil.Process) -> tuple[int, float] | None:
    """(pid, start time): a process no recycled PID can pass for; None once it is gone."""
    try:
        return proc.pid, round(proc.create_time(), 2)
    except psutil.Error:
        return None


def launch_scratch() -> tuple[Path, dict[str, str]]:
    """A new scratch directory for one launch, and the variables that point vLLM's temporary
    files and IPC sockets at it (removed at stop)."""
    # Short on purpose: ZMQ IPC socket paths must fit in 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="grpod-vllm-"))
    # Keep torch.compile's cache where it would be without the TMPDIR below. torch also keeps
    # its precompiled C++ header under the temp dir whatever TORCHINDUCTOR_CACHE_DIR says
    # (torch/_inductor/codecache.py, _HEADER_DIR): linked back to the lasting cache, vLLM's
    # CPU build does not compile it again at every launch (~8-10 CPU-s measured per launch).
    inductor_name = f"torchinductor_{getpass.getuser()}"
    inductor_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), inductor_name))
    Path(inductor_cache).mkdir(parents=True, exist_ok=True)
    (scratch / inductor_name).symlink_to(inductor_cache, target_is_directory=True)
    return scratch, {"TMPDIR": str(scratch), "VLLM_RPC_BASE_PATH": str(scratch), "TORCHINDUCTOR_CACHE_DIR": inductor_cache}


class InferenceProcess:
    """One vLLM server child in its own process group. Not reentrant: one launch at a time."""

    def __init__(
        self,
        cfg: InferenceConfig,
        model: ModelConfig,
        run_dir: Path,
        *,
        gpu: bool | None = None,
        index: int = 0,
        env: dict[str, str] | None = None,
        outlives_launcher: bool = False,
    ) -> None:
        """`gpu`: size the KV cache for an NVIDIA GPU (None = detect with NVML). `index`: which
        engine of the run this is (its log and launch record are `vllm.log` / `vllm.launch.json`
        for engine 0, `vllm-<index>.log` / `vllm-<index>.launch.json` after) and, with a fixed
        `inference.port`, its port (`port + index`). `env`: variables for this engine only (its
        CPU cores or GPU), added after `inference.env`. `outlives_launcher`: the server does not
        stop when this process dies (an agent's engines serve on while the agent restarts)."""
        if not is_loopback(cfg.host) and not cfg.api_key:
            raise UnsafeBindError(
                f"inference.host = {cfg.host!r} is not a loopback address and inference.api_key is not set: "
                "vLLM's dev endpoints (/pause, /collective_rpc, ...) would be open to the network. "
                "Set inference.api_key or bind 127.0.0.1."
            )
        self.cfg = cfg
        self.model = model
        self.run_dir = Path(run_dir)
        self.gpu = release.nvidia_gpu_count() > 0 if gpu is None else gpu
        block_size_for(cfg, self.gpu)  # a block this engine cannot run is refused before any launch
        self._popen: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._model_path: Path | None = None
        self._scratch: Path | None = None
        self._segments: set[Path] = set()
        self.fixed_port = cfg.port + index if cfg.port else 0
        self.outlives_launcher = outlives_launcher
        self.engine_env = dict(env or {})
        suffix = f"-{index}" if index else ""
        self.log = LaunchLog(self.run_dir / f"vllm{suffix}.log")
        self._record = LaunchRecord(self.run_dir / f"vllm{suffix}.launch.json")
        self._last_exit_code: int | None = None
        self._launch_token: str | None = None
        self._stopping = anyio.Lock()  # one stop at a time: a start's own, a bridge's, a shutdown's

    @property
    def log_path(self) -> Path:
        return self.log.path

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def pgid(self) -> int | None:
        """The process group created at launch (the leader's PID)."""
        return self.pid

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def base_url(self) -> str:
        if self._port is None:
            raise RuntimeError("InferenceProcess has no port before start()")
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self._port}"

    @property
    def running(self) -> bool:
        """True from launch until the server process has exited."""
        return self._popen is not None and exit_code_of(self._popen) is None

    @property
    def exit_code(self) -> int | None:
        """The server's exit code once it has exited (negative: killed by that signal)."""
        return exit_code_of(self._popen) if self._popen is not None else self._last_exit_code

    def client(self, timeout_s: float | None = None) -> InferenceClient:
        """A client for this launch of the server (use it as `async with`): it accepts only
        answers that carry this launch's token."""
        return InferenceClient(
            self.base_url, timeout_s or self.cfg.request_timeout_s, self.cfg.api_key, launch_token=self._launch_token,
            generation_timeout_s=self.cfg.generation_timeout_s, core_timeout_s=self.cfg.stall_timeout_s,
        )

    def build_args(self, model_path: Path | str, **launch_kw) -> list[str]:
        """The server's argv (`server_argv`); `--port` is the resolved port once `start` picked
        it, else the configured one."""
        port = self._port if self._port is not None else self.fixed_port
        return server_argv(self.cfg, self.model, model_path, port, self.gpu, **launch_kw)

    def served_model_names(self, *, lora: bool = False) -> list[str]:
        return served_model_names(self.model, lora=lora)

    def build_env(self) -> dict[str, str]:
        # grpod's defaults < inference.env (in server_env) < the executor's switches < this engine's own.
        return default_env(self.cfg, self.gpu) | server_env(self.cfg) | executor_env(self.cfg, self.gpu) | self.engine_env

    def _resolve_port(self) -> int:
        host = self.cfg.host
        if self.fixed_port == 0:
            # A relaunch keeps the port the first launch picked while it is free: environments keep their URL.
            if self._port is not None and release.port_is_free(host, self._port):
                return self._port
            return release.free_port(host)
        if not release.port_is_free(host, self.fixed_port):
            raise PortInUseError(
                f"inference.port {self.fixed_port} on {host} is already in use by another process; "
                "stop it, choose another inference.port, or set inference.port = 0 for a free one"
            )
        return self.fixed_port

    async def start(self, model_path: Path | str, **build_kw) -> None:
        """Launch the server on `model_path` and return once `/health` answers 200.

        `build_kw` goes to `build_args` (LoRA modules, worker extension). On any failure,
        cancellation included, everything launched is stopped before the error propagates.
        """
        if self._popen is not None:
            raise InferenceStartError(f"vLLM is already launched (pid {self.pid}); stop() it first")
        await self.stop_left_behind()
        self._port = self._resolve_port()
        self._model_path = Path(model_path)
        argv = self.build_args(model_path, **build_kw)
        # A start cancelled while it ran without a checkpoint (a build in a thread) launches nothing.
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._launch(argv)
        self._last_exit_code = None
        log.info("inference_launched", pid=self.pid, port=self._port, model=str(model_path), log=str(self.log_path))
        started = time.monotonic()
        try:
            await self._wait_healthy()
        except anyio.get_cancelled_exc_class():
            log.info("inference_start_cancelled", pid=self.pid)  # a stop request, not a failure
            await self.stop()
            raise
        except BaseException as exc:
            log.error("inference_start_failed", pid=self.pid, error=(str(exc).splitlines() or [repr(exc)])[0])
            await self.stop()
            raise
        log.info("inference_healthy", pid=self.pid, port=self._port, elapsed_s=round(time.monotonic() - started, 2))
        members = await anyio.to_thread.run_sync(release.group_members, self.pgid)
        # Its /dev/shm segments, removed at stop even when its processes are gone (crash, SIGKILL).
        self._segments = await anyio.to_thread.run_sync(release.vllm_shm_segments, members)
        self._record.write(self.pgid, self._scratch, members)

    def _launch(self, argv: list[str]) -> None:
        """Spawn the server in a new session (its own process group), output appended to the log."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        scratch, scratch_env = launch_scratch()
        self._launch_token = secrets.token_hex(16)
        env = {**os.environ, **scratch_env, **self.build_env(), LAUNCH_TOKEN_ENV: self._launch_token,
               **({} if self.outlives_launcher else parent_env(self.cfg.stop_grace_s))}
        try:
            with self.log.open_for_launch(argv) as log_file:
                self._popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        except OSError as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise InferenceStartError(f"cannot launch vLLM with {argv[0]!r} (log {self.log_path}): {exc}") from exc
        self._scratch = scratch
        self._record.write(self._popen.pid, scratch)

    async def _wait_healthy(self) -> None:
        timeout = self.cfg.start_timeout_s
        async with self.client() as client:
            with anyio.move_on_after(timeout):
                while True:
                    code = exit_code_of(self._popen)
                    if code is not None:
                        holder = self._port_holder()
                        if holder is not None:
                            raise PortTakenError(
                                f"vLLM exited with code {code}: inference.port {self._port} on {self.cfg.host} was taken by "
                                f"{holder} after grpod checked that it was free. {PORT_ADVICE}",
                                pgid=self.pgid,
                            )
                        raise InferenceStartError(
                            f"vLLM exited with code {code} before becoming healthy "
                            f"(model {self._model_path}, port {self._port}); {self.log.excerpt()}",
                            pgid=self.pgid, exit_code=code,
                        )
                    try:
                        if await client.health(timeout_s=min(HEALTH_PROBE_TIMEOUT_S, timeout)):
                            return
                    except ForeignServerError:
                        raise PortTakenError(
                            f"inference.port {self._port} on {self.cfg.host} is answered by "
                            f"{self._port_holder() or 'a process that is not'} — not the vLLM this grpod launched "
                            f"(pid {self.pid}; its answers lack this launch's token). {PORT_ADVICE}",
                            pgid=self.pgid,
                        ) from None
                    await anyio.sleep(min(STARTUP_POLL_S, self.cfg.health_interval_s))
        raise InferenceStartError(
            f"vLLM did not answer /health within inference.start_timeout_s = {timeout:g} s; "
            f"raise it if start-up is just slow; {self.log.excerpt()}",
            pgid=self.pgid,
        )

    def _port_holder(self) -> str | None:
        """'pid N (command line)' of a process outside this launch's group listening on the port."""
        return release.port_holder(self._port, exclude_pgid=self.pgid if self._popen is not None else None)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last `lines` lines this launch wrote to the log (long lines cut)."""
        return self.log.tail(lines)

    async def wait_exit(self) -> int:
        """Wait until the server process exits (for a crash watch) and return its exit code.

        A watch rather than a bounded wait: the caller bounds it by cancelling. Event-driven
        through a pidfd, so a long watch costs nothing.
        """
        popen = self._popen
        if popen is None:
            raise RuntimeError("wait_exit() before start()")
        if popen.returncode is None:
            # The leader is unreaped until stop() is done, so this PID is still ours.
            pidfd = os.pidfd_open(popen.pid)
            try:
                await anyio.wait_readable(pidfd)
            finally:
                os.close(pidfd)
        return exit_code_of(popen)

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    async def stop_left_behind(self) -> None:
        """Stop what a killed predecessor launched in this slot (its launch record names it)."""
        await self._record.stop_left_behind(self.cfg.stop_grace_s, self.cfg.release_timeout_s)

    async def stop(self) -> None:
        """Stop the server and wait until its processes, port and GPU memory are released.

        Idempotent; safe after a crash (what is left of the group is stopped the same way).
        Shielded from cancellation: a half-done stop would leak the very processes it exists to
        end, and every wait inside is bounded by `stop_grace_s` / `release_timeout_s`.
        """
        with anyio.CancelScope(shield=True):
            async with self._stopping:  # a second stop waits, then finds nothing left to stop
                await self._stop()

    async def _stop(self) -> None:
        popen = self._popen
        if popen is None:
            return
        pgid, port, cfg = self.pgid, self._port, self.cfg
        started = time.monotonic()
        members = release.group_members(pgid)
        member_pids = {p.pid for p in members}
        segments = await anyio.to_thread.run_sync(release.vllm_shm_segments, members) | self._segments
        self._segments = set()
        killed = False
        if members:
            log.info("inference_stopping", pgid=pgid, processes=len(members))
            self._signal_group(signal.SIGTERM)
            try:
                await release.wait_group_gone(pgid, cfg.stop_grace_s)
            except release.ReleaseTimeoutError:
                killed = True
                log.warning("inference_sigkill", pgid=pgid, grace_s=cfg.stop_grace_s)
                self._signal_group(signal.SIGKILL)
                await release.wait_group_gone(pgid, cfg.release_timeout_s)
        self._last_exit_code = await release.reap_leader(popen, pgid, cfg.release_timeout_s)
        self._popen = None
        holder = None if release.port_is_free(cfg.host, port) else self._port_holder()
        if holder is not None:
            # This group is gone; the listener is someone else's and is not waited for.
            log.warning("inference_port_held_by_other", port=port, holder=holder)
        else:
            await release.wait_port_free(cfg.host, port, cfg.release_timeout_s)
        if self.gpu:
            await release.wait_gpu_memory_released(member_pids, cfg.release_timeout_s)
        removed = release.remove_shm_segments(segments)
        self._record.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        log.info(
            "inference_stopped",
            pgid=pgid,
            exit_code=self._last_exit_code,
            sigkill=killed,
            shm_removed=len(removed),
            elapsed_s=round(time.monotonic() - started, 2),
        )


def exit_code_of(popen: subprocess.Popen[bytes]) -> int | None:
    """The child's exit code if it has exited, without reaping it (see the module docstring)."""
    if popen.returncode is not None:
        return popen.returncode
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return popen.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
