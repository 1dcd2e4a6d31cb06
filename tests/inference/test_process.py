"""InferenceProcess: its argv and env, the loopback/API-key rule, and the launch/stop lifecycle.

The lifecycle cases here run a stub server (tests/inference/stub_server.py) in place of vLLM for
what a real vLLM cannot do on demand: exit at once, never answer, ignore SIGTERM, leave an orphan.
The same lifecycle with a real vLLM is in tests/e2e/test_inference_process.py.
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import psutil
import pytest
import structlog.testing
from pydantic import ValidationError

from grpod.config import ConfigError, InferenceConfig, ModelConfig
from grpod.inference.process import (
    CPU_BLOCK_SIZE,
    InferenceProcess,
    InferenceStartError,
    PortInUseError,
    PortTakenError,
    UnsafeBindError,
    is_loopback,
)
from grpod.inference.release import group_members, port_is_free
from grpod.service.children import GRACE_ENV, PARENT_PID_ENV
from tests.harness import start_decoy

STUB = Path(__file__).with_name("stub_server.py")
MODEL = ModelConfig(path=Path("/models/tiny"), dtype="bfloat16", max_seq_len=128)


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_args_run_grpod_server_with_model_settings_on_cpu():
    proc = InferenceProcess(InferenceConfig(port=8123, kv_cache_bytes="96M"), MODEL, Path("run"), gpu=False)
    args = proc.build_args("/ckpt/step-3")
    assert args[:3] == [sys.executable, "-m", "grpod.inference.server"]
    assert _value(args, "--model") == "/ckpt/step-3"
    assert _value(args, "--host") == "127.0.0.1"
    assert _value(args, "--port") == "8123"
    assert _value(args, "--dtype") == "bfloat16"
    assert _value(args, "--max-model-len") == "128"
    assert _value(args, "--kv-cache-memory-bytes") == "96M"
    assert "--gpu-memory-utilization" not in args
    assert _value(args, "--logprobs-mode") == "processed_logprobs"
    # the model's generation_config.json sampling defaults are not applied behind the trainer's back
    assert _value(args, "--generation-config") == "vllm"
    names = args[args.index("--served-model-name") + 1 : args.index("--host")]
    assert names == ["policy", "/models/tiny"], "policy first, then the model's path (issue #16 item 7)"
    lora_args = proc.build_args("/m", enable_lora=True)
    assert lora_args[lora_args.index("--served-model-name") + 1 : lora_args.index("--host")] == ["policy"]
    assert "--enforce-eager" in args
    assert "--enable-lora" not in args
    # A mode without an extension of its own still gets the engine-threads one (grpod.inference.cores).
    assert _value(args, "--worker-extension-cls") == "grpod.inference.threads_ext.EngineThreads"
    pinned = InferenceProcess(InferenceConfig(cpu_executor="mp"), MODEL, Path("run"), gpu=False).build_args("/m")
    assert "--worker-extension-cls" not in pinned, "a pinned Worker process never borrows cores"


def test_args_on_gpu_size_kv_cache_by_memory_fraction():
    cfg = InferenceConfig(gpu_memory_utilization=0.3, enforce_eager=False)
    args = InferenceProcess(cfg, MODEL, Path("run"), gpu=True).build_args("/m")
    assert _value(args, "--gpu-memory-utilization") == "0.3"
    assert "--kv-cache-memory-bytes" not in args
    assert "--enforce-eager" not in args


def test_a_cpu_engine_gets_a_kv_block_short_enough_to_share_a_groups_prompt():
    """vLLM's CPU default block (128 tokens) is longer than most prompts, and its prefix cache
    shares whole blocks only: grpod passes a short block on a CPU, vLLM's own on a GPU, and the
    setting when one is given."""
    cpu = InferenceProcess(InferenceConfig(), MODEL, Path("run"), gpu=False).build_args("/m")
    assert _value(cpu, "--block-size") == str(CPU_BLOCK_SIZE) and CPU_BLOCK_SIZE < 128
    assert "--block-size" not in InferenceProcess(InferenceConfig(), MODEL, Path("run"), gpu=True).build_args("/m")
    chosen = InferenceProcess(InferenceConfig(block_size=64), MODEL, Path("run"), gpu=True).build_args("/m")
    assert _value(chosen, "--block-size") == "64"
    for bad in (0, 8, 24, 512):
        with pytest.raises(ValidationError, match="block_size"):
            InferenceConfig(block_size=bad)
    with pytest.raises(ConfigError, match="inference.block_size = 48: a CPU engine's block must be a multiple of 32"):
        InferenceProcess(InferenceConfig(block_size=48), MODEL, Path("run"), gpu=False)


def test_args_lora_extension_and_extra_args_last():
    cfg = InferenceConfig(extra_args=["--max-num-seqs", "8"])
    args = InferenceProcess(cfg, MODEL, Path("run"), gpu=False).build_args(
        "/m", lora_modules={"policy-v2": "/a/v2"}, max_lora_rank=32, worker_extension="grpod.inference.ext.Ext"
    )
    assert "--enable-lora" in args
    assert _value(args, "--max-lora-rank") == "32"
    assert _value(args, "--lora-modules") == "policy-v2=/a/v2"
    assert _value(args, "--worker-extension-cls") == "grpod.inference.ext.Ext"
    assert args[-2:] == ["--max-num-seqs", "8"]
    plain = InferenceProcess(InferenceConfig(), MODEL, Path("run"), gpu=False).build_args("/m", enable_lora=True)
    assert _value(plain, "--max-lora-rank") == "16" and "--lora-modules" not in plain
    targeted = InferenceProcess(InferenceConfig(), MODEL, Path("run"), gpu=False).build_args(
        "/m", enable_lora=True, lora_target_modules=["q_proj", "v_proj"]
    )
    i = targeted.index("--lora-target-modules")
    assert targeted[i + 1 : i + 3] == ["q_proj", "v_proj"], "vLLM wraps only what the adapter adapts"


def test_env_enables_dev_routes_runtime_lora_and_config_env():
    cfg = InferenceConfig(env={"VLLM_CPU_OMP_THREADS_BIND": "all"})
    env = InferenceProcess(cfg, MODEL, Path("run"), gpu=False).build_env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "all"
    assert "VLLM_API_KEY" not in env


def test_one_unpinned_cpu_engine_runs_its_worker_inside_engine_core():
    """"auto": vLLM's worker inside EngineCore for one CPU engine whose cores are not pinned; a
    Worker process of its own (vLLM's default) where VLLM_CPU_OMP_THREADS_BIND must apply, on GPU,
    or when asked for."""

    def launch(gpu: bool = False, **cfg) -> tuple[list[str], dict[str, str]]:
        proc = InferenceProcess(InferenceConfig(**cfg), MODEL, Path("run"), gpu=gpu)
        return proc.build_args("/m"), proc.build_env()

    args, env = launch()
    assert _value(args, "--distributed-executor-backend") == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["GRPOD_FORK_ENGINE_CORE"] == "1"
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) - 1))
    _, env = launch(env={"OMP_NUM_THREADS": "3"})
    assert env["OMP_NUM_THREADS"] == "3", "inference.env wins"
    for pinned in (
        {"engines": 2},
        {"engines": 2, "cpu_binds": ["0", "1"]},
        {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
        {"cpu_executor": "mp"},
    ):
        args, env = launch(**pinned)
        assert "--distributed-executor-backend" not in args, pinned
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "GRPOD_FORK_ENGINE_CORE" not in env, pinned
    args, env = launch(gpu=True)
    assert "--distributed-executor-backend" not in args and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    args, env = launch(engines=2, cpu_executor="uni")
    assert _value(args, "--distributed-executor-backend") == "uni" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_an_eager_cpu_engine_runs_vllms_compiled_sampler_op_as_plain_torch():
    """enforce_eager on CPU: TORCHDYNAMO_DISABLE=1, so the first logprobs request does not pay a
    torch.compile (2-3 CPU-s); not when the engine compiles anyway, not on GPU, and inference.env wins."""

    def env(gpu: bool = False, **cfg) -> dict[str, str]:
        return InferenceProcess(InferenceConfig(**cfg), MODEL, Path("run"), gpu=gpu).build_env()

    assert env()["TORCHDYNAMO_DISABLE"] == "1"
    assert env(engines=2)["TORCHDYNAMO_DISABLE"] == "1", "pool engines too"
    assert "TORCHDYNAMO_DISABLE" not in env(enforce_eager=False)
    assert "TORCHDYNAMO_DISABLE" not in env(gpu=True)
    assert env(env={"TORCHDYNAMO_DISABLE": "0"})["TORCHDYNAMO_DISABLE"] == "0"


def test_a_cpu_engine_bounds_onednns_primitive_cache_unless_told_otherwise():
    """oneDNN's cache of compiled primitives grew a CPU engine by ~570 MiB in 1000 steps at its own
    bound (1024); grpod's default is 128, inference.env wins, a GPU engine is left as it is."""

    def env(gpu: bool = False, **cfg) -> dict[str, str]:
        return InferenceProcess(InferenceConfig(**cfg), MODEL, Path("run"), gpu=gpu).build_env()

    assert env()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"
    assert env(engines=2, enforce_eager=False)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"
    assert env(env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"})["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in env(gpu=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "localhost", "::1"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host)
    InferenceProcess(InferenceConfig(host=host), MODEL, Path("run"), gpu=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.7", "::", "gpu-node-3"])
def test_network_host_without_key_is_refused(host):
    with pytest.raises(UnsafeBindError, match="api_key"):
        InferenceProcess(InferenceConfig(host=host), MODEL, Path("run"), gpu=False)


def test_network_host_with_key_passes_key_outside_argv():
    proc = InferenceProcess(InferenceConfig(host="0.0.0.0", api_key="s3cret"), MODEL, Path("run"), gpu=False)
    assert proc.build_env()["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in " ".join(proc.build_args("/m"))


class StubProcess(InferenceProcess):
    """The real lifecycle code launching the stub server instead of vLLM."""

    def __init__(self, run_dir: Path, *stub_flags: str, outlives_launcher: bool = False, **cfg) -> None:
        cfg = {"start_timeout_s": 20.0, "stop_grace_s": 0.5, "release_timeout_s": 10.0, "health_interval_s": 0.05} | cfg
        super().__init__(InferenceConfig(**cfg), MODEL, run_dir, gpu=False, outlives_launcher=outlives_launcher)
        self.stub_flags = list(stub_flags)

    def build_args(self, model_path, **kw) -> list[str]:
        return [sys.executable, str(STUB), "--port", str(self.port), *self.stub_flags]


def _assert_released(pgid: int, port: int) -> None:
    assert group_members(pgid) == [], f"left in group {pgid}: {group_members(pgid)}"
    assert port_is_free("127.0.0.1", port)


@pytest.mark.anyio
async def test_early_exit_raises_with_code_and_log_tail(tmp_path):
    proc = StubProcess(tmp_path, "--exit-code", "3")
    with pytest.raises(InferenceStartError) as err:
        await proc.start("/models/none")
    message = str(err.value)
    assert "exited with code 3" in message
    assert "stub failure: model directory has no config.json" in message
    assert not proc.running and proc.exit_code == 3
    _assert_released(err.value.pgid, proc.port)
    assert proc.log_path.read_text().startswith("=== grpod launch ")


@pytest.mark.anyio
async def test_start_timeout_names_timeout_and_stops_everything(tmp_path):
    proc = StubProcess(tmp_path, "--no-health", "--orphan", start_timeout_s=1.5)
    with pytest.raises(InferenceStartError, match=r"start_timeout_s = 1\.5 s") as err:
        await proc.start("/m")
    assert "stub helper pid" in str(err.value)
    assert err.value.pgid is not None
    _assert_released(err.value.pgid, proc.port)


@pytest.mark.anyio
async def test_stop_escalates_to_sigkill_and_waits_for_orphans(tmp_path):
    decoy = start_decoy(tmp_path)
    try:
        proc = StubProcess(tmp_path, "--ignore-term", "--orphan")
        await proc.start("/m")
        assert proc.running
        pgid, port = proc.pgid, proc.port
        assert len(group_members(pgid)) == 2
        await proc.stop()
        _assert_released(pgid, port)
        assert proc.exit_code == -signal.SIGKILL
        assert not proc.running
        assert decoy.poll() is None, "stop() touched a process outside its group"
        scratch = Path(proc.log_path.read_text().split("stub tmpdir ")[1].split()[0])
        assert scratch.name.startswith("grpod-vllm-") and not scratch.exists()
        await proc.stop()  # idempotent
    finally:
        decoy.kill()
        decoy.wait(timeout=10)


@pytest.mark.anyio
@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the stub needs exit(2)'s number")
async def test_a_leader_whose_last_thread_is_still_exiting_is_waited_for_not_killed(tmp_path):
    """A server that exits 0 on SIGTERM, its main thread first: for a while its leader is a
    zombie that cannot be reaped yet (another thread still runs). That is a leader exiting, not
    one that left its group: stop waits for it and reaps its exit code 0, without SIGKILL."""
    proc = StubProcess(tmp_path, "--linger-on-term", "1.0", stop_grace_s=10.0)
    await proc.start("/m")
    pgid, port = proc.pgid, proc.port
    with structlog.testing.capture_logs() as events:
        await proc.stop()
    names = [e["event"] for e in events]
    assert "inference_leader_left_group" not in names and "inference_sigkill" not in names, events
    assert proc.exit_code == 0
    (stopped,) = [e for e in events if e["event"] == "inference_stopped"]
    assert stopped["exit_code"] == 0 and not stopped["sigkill"]
    _assert_released(pgid, port)
    assert not psutil.pid_exists(pgid), "the leader was not reaped"


@pytest.mark.anyio
async def test_wait_exit_reports_a_crash(tmp_path):
    proc = StubProcess(tmp_path)
    await proc.start("/m")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        with anyio.fail_after(10):
            assert await proc.wait_exit() == -signal.SIGKILL
        assert not proc.running
    finally:
        await proc.stop()


@pytest.mark.anyio
async def test_wait_exit_can_be_cancelled_and_process_stays_up(tmp_path):
    proc = StubProcess(tmp_path)
    await proc.start("/m")
    try:
        with anyio.move_on_after(0.3):
            await proc.wait_exit()
        assert proc.running
    finally:
        await proc.stop()


@pytest.mark.anyio
async def test_fixed_port_taken_raises_before_launch(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = StubProcess(tmp_path, port=port)
        with pytest.raises(PortInUseError, match=f"inference.port {port} "):
            await proc.start("/m")
    assert proc.pid is None and not proc.log_path.exists()


@pytest.mark.anyio
async def test_cancelled_start_stops_what_it_launched(tmp_path):
    proc = StubProcess(tmp_path, "--no-health")
    with anyio.move_on_after(1.0):
        await proc.start("/m")
    assert proc.pid is None
    text = proc.log_path.read_text()
    pgid = int(text.split("stub server pid ")[1].split()[0])
    _assert_released(pgid, proc.port)


@pytest.mark.anyio
async def test_a_stop_while_the_start_waits_for_health_is_one_stop_not_two(tmp_path):
    """A bridge's stop meeting a relaunch still waiting for /health: the start's own stop (its
    server exited) and the bridge's ran at once on one process, and the second read the process
    the first had just reaped (AttributeError): the pool's stop ended there, the other engines
    unstopped. Now the second waits for the first, then finds nothing left to stop."""
    proc = StubProcess(tmp_path, "--no-health")
    outcome: dict[str, str] = {}

    async def start() -> None:
        try:
            await proc.start("/m")
            outcome["start"] = "healthy"
        except InferenceStartError as exc:
            outcome["start"] = str(exc).splitlines()[0]

    async def stop() -> None:
        while proc.pid is None:
            await anyio.sleep(0.01)
        await anyio.sleep(0.3)
        await proc.stop()
        outcome["stop"] = "stopped"

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            tg.start_soon(stop)
    assert outcome["stop"] == "stopped" and "exited with code -15 before becoming healthy" in outcome["start"], outcome
    text = proc.log_path.read_text()
    pgid = int(text.split("stub server pid ")[1].split()[0])
    assert proc.pid is None and not proc.running
    _assert_released(pgid, proc.port)


@pytest.mark.anyio
async def test_a_foreign_server_on_the_port_is_refused_never_adopted(tmp_path):
    """Issue #16 hole 1: another process binds the fixed port after the free-port check (a vLLM
    left by a killed grpod), while this launch is still loading. Its healthy answers lack this
    launch's token: start fails naming it, stops only its own group, and stop does not wait for
    the foreign listener."""
    port = free_port_for_test()
    proc = StubProcess(tmp_path, "--no-health", port=port)
    foreign = None
    try:
        async with anyio.create_task_group() as tg:

            async def start_foreign_once_launched() -> None:
                nonlocal foreign
                while proc.pid is None:
                    await anyio.sleep(0.02)
                env = {k: v for k, v in os.environ.items() if k != "GRPOD_LAUNCH_TOKEN"} | {"TMPDIR": str(tmp_path)}
                foreign = subprocess.Popen([sys.executable, str(STUB), "--port", str(port)], env=env)

            tg.start_soon(start_foreign_once_launched)
            with pytest.raises(PortTakenError) as err:
                await proc.start("/m")
        message = str(err.value)
        assert f"inference.port {port}" in message
        assert f"pid {foreign.pid}" in message and "not the vLLM this grpod launched" in message
        assert group_members(err.value.pgid) == []
        assert foreign.poll() is None, "the foreign server must not be signalled"
        assert not proc.running
    finally:
        if foreign is not None:
            foreign.kill()
            foreign.wait(timeout=10)


def free_port_for_test() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_launch_tail_is_the_latest_launchs_after_the_log_was_cut(tmp_path):
    """A relaunch's error quotes its own output: the lines after the latest launch header, also
    when LogLimit cut the file's head (header and all) while that launch ran."""
    from grpod.inference.process import LaunchLog
    from grpod.service.logs import cut_log

    launch_log = LaunchLog(tmp_path / "vllm.log")
    with launch_log.open_for_launch(["vllm", "serve", "a"]) as f:
        f.write(b"first launch output\n" * 10)
    with launch_log.open_for_launch(["vllm", "serve", "b"]) as f:
        f.write(b"second launch line\n" * 3)
    tail = launch_log.tail()
    assert tail[0].startswith("=== grpod launch ") and tail[0].endswith("vllm serve b")
    assert tail[1:] == ["second launch line"] * 3
    with open(launch_log.path, "ab") as f:
        f.write(b"y" * 5000 + b"\n")
        assert cut_log(launch_log.path, 4096) > 0
        f.write(b"after the cut\n")
    tail = launch_log.tail()
    assert tail[0].startswith("=== grpod: cut ") and tail[-1] == "after the cut"
    assert not any("first launch" in line for line in tail)


@pytest.mark.anyio
@pytest.mark.parametrize("agents", [False, True], ids=["daemon", "agent"])
async def test_a_daemons_server_is_told_who_launched_it_an_agents_is_not(tmp_path, agents):
    """A daemon's vLLM stops when the daemon dies (it watches the PID it is given:
    `grpod.service.children.stop_group_with_parent`, whose own test kills real parents); an
    agent's serves on while the agent restarts, so it is given none."""
    proc = StubProcess(tmp_path, outlives_launcher=agents)
    await proc.start("/models/none")
    try:
        told = psutil.Process(proc.pid).environ().get(PARENT_PID_ENV)
        assert told == (None if agents else str(os.getpid()))
        assert psutil.Process(proc.pid).environ().get(GRACE_ENV) == (None if agents else "0.5")
    finally:
        await proc.stop()
