"""Case 3: the daemon SIGKILLed mid-step, then mid-checkpoint; case 8: a control-socket flood.

All runs replay the same recorded rollouts (source.kind = "replay"), so a straight run with no
fault is the reference every other run must match; it is trained in this process, with the
daemon's own trainer path (`train_batch`) on the same config, groups and order (a replay needs no
vLLM). One lineage of three daemons on one run directory takes the faults in turn:

    daemon 1  trains, checkpoints after every step    SIGKILL while a step trains
    daemon 2  resumes from the last complete checkpoint  SIGKILL while a checkpoint is written
    daemon 3  resumes again, under 1000 control requests (case 8), runs to the end (exit 0)

After each kill `grpod start` on the same run directory resumes from the newest complete
checkpoint (never the half-written one), and the groups that checkpoint recorded as buffered are
the first ones trained. Daemon 1's vLLM stops itself once its daemon is gone; daemon 2's is
SIGSTOPped before the kill (a hung vLLM, which cannot), and daemon 3 stops it by its launch record. Over the whole lineage every step 1..N is trained exactly once with the same
groups and the same loss as the reference; nothing is lost, nothing trained twice.

Case 8: while daemon 3 trains, a few client threads send 1000 requests — valid pause-free
commands and garbage (bad JSON, unknown commands, wrong argument types, invalid UTF-8, lines
over the 64 KiB limit). Every request gets a reply of the right kind; latencies are reported;
the losses of the steps trained under the flood equal the reference's.

Exact resume (issue 3): the lineage's final weights equal the straight run's bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load_file

from tests.faults.injection import (
    alive,
    checkpoint_steps,
    failure_reason,
    lineage,
    log_events,
    losses,
    replay_settings,
    run_state,
    status_until,
    step_records,
    temp_checkpoints,
    wait_until,
    write_replay_rollouts,
)
from tests.harness import DaemonProcess, write_config

pytestmark = pytest.mark.faults

STEPS = 24
PREFETCH = 3
LOSS_TOLERANCE = 1e-6
FLOOD_REQUESTS = 1000
FLOOD_THREADS = 4
# Between two requests of one client: spreads the flood over a few training steps (~1.5 s).
FLOOD_PAUSE_S = 0.005


def _settings(run_dir, model_dir, replay):
    return replay_settings(run_dir, model_dir, replay, steps=STEPS, prefetch=PREFETCH) | {
        "bridge.sync_every": 2,
        "inference.start_timeout_s": 300.0,
    }


@pytest.fixture(scope="module")
def replay_file(tmp_path_factory, fault_model_dir):
    path = tmp_path_factory.mktemp("replay") / "rollouts.jsonl"
    write_replay_rollouts(path, fault_model_dir, groups=STEPS * 2 + PREFETCH + 2, completion_len=180)
    return path


@dataclass
class Reference:
    lineage: dict[int, list[str]]
    losses: dict[int, float]
    weights: dict[str, torch.Tensor]


class _NoFence:
    """`bridge.fence` of a mode that ships a copy: the update runs as is."""

    async def fence(self, update):
        await update()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, fault_model_dir, replay_file) -> Reference:
    """The straight run: the daemons' config and data, no fault, no flood, trained here with the
    step loop's trainer path: the replay's groups in order, `train.groups_per_step` per step."""
    import anyio

    from grpod.config import load_config
    from grpod.daemon.step_loop import train_batch
    from grpod.rollouts.group import RolloutGroup
    from grpod.training.trainer import build_trainer

    tmp = tmp_path_factory.mktemp("reference")
    cfg = load_config(write_config(tmp / "grpod.toml", _settings(tmp / "run", fault_model_dir, replay_file)))
    groups = [RolloutGroup.from_json(json.loads(line)["group"]) for line in replay_file.read_text().splitlines()]
    threads = torch.get_num_threads()
    trainer = build_trainer(cfg)  # train.threads = 1, as in the daemons
    per_step = cfg.train.groups_per_step
    reference = Reference({}, {}, {})
    try:
        for step in range(1, STEPS + 1):
            batch = groups[(step - 1) * per_step : step * per_step]
            metrics, _ = anyio.run(train_batch, trainer, _NoFence(), batch)
            reference.lineage[step] = [g.group_id for g in batch]
            reference.losses[step] = metrics["loss"]
        trainer.save_weights(tmp / "final")  # as a checkpoint saves them
        reference.weights = load_file(tmp / "final" / "model.safetensors")
    finally:
        torch.set_num_threads(threads)
    return reference


# ---- the flood -----------------------------------------------------------------------------
# kind -> (the request line, whether the daemon must accept it, what its error must say)
HUGE = json.dumps({"cmd": "status", "pad": "x" * 200_000}).encode() + b"\n"
REQUESTS = {
    "status": (b'{"cmd": "status"}\n', True, None),
    "resume": (b'{"cmd": "resume", "args": {}}\n', True, None),
    "bad_json": (b'{"cmd": "status"\n', False, "malformed request"),
    "not_an_object": (b"[1, 2, 3]\n", False, "malformed request"),
    "cmd_not_a_string": (b'{"cmd": 5}\n', False, "malformed request"),
    "unknown_command": (b'{"cmd": "frobnicate", "args": {}}\n', False, "unknown command"),
    "args_not_an_object": (b'{"cmd": "status", "args": [1]}\n', False, "args must be a JSON object"),
    "set_wrong_type": (b'{"cmd": "set", "args": {"key": "train.lr", "value": "fast"}}\n', False, "valid number"),
    "set_without_key": (b'{"cmd": "set", "args": {"value": 1}}\n', False, "expected args"),
    "set_not_live": (b'{"cmd": "set", "args": {"key": "model.path", "value": "/elsewhere"}}\n', False, "cannot change while running"),
    "invalid_utf8": (b'\xff\xfe{"cmd": "status"}\n', False, "malformed request"),
    "huge_line": (HUGE, False, "request longer than"),
}


def _flood_plan(n: int) -> list[str]:
    """Half valid requests, half garbage of every kind, shuffled (seeded)."""
    garbage = [k for k in REQUESTS if k not in ("status", "resume")]
    plan = ["status"] * (n * 4 // 10) + ["resume"] * (n // 10)
    plan += [garbage[i % len(garbage)] for i in range(n - len(plan))]
    random.Random(0).shuffle(plan)
    return plan


@dataclass
class FloodResult:
    latencies_s: list[float] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    steps_seen: list[int] = field(default_factory=list)
    replies: int = 0


def _read_line(sock: socket.socket, pending: bytearray) -> bytes:
    while b"\n" not in pending:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the daemon closed the connection without replying")
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line


def _flood(socket_path, plan: list[str], persistent: bool, result: FloodResult, lock: threading.Lock) -> None:
    """Send `plan`'s requests one after the other; check and time each reply."""
    sock, pending = None, bytearray()
    for kind in plan:
        line, accepted, error_part = REQUESTS[kind]
        began = time.perf_counter()
        try:
            if sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(60)
                sock.connect(str(socket_path))
                pending = bytearray()
            sock.sendall(line)
            reply = json.loads(_read_line(sock, pending))
        except (OSError, ValueError) as exc:
            with lock:
                result.wrong.append(f"{kind}: no reply ({type(exc).__name__}: {exc})")
            if sock is not None:
                sock.close()
            sock = None
            continue
        elapsed = time.perf_counter() - began
        if not persistent:
            sock.close()
            sock = None
        time.sleep(FLOOD_PAUSE_S)
        problem = None
        if reply.get("ok") is not accepted:
            problem = f"{kind}: expected ok={accepted}, got {str(reply)[:200]}"
        elif not accepted and (error_part not in str(reply.get("error")) or "internal error" in str(reply.get("error"))):
            problem = f"{kind}: error should mention {error_part!r}: {str(reply)[:200]}"
        with lock:
            result.replies += 1
            result.latencies_s.append(elapsed)
            if problem:
                result.wrong.append(problem)
            if kind == "status" and reply.get("ok"):
                result.steps_seen.append(reply["result"]["step"])
    if sock is not None:
        sock.close()


def _run_flood(socket_path) -> FloodResult:
    plan = _flood_plan(FLOOD_REQUESTS)
    result, lock = FloodResult(), threading.Lock()
    threads = [
        threading.Thread(
            target=_flood, args=(socket_path, plan[i::FLOOD_THREADS], i % 2 == 0, result, lock), daemon=True
        )
        for i in range(FLOOD_THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a flood client is still waiting for replies after 300 s"
    return result


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


# ---- the kills -----------------------------------------------------------------------------
def _kill_mid_step(daemon: DaemonProcess, run_dir) -> tuple[int, float]:
    """SIGKILL the daemon while it trains the step after a completed checkpoint; (that checkpoint's
    step, kill time)."""

    def training_after_checkpoint(status) -> bool:
        ckpt = status["last_checkpoint"]
        return (
            status["step"] >= 2
            and ckpt is not None
            and ckpt["step"] == status["step"]
            and status["heartbeat"]["busy_for_s"] is not None
            and not temp_checkpoints(run_dir)
        )

    status_until(daemon, lambda s: s["state"] == "running", 400, "daemon 1 running")
    status = status_until(daemon, training_after_checkpoint, 120, "a step in training after a checkpoint", poll_s=0.002)
    daemon.proc.kill()
    killed_at = time.monotonic()
    daemon.proc.wait(timeout=30)
    return status["step"], killed_at


def _kill_mid_checkpoint(daemon: DaemonProcess, run_dir, before_kill=lambda: None) -> tuple[str, float]:
    """SIGKILL the daemon as soon as a checkpoint directory is being written (frozen there, then
    `before_kill` run); (its name, kill time)."""
    before = set(temp_checkpoints(run_dir))

    def writing():
        if daemon.proc.poll() is not None:
            raise AssertionError(f"daemon exited ({daemon.proc.returncode}) before a checkpoint:\n{daemon.tail()}")
        new = [p for p in temp_checkpoints(run_dir) if p not in before]
        return new[0] if new else None

    tmp = wait_until(writing, 400, "a checkpoint being written", poll_s=0.001)
    # Frozen first (the daemon's own PID, which this test started): the write stays half done
    # however long `before_kill` takes; a SIGKILL ends a stopped process as it does a running one.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    before_kill()
    daemon.proc.kill()
    killed_at = time.monotonic()
    daemon.proc.wait(timeout=30)
    return tmp.name, killed_at


def _resumed_from(run_dir, daemon_number: int) -> int:
    # (`ctl resume` logs a "resumed" event too; a checkpoint resume names its checkpoint)
    events = [e for e in log_events(run_dir, "resumed") if "checkpoint" in e]
    assert len(events) >= daemon_number - 1, f"daemon {daemon_number} did not log a resume"
    return int(events[daemon_number - 2]["step"])


@pytest.mark.timeout(1200)
def test_daemon_sigkill_mid_step_and_mid_checkpoint_then_resume_under_control_flood(
    tmp_path, fault_model_dir, replay_file, reference_run, fault_case
):
    step_row = fault_case("3a SIGKILL daemon mid-step, resume")
    ckpt_row = fault_case("3b SIGKILL daemon mid-checkpoint, resume")
    flood_row = fault_case("8 1000 control requests (half garbage) during training")
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "grpod.toml", _settings(run_dir, fault_model_dir, replay_file))
    daemons: list[DaemonProcess] = []
    flood = None
    try:
        # Daemon 1: killed while a step trains.
        first = DaemonProcess(config, run_dir)
        daemons.append(first)
        ckpt_1, killed_at = _kill_mid_step(first, run_dir)
        first.close(stop_vllm=False)
        assert step_records(run_dir)[-1]["step"] == ckpt_1, "the kill landed after the step ended"
        assert checkpoint_steps(run_dir)[-1] == ckpt_1
        buffered_1 = [g["group_id"] for g in run_state(run_dir, ckpt_1)["buffered"]]
        # (grpod.log is shared by the lineage: snapshot each daemon's vLLM groups before the next)
        vllm_1 = set(first.vllm_pgids)
        wait_until(lambda: alive(vllm_1) == [], 60, "the killed daemon's vLLM to stop itself",
                   describe=lambda: str(alive(vllm_1)))

        # Daemon 2: resumes from checkpoint ckpt_1, killed while writing its first checkpoint.
        records_before = len(step_records(run_dir))
        second = DaemonProcess(config, run_dir)
        daemons.append(second)

        def hang_vllm():  # a vLLM that cannot stop itself: the next daemon stops it by its launch record
            for pgid in set(second.vllm_pgids) - vllm_1:
                os.killpg(pgid, signal.SIGSTOP)

        tmp_name, killed_2 = _kill_mid_checkpoint(second, run_dir, hang_vllm)
        step_row.recovery_s = _first_step_time(run_dir, ckpt_1, records_before) - killed_at
        second.close(stop_vllm=False)
        assert _resumed_from(run_dir, 2) == ckpt_1
        half_written = int(tmp_name.split("-")[2])
        assert (run_dir / "checkpoints" / tmp_name).exists(), "the kill landed after the checkpoint was complete"
        ckpt_2 = checkpoint_steps(run_dir)[-1]
        assert ckpt_2 == half_written - 1, (tmp_name, checkpoint_steps(run_dir))
        buffered_2 = [g["group_id"] for g in run_state(run_dir, ckpt_2)["buffered"]]
        vllm_2 = set(second.vllm_pgids) - vllm_1
        assert alive(vllm_2), "a stopped (hung) vLLM outlives its killed daemon"

        # Daemon 3: resumes from ckpt_2 and finishes under the flood.
        records_before = len(step_records(run_dir))
        third = DaemonProcess(config, run_dir)
        daemons.append(third)
        status_until(third, lambda s: s["state"] == "running", 400, "daemon 3 running")
        assert alive(vllm_2) == [], f"daemon 3 stops the hung vLLM daemon 2 left behind: {alive(vllm_2)}"
        flood_began = time.monotonic()
        flood = _run_flood(third.socket)
        flood_s = time.monotonic() - flood_began
        code = third.wait_exit(400)
        ckpt_row.recovery_s = _first_step_time(run_dir, ckpt_2, records_before) - killed_2
    finally:
        for daemon in daemons:
            daemon.close()

    reference = reference_run.lineage
    got = lineage(run_dir)
    trained = [gid for step in sorted(got) for gid in got[step]]
    lost = sorted(set(gid for gids in reference.values() for gid in gids) - set(trained))
    twice = len(trained) - len(set(trained))
    lost_text = "none" if not lost and not twice and got == reference else f"{len(lost)} lost, {twice} twice"
    step_row.data_lost = ckpt_row.data_lost = lost_text
    step_row.notes = f"killed training step {ckpt_1 + 1}; resumed from step {ckpt_1}, {len(buffered_1)} buffered groups"
    ckpt_row.notes = f"killed writing {tmp_name[:16]}; resumed from step {ckpt_2}, {len(buffered_2)} buffered groups"
    ref_loss, run_loss = reference_run.losses, losses(run_dir)
    flood_steps = [step for step in range(ckpt_2 + 1, STEPS + 1) if step in run_loss]
    flood_diff = max((abs(run_loss[s] - ref_loss[s]) for s in flood_steps), default=float("nan"))
    if flood is not None and flood.latencies_s:
        ms = sorted(x * 1000 for x in flood.latencies_s)
        flood_row.notes = (
            f"{flood.replies}/{FLOOD_REQUESTS} replies in {flood_s:.1f} s, p50 {_percentile(ms, 50):.1f} ms, "
            f"p99 {_percentile(ms, 99):.1f} ms, max {ms[-1]:.0f} ms; steps {min(flood.steps_seen, default=-1)}"
            f"..{max(flood.steps_seen, default=-1)} trained meanwhile; loss vs no-flood run: max |diff| "
            f"{flood_diff:.1e} over steps {ckpt_2 + 1}..{STEPS}"
        )
        flood_row.data_lost = lost_text

    assert code == 0, f"exit {code}: {failure_reason(run_dir)}\n{third.tail()}"
    for daemon in daemons:
        assert alive(daemon.vllm_pgids) == [], "no vLLM group of any daemon remains"
    left = log_events(run_dir, "inference_left_behind")
    assert [e["pgid"] for e in left] == sorted(vllm_2), "only the hung vLLM was left for the next daemon to stop"
    # Resumes: from the newest complete checkpoint each time; its buffered groups trained first.
    assert [_resumed_from(run_dir, 2), _resumed_from(run_dir, 3)] == [ckpt_1, ckpt_2]
    assert temp_checkpoints(run_dir) == [], "the half-written checkpoint was discarded, never read"
    for ckpt, buffered in ((ckpt_1, buffered_1), (ckpt_2, buffered_2)):
        assert buffered, f"checkpoint {ckpt} recorded no buffered group (prefetch {PREFETCH})"
        after = [gid for step in range(ckpt + 1, STEPS + 1) for gid in got[step]]
        assert after[: len(buffered)] == buffered, f"groups buffered at step {ckpt} are the first trained after resume"
    # The whole lineage equals the straight run: same groups at the same steps, same losses.
    assert sorted(got) == list(range(1, STEPS + 1))
    assert not lost and not twice
    assert got == reference, "the same groups trained at the same steps"
    for step in range(1, STEPS + 1):
        assert abs(run_loss[step] - ref_loss[step]) <= LOSS_TOLERANCE * max(1.0, abs(ref_loss[step])), (
            f"step {step}: loss {run_loss[step]} vs reference {ref_loss[step]}"
        )
    # Exact resume: the twice-killed lineage ends bitwise where the straight run ends.
    ours, theirs = _final_weights(run_dir), reference_run.weights
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), f"{name} differs from the straight run after two resumes"
    # Case 8: every request answered correctly, while steps were being trained.
    assert flood.replies == FLOOD_REQUESTS and not flood.wrong, flood.wrong[:10]
    assert max(flood.steps_seen) > min(flood.steps_seen), "the flood overlapped training (the step advanced)"
    assert min(flood.steps_seen) < STEPS


def _final_weights(run_dir) -> dict:
    final = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    assert (final / "manifest.json").exists(), f"no final checkpoint {final}"
    return load_file(final / "model" / "model.safetensors")


def _first_step_time(run_dir, step: int, records_before: int) -> float:
    """When the first record of a step after `step` was written by the resumed daemon (its
    timestamp in metrics.jsonl, converted to this clock)."""
    for record in step_records(run_dir)[records_before:]:
        if record["step"] > step:
            return time.monotonic() - (time.time() - record["time"])
    raise AssertionError(f"no step after {step} was trained after the resume")
