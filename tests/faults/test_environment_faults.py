"""Cases 27.x: environments that die or hang never stop training, and episodes that span weight
updates train with the version of every token (issue #27).

One daemon trains SmolLM2-135M-Instruct on an OpenEnv environment served by the server process
grpod starts (the adapter `openenv`), multi-turn, a sync after every step. The environment is slow
on purpose: the first tool call of the run hangs; after it, half the tasks (by seed) hold their
tool's answer until the daemon writes its next `sync` record to metrics.jsonl (at most WAIT_S), so
their second turn is generated after a weight update however long a step takes on a loaded machine,
and the rest answer in 1 s and keep the trainer fed. Once the hung call's group is dropped, a step
is trained and a call is held on the server (the tool marks it in a file), the test SIGKILLs that
server (found by its PID in `ctl status`). Without the held call the kill could find no episode
in flight (the workers all waiting for room in the queue) and drop nothing.

One hang, and the kill after it, so the rest of the run is undisturbed: a kill drops every episode
playing on the server, the held ones too (with one task in five hanging all run long, and every
hang killing the server, CI twice trained no group that spanned a version). The prefetch queue is
short (2 groups) so that the groups generated before the first sync fill the first steps only, not
most of the run's eight.

  27.1  the environment server SIGKILLed mid-episode: the episodes on it are dropped
        (environment_crash), the server is restarted, training goes on and the run ends normally
  27.2  a tool that hangs: its group is dropped (environment_timeout) within timeout_s, the call
        abandoned (the server is killed only at STUCK_LIMIT stuck calls), and the other episodes
        on the server play on
  27.3  episodes spanning weight updates: groups whose loss tokens carry several versions were
        trained (run.record_rollouts), each token with the version vLLM labelled it with
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.faults.injection import follow_to_exit, status_until
from tests.harness import DaemonProcess, write_config

pytestmark = pytest.mark.faults

STEPS = 8  # the groups generated before the first sync and the kill fill about four steps
TIMEOUT_S = 20.0
WAIT_S = 15.0  # under TIMEOUT_S: a task held for a sync is never dropped as a hang
ENVIRONMENT = '''
import os
import random
import time
from pathlib import Path

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

METRICS = Path(__METRICS__)
HUNG = Path(__HUNG__)
HOLDING = Path(__HOLDING__)  # one file per call held for a sync, named "<server pid>-<n>"


def first_hang():
    """True for the run's first tool call only (the flag file outlives a restarted server)."""
    try:
        os.close(os.open(HUNG, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def syncs():
    """The `sync` records the daemon has written so far (one per weight update of the engine)."""
    try:
        return METRICS.read_text().count('"kind": "sync"')
    except FileNotFoundError:
        return 0


class Say(Action):
    message: str = ""


class Heard(Observation):
    prompt: str = ""


class SlowTool(Environment[Say, Heard, State]):
    """Two turns: the model asks, the tool answers (the run's first call hangs; then half the tasks
    wait for the daemon's next sync, the rest take 1 s), the model answers again; reward: the second
    answer's length mod 3 (so groups carry a signal)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()
        self.waits = False
        self.turn = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        rng = random.Random(seed)
        self.waits = rng.random() < 0.5
        self.turn = 0
        self._state = State(episode_id=episode_id, step_count=0)
        return Heard(prompt=f"Name a fruit that starts with the letter {rng.choice('abcmops')}.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self.turn += 1
        if self.turn == 1:
            if first_hang():
                time.sleep(3600)
            elif self.waits:
                marker = HOLDING / f"{os.getpid()}-{id(self)}"
                marker.touch()
                try:
                    seen, deadline = syncs(), time.monotonic() + __WAIT_S__
                    while syncs() == seen and time.monotonic() < deadline:
                        time.sleep(0.2)
                finally:
                    marker.unlink(missing_ok=True)
            else:
                time.sleep(1.0)
            return Heard(prompt="The tool says: try again with one word.", done=False, reward=0.0)
        return Heard(prompt="", done=True, reward=float(len(action.message) % 3))

    @property
    def state(self):
        return self._state
'''


def _settings(tmp: Path, model_dir: Path, run_dir: Path) -> dict:
    return {
        "run.dir": str(run_dir), "run.progress": True, "run.record_rollouts": True,
        "model.path": str(model_dir), "model.init_if_missing": False, "model.max_seq_len": 256,
        "inference.start_timeout_s": 240.0, "inference.kv_cache_bytes": "256M",
        "source.kind": "environment", "source.group_size": 3, "source.max_tokens": 10,
        "source.concurrency": 3, "source.prefetch_groups": 2, "source.error_alarm_s": 3600.0,
        "source.environment.adapter": "openenv", "source.environment.name": f"{tmp / 'slow_tool.py'}:SlowTool",
        "source.environment.max_turns": 2, "source.environment.timeout_s": TIMEOUT_S,
        "train.steps": STEPS, "train.groups_per_step": 2, "train.lr": 1e-6, "train.threads": 1,
        "train.max_staleness": 4,
        "bridge.mode": "none", "bridge.sync_every": 1, "bridge.probe_every": 1000,
        "eval.size": 0, "checkpoint.every": 1000, "checkpoint.at_shutdown": False,  # 1.6 GB that nothing here reads
    }


@pytest.mark.timeout(600)
def test_environment_faults_drop_groups_and_training_goes_on(tmp_path, smollm2_dir, fault_case):
    killed_row = fault_case("27.1 environment server SIGKILLed mid-episode")
    hang_row = fault_case("27.2 a tool that hangs")
    spans_row = fault_case("27.3 episodes spanning weight updates train with per-token versions")
    run_dir, holding = tmp_path / "run", tmp_path / "holding"
    holding.mkdir()

    def held_on(pid: int | None) -> bool:
        """A call is held on server `pid` right now (so the kill lands mid-episode)."""
        return any(marker.name.startswith(f"{pid}-") for marker in holding.iterdir())

    (tmp_path / "slow_tool.py").write_text(
        ENVIRONMENT.replace("__METRICS__", repr(str(run_dir / "metrics.jsonl")))
        .replace("__HUNG__", repr(str(tmp_path / "hung")))
        .replace("__HOLDING__", repr(str(holding)))
        .replace("__WAIT_S__", repr(WAIT_S))
    )
    daemon = DaemonProcess(write_config(tmp_path / "grpod.toml", _settings(tmp_path, smollm2_dir, run_dir)), run_dir)
    try:
        gone: set[int] = set()
        for _ in range(10):
            status = status_until(
                daemon, lambda s: s["step"] >= 1 and (s.get("source") or {}).get("drop_reasons", {}).get("environment_timeout", 0) >= 1
                and s["source"].get("environment", {}).get("state") == "up"
                and s["source"]["environment"].get("pid") not in {None, *gone}
                and held_on(s["source"]["environment"]["pid"]),
                400, "the first step, the hung call's drop, and a call held on the environment server",
            )
            server = status["source"]["environment"]["pid"]
            try:
                os.kill(server, signal.SIGKILL)
                break
            except ProcessLookupError:
                # that server died between the status read and the kill: kill the one grpod
                # launches next.
                gone.add(server)
        else:
            pytest.fail("the environment server's pid changed before each of 10 kills")
        killed_at, step_at_kill = time.monotonic(), status["step"]
        status = status_until(
            daemon, lambda s: s["source"]["environment"].get("restarts", 0) >= 1 and s["trained_steps"] > step_at_kill,
            300, "a restarted server and a step trained after the kill",
        )
        recovery = time.monotonic() - killed_at
        code, last = follow_to_exit(daemon, 400, status)
    finally:
        daemon.close()
    assert code == 0, daemon.tail()
    drops = last["source"]["drop_reasons"]
    assert drops.get("environment_crash", 0) >= 1, drops
    assert drops.get("environment_timeout", 0) >= 1, drops
    assert set(drops) <= {"environment_crash", "environment_timeout"}, drops
    assert last["trained_steps"] >= STEPS - 2 and last["step"] == STEPS
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
    assert last["source"]["environment"]["pid"] != server
    assert last["source"]["environment"]["restarts"] == 1, "the hung call was abandoned; only the kill restarted it"
    killed_row.recovery_s = round(recovery, 1)
    killed_row.data_lost = "the groups playing on it only"
    killed_row.notes = (f"server pid {server} SIGKILLed at step {step_at_kill}; restarted "
                        f"{last['source']['environment']['restarts']}x in the run; drops {drops}; run ended 0")
    hang_row.recovery_s = TIMEOUT_S
    hang_row.data_lost = "that group only"
    hang_row.notes = (f"{drops['environment_timeout']} group dropped as environment_timeout at timeout_s {TIMEOUT_S:g}; "
                      "the server played on (restarted once in the run: the kill of 27.1)")

    spanning = trained = 0
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        group = json.loads(line)["group"]  # record_groups: {"step", "group"}
        versions = group.get("token_versions")
        if not versions:
            continue
        sampled = {v for row, mask in zip(versions, group["loss_mask"], strict=True) for v, m in zip(row, mask, strict=True) if m}
        spanning += len(sampled) > 1
        trained += 1
    assert spanning >= 1, f"none of {trained} trained groups spanned a weight update; drops {drops}"
    spans_row.recovery_s = 0.0
    spans_row.data_lost = "none"
    spans_row.notes = f"{spanning} trained groups carried tokens of several versions (rollouts.jsonl)"
