"""Cases 30.1-30.9: an operator's mistake never ruins a run (issue #30).

One daemon (`daemon`, module scope: one vLLM launch for every case that needs a running run) is
started with `--set train.lr=3e-5 --set metrics.prometheus_port=P` over a file that says
`lr = 1e-4`, its checkpoints and its synced weights each on a small tmpfs of their own (we run as
root; without the mounts the disk-full and read-only cases are skipped and only its unit test in tests/run/test_checkpoint.py runs). Each case
throws one mistake at it and checks that it is answered and that the daemon still trains after
it; the last case stops it cleanly and starts `grpod start` again on the run directory, which
resumes the final checkpoint and the values set with `ctl set` before it. The cases without a running daemon (a broken trainer's checkpoint,
corrupt checkpoints at start) need no vLLM and run in seconds.

  30.1  `ctl set` of inf / NaN / a boolean / 1e308 / JSON's 1e999 is refused
  30.2  a trainer with non-finite weights or optimizer state is never checkpointed
  30.3  a 5000-digit integer and 30,000 nested brackets get error replies
  30.4  SIGHUP with a config file that is not UTF-8 is refused, the run goes on
  30.5  SIGHUP with an unchanged file keeps --set and ctl set values, refuses nothing
  30.6  a queued `ctl set` is corrected by the next one
  30.7  a second `grpod start` on the run directory is refused (exit 2, the first one's pid)
  30.8  a periodic checkpoint on a full disk: alarm, training goes on, the next one succeeds
  30.9  every checkpoint corrupt: `grpod start` refuses (exit 2, naming each and why)
  30.10 a periodic checkpoint on a read-only file system: alarm, training goes on, then it succeeds
  30.11 a sync's weights on a read-only file system: alarm, the engine serves the version it had,
        training goes on, then a sync lands
  30.P  property: random and hostile request lines and live settings, the daemon trains on
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpod.daemon.control import request
from grpod.daemon.live import LIVE_KEYS
from grpod.run.checkpoint import CorruptCheckpointError, verify_checkpoint
from tests.faults.injection import alive, log_events, run_to_exit, status_until, training, wait_until
from tests.harness import DaemonProcess, base_settings, group_processes, write_config

pytestmark = pytest.mark.faults

TMPFS_BYTES = 48 << 20
CHECKPOINT_EVERY = 3
# The live settings of the shared daemon, which the property test puts back when it ends.
INITIAL = {
    "train.lr": 3e-5, "train.loss.clip_high": 0.28, "train.loss.clip_low": 0.2, "source.temperature": 1.0,
    "bridge.sync_every": 1, "bridge.probe_every": 1, "train.max_staleness": 4, "checkpoint.every": CHECKPOINT_EVERY,
    "train.loss.kl_coef": 0.0, "train.loss.entropy_coef": 0.0,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, timeout=30)
    return done.returncode == 0


def _remount(path: Path, mode: str, timeout_s: float = 60.0) -> None:
    """`mount -o remount,<mode>` of a tmpfs the daemon writes in: going read-only is refused while
    a file on it is open for writing (a checkpoint or a sync being written: "busy"), so it is
    tried again until the daemon is between two writes."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return
        if "busy" not in done.stderr or time.monotonic() > deadline:
            raise AssertionError(f"remount,{mode} {path}: exit {done.returncode}: {done.stderr.strip()}")
        time.sleep(0.01)


class Run:
    """The shared daemon and what the cases need of it."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.tmp = tmp
        self.run_dir = tmp / "run"
        self.checkpoints = self.run_dir / "checkpoints"
        self.tmpfs = _mount_tmpfs(self.checkpoints, TMPFS_BYTES)
        self.weights = self.run_dir / "weights"  # bridge mode "none": each sync's weights are written here
        self.weights_tmpfs = _mount_tmpfs(self.weights, TMPFS_BYTES)
        self.metrics_port = _free_port()
        self.settings = base_settings(self.run_dir, model_dir) | {
            "train.steps": 100000,
            "train.lr": 1e-4,
            "checkpoint.every": CHECKPOINT_EVERY,
            "checkpoint.keep_last": 1,
        }
        self.config = write_config(tmp / "grpod.toml", self.settings)
        self.text = self.config.read_text()
        self.daemon = DaemonProcess(
            self.config, self.run_dir,
            extra_args=["--set", "train.lr=3e-5", "--set", f"metrics.prometheus_port={self.metrics_port}"],
        )

    @property
    def socket(self) -> Path:
        return self.daemon.socket

    def status(self) -> dict:
        return self.daemon.ctl("status", timeout_s=30)["result"]

    def set(self, key: str, value) -> dict:
        return request(self.socket, "set", {"key": key, "value": value}, timeout_s=60)

    def raw(self, payload: bytes, replies: int, timeout_s: float = 60) -> list[dict]:
        """Send raw bytes on one connection; the first `replies` reply lines."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(self.socket))
            s.sendall(payload)
            data = b""
            while data.count(b"\n") < replies:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        return [json.loads(line) for line in data.splitlines()[:replies]]

    def trains_on(self, steps: int = 2, timeout_s: float = 120) -> dict:
        """The daemon is alive and takes `steps` more steps, with a finite loss."""
        start = self.status()["step"]
        status = status_until(self.daemon, lambda s: s["step"] >= start + steps, timeout_s, f"{steps} steps after step {start}")
        loss = status["last_metrics"].get("loss")
        assert loss is None or math.isfinite(loss), status["last_metrics"]
        assert status["state"] == "running" and status["stop_reason"] is None, status
        return status

    def changes(self, key: str) -> list[dict]:
        return [c for c in self.status()["config_changes"] if c["key"] == key]

    def close(self) -> None:
        self.daemon.close()
        for mounted, path in ((self.tmpfs, self.checkpoints), (self.weights_tmpfs, self.weights)):
            if mounted:
                subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def run(tmp_path_factory, fault_model_dir):
    shared = Run(tmp_path_factory.mktemp("operator"), fault_model_dir)
    with training(shared, shared.close):
        yield shared


@pytest.mark.timeout(300)
def test_live_settings_that_would_destroy_the_run_are_refused(run, fault_case):
    row = fault_case("30.1 ctl set train.lr=inf, =true, temperature=inf, kl_coef=1e308, clip_high=1e999")
    began = time.monotonic()
    hostile = [("train.lr", math.inf), ("train.lr", True), ("source.temperature", math.inf),
               ("train.loss.kl_coef", 1e308), ("train.lr", math.nan)]
    replies = [run.set(key, value) for key, value in hostile]
    # JSON's 1e999 is what a client that writes numbers as text sends; Python reads it as inf.
    replies += run.raw(b'{"cmd": "set", "args": {"key": "train.loss.clip_high", "value": 1e999}}\n', 1)
    assert [r["ok"] for r in replies] == [False] * 6, replies
    for reply in replies:
        assert any(s in reply["error"] for s in ("finite number", "not the boolean", "less than or equal")), reply
    status = run.trains_on()
    assert not [c for c in status["config_changes"] if c["key"] in dict(hostile)], status["config_changes"]
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"6 refused; trained on to step {status['step']}, loss {status['last_metrics'].get('loss'):.4f}"


@pytest.mark.timeout(300)
def test_hostile_request_lines_get_error_replies(run, fault_case):
    row = fault_case("30.3 a 5000-digit integer, 30,000 nested brackets on the control socket")
    began = time.monotonic()
    lines = (b'{"cmd": "set", "args": {"key": "train.lr", "value": ' + b"9" * 5000 + b"}}\n"
             + b"[" * 30000 + b"]" * 30000 + b"\n" + b'{"cmd": "status"}\n')
    replies = run.raw(lines, 3)
    assert [r["ok"] for r in replies] == [False, False, True], replies
    assert "Exceeds the limit" in replies[0]["error"] and "nested too deeply" in replies[1]["error"]
    status = run.trains_on()
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"error replies, the connection answered on; trained on to step {status['step']}"


@pytest.mark.timeout(300)
def test_a_queued_set_is_corrected_by_the_next(run, fault_case):
    row = fault_case("30.6 set clip_high=0.5 then =0.28 before the boundary")
    began = time.monotonic()
    pair = b"".join(json.dumps({"cmd": "set", "args": {"key": "train.loss.clip_high", "value": v}}).encode() + b"\n"
                    for v in (0.5, 0.28))
    outcomes = []
    for _ in range(5):  # some pairs land while a step runs (both pending), some at an idle boundary
        run.trains_on(1)
        replies = run.raw(pair, 2)
        assert [r["ok"] for r in replies] == [True, True], replies
        outcomes.append("pending" if replies[1]["result"].get("replaced_pending") == 0.5 else "applied between")
        assert not replies[1]["result"]["unchanged"], f"the correction was dropped: {replies}"
    run.trains_on(1)
    last = run.changes("train.loss.clip_high")
    assert not last or last[-1]["new"] == 0.28, last
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"5 pairs ({outcomes.count('pending')} corrected while pending); clip_high ends 0.28"


@pytest.mark.timeout(300)
def test_sighup_keeps_set_overrides_and_ctl_set_values(run, fault_case):
    row = fault_case("30.5 SIGHUP, file unchanged: --set and ctl set values kept, nothing refused")
    began = time.monotonic()
    assert run.set("source.temperature", 0.9)["ok"]
    run.trains_on(1)
    seen = len(log_events(run.run_dir, "reload_accepted"))
    run.daemon.proc.send_signal(signal.SIGHUP)
    (accepted,) = wait_until(lambda: log_events(run.run_dir, "reload_accepted")[seen:], 60, "the reload")
    assert accepted["changes"] == [], accepted
    refused = [e for e in log_events(run.run_dir, "reload_refused")]
    assert refused == [], f"an unchanged file refused {refused}"
    status = run.trains_on()
    lr = run.changes("train.lr")
    assert not lr, f"the reload changed train.lr (--set 3e-5): {lr}"
    assert run.changes("source.temperature")[-1]["new"] == 0.9, "the ctl set value stands"
    assert run.set("source.temperature", 1.0)["ok"]
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"no change, nothing refused; trained on to step {status['step']}"


@pytest.mark.timeout(300)
def test_sighup_with_a_file_that_is_not_utf8(run, fault_case):
    row = fault_case("30.4 SIGHUP with a config file that is not UTF-8")
    began = time.monotonic()
    seen = len(log_events(run.run_dir, "reload_refused"))
    try:
        run.config.write_bytes(run.text.encode() + b"\n# \xff\xfe saved as latin-1: caf\xe9\n")
        run.daemon.proc.send_signal(signal.SIGHUP)
        (refused,) = wait_until(lambda: log_events(run.run_dir, "reload_refused")[seen:], 60, "the refused reload",
                                describe=run.daemon.tail)
    finally:
        run.config.write_text(run.text)
    assert "not a UTF-8 text file" in refused["reason"], refused
    status = run.trains_on()
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"reload refused ({refused['reason'][-60:]}); trained on to step {status['step']}"


_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers(min_value=-(10**30), max_value=10**30) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_SAFE = {  # values a run may take for real: the property is about answers, not about tuning
    "train.lr": st.floats(1e-6, 1e-4), "train.loss.clip_high": st.floats(0.1, 0.5),
    "train.loss.clip_low": st.floats(0.1, 0.3), "source.temperature": st.floats(0.8, 1.2),
    "bridge.sync_every": st.integers(1, 2), "bridge.probe_every": st.integers(1, 3),
    "train.max_staleness": st.integers(2, 8), "checkpoint.every": st.integers(2, 6),
    "train.loss.kl_coef": st.floats(0, 0.01), "train.loss.entropy_coef": st.floats(0, 0.001),
}
_HOSTILE_VALUES = (st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -1e308, True, False, None, 2**64, -1, 0, "1e-5"])
                   | _VALUES.filter(lambda v: not isinstance(v, (int, float)) or isinstance(v, bool)))
_SET = st.builds(
    lambda key, value: {"cmd": "set", "args": {"key": key, "value": value}},
    st.sampled_from(LIVE_KEYS),
    st.one_of(_HOSTILE_VALUES),
) | st.sampled_from(sorted(_SAFE)).flatmap(
    lambda key: _SAFE[key].map(lambda value: {"cmd": "set", "args": {"key": key, "value": value}})
) | st.builds(lambda key, value: {"cmd": "set", "args": {"key": key, "value": value}},
              st.text(max_size=30) | st.sampled_from(["model.path", "train.steps", "run.dir", "inference.port"]), _VALUES)
_SAFE_CMDS = st.text(max_size=12).filter(lambda c: c not in {"stop", "drain", "pause", "checkpoint", "sync"})
_REQUEST = _SET | st.builds(lambda cmd, args: {"cmd": cmd, "args": args}, _SAFE_CMDS, _VALUES) | st.just({"cmd": "status"})
_LINE = (
    _REQUEST.map(lambda r: json.dumps(r, allow_nan=True).encode())
    | st.binary(max_size=200).map(lambda b: b.replace(b"\n", b" "))
    | st.integers(1, 40000).map(lambda n: b"[" * n + b"]" * n)
    | st.integers(4301, 6000).map(lambda n: b'{"cmd": "set", "args": {"key": "train.lr", "value": -' + b"7" * n + b"}}")
)


@pytest.mark.timeout(420)
def test_property_random_and_hostile_requests_are_answered_and_training_goes_on(run, fault_case):
    row = fault_case("30.P random and hostile request lines and live settings (hypothesis)")
    began = time.monotonic()
    answered = {"ok": 0, "error": 0}

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
    @given(lines=st.lists(_LINE, min_size=1, max_size=4))
    def every_line_is_answered(lines):
        payload = b"".join(line + b"\n" for line in lines)
        expected = sum(1 for line in lines if line.strip())
        replies = run.raw(payload, expected, timeout_s=120)
        assert len(replies) == expected, (lines, replies)
        for reply in replies:
            assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
            assert reply["ok"] or isinstance(reply.get("error"), str), reply
            answered["ok" if reply["ok"] else "error"] += 1
        assert run.daemon.proc.poll() is None, run.daemon.tail()

    try:
        every_line_is_answered()
    finally:
        for key, value in INITIAL.items():  # the settings the other cases expect
            if run.daemon.proc.poll() is None:
                run.set(key, value)
    status = run.trains_on()
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"{answered['ok']} results, {answered['error']} error replies; trained on to step {status['step']}"


def _complete_or_pruned(path: Path) -> bool:
    """`path` verifies, or the daemon pruned it meanwhile (keep_last = 1: each checkpoint prunes one)."""
    try:
        return bool(verify_checkpoint(path))
    except CorruptCheckpointError:
        if path.exists():
            raise
        return True


def _prometheus_alarm(port: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('grpod_alarm{alarm="checkpoint"}'):
                return float(line.split()[-1])
    return None


def _fill(filler: Path) -> bool:
    """Grow `filler` until its file system is full (ENOSPC); True."""
    with open(filler, "ab", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 20))
                fh.flush()
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
    return True


@pytest.mark.timeout(300)
def test_a_periodic_checkpoint_on_a_full_disk(run, fault_case):
    row = fault_case("30.8 periodic checkpoint on a full disk (tmpfs filled), then space freed")
    if not run.tmpfs:
        pytest.skip("cannot mount a tmpfs here (not root?); tests/run/test_checkpoint.py fakes the full disk")
    began = time.monotonic()
    status_until(run.daemon, lambda s: s["last_checkpoint"] is not None, 120, "a first periodic checkpoint")
    filler = run.checkpoints / "filler"
    try:
        # Topped up at every poll: a checkpoint pruned meanwhile (keep_last = 1) frees its space again.
        status = status_until(run.daemon, lambda s: _fill(filler) and (s["alarms"].get("checkpoint") or {}).get("active"),
                              120, "the checkpoint alarm")
        error = status["alarms"]["checkpoint"]["last_error"]
        assert error.startswith(f"no space left on {run.checkpoints} (tmpfs"), error
        assert "writing " + str(run.checkpoints / "step-") in error, error
        assert _prometheus_alarm(run.metrics_port) == 1.0
        status = run.trains_on(CHECKPOINT_EVERY + 1)  # past the next periodic checkpoint, which fails again
        assert status["alarms"]["checkpoint"]["failures"] >= 2, status["alarms"]["checkpoint"]
    finally:
        filler.unlink()
    status = status_until(run.daemon, lambda s: not s["alarms"]["checkpoint"]["active"], 120, "the alarm cleared")
    assert _prometheus_alarm(run.metrics_port) == 0.0
    visible = sorted(p for p in run.checkpoints.iterdir() if p.name.startswith("step-"))
    assert visible and all(_complete_or_pruned(p) for p in visible), "every visible checkpoint is complete"
    assert "checkpoint failed, training goes on" in run.daemon.tail(400)
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = (f"{status['alarms']['checkpoint']['failures']} checkpoints failed, training went on; written again at "
                 f"step {status['last_checkpoint']['step']}")


@pytest.mark.timeout(300)
def test_a_periodic_checkpoint_on_a_read_only_file_system(run, fault_case):
    row = fault_case("30.10 periodic checkpoint on a read-only file system (remounted ro), then rw again")
    if not run.tmpfs:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    began = time.monotonic()
    before = (run.status()["alarms"].get("checkpoint") or {}).get("failures", 0)
    _remount(run.checkpoints, "ro")
    try:
        status = status_until(run.daemon, lambda s: (s["alarms"].get("checkpoint") or {}).get("active"), 120,
                              "the checkpoint alarm")
        error = status["alarms"]["checkpoint"]["last_error"]
        # Whichever call met the remount (the temporary directory's mkdir, or torch opening a file
        # in it), the alarm names the filesystem, not a raw OSError or torch's enforce failure.
        assert error.startswith(f"read-only file system at {run.checkpoints} (tmpfs) writing "), error
        status = run.trains_on(CHECKPOINT_EVERY + 1)  # the run goes on past the next one, which fails again
        assert status["alarms"]["checkpoint"]["failures"] >= before + 2, status["alarms"]["checkpoint"]
    finally:
        _remount(run.checkpoints, "rw")
    status = status_until(run.daemon, lambda s: not s["alarms"]["checkpoint"]["active"], 120, "the alarm cleared")
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = (f"{status['alarms']['checkpoint']['failures']} checkpoints failed (EROFS), training went on; "
                 f"written again at step {status['last_checkpoint']['step']}")


@pytest.mark.timeout(300)
def test_a_sync_on_a_read_only_file_system(run, fault_case):
    """The run ended here before (bridge FAILED, exit 1): now no engine is touched, the alarm is up
    and training goes on; once the filesystem is writable again the next sync lands."""
    row = fault_case("30.11 a sync's weights on a read-only file system (remounted ro), then rw again")
    if not run.weights_tmpfs:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    began = time.monotonic()
    _remount(run.weights, "ro")
    try:
        status = status_until(run.daemon, lambda s: (s["alarms"].get("sync") or {}).get("active"), 120, "the sync alarm")
        error = status["alarms"]["sync"]["last_error"]
        assert "not written" in error and "Read-only file system" in error, error
        served = status["policy_version"]
        status = run.trains_on(4)  # past the next syncs, which fail again
        assert status["alarms"]["sync"]["failures"] >= 2, status["alarms"]["sync"]
        assert status["policy_version"] == served, "the engine serves the version it had"
        assert status["bridge"]["state"] != "failed", status["bridge"]
    finally:
        _remount(run.weights, "rw")
    status = status_until(run.daemon, lambda s: not s["alarms"]["sync"]["active"], 120, "the alarm cleared")
    assert status["policy_version"] > served
    assert "sync failed, the engines serve the last synced version" in run.daemon.tail(400)
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = (f"{status['alarms']['sync']['failures']} syncs not written (EROFS), training went on at version "
                 f"{served}; synced again to version {status['policy_version']}")


@pytest.mark.timeout(300)
def test_a_second_daemon_on_the_run_directory_is_refused(run, fault_case):
    row = fault_case("30.7 a second grpod start on the run dir (another control.socket)")
    began = time.monotonic()
    first = run.status()
    vllm = first["bridge"]["vllm"]["pid"]
    # Another socket path is what let the second one in (so does deleting the socket file).
    second = write_config(run.tmp / "second.toml", run.settings | {"control.socket": str(run.tmp / "other.sock"),
                                                                   "train.steps": 2})
    finished = run_to_exit(second, timeout_s=240)
    assert finished.code == 2, finished.stderr[-3000:]
    assert f"in use by grpod pid {run.daemon.proc.pid}" in finished.stderr, finished.stderr[-3000:]
    assert group_processes(vllm), "the first daemon's vLLM was stopped"
    status = run.trains_on()
    assert status["bridge"]["vllm"]["pid"] == vllm and status["bridge"]["restarts"] == first["bridge"]["restarts"]
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"exit 2 in {finished.seconds:.1f} s: {finished.stderr.strip().splitlines()[-1][7:90]}"


@pytest.mark.timeout(420)
def test_zz_the_run_stops_cleanly_and_resumes(run, fault_case):
    """After every mistake: `ctl stop` writes a good final checkpoint and `grpod start` resumes it."""
    row = fault_case("30.0 after 30.1-30.8: stop, final checkpoint, grpod start resumes it and its ctl set values")
    began = time.monotonic()
    assert run.set("train.loss.clip_high", 0.3)["ok"] and run.set("train.lr", 2e-5)["ok"]
    run.trains_on(1)
    assert run.daemon.ctl("stop", timeout_s=60)["ok"]
    assert run.daemon.wait_exit(180) == 0, run.daemon.tail()
    stopped = [e for e in log_events(run.run_dir, "checkpoint_written")][-1]
    final = int(Path(stopped["path"]).name.removeprefix("step-"))
    pgids = run.daemon.vllm_pgids
    assert alive(pgids) == []
    again = DaemonProcess(run.config, run.run_dir)
    try:
        status = status_until(again, lambda s: s["step"] >= final + 1, 300, "a step after the resume")
        (resumed,) = log_events(run.run_dir, "resumed")
        assert resumed["step"] == final and resumed["checkpoint"] == stopped["path"]
        # Started again without `--set train.lr=3e-5`: the ctl set values of the stopped run stand.
        restored = {c["key"]: c["new"] for c in status["config_changes"] if c["origin"] == f"checkpoint {stopped['path']}"}
        assert restored.get("train.loss.clip_high") == 0.3 and restored.get("train.lr") == 2e-5, status["config_changes"]
        assert again.ctl("stop", timeout_s=60)["ok"] and again.wait_exit(180) == 0
    finally:
        again.close()
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"final checkpoint step {final}; resumed and trained to step {status['step']}"


# ---- without a running daemon -------------------------------------------------------------------
def _store(tmp_path: Path, model_dir: Path):
    from grpod.config import load_config
    from grpod.run.store import RunStore

    cfg = load_config(write_config(tmp_path / "grpod.toml", base_settings(tmp_path / "run", model_dir) | {"train.steps": 2}))
    return cfg, RunStore(cfg, cfg.run.dir)


@pytest.mark.timeout(300)
def test_a_broken_trainer_is_never_checkpointed(tmp_path, fault_model_dir, fault_case):
    """In process (the trainer and the run's store, no vLLM): what every path to a checkpoint —
    periodic, `ctl checkpoint`, shutdown — goes through."""
    import torch

    from grpod.run.checkpoint import CheckpointError, latest_checkpoint
    from grpod.run.store import RunSnapshot

    row = fault_case("30.2 checkpoint of a trainer whose weights went NaN (as train.lr=inf made them)")
    began = time.monotonic()
    cfg, store = _store(tmp_path, fault_model_dir)
    trainer = store.load_trainer(store.resume_point())
    good = store.save(trainer, RunSnapshot(1, 1, [], {"kind": "builtin", "next_index": 4}, {}))
    with torch.no_grad():
        for param in trainer.trainable:
            param.mul_(math.inf)  # every weight inf or NaN: one step at lr = inf
    with pytest.raises(CheckpointError) as caught:  # BrokenTrainerState
        store.save(trainer, RunSnapshot(2, 2, [], {"kind": "builtin", "next_index": 8}, {}))
    assert type(caught.value).__name__ == "BrokenTrainerState"
    assert "checkpoint of step 2 refused" in str(caught.value) and str(good) in str(caught.value)
    assert latest_checkpoint(store.root).path == good, "the last good checkpoint stays the newest"
    restored = store.resume_point()
    resumed = store.load_trainer(restored)
    assert restored.step == 1 and all(torch.isfinite(p).all() for p in resumed.trainable)
    row.recovery_s, row.data_lost = time.monotonic() - began, "none"
    row.notes = f"refused: {str(caught.value)[:80]}...; resumes step 1"


@pytest.mark.timeout(300)
def test_every_checkpoint_corrupt_refuses_to_start(tmp_path, fault_model_dir, fault_case):
    from grpod.run.store import RunSnapshot

    row = fault_case("30.9 every checkpoint corrupt: grpod start refuses (exit 2)")
    cfg, store = _store(tmp_path, fault_model_dir)
    trainer = store.load_trainer(store.resume_point())
    first = store.save(trainer, RunSnapshot(1, 1, [], {"kind": "builtin", "next_index": 4}, {}))
    second = store.save(trainer, RunSnapshot(2, 2, [], {"kind": "builtin", "next_index": 8}, {}))
    weights = next((first / "model").glob("*.safetensors"))
    blob = bytearray(weights.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    weights.write_bytes(bytes(blob))
    (second / "manifest.json").unlink()
    finished = run_to_exit(tmp_path / "grpod.toml", timeout_s=240)
    assert finished.code == 2, finished.stderr[-3000:]
    assert "none of the 2 checkpoints" in finished.stderr, finished.stderr[-3000:]
    assert "step-000001: " in finished.stderr and "sha256" in finished.stderr, finished.stderr[-3000:]
    assert "step-000002: " in finished.stderr and "manifest.json is missing" in finished.stderr
    assert sorted(p.name for p in store.root.iterdir()) == ["step-000001", "step-000002"], "nothing overwritten"
    assert alive({int(e["pid"]) for e in log_events(cfg.run.dir, "inference_launched")}) == []
    row.data_lost = "none"
    row.notes = f"exit 2 in {finished.seconds:.1f} s naming both checkpoints and why"
