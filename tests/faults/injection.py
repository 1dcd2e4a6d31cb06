"""How the fault cases find what to break, break it, and read back what the daemon did.

Processes are found only inside a process group the daemon under test created (its vLLM, known
from the daemon's `ctl status` and `inference_launched` log events) and signalled by PID. The
readers parse the run directory's own records: `grpod.log` (structlog JSON lines),
`metrics.jsonl` (one record per trained step), checkpoints' `run_state.json`.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from grpod.inference.client import metric_totals
from tests.harness import ROOT, base_settings, group_processes, metrics


# ---- vLLM's process tree: API server (group leader) → EngineCore [→ Worker] ------------------
def vllm_api_server(pgid: int) -> psutil.Process:
    """The group leader: vLLM's OpenAI API server process."""
    leader = psutil.Process(pgid)
    if os.getpgid(pgid) != pgid:
        raise AssertionError(f"process {pgid} does not lead its own process group")
    return leader


def vllm_weights_holder(pgid: int) -> psutil.Process:
    """The process that holds the weights: vLLM's Worker (a child of EngineCore) when the engine
    runs one (`inference.cpu_executor` "mp", GPUs), else EngineCore itself (a child of the leader;
    "uni", grpod's default for one CPU engine)."""
    members = {p.pid: p for p in group_processes(pgid)}
    engine_cores, workers = [], []
    for proc in members.values():
        try:
            parent = proc.ppid()
            name = " ".join(proc.cmdline())
            if parent == pgid and "EngineCore" in name:
                engine_cores.append(proc)
            elif parent in members and parent != pgid and members[parent].ppid() == pgid and "Worker" in name:
                workers.append(proc)
        except psutil.NoSuchProcess:
            continue
    if workers:
        return workers[0]
    if engine_cores:
        return engine_cores[0]
    described = []
    for p in members.values():
        try:
            described.append(f"{p.pid}<-{p.ppid()} {p.name()}")
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no VLLM::EngineCore or VLLM::Worker in process group {pgid}: {described}")


def sigkill(proc: psutil.Process) -> float:
    """SIGKILL `proc` (by PID); returns the monotonic time of the kill."""
    proc.send_signal(signal.SIGKILL)
    return time.monotonic()


def generations_running(base_url: str) -> float:
    """vLLM's own gauge of requests being generated right now (`/metrics`); 0 if it cannot answer."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0.0
    return metric_totals(text, ["vllm:num_requests_running"])["vllm:num_requests_running"]


# ---- waiting ------------------------------------------------------------------------------
def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05, describe=None) -> Any:
    """Poll `condition` until it returns something truthy (returned); AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            state = f"; {describe()}" if describe is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{state}")
        time.sleep(poll_s)


def status_until(daemon, condition, timeout_s: float, what: str, poll_s: float = 0.3) -> dict[str, Any]:
    """Read `ctl status` until `condition(status)` holds; that status. AssertionError naming `what`
    (with the daemon's output) when the daemon exits first or the time runs out."""
    from grpod.daemon.control import ControlError

    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while True:
        if daemon.proc.poll() is not None:
            raise AssertionError(
                f"daemon exited ({daemon.proc.returncode}) while waiting for {what}: "
                f"{failure_reason(daemon.run_dir)}\n{daemon.tail()}"
            )
        try:
            last = daemon.ctl("status", timeout_s=10)["result"]
        except (ControlError, OSError, ValueError):
            last = {}
        if last and condition(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}; last status {last}\n{daemon.tail()}")
        time.sleep(poll_s)


def follow_to_exit(daemon, timeout_s: float, last: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """Keep reading `ctl status` until the daemon exits; (exit code, the last status it gave)."""
    last = dict(last or {})
    deadline = time.monotonic() + timeout_s
    while daemon.proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon still running after {timeout_s:g}s\n{daemon.tail()}")
        try:
            last = daemon.ctl("status", timeout_s=10)["result"]
        except Exception:  # noqa: BLE001 — the socket goes away while the daemon exits
            pass
        time.sleep(0.2)
    return daemon.proc.returncode, last


# ---- what the run directory says ------------------------------------------------------------
@contextmanager
def training(shared, close: Callable[[], None], timeout_s: float = 300) -> Iterator[Any]:
    """A module's shared daemon (`shared.daemon`) once it has trained its first step; `close` at
    the end, whatever happened (the module fixtures' one shape)."""
    try:
        status_until(shared.daemon, lambda s: s["step"] >= 1, timeout_s, "the first step")
        yield shared
    finally:
        close()


def log_events(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    path = run_dir / "grpod.log"
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by SIGKILL
        if event is None or record.get("event") == event:
            found.append(record)
    return found


def failure_reason(run_dir: Path) -> str:
    """Why the daemon said its run failed (its last `run_failed` event), or a placeholder."""
    failed = log_events(run_dir, "run_failed")
    return failed[-1].get("reason", "?") if failed else "no run_failed event in grpod.log"


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in metrics(run_dir) if r["kind"] == "step"]


def lineage(run_dir: Path) -> dict[int, list[str]]:
    """group ids per step; the last record of a step wins (a step redone after a kill)."""
    return {r["step"]: r["group_ids"] for r in step_records(run_dir)}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in step_records(run_dir)}


def checkpoint_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def run_state(run_dir: Path, step: int) -> dict[str, Any]:
    return json.loads((run_dir / "checkpoints" / f"step-{step:06d}" / "run_state.json").read_text())


def temp_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    return sorted(root.glob(".tmp-step-*")) if root.exists() else []


def alive(pgids) -> list[str]:
    """Every live process still in any of the groups, described (empty when all are gone).

    Zombies do not count: a group member orphaned when its leader died is reparented to PID 1,
    and whether PID 1 reaps it is the host's business; a zombie holds no memory, port or file.
    """
    left = []
    for pgid in pgids:
        for proc in group_processes(pgid):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.pid} {proc.name()} (group {pgid})")
            except psutil.NoSuchProcess:
                continue
    return left


# ---- replayable rollouts -------------------------------------------------------------------
def write_replay_rollouts(path: Path, model_dir: Path, groups: int, *, seed: int = 11, completion_len: int = 48) -> None:
    """`groups` recorded arithmetic groups (4 completions each) in rollouts.jsonl format.

    Completions are long enough (~`completion_len` tokens) that a training step takes a while
    on the tiny model: a SIGKILL aimed "mid-step" has a step to land in.
    """
    from transformers import AutoTokenizer

    from grpod.rollouts.arithmetic import ArithmeticTask, prompt_ids
    from grpod.rollouts.group import RolloutGroup

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = ArithmeticTask(seed=seed)
    rng = random.Random(seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    alphabet = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789 +-="]
    with open(path, "w") as out:
        for index in range(groups):
            prompt = prompt_ids(tokenizer, task.sample(rng))
            tokens, masks, logprobs, scores = [], [], [], []
            for seq in range(4):
                completion = [rng.choice(alphabet) for _ in range(rng.randint(completion_len // 2, completion_len))]
                completion.append(eos)
                tokens.append(prompt + completion)
                masks.append([0] * len(prompt) + [1] * len(completion))
                logprobs.append([0.0] * len(prompt) + [-rng.uniform(0.5, 3.5) for _ in completion])
                scores.append(float((seq + index) % 2))
            group = RolloutGroup(tokens, masks, scores, logprobs, group_id=f"replay-{index}")
            out.write(json.dumps({"step": 0, "group": group.to_json()}) + "\n")


# ---- a `grpod start` run to its end, stderr apart ------------------------------------------
@dataclass
class Finished:
    code: int
    stdout: str
    stderr: str
    seconds: float


def run_to_exit(config: Path, timeout_s: float) -> Finished:
    """Run `grpod start --config config` until it exits; AssertionError (after SIGKILL) on timeout."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpod", "start", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate(timeout=30)
        raise AssertionError(f"grpod start still running after {timeout_s:g}s; stderr:\n{stderr[-3000:]}") from None
    return Finished(proc.returncode, stdout, stderr, time.monotonic() - started)


def launched_pgids(run_dir: Path) -> set[int]:
    return {int(e["pid"]) for e in log_events(run_dir, "inference_launched")}


def first_line_matching(text: str, pattern: str) -> str | None:
    for line in text.splitlines():
        if re.search(pattern, line):
            return line.strip()
    return None


def replay_settings(run_dir: Path, model_dir: Path, replay: Path, *, steps: int, prefetch: int) -> dict[str, Any]:
    """The base of the kill-and-resume cases: `steps` steps on the recorded groups of `replay`
    (never stale), a checkpoint after every step, every checkpoint kept."""
    return base_settings(run_dir, model_dir) | {
        "train.steps": steps,
        "train.max_staleness": 1000,
        "source.kind": "replay",
        "source.replay_path": str(replay),
        "source.prefetch_groups": prefetch,
        "checkpoint.every": 1,
        "checkpoint.keep_last": 2 * steps,
    }


def replay_lineage(replay: Path, steps: int, per_step: int) -> dict[int, list[str]]:
    """Step -> the group ids a straight run trains at it: the replay's groups, `per_step` a step, in order."""
    ids = [json.loads(line)["group"]["group_id"] for line in replay.read_text().splitlines()]
    return {step: ids[(step - 1) * per_step : step * per_step] for step in range(1, steps + 1)}
