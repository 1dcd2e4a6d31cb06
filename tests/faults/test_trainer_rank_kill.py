"""Case 14: a follower trainer rank SIGKILLed mid-step under torchrun; torchrun restarts the job and
rank 0 resumes from the sharded checkpoint.

`torchrun --max-restarts 1 --nproc-per-node 2 -m grpod start`: two FSDP ranks (rank 0 the
daemon, with one vLLM engine and bridge mode `broadcast`), replayed groups, a checkpoint after
every step. Once a step trains after a complete checkpoint, rank 1 is SIGKILLed. Rank 0's step
fails on the dead rank (the ranks are out of step: nothing more is sent to it, no checkpoint is
written), torchrun stops rank 0 (SIGTERM: the daemon stops its engine) and starts both ranks
again; the new rank 0 resumes from the newest complete checkpoint — model and optimizer from
both ranks' DCP shards, the buffered groups from its run state — and runs to the end (exit 0).

Nothing lost: every step 1..N is trained with the replay's groups in order, each group once, the
checkpoint's buffered groups first after the resume; and the final weights equal, bit for bit, a
straight run of the same 2 ranks on the same groups with no fault (tests/training/fsdp_ranks.py
under torchrun, no vLLM). No engine process of either attempt is left.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.faults.injection import (
    alive,
    checkpoint_steps,
    failure_reason,
    lineage,
    log_events,
    replay_lineage,
    replay_settings,
    run_state,
    status_until,
    step_records,
    temp_checkpoints,
    write_replay_rollouts,
)
from tests.harness import ROOT, DaemonProcess, torchrun, write_config

pytestmark = pytest.mark.faults

STEPS = 12
PER_STEP = 2
PREFETCH = 3


def _settings(run_dir: Path, model: Path, replay: Path) -> dict:
    return replay_settings(run_dir, model, replay, steps=STEPS, prefetch=PREFETCH) | {
        "train.groups_per_step": PER_STEP,
        "train.collective_timeout_s": 60.0,
        "bridge.mode": "broadcast",
        "bridge.sync_every": 2,
        "inference.start_timeout_s": 400.0,
    }


@pytest.fixture(scope="module")
def workload(tmp_path_factory, fault_model_dir):
    root = tmp_path_factory.mktemp("rank-kill")
    write_replay_rollouts(root / "rollouts.jsonl", fault_model_dir, groups=STEPS * PER_STEP + PREFETCH + 2, completion_len=120)
    return fault_model_dir, root / "rollouts.jsonl"


@pytest.fixture(scope="module")
def straight_two_ranks(workload, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same 2 ranks on the same groups, no fault, no vLLM: the final weights."""
    model, replay = workload
    out = tmp_path_factory.mktemp("straight")
    config = write_config(out / "grpod.toml", _settings(out / "run", model, replay))
    proc = subprocess.run(
        [*torchrun(2), str(ROOT / "tests" / "training" / "fsdp_ranks.py"), str(config), str(out), "--steps", str(STEPS)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return load_file(out / "final" / "model.safetensors")


def _first_step_after(run_dir: Path, step: int, records_before: int) -> float:
    for record in step_records(run_dir)[records_before:]:
        if record["step"] > step:
            return time.monotonic() - (time.time() - record["time"])
    raise AssertionError(f"no step after {step} was trained after the restart")


@pytest.mark.timeout(1800)
def test_a_killed_follower_rank_restarts_the_job_which_resumes_from_the_sharded_checkpoint(
    tmp_path, workload, straight_two_ranks, fault_case
):
    row = fault_case("14 SIGKILL a follower trainer rank mid-step; torchrun restarts, resume from the sharded checkpoint")
    model, replay = workload
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "grpod.toml", _settings(run_dir, model, replay))
    daemon = DaemonProcess(config, run_dir, launcher=torchrun(2, max_restarts=1))
    try:
        running = status_until(daemon, lambda s: s["state"] == "running", 500, "rank 0's daemon running")
        assert running["trainer_ranks"] == {"world_size": 2, "restarts": 0, "backend": "gloo", "out_of_step": None}
        follower = daemon.rank_processes()[1]

        def training_after_checkpoint(status) -> bool:
            ckpt = status["last_checkpoint"]
            return (
                status["step"] >= 3 and ckpt is not None and ckpt["step"] == status["step"]
                and status["heartbeat"]["busy_for_s"] is not None and not temp_checkpoints(run_dir)
            )

        status = status_until(daemon, training_after_checkpoint, 300, "a step in training after a checkpoint", poll_s=0.002)
        follower.kill()
        killed_at = time.monotonic()
        killed_step = status["step"]
        records_before = len(step_records(run_dir))
        # `ctl status` of the restarted job's rank 0 (its engine takes a while to start).
        again = status_until(daemon, lambda s: (s.get("trainer_ranks") or {}).get("restarts") == 1, 300,
                             "the restarted ranks' status")
        assert again["trainer_ranks"]["world_size"] == 2 and again["trainer_ranks"]["out_of_step"] is None
        code = daemon.wait_exit(1200)
        output = daemon.tail(400)
    finally:
        daemon.close()

    assert code == 0, f"torchrun exited {code}: {failure_reason(run_dir)}\n{output}"
    assert "restarts=1" in daemon.output.read_text(errors="replace"), "torchrun started the ranks a second time"
    resumed = [e for e in log_events(run_dir, "resumed") if "checkpoint" in e]
    assert len(resumed) == 1, resumed
    resumed_step = int(resumed[0]["step"])
    assert resumed_step == killed_step, "resumed from the newest complete checkpoint, the one before the kill"
    assert temp_checkpoints(run_dir) == [], "no half-written checkpoint was left or read"
    assert (run_dir / "checkpoints" / f"step-{resumed_step:06d}" / "sharded" / "__1_0.distcp").exists()
    row.recovery_s = _first_step_after(run_dir, resumed_step, records_before) - killed_at

    # Nothing lost: each step once with the replay's groups, the buffered ones first after resume.
    got = lineage(run_dir)
    expected = replay_lineage(replay, STEPS, PER_STEP)
    trained = [gid for step in sorted(got) for gid in got[step]]
    lost = sorted({gid for gids in expected.values() for gid in gids} - set(trained))
    twice = len(trained) - len(set(trained))
    row.data_lost = "none" if not lost and not twice and got == expected else f"{len(lost)} lost, {twice} twice"
    buffered = [g["group_id"] for g in run_state(run_dir, resumed_step)["buffered"]]
    row.notes = (f"killed rank 1 while step {killed_step + 1} trained; rank 0 resumed from step {resumed_step} "
                 f"(DCP shards of 2 ranks), {len(buffered)} buffered groups")
    assert got == expected and not lost and not twice
    assert buffered, f"checkpoint {resumed_step} recorded no buffered group (prefetch {PREFETCH})"
    after = [gid for step in range(resumed_step + 1, STEPS + 1) for gid in got[step]]
    assert after[: len(buffered)] == buffered, "the checkpoint's buffered groups are the first trained after resume"
    assert checkpoint_steps(run_dir)[-1] == STEPS
    final = load_file(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "model" / "model.safetensors")
    assert final.keys() == straight_two_ranks.keys()
    differ = [name for name in final if not torch.equal(final[name], straight_two_ranks[name])]
    assert differ == [], f"differ from the straight 2-rank run after the restart: {differ}"
    assert alive(daemon.vllm_pgids) == [], "no engine process of either attempt remains"
    assert len(daemon.vllm_pgids) >= 2, "the restarted daemon launched its own engine"


@pytest.mark.timeout(900)
def test_a_killed_torchrun_stops_its_ranks_as_its_sigterm_would(tmp_path, workload, fault_case):
    """torchrun itself SIGKILLed (its PID only; it starts each rank in a session of its own, so
    nothing reaches them): rank 0 sees its launcher gone and stops as on torchrun's SIGTERM — the
    final checkpoint, with its follower, then its engine — and releases the follower."""
    row = fault_case("14b SIGKILL torchrun itself: rank 0 stops as on its SIGTERM, nothing left running")
    model, replay = workload
    run_dir = tmp_path / "run"
    settings = {k: v for k, v in _settings(run_dir, model, replay).items() if k != "source.replay_path"}
    # The builtin task: a source that never runs out, so only the stop can end the run.
    settings |= {"source.kind": "builtin", "train.steps": 100000, "checkpoint.every": 0}
    config = write_config(tmp_path / "grpod.toml", settings)
    daemon = DaemonProcess(config, run_dir, launcher=torchrun(2))
    try:
        status = status_until(daemon, lambda s: s["state"] == "running" and s["step"] >= 2, 500, "two steps trained")
        ranks = daemon.rank_processes()
        assert sorted(ranks) == [0, 1]
        daemon.proc.kill()  # torchrun only, not its ranks' sessions
        killed_at = time.monotonic()
        daemon.proc.wait(timeout=30)
        gone = psutil.wait_procs(list(ranks.values()), timeout=180)[1] == []
        row.recovery_s = time.monotonic() - killed_at
        assert gone, f"ranks still running 180 s after torchrun was killed: {[p.pid for p in ranks.values() if p.is_running()]}"
        assert alive(daemon.vllm_pgids) == [], "rank 0 stopped its engine"
    finally:
        for rank in (locals().get("ranks") or {}).values():  # sessions of their own: close() misses them
            if rank.is_running():
                rank.kill()
        daemon.close()
    stopped = log_events(run_dir, "daemon_stopped")
    assert stopped and stopped[-1]["exit_code"] == 0, stopped
    assert stopped[-1]["reason"] != "source exhausted", stopped
    final = checkpoint_steps(run_dir)[-1]  # no periodic checkpoints: the stop's
    assert final >= status["step"] and temp_checkpoints(run_dir) == []
    assert (run_dir / "checkpoints" / f"step-{final:06d}" / "sharded" / "__1_0.distcp").exists(), "both ranks' shards"
    row.data_lost = "none"
    row.notes = f"killed at step {status['step']}; rank 0's final checkpoint at step {final}, follower released"


FROZEN_TIMEOUT_S = 20.0  # train.collective_timeout_s of case 14c


@pytest.mark.timeout(900)
def test_a_frozen_follower_rank_ends_rank_0_within_the_collective_timeout(tmp_path, workload, fault_case):
    """A follower rank SIGSTOPped (a hung driver, a debugger, a node swapping): rank 0 used to wait
    for it in the next command without a deadline, so `ctl stop` never ended the run. Now every
    call rank 0 sends, as every collective inside one, is bounded by `train.collective_timeout_s`:
    the ranks are declared out of step, the stop's checkpoint is refused (the last complete one is
    kept), rank 0 stops its engine and exits non-zero, and torchrun ends the frozen rank."""
    row = fault_case("14c SIGSTOP a follower trainer rank: rank 0 ends within train.collective_timeout_s")
    model, replay = workload
    run_dir = tmp_path / "run"
    settings = {k: v for k, v in _settings(run_dir, model, replay).items() if k != "source.replay_path"}
    settings |= {"source.kind": "builtin", "train.steps": 100000, "checkpoint.every": 2,
                 "train.collective_timeout_s": FROZEN_TIMEOUT_S}
    config = write_config(tmp_path / "grpod.toml", settings)
    daemon = DaemonProcess(config, run_dir, launcher=torchrun(2))
    ranks: dict = {}
    try:
        status_until(daemon, lambda s: s["state"] == "running" and (s["last_checkpoint"] or {}).get("step", 0) >= 2,
                     500, "a checkpoint of both ranks")
        ranks = daemon.rank_processes()
        ranks[1].suspend()
        frozen_at = time.monotonic()
        try:
            daemon.ctl("stop", timeout_s=30)
        except Exception:  # noqa: BLE001 — the daemon may already be ending on the frozen rank
            pass
        code = daemon.wait_exit(FROZEN_TIMEOUT_S * 3 + 120)
        row.recovery_s = time.monotonic() - frozen_at
        gone = psutil.wait_procs(list(ranks.values()), timeout=120)[1] == []
    finally:
        for rank in ranks.values():  # sessions of their own: close() misses them
            if rank.is_running():
                rank.kill()
        daemon.close()
    assert code != 0, "the run could not end cleanly: a rank never answered"
    assert gone, "torchrun ended the frozen rank"
    reason = failure_reason(run_dir)
    # Frozen between calls: the next call is not taken; inside one: a collective of it times out.
    assert "train.collective_timeout_s = 20 s" in reason and ("did not take the call" in reason or "out of step" in reason), reason
    assert alive(daemon.vllm_pgids) == [], "rank 0 stopped its engine"
    assert temp_checkpoints(run_dir) == [], "no half-written checkpoint"
    kept = checkpoint_steps(run_dir)[-1]
    assert (run_dir / "checkpoints" / f"step-{kept:06d}" / "sharded" / "__1_0.distcp").exists()
    row.data_lost = "none (steps after the last checkpoint are retrained at resume)"
    row.notes = f"torchrun exited {code} {row.recovery_s:.0f} s after the freeze; last checkpoint step {kept}"
