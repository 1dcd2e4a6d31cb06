"""Case 17: the trainer (the daemon, trainer rank 0) SIGKILLed mid-broadcast, bridge mode `broadcast`.

One daemon, one engine, a sync after every step; recorded groups (`source.kind = "replay"`) and a
checkpoint after every step. The test watches `ctl status` until the bridge is BROADCASTING — the
engine fenced (`/grpod/pause?mode=keep`), part of an update sent over the weight-transfer group —
and SIGKILLs the daemon there. What must hold:

- the engine stops itself once its trainer is gone, with its whole process group, within
  `inference.stop_grace_s` and a poll (its server watches its parent): fenced, or about to be, by
  an update that was cut, it may hold a mix of two versions, and is never served from again;
- `grpod start` on the same run directory is that repair: it resumes from the newest complete
  checkpoint, finds no engine left behind, launches one on the checkpoint's weights, probes it
  (it serves exactly the trainer's weights) and trains to the end (exit 0);
- nothing lost: every step 1..N is trained once, with the replay's groups in order;
- no process of either engine remains.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.injection import (
    alive,
    failure_reason,
    lineage,
    log_events,
    replay_lineage,
    replay_settings,
    status_until,
    wait_until,
    write_replay_rollouts,
)
from tests.harness import DaemonProcess, write_config

pytestmark = pytest.mark.faults

STEPS = 10
PER_STEP = 2
PREFETCH = 3


def _settings(run_dir, model_dir, replay) -> dict:
    return replay_settings(run_dir, model_dir, replay, steps=STEPS, prefetch=PREFETCH) | {
        "train.groups_per_step": PER_STEP,
        "bridge.mode": "broadcast",
        "bridge.sync_every": 1,
        "inference.start_timeout_s": 400.0,
        "inference.stop_grace_s": 2.0,
    }


@pytest.mark.timeout(1200)
def test_the_trainer_killed_mid_broadcast_takes_its_engine_along_and_the_restart_repairs_it(
    tmp_path, fault_model_dir, fault_case
):
    row = fault_case("17 SIGKILL the trainer mid-broadcast (the engine stops itself; the restart launches and probes a new one)")
    replay = tmp_path / "rollouts.jsonl"
    write_replay_rollouts(replay, fault_model_dir, groups=STEPS * PER_STEP + PREFETCH + 2, completion_len=96)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "grpod.toml", _settings(run_dir, fault_model_dir, replay))

    first = DaemonProcess(config, run_dir)
    second = None
    try:
        status_until(first, lambda s: s["state"] == "running" and s["step"] >= 2, 500, "daemon 1 training")
        status = status_until(first, lambda s: s["bridge"]["state"] == "BROADCASTING", 120,
                              "a broadcast in flight", poll_s=0.001)
        first.proc.kill()
        killed_at = time.monotonic()
        first.proc.wait(timeout=30)
        engine_pgid = status["bridge"]["engines"][0]["pid"]
        killed_version = status["policy_version"]
        wait_until(lambda: alive([engine_pgid]) == [], 60, "the engine to stop itself without its trainer",
                   describe=lambda: str(alive([engine_pgid])))

        second = DaemonProcess(config, run_dir)
        status_until(second, lambda s: s["state"] == "running", 500, "daemon 2 running")
        row.recovery_s = time.monotonic() - killed_at
        code = second.wait_exit(600)
    finally:
        for daemon in (first, second):
            if daemon is not None:
                daemon.close()

    assert code == 0, f"exit {code}: {failure_reason(run_dir)}\n{second.tail()}"
    assert log_events(run_dir, "inference_left_behind") == [], "no engine was left for daemon 2 to stop"
    resumed = [e for e in log_events(run_dir, "resumed") if "checkpoint" in e]
    assert len(resumed) == 1, resumed
    # Daemon 2's first probe: its engine serves the checkpoint's weights, exactly.
    probes = [e for e in log_events(run_dir, "engine_probed") if e["version"] == int(resumed[0]["policy_version"])]
    assert probes and probes[-1]["ok"], probes

    got = lineage(run_dir)
    expected = replay_lineage(replay, STEPS, PER_STEP)
    row.data_lost = "none" if got == expected else f"lineage {got}"
    row.notes = (f"killed broadcasting version {killed_version + 1} at step {status['step']}; resumed from step "
                 f"{resumed[0]['step']}; the engine left mid-update stopped itself, a new one probed")
    assert got == expected, "every step once, with the replay's groups in order"
    assert alive(first.vllm_pgids | second.vllm_pgids | {engine_pgid}) == [], "no engine process remains"
