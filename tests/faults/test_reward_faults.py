"""Cases 26.x: no reward function can stall, freeze or kill the daemon (issue #26); and the user's
inputs are checked before anything launches (issue #30, 10).

One daemon (module scope) trains the tiny model on a dataset whose rows say how the one reward
function behaves on them: most score normally, the others hang, spin in a catastrophic regex,
busy-loop in Python, call `os._exit`, segfault, or allocate without bound. While the faults go on
the test reads `ctl status` every 50 ms and measures each answer; after at least 50 faulty calls it
counts the daemon's threads and reward workers, then stops it with `ctl stop` (exit 0, final
checkpoint); a second daemon resumes that checkpoint, meets the same faults and is stopped by
SIGTERM.

  26.1-26.6  hang / backtracking regex / busy loop / os._exit / SIGSEGV / unbounded allocation:
             each group dropped with its reason, training goes on, `ctl status` answers fast
  26.7       after 50 faulty calls: no thread or process leaked
  26.8       `ctl stop` after the faults: exit 0 and a final checkpoint within 30 s
  26.9       the run resumes; SIGTERM after more faults: exit 0 and a final checkpoint within 30 s
  26.12      the reward function prints 63 KB a call: rewards.log is cut to its end whenever it
             passes run.log_max_mb, and the workers go on writing to it
  26.10      a reward function with a wrong signature: exit 2 in < 10 s, vLLM never launched
  26.11      a reward function raising on every group: one alarm line, rate-limited warnings,
             source.fail_after_s ends the run (exit 1)
  30.10      a reward module with a syntax error, a missing function or file, a bad row, a line
             that is not JSON, an empty file: exit 2 in < 5 s, vLLM never launched, and
             `grpod check-config` fails with the same message
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpod.daemon.control import request
from tests.faults.injection import log_events, run_to_exit, status_until, training
from tests.harness import ROOT, DaemonProcess, base_settings, write_config

pytestmark = pytest.mark.faults

REWARDS = '''
import ctypes, os, re, sys, time

def reward(prompts, completions, completion_ids, mode, **kwargs):
    kind = mode[0]
    if kind == "hang":
        time.sleep(3600)
    elif kind == "regex":
        re.match(r"^(a+)+$", "a" * 64 + "b")
    elif kind == "spin":
        while True:
            pass
    elif kind == "exit":
        os._exit(5)
    elif kind == "segv":
        ctypes.string_at(0)
    elif kind == "hog":
        held = []
        while True:
            held.append(bytearray(10 ** 7))
    sys.stderr.write("chatty " * 9000 + "\\n")  # 63 KB a call into rewards.log
    return [float(len(ids)) for ids in completion_ids]
'''
# What each row kind is dropped as.
KINDS = {
    "hang": "reward_timeout", "regex": "reward_timeout", "spin": "reward_timeout",
    "exit": "reward_crash", "segv": "reward_crash", "hog": "reward_memory",
}
FAULTY_CALLS = 50
WORKERS = 2
# A reward call run in the event loop would hold it for the whole call (a hang never returns, the
# regex and the busy loop run for seconds), on each of the 50 faulty calls: 99 % of the reads must
# take under 300 ms, and the slowest under 2.5 s. The bounds are loose on purpose: they tell a
# loop held by a reward from a loop shared with a step on 2 loaded cores. (Under the whole
# suite's load one read alone took 401 ms, another time 541 ms, with the 99th percentile at 74
# and 102 ms: a bound of 100 ms failed by chance.)
STATUS_BOUND_S = 2.5
LOG_MAX_MB = 0.25
STATUS_P99_S = 0.3


def _rows() -> list[dict]:
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "mode": "ok"} for i in range(6)]
    rows += [{"prompt": f"{i}+1=", "answer": str(i + 1), "mode": kind} for i, kind in enumerate(KINDS)]
    return rows  # the first row (the start-up call's) scores normally


def _dataset(tmp: Path, rows: list[dict]) -> Path:
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _settings(tmp: Path, model_dir: Path, run_dir: Path, data: Path) -> dict:
    return base_settings(run_dir, model_dir) | {
        "train.steps": 100000,
        "source.kind": "dataset",
        "source.dataset.path": str(data),
        "source.dataset.reward_timeout_s": 0.5,
        "source.dataset.reward_workers": WORKERS,
        "source.dataset.reward_memory_mb": 256,
        "source.error_alarm_s": 3600.0,
        "run.log_max_mb": LOG_MAX_MB,
    }


def _config(path: Path, settings: dict, reward: str) -> Path:
    """`settings` as TOML, with the one reward function as an array-of-tables entry."""
    config = write_config(path, settings)
    config.write_text(config.read_text() + f"\n[[source.dataset.rewards]]\nfunction = {json.dumps(reward)}\n")
    return config


def _reward_workers(pid: int) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "grpod.rollouts.reward_worker" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _faulty(status: dict) -> int:
    drops = (status.get("source") or {}).get("drop_reasons") or {}
    return sum(drops.get(reason, 0) for reason in set(KINDS.values()))


class RewardRun:
    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.tmp = tmp
        self.run_dir = tmp / "run"
        (tmp / "rewards.py").write_text(REWARDS)
        data = _dataset(tmp, _rows())
        self.config = _config(tmp / "grpod.toml", _settings(tmp, model_dir, self.run_dir, data), f"{tmp / 'rewards.py'}:reward")
        self.daemon = DaemonProcess(self.config, self.run_dir)
        self.latencies: list[float] = []

    def status(self) -> dict:
        """`ctl status`, its answer time recorded."""
        started = time.perf_counter()
        reply = request(self.daemon.socket, "status", timeout_s=30)
        self.latencies.append(time.perf_counter() - started)
        assert reply["ok"], reply
        return reply["result"]

    def through_faults(self, faulty: int, timeout_s: float) -> dict:
        """Poll status every 50 ms until `faulty` more faulty calls were dropped."""
        start = _faulty(self.status())
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.daemon.proc.poll() is None, f"the daemon exited:\n{self.daemon.tail()}"
            status = self.status()
            if _faulty(status) >= start + faulty:
                return status
            assert time.monotonic() < deadline, f"{_faulty(status) - start} faulty calls in {timeout_s} s: {status['source']}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def rewards_run(tmp_path_factory, fault_model_dir):
    shared = RewardRun(tmp_path_factory.mktemp("rewards"), fault_model_dir)
    with training(shared, shared.daemon.close):
        yield shared


@pytest.mark.timeout(400)
def test_reward_faults_drop_groups_and_the_daemon_trains_and_answers(rewards_run, fault_case):
    rows = {kind: fault_case(f"26.{i} reward function: {label}") for i, (kind, label) in enumerate([
        ("hang", "hangs (time.sleep)"), ("regex", "catastrophic regex (holds the GIL in C)"),
        ("spin", "busy loop in Python"), ("exit", "os._exit(5)"), ("segv", "SIGSEGV in C"),
        ("hog", "allocates without bound"),
    ], start=1)}
    run = rewards_run
    before = run.status()
    started = time.monotonic()
    status = run.through_faults(FAULTY_CALLS, 300)
    drops = status["source"]["drop_reasons"]
    assert status["step"] > before["step"] + 2, "training went on"
    assert status["state"] == "running" and status["stop_reason"] is None
    for reason in set(KINDS.values()):
        assert drops.get(reason, 0) > 0, drops
    assert set(drops) <= set(KINDS.values()), drops  # nothing else was dropped
    log = {e["reason"] for e in log_events(run.run_dir, "reward_worker_replaced")}
    assert log >= set(KINDS.values()), log
    slowest = max(run.latencies)
    p99 = statistics.quantiles(run.latencies, n=100)[98]
    assert slowest < STATUS_BOUND_S and p99 < STATUS_P99_S, f"ctl status took {slowest * 1000:.0f} ms (p99 {p99 * 1000:.0f} ms)"
    for kind, row in rows.items():
        row.recovery_s = 0.0
        row.data_lost = "that group only"
        row.notes = (f"dropped as {KINDS[kind]} ({drops.get(KINDS[kind], 0)} of that reason); "
                     f"{status['step'] - before['step']} steps trained meanwhile; ctl status max "
                     f"{slowest * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms over {len(run.latencies)} reads; "
                     f"{_faulty(status)} faulty calls in {time.monotonic() - started:.0f} s")


@pytest.mark.timeout(300)
def test_no_thread_or_process_leaks_after_fifty_faulty_calls(rewards_run, fault_case):
    row = fault_case("26.7 after 50+ faulty reward calls: threads and reward workers counted")
    run = rewards_run
    daemon = psutil.Process(run.daemon.proc.pid)
    threads_before = daemon.num_threads()
    status = run.through_faults(FAULTY_CALLS, 300)
    threads_after = daemon.num_threads()
    workers = _reward_workers(run.daemon.proc.pid)
    # A worker killed a moment ago may still be being replaced: never more than the pool's size.
    assert len(workers) <= WORKERS, [w.cmdline() for w in workers]
    assert threads_after <= threads_before + 2, (threads_before, threads_after)
    row.data_lost = "none"
    row.notes = (f"{_faulty(status)} faulty calls in all; daemon threads {threads_before} -> {threads_after}; "
                 f"reward workers alive {len(workers)} (pool size {WORKERS})")


@pytest.mark.timeout(120)
def test_a_reward_function_printing_every_call_does_not_grow_its_log_past_the_limit(rewards_run, fault_case):
    row = fault_case("26.12 a reward function printing 63 KB a call: rewards.log under run.log_max_mb")
    run = rewards_run
    path = run.run_dir / "rewards.log"
    limit = int(LOG_MAX_MB * (1 << 20))
    deadline = time.monotonic() + 60
    while not [e for e in log_events(run.run_dir, "log_cut") if e.get("path") == str(path)]:
        assert time.monotonic() < deadline, f"rewards.log never cut: {path.stat().st_size} bytes"
        time.sleep(0.5)
    cuts = [e for e in log_events(run.run_dir, "log_cut") if e.get("path") == str(path)]
    printed = sum(e["bytes_cut"] for e in cuts) + path.stat().st_size
    run.through_faults(2, 120)  # the workers write on after the cuts, at the file's new end
    head, _, rest = path.read_bytes().partition(b"\n")
    assert head.startswith(b"=== grpod: cut ") and b"run.log_max_mb = 0.25" in head, head[:200]
    assert b"chatty chatty" in rest and b"\0" not in rest
    data = head + rest
    row.data_lost = "the log's head"
    row.notes = (f"{len(cuts)} cuts of rewards.log ({printed / (1 << 20):.1f} MiB printed by then, limit "
                 f"{limit / (1 << 20):g} MiB); {len(data) / 1024:.0f} KiB at the end")


@pytest.mark.timeout(400)
def test_stop_after_faults_then_resume_and_sigterm(rewards_run, fault_case):
    stop_row = fault_case("26.8 ctl stop after hung and spinning reward calls")
    term_row = fault_case("26.9 resumed run, more faulty calls, then SIGTERM")
    run = rewards_run
    run.through_faults(10, 120)
    started = time.monotonic()
    reply = request(run.daemon.socket, "stop", timeout_s=60)
    assert reply["ok"], reply
    code = run.daemon.wait_exit(30)
    stopped_s = time.monotonic() - started
    assert code == 0, run.daemon.tail()
    final = log_events(run.run_dir, "checkpoint_written")
    assert final, "no final checkpoint"
    assert not _reward_workers_left(run.daemon.proc.pid)
    stop_row.recovery_s, stop_row.data_lost = stopped_s, "none"
    stop_row.notes = f"exit 0 in {stopped_s:.1f} s, final checkpoint at step {final[-1].get('step')}"

    resumed = DaemonProcess(run.config, run.run_dir)
    try:
        status = status_until(resumed, lambda s: s["step"] > final[-1].get("step", 0), 300, "a step after resuming")
        second = RewardRun.__new__(RewardRun)
        second.daemon, second.latencies = resumed, []
        second.through_faults(10, 120)
        started = time.monotonic()
        resumed.proc.send_signal(signal.SIGTERM)
        code = resumed.wait_exit(30)
        stopped_s = time.monotonic() - started
        assert code == 0, resumed.tail()
        again = log_events(run.run_dir, "checkpoint_written")
        assert again[-1].get("step", 0) > final[-1].get("step", 0)
        term_row.recovery_s, term_row.data_lost = stopped_s, "none"
        term_row.notes = (f"resumed at step {status['step']}; SIGTERM: exit 0 in {stopped_s:.1f} s, "
                          f"final checkpoint at step {again[-1].get('step')}")
    finally:
        resumed.close()


def _reward_workers_left(pid: int) -> list[int]:
    """Reward workers of an exited daemon still alive (found by the parent they were started by)."""
    left = []
    for proc in psutil.process_iter(["ppid", "cmdline"]):
        try:
            if proc.info["ppid"] == pid and "grpod.rollouts.reward_worker" in " ".join(proc.info["cmdline"] or []):
                left.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return left


# ---- bad inputs: refused before anything launches -------------------------------------------

WRONG_SIGNATURE = "def reward(prompts, completions, completion_ids, answer):\n    return [0.0] * len(completions)\n"
GOOD = "def reward(completions, **kwargs):\n    return [0.0] * len(completions)\n"
GOOD_ROWS = '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'


def _bad_input(tmp: Path, case: str) -> tuple[str, str, str]:
    """(the reward spec, the dataset text, what the message must say) of a bad-input case."""
    module = tmp / "rewards.py"
    module.write_text(GOOD)
    spec, rows = f"{module}:reward", GOOD_ROWS
    if case == "wrong signature":
        module.write_text(WRONG_SIGNATURE)
        return spec, rows, "unexpected keyword argument 'trainer_state'"
    if case == "syntax error":
        module.write_text("def reward(:\n")
        return spec, rows, "SyntaxError"
    if case == "missing function":
        return f"{module}:absent", rows, "has no callable 'absent'"
    if case == "missing file":
        return f"{tmp / 'absent.py'}:reward", rows, "no file"
    if case == "bad row":
        return spec, GOOD_ROWS + '{"prompt": "   ", "answer": "6"}\n', "row 3, column 'prompt': empty prompt"
    if case == "not json":
        return spec, GOOD_ROWS + '{"prompt": "3+3=", "answer": \n', "line 3: not JSON"
    if case == "empty file":
        return spec, "", "the file is empty"
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("label", "case", "bound_s"),
    [
        ("26.10", "wrong signature", 10.0),
        ("30.10a", "syntax error", 5.0),
        ("30.10b", "missing function", 5.0),
        ("30.10c", "missing file", 5.0),
        ("30.10d", "bad row", 5.0),
        ("30.10e", "not json", 5.0),
        ("30.10f", "empty file", 5.0),
    ],
)
@pytest.mark.timeout(120)
def test_bad_inputs_stop_the_start_before_anything_launches(tmp_path, fault_model_dir, fault_case, label, case, bound_s):
    row = fault_case(f"{label} grpod start with a reward module / dataset: {case}")
    spec, rows, expected = _bad_input(tmp_path, case)
    data = tmp_path / "train.jsonl"
    data.write_text(rows)
    run_dir = tmp_path / "run"
    config = _config(tmp_path / "grpod.toml", _settings(tmp_path, fault_model_dir, run_dir, data), spec)
    finished = run_to_exit(config, 60)
    assert finished.code == 2, finished.stderr[-3000:]
    assert finished.seconds < bound_s, f"{finished.seconds:.1f} s"
    assert expected in finished.stderr, finished.stderr[-3000:]
    assert not log_events(run_dir, "inference_launched") and not (run_dir / "vllm.log").exists()
    assert "Cancelled" not in finished.stderr
    check = subprocess.run([sys.executable, "-m", "grpod", "check-config", str(config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 2 and expected in check.stderr, check.stderr[-3000:]
    row.recovery_s, row.data_lost = finished.seconds, "none"
    row.notes = f"exit 2 in {finished.seconds:.1f} s, vLLM never launched; check-config: exit 2, same message"


ALWAYS_RAISES = "def reward(completions, answer, **kwargs):\n    raise ValueError('gold answer missing from the lookup table')\n"


@pytest.mark.timeout(300)
def test_a_function_failing_on_every_group_raises_the_alarm_once_and_fail_after_ends_the_run(
        tmp_path, fault_model_dir, fault_case):
    row = fault_case("26.11 a reward function that raises on every group (error_alarm_s 2, fail_after_s 8)")
    (tmp_path / "rewards.py").write_text(ALWAYS_RAISES)
    data = tmp_path / "train.jsonl"
    data.write_text(GOOD_ROWS)
    run_dir = tmp_path / "run"
    settings = _settings(tmp_path, fault_model_dir, run_dir, data) | {"source.error_alarm_s": 2.0, "source.fail_after_s": 8.0}
    config = _config(tmp_path / "grpod.toml", settings, f"{tmp_path / 'rewards.py'}:reward")
    finished = run_to_exit(config, 240)
    assert finished.code == 1, finished.stderr[-3000:]
    # It started (a ValueError on the placeholder completion is only reported), then every group failed.
    assert log_events(run_dir, "inference_launched"), finished.stderr[-3000:]
    failed = [line for line in finished.stderr.splitlines() if "reward_failed" in line]
    alarms = [line for line in finished.stderr.splitlines() if "grpod: ALARM:" in line]
    assert len(alarms) == 1 and "gold answer missing" in alarms[0], alarms
    assert 1 <= len(failed) <= 2, failed  # one line per reason per 30 s, not one per group
    assert "source.fail_after_s = 8" in finished.stderr
    row.recovery_s, row.data_lost = finished.seconds, "none (nothing trained)"
    row.notes = (f"exit 1 after {finished.seconds:.0f} s (start-up included); 1 alarm line and "
                 f"{len(failed)} reward_failed line(s) on the console for every group failing")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) to make a PID namespace")
def test_grpod_as_a_containers_first_process_starts_its_reward_workers(tmp_path, fault_model_dir, fault_case):
    """grpod run as PID 1 (a container's first process, no init): a reward worker took "my parent
    is PID 1" for "my parent died" and exited at once, so check-config and start failed on every
    dataset run ("a reward worker did not start: exited with status 1")."""
    row = fault_case("26.13 grpod as PID 1 of its PID namespace (a container): reward workers start")
    (tmp_path / "rewards.py").write_text(GOOD)
    data = tmp_path / "train.jsonl"
    data.write_text(GOOD_ROWS)
    config = _config(tmp_path / "grpod.toml", _settings(tmp_path, fault_model_dir, tmp_path / "run", data),
                     f"{tmp_path / 'rewards.py'}:reward")
    started = time.monotonic()
    check = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                            "import os, sys; from grpod.cli import main; assert os.getpid() == 1; "
                            f"sys.exit(main(['check-config', {str(config)!r}]))"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    if check.returncode != 0 and "Operation not permitted" in check.stderr:
        pytest.skip(f"no PID namespace here: {check.stderr.strip()[:200]}")
    assert check.returncode == 0, check.stderr[-3000:]
    row.recovery_s, row.data_lost = time.monotonic() - started, "none"
    row.notes = "check-config as PID 1: the reward workers started and answered the probe"
