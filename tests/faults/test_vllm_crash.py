"""Cases 1, 2, 18 and 19: vLLM dies or freezes under a running daemon, which relaunches it and
finishes the run.

One daemon run (builtin source, `none` bridge reloading in place every `SYNC_EVERY` steps)
takes the four faults, one after the other, in one test (five rows of the fault table). They are
timed so that each of the bridge's ways of meeting a lost vLLM is exercised:

1. SIGKILL of the vLLM process that holds the weights (EngineCore with grpod's default one-engine
   CPU executor, its Worker child otherwise) while vLLM generates, just
   after a sync (the next one is steps away): the bridge's health watch finds it.
2. SIGKILL of vLLM's API server (the process group leader) while the step before a sync trains:
   the sync that follows the step meets the dead server.
18. SIGSTOP of the process that holds the weights while vLLM generates, just after a sync: the
   API server still answers /health, so only the stall watch can find it (its token counters
   stand still for `inference.stall_timeout_s` with requests in flight).
19. The same freeze while the step before a sync trains: the engine core does not answer the
   sync's pause within `inference.stall_timeout_s` (not `inference.request_timeout_s`, which is
   longer here) while the API server answers /health: the sync relaunches it and applies itself
   again.

After each: vLLM is relaunched on the current (newest synced) weights, the alignment probe
passes, training goes on; each fault costs exactly one restart; groups whose generation failed
are dropped and counted, never trained. Then the run completes with exit 0, every step 1..N
trained exactly once from whole groups, and no process of any vLLM group remains.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from tests.faults.injection import (
    alive,
    checkpoint_steps,
    failure_reason,
    follow_to_exit,
    generations_running,
    log_events,
    run_state,
    sigkill,
    status_until,
    step_records,
    vllm_api_server,
    vllm_weights_holder,
    wait_until,
)
from tests.harness import DaemonProcess, base_settings, metrics, write_config

pytestmark = pytest.mark.faults

STEPS = 40
SYNC_EVERY = 4
GROUP_SIZE = 4
GROUPS_PER_STEP = 2
CONCURRENCY = 2
# Case 18's limit: well above an engine step under load, well below a test's patience.
STALL_S = 10.0
FAULTS = 4


def _settings(run_dir, model_dir):
    return base_settings(run_dir, model_dir) | {
        "train.steps": STEPS,
        "train.groups_per_step": GROUPS_PER_STEP,
        "source.group_size": GROUP_SIZE,
        "source.concurrency": CONCURRENCY,
        # The random-weight model rarely ends a turn: completions run to max_tokens, so vLLM is
        # generating most of the time and every step takes long enough to be hit on an idle machine.
        "source.max_tokens": 160,
        "source.prefetch_groups": GROUPS_PER_STEP,
        "bridge.sync_every": SYNC_EVERY,
        "run.record_rollouts": True,
        "inference.start_timeout_s": 300.0,
        # A vLLM whose engine died ignores SIGTERM; do not wait the default 5 s before SIGKILL.
        "inference.stop_grace_s": 2.0,
        "inference.stall_timeout_s": STALL_S,
        # Above STALL_S: case 19's pause of the frozen engine is bounded by the stall limit, not this.
        "inference.request_timeout_s": 20.0,
        "inference.max_restarts": FAULTS,
        "checkpoint.every": 0,
    }


@dataclass
class CrashRun:
    daemon: DaemonProcess
    run_dir: Path
    model_dir: Path
    pgids: list[int] = field(default_factory=list)  # vLLM process groups, in launch order


@pytest.fixture()
def crash_run(tmp_path, fault_model_dir):
    tmp = tmp_path
    run_dir = tmp / "run"
    daemon = DaemonProcess(write_config(tmp / "grpod.toml", _settings(run_dir, fault_model_dir)), run_dir)
    try:
        yield CrashRun(daemon, run_dir, fault_model_dir)
    finally:
        daemon.close()


def _serving(status, restarts: int) -> bool:
    bridge = status["bridge"] or {}
    return bridge.get("restarts") == restarts and bridge.get("state") == "SERVING" and bridge["vllm"]["available"]


def _recorded_groups(run_dir) -> dict[str, dict]:
    groups = {}
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        group = json.loads(line)["group"]
        groups.setdefault(group["group_id"], group)
    return groups


def _whole(group: dict) -> bool:
    """All `GROUP_SIZE` sequences, each with a non-empty completion and aligned masks/logprobs."""
    tokens, masks, logprobs = group["tokens"], group["loss_mask"], group["inference_logprobs"]
    if not (len(tokens) == len(masks) == len(logprobs) == len(group["scores"]) == GROUP_SIZE):
        return False
    return all(len(t) == len(m) == len(lp) and sum(m) > 0 for t, m, lp in zip(tokens, masks, logprobs))


def _detected_by(run_dir, killed_wall: float) -> str:
    """Which part of the bridge met the dead vLLM first: a sync started after the kill and before
    the engine was declared lost, or the health watch."""
    lost = [_wall(e) for e in log_events(run_dir, "inference_lost") if _wall(e) >= killed_wall]
    syncs = [
        _wall(e)
        for e in log_events(run_dir, "bridge_transition")
        if e.get("trigger") == "SYNC" and killed_wall <= _wall(e) <= (lost[0] if lost else float("inf"))
    ]
    return "the sync after the step" if syncs else "the health watch"


def _wall(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def _check_recovery(run: CrashRun, restarts: int, row, killed_at: float, drops_before: int) -> list[dict]:
    """After the kill: one more restart, relaunched on the newest synced weights, drops counted and
    never trained, training goes on. Returns the `generation_failed` events since the kill."""
    killed_wall = time.time() - (time.monotonic() - killed_at)
    back = status_until(run.daemon, lambda s: _serving(s, restarts), 400, f"recovery {restarts}")
    row.recovery_s = time.monotonic() - killed_at
    run.pgids.append(back["bridge"]["vllm"]["pid"])
    after = status_until(run.daemon, lambda s: s["step"] > back["step"], 120, f"a step after recovery {restarts}")
    failures = log_events(run.run_dir, "generation_failed")
    drops = failures[drops_before:]
    recovered = log_events(run.run_dir, "inference_recovered")
    row.notes = f"found by {_detected_by(run.run_dir, killed_wall)}; {len(drops)} groups dropped (counted)"
    if len(recovered) >= restarts:
        row.notes += f"; relaunch + probe {recovered[restarts - 1]['seconds']:.1f} s"

    lost_events = log_events(run.run_dir, "inference_lost")
    assert [e["restarts"] for e in lost_events] == list(range(1, restarts + 1)), "one restart per fault"
    assert len(set(run.pgids)) == len(run.pgids) == restarts + 1, "a new vLLM process group serves"
    synced = [e for e in log_events(run.run_dir, "sync_done") if e["timestamp"] < lost_events[-1]["timestamp"]]
    relaunch = log_events(run.run_dir, "inference_launched")[restarts]
    expected = run.run_dir / "weights" / f"v{synced[-1]['version']:06d}" if synced else run.model_dir
    assert relaunch["model"] == str(expected), "relaunched on the newest synced weights"
    assert after["source"]["dropped"] == sum(after["source"]["drop_reasons"].values()) == len(failures)
    trained = {gid for r in step_records(run.run_dir) for gid in r["group_ids"]}
    assert not {f"builtin-{e['index']}" for e in drops} & trained, "a dropped group was trained"
    row.data_lost = "none"
    return drops


def worker_sigkill_while_generating(crash_run, fault_case) -> None:
    row = fault_case("1 SIGKILL vLLM engine (holds the weights) while generating")
    daemon = crash_run.daemon
    status = status_until(daemon, lambda s: s["state"] == "running" and s["step"] >= 1, 400, "step 1 trained")
    crash_run.pgids.append(status["bridge"]["vllm"]["pid"])
    base_url = status["bridge"]["vllm"]["base_url"]
    worker = vllm_weights_holder(crash_run.pgids[0])
    drops_before = len(log_events(crash_run.run_dir, "generation_failed"))
    status_until(daemon, generating_after_sync(base_url), 120, "vLLM generating just after a sync", poll_s=0.005)
    killed_at = sigkill(worker)
    drops = _check_recovery(crash_run, 1, row, killed_at, drops_before)
    assert drops, "the generation running at the kill is dropped and counted"


def generating_after_sync(base_url: str):
    """A status condition: the policy was synced at this step (the next sync is steps away) and
    vLLM at `base_url` is generating."""

    def condition(s) -> bool:
        just_synced = s["step"] % SYNC_EVERY == 0 and s["policy_version"] == s["step"] // SYNC_EVERY
        return just_synced and s["bridge"]["state"] == "SERVING" and generations_running(base_url) > 0

    return condition


def api_server_sigkill_mid_step(crash_run, fault_case) -> None:
    row = fault_case("2 SIGKILL vLLM API server (group leader) mid-step")
    daemon = crash_run.daemon
    assert len(crash_run.pgids) == 2, "case 1 ran first on this daemon"
    drops_before = len(log_events(crash_run.run_dir, "generation_failed"))
    busy = status_until(daemon, training_before_sync, 120, "the step before a sync in training", poll_s=0.005)
    assert busy["bridge"]["vllm"]["pid"] == crash_run.pgids[-1]
    killed_at = sigkill(vllm_api_server(crash_run.pgids[-1]))
    _check_recovery(crash_run, 2, row, killed_at, drops_before)


def training_before_sync(s) -> bool:
    """A status condition: the step that a sync follows is training."""
    busy = s["heartbeat"]["busy_for_s"] is not None and s["bridge"]["state"] == "SERVING"
    return busy and (s["step"] + 1) % SYNC_EVERY == 0


def weights_holder_frozen_while_generating(crash_run, fault_case) -> None:
    row = fault_case("18 SIGSTOP vLLM engine (holds the weights) while generating: /health still answers")
    daemon = crash_run.daemon
    assert len(crash_run.pgids) == 3, "cases 1 and 2 ran first on this daemon"
    status = status_until(daemon, lambda s: _serving(s, 2), 60, "serving after case 2")
    base_url = status["bridge"]["vllm"]["base_url"]
    frozen = vllm_weights_holder(crash_run.pgids[-1])
    drops_before = len(log_events(crash_run.run_dir, "generation_failed"))
    status_until(daemon, generating_after_sync(base_url), 180, "vLLM generating just after a sync", poll_s=0.005)
    frozen.suspend()  # a process of the vLLM group this daemon launched (by PID)
    frozen_at = time.monotonic()
    try:
        lost = wait_until(lambda: log_events(crash_run.run_dir, "inference_lost")[2:], 4 * STALL_S + 60,
                          "the frozen engine found lost")[0]
        found_s = time.monotonic() - frozen_at
        drops = _check_recovery(crash_run, 3, row, frozen_at, drops_before)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            frozen.resume()
    row.notes = f"found by the stall watch after {found_s:.1f} s ({lost['error']}); " + row.notes.split("; ", 1)[1]
    assert "computed no token" in lost["error"], lost
    assert found_s >= STALL_S, "found before the stall limit: not by the stall watch"
    assert drops, "the generation frozen in flight is dropped and counted"


def weights_holder_frozen_before_a_sync(crash_run, fault_case) -> None:
    row = fault_case("19 SIGSTOP vLLM engine (holds the weights) while the step before a sync trains")
    daemon = crash_run.daemon
    assert len(crash_run.pgids) == 4, "cases 1, 2 and 18 ran first on this daemon"
    status_until(daemon, lambda s: _serving(s, 3), 60, "serving after case 18")
    drops_before = len(log_events(crash_run.run_dir, "generation_failed"))
    status_until(daemon, training_before_sync, 180, "the step before a sync in training", poll_s=0.005)
    frozen = vllm_weights_holder(crash_run.pgids[-1])
    frozen.suspend()  # a process of the vLLM group this daemon launched (by PID)
    frozen_at = time.monotonic()
    try:
        _check_recovery(crash_run, 4, row, frozen_at, drops_before)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            frozen.resume()
    lost = log_events(crash_run.run_dir, "inference_lost")[3]
    assert lost["during"] == "sync" and "stalled during the sync" in lost["error"], lost
    assert f"/grpod/pause: no response: timed out after {STALL_S:g} s (inference.stall_timeout_s)" in lost["error"], lost
    silent = log_events(crash_run.run_dir, "engine_core_silent")
    assert [e["route"] for e in silent] == ["/grpod/pause"], "the unanswered pause found it; nothing more was asked"
    row.notes = f"the core left the sync's pause unanswered for {STALL_S:g} s: relaunched mid-sync; " + row.notes.split("; ", 1)[1]


def run_completes_after_the_faults(crash_run, fault_case) -> None:
    row = fault_case("1+2+18+19 the run that lost vLLM four times completes")
    run_dir = crash_run.run_dir
    code, last = follow_to_exit(crash_run.daemon, 300)
    crash_run.daemon.close()
    records = step_records(run_dir)
    trained = [gid for record in records for gid in record["group_ids"]]
    saved = checkpoint_steps(run_dir)
    final = run_state(run_dir, saved[-1]) if saved else {"buffered": [], "source_cursor": {}}
    buffered = [g["group_id"] for g in final["buffered"]]
    failures = log_events(run_dir, "generation_failed")
    dropped = {f"builtin-{e['index']}" for e in failures}
    drawn = {f"builtin-{i}" for i in range(final["source_cursor"].get("next_index", 0))}
    # Problems drawn but neither trained, buffered nor dropped: generations cancelled by the
    # shutdown, at most one per generation worker.
    unaccounted = drawn - set(trained) - set(buffered) - dropped
    twice = len(trained) - len(set(trained))
    recorded = _recorded_groups(run_dir)
    partial = [gid for gid in trained if gid not in recorded or not _whole(recorded[gid])]
    problems = [f"{twice} trained twice"] * bool(twice) + [f"{len(partial)} partial"] * bool(partial)
    problems += [f"{len(unaccounted)} unaccounted"] * (len(unaccounted) > CONCURRENCY)
    row.data_lost = ", ".join(problems) or "none"
    row.notes = (
        f"exit {code}; steps {len(records)}/{STEPS}; restarts {(last.get('bridge') or {}).get('restarts')}; "
        f"{len(dropped)} dropped groups counted, {len(unaccounted)} cancelled at shutdown"
    )

    assert code == 0, f"exit {code}: {failure_reason(run_dir)}\n{crash_run.daemon.tail()}"
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step trained exactly once"
    assert (last.get("bridge") or {}).get("restarts") == FAULTS, "one restart per fault"
    assert len(log_events(run_dir, "inference_recovered")) == FAULTS
    syncs = [r for r in metrics(run_dir) if r["kind"] == "sync"]
    assert [r["weights_step"] for r in syncs] == list(range(SYNC_EVERY, STEPS + 1, SYNC_EVERY)), "every sync done, once"
    assert all(r["probe"]["max_abs_diff"] <= 0.02 for r in syncs), "every sync probed and aligned"
    source = last["source"]
    assert source["dropped"] == sum(source["drop_reasons"].values()) == len(failures) >= 1, "drops are counted"
    assert not dropped & set(trained), "a dropped group was trained"
    assert not twice and not partial, problems
    assert len(unaccounted) <= CONCURRENCY, f"groups neither trained, buffered nor dropped: {sorted(unaccounted)}"
    assert alive(crash_run.daemon.vllm_pgids | set(crash_run.pgids)) == [], "no process of any vLLM group remains"


@pytest.mark.timeout(1200)
def test_vllm_killed_twice_and_frozen_twice_mid_run_is_relaunched_and_the_run_completes(crash_run, fault_case):
    worker_sigkill_while_generating(crash_run, fault_case)
    api_server_sigkill_mid_step(crash_run, fault_case)
    weights_holder_frozen_while_generating(crash_run, fault_case)
    weights_holder_frozen_before_a_sync(crash_run, fault_case)
    run_completes_after_the_faults(crash_run, fault_case)
