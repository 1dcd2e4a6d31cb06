"""The walking skeleton end to end: a real `grpod start` supervising a real vLLM (CPU build).

One test, two daemon runs on one run directory. The first exercises the control socket (status,
pause, resume, sync, checkpoint, and `grpod ctl stop` as the unit's ExecStop runs it) and
scheduled and forced in-place syncs (the restart path is tested in `tests/e2e/test_none_bridge.py`
and for `lora_restart`); the second resumes from the first run's final checkpoint, reloads in
place and is stopped by SIGTERM. After each: no process of any vLLM group it started remains, the
decoy survives, and the final checkpoint loads with `from_pretrained`.

The second run is started the way `systemd/grpod.service` starts it (`Type=notify`, a watchdog):
the test is systemd's side of the notify socket. It checks READY=1, WATCHDOG=1 pings, their
stop while a sync hangs (vLLM's process group is frozen with SIGSTOP, so the in-place reload
cannot answer) and their return when it is thawed, then STOPPING=1 on SIGTERM.
"""

from __future__ import annotations

import configparser
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.harness import (
    ROOT,
    DaemonProcess,
    base_settings,
    group_processes,
    metrics,
    start_decoy,
    write_config,
)

pytestmark = pytest.mark.e2e


def _final_checkpoint(run_dir):
    steps = sorted((run_dir / "checkpoints").glob("step-*"))
    assert steps, f"no checkpoint under {run_dir}"
    return steps[-1]


def first_run(tmp_path, warm_model_dir, run_dir) -> tuple[DaemonProcess, int]:
    """A daemon operated over its socket, then stopped as the unit's ExecStop does; returns it and
    the step of its final checkpoint."""
    decoy = start_decoy(tmp_path)
    try:
        settings = base_settings(run_dir, warm_model_dir) | {
            "train.steps": 100,
            "bridge.mode": "none",
            "bridge.reload": "in_place",
            "bridge.sync_every": 3,
            # Evaluations beside training (issue #14), the trainer's core lent to the engine while the
            # loop waits, and the engine's to the trainer while the engine idles (both on for this
            # tiny model only because they are forced).
            "eval.size": 8,
            "eval.every": 2,
            "inference.borrow_trainer_cores": True,
            "train.borrow_engine_cores": True,
            "metrics.memory_every_s": 1.0,
        }
        config = write_config(tmp_path / "grpod.toml", settings)
        daemon = DaemonProcess(config, run_dir)
        try:
            status = daemon.wait_for(lambda s: s["state"] == "running", 300, "vLLM ready and running")
            first_vllm = status["bridge"]["vllm"]["pid"]
            assert status["bridge"]["mode"] == "none"
            # Where environments reach the policy (issue #16 item 8): status and the console say it.
            endpoint = status["inference"]
            assert endpoint["base_url"] == status["bridge"]["vllm"]["base_url"] + "/v1"
            assert endpoint["model_names"][:2] == ["policy", str(warm_model_dir)]
            assert f"grpod: vLLM serves the policy at {endpoint['base_url']}" in daemon.tail(200)
            assert any("SYNC" in t for t in status["bridge"]["transitions"])

            # Pause and resume over the socket (that a paused loop trains nothing is proven without a
            # clock in tests/daemon/test_step_loop.py).
            paused = daemon.ctl("pause")
            assert paused["ok"] and paused["result"]["paused"]
            daemon.wait_for(lambda s: s["paused"], 60, "pause acknowledged")
            resumed = daemon.ctl("resume")
            assert resumed["ok"] and resumed["result"]["was_paused"]

            sync = daemon.ctl("sync")
            assert sync["ok"], sync
            assert sync["result"]["probe"]["ok"] is True
            assert sync["result"]["forced"] and "reload" in sync["result"]["phases"], "an in-place reload, forced"

            ckpt = daemon.ctl("checkpoint")
            assert ckpt["ok"], ckpt
            assert (run_dir / "checkpoints").exists() and ckpt["result"]["path"].startswith(str(run_dir))

            bad = daemon.ctl("frobnicate")
            assert not bad["ok"] and "unknown command" in bad["error"]

            # The unit's ExecStop: finish the step, final checkpoint, stop vLLM, exit 0.
            status = daemon.wait_for(lambda s: s["step"] >= 4, 300, "step 4")
            loan = status["core_loan"]
            assert loan["enabled"] and loan["borrowed_threads"] == loan["engine_threads"] + 1 and loan["loans"] >= 1, loan
            assert loan["trainer"]["enabled"] and loan["trainer"]["borrowed_threads"] == 1 + loan["engine_threads"], loan
            steps = [r for r in metrics(run_dir) if r.get("kind") == "step"]
            assert all("borrowed_core_micro_batches" in r for r in steps), "each step says how many it ran on borrowed cores"
            # What this node's processes hold: vLLM's whole process group (its API server and engine
            # core) as the engine, the trainer in the daemon.
            status = daemon.wait_for(lambda s: (s["memory"] or {}).get("since_s", 0) > 0, 60, "a second memory reading")
            memory, (engine,) = status["memory"], status["bridge"]["engines"]
            held = memory["engines"][engine["name"]]
            assert held["rss"] > 200 * 2**20 and memory["daemon_rss"] > 200 * 2**20, memory
            readings = [r for r in metrics(run_dir) if r.get("kind") == "memory"]
            assert sum(r.get(f"engine_rss_mib/{engine['name']}", 0) > 200 for r in readings) >= 2, readings[:3]
            # `ctl stop` returns once the daemon has exited (a start right after finds the run free).
            stop = subprocess.run(
                [sys.executable, "-m", "grpod", "ctl", "stop", "--config", str(config), "--timeout", "600"],
                cwd=ROOT, capture_output=True, text=True, timeout=660,
            )
            assert stop.returncode == 0 and "exited: True" in stop.stdout, (stop.stdout, stop.stderr)
            assert daemon.proc.poll() is not None, "ctl stop returned before the daemon exited"
            code = daemon.wait_exit(600)
            assert code == 0, daemon.tail()
        finally:
            daemon.close()
        for pgid in daemon.vllm_pgids | {first_vllm}:
            assert group_processes(pgid) == [], f"vLLM process group {pgid} left behind"
        assert decoy.poll() is None, "grpod must not touch a process it did not start"
    finally:  # a failed assertion above must not leave it running
        decoy.kill()
        decoy.wait(timeout=30)

    records = [r for r in metrics(run_dir) if r["kind"] == "step"]
    trained = [r["step"] for r in records]
    assert len(trained) >= 4 and trained == list(range(1, len(trained) + 1)) and trained[-1] < 100
    syncs = [r for r in metrics(run_dir) if r["kind"] == "sync"]
    scheduled = [r for r in syncs if not r["forced"]]
    assert scheduled and all(r["probe"]["max_abs_diff"] <= 0.02 for r in syncs), "scheduled syncs, probed"
    # sync_every = 3, pipelined (overlap on): every third step's weights reach vLLM, and the
    # step's record holds the time it waited for the sync's trainer half; unless an evaluation
    # held the engines' version then, and the sync came after it: before the next evaluation
    # (carrying that boundary's weights) or at the first step after it.
    deferred = {r["step"] for r in records if r["sync_deferred"]}
    assert {s for s in trained if s % 3 == 0} - deferred <= {r["weights_step"] for r in syncs}
    assert all(r["sync_s"] is not None for r in records if r["step"] % 3 == 0 and r["step"] not in deferred)
    for step in deferred:
        later = [r["step"] for r in records if r["step"] > step and not r["sync_deferred"]]
        if later:  # (a stop abandons the sync still held back at the end)
            shipped = [r["weights_step"] for r in syncs if step <= r["weights_step"] <= later[0]]
            assert shipped, f"the sync held back at step {step} followed the evaluation by step {later[0]}"
    assert all(r["batch_wait_s"] >= 0 for r in records)
    evals = [r for r in metrics(run_dir) if r["kind"] == "eval"]
    assert [e["step"] for e in evals][:2] == [0, 2] and evals[-1]["when"] == "end", evals
    assert all(e["finished_step"] >= e["step"] and e["eval_s"] > 0 and e["eval_size"] == 8 for e in evals)
    assert daemon.vllm_pgids == {first_vllm}, "in-place syncs never relaunch vLLM"

    final = _final_checkpoint(run_dir)
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == trained[-1], "ctl stop checkpoints the last trained step"
    model = AutoModelForCausalLM.from_pretrained(final / "model")
    original = AutoModelForCausalLM.from_pretrained(warm_model_dir)
    changed = any(
        not torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values(), strict=True)
    )
    assert changed, "training changed the weights"
    return daemon, trained[-1]


WATCHDOG_USEC = 1_000_000  # grpod pings every 0.5 s
STALL_AFTER_S = 3.0


class NotifySocket:
    """systemd's end of $NOTIFY_SOCKET: every datagram the daemon sends, with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def times(self, key: str) -> list[float]:
        return [t for t, fields in list(self.messages) if key in fields]

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=5)
        self.sock.close()


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str
    unit.read(ROOT / "systemd" / "grpod.service")
    return unit


def test_the_unit_file_runs_grpod_start_as_a_notify_service_with_a_watchdog():
    service = _unit()["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["ExecStart"].split()[1:3] == ["start", "--config"]
    assert service["ExecStop"].split()[1:3] == ["ctl", "stop"]
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["WatchdogSec"] and service["KillMode"] == "mixed" and service["Restart"] == "on-failure"


def _withheld(notify: NotifySocket, since: float, until: float) -> bool:
    return not [t for t in notify.times("WATCHDOG") if since < t <= until]


def test_daemon_operated_stopped_then_resumed_as_a_notify_service_until_sigterm(tmp_path, warm_model_dir):
    run_dir = tmp_path / "run"
    first, stopped_at = first_run(tmp_path, warm_model_dir, run_dir)
    assert _final_checkpoint(run_dir).name == f"step-{stopped_at:06d}"
    settings = base_settings(run_dir, warm_model_dir) | {
        "bridge.mode": "none",
        "bridge.reload": "in_place",
        # The run ends by SIGTERM; steps must outlast the test however fast the policy trains.
        "train.steps": 1_000_000,
        "notify.stall_after_s": STALL_AFTER_S,
        # The frozen vLLM must hang the sync, not be declared dead and relaunched.
        "inference.health_failures": 100_000,
        "inference.request_timeout_s": 120.0,
    }
    config_b = write_config(tmp_path / "b.toml", settings)
    notify = NotifySocket(tmp_path / "notify.sock")
    second = DaemonProcess(config_b, run_dir, env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    frozen: int | None = None
    try:
        # In-place syncs after every step continue the resumed run's policy version.
        resumed_version = second.wait_for(lambda s: s["policy_version"] is not None, 400, "resumed")["policy_version"]
        status = second.wait_for(
            lambda s: (s["policy_version"] or 0) >= resumed_version + 2, 400, "two more syncs after resume"
        )
        assert status["step"] >= stopped_at + 2
        deadline = time.monotonic() + 10
        while len(notify.times("WATCHDOG")) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert notify.times("READY") and len(notify.times("WATCHDOG")) >= 3, notify.messages[:5]

        # A hung sync withholds the watchdog; systemd (WatchdogSec) would restart the service.
        # vLLM is frozen while the buffer holds a step's groups, so the next step trains without
        # it and its sync hangs. (Frozen with an empty buffer, the daemon would only wait for
        # rollouts, which is not a stall: thaw and try again.)
        hung = None
        for _ in range(3):
            ready = second.wait_for(lambda s: s["queue_depth"] >= settings["train.groups_per_step"], 120, "a full step buffered")
            frozen = ready["bridge"]["vllm"]["pid"]
            os.killpg(frozen, signal.SIGSTOP)
            try:
                hung = second.wait_for(
                    lambda s: (s["heartbeat"]["busy_for_s"] or 0) > STALL_AFTER_S + 3, 30, "a sync hung on the frozen vLLM"
                )
                break
            except AssertionError:
                os.killpg(frozen, signal.SIGCONT)
                frozen = None
        assert hung is not None, "no sync hung on the frozen vLLM in three tries"
        assert not hung["heartbeat"]["healthy"]
        now = time.monotonic()
        stalled_since = now - hung["heartbeat"]["busy_for_s"] + STALL_AFTER_S + WATCHDOG_USEC / 2e6
        assert _withheld(notify, stalled_since, now), "WATCHDOG=1 sent while the sync hung"
        os.killpg(frozen, signal.SIGCONT)
        frozen = None
        thawed = time.monotonic()
        second.wait_for(lambda s: s["step"] > hung["step"] and s["heartbeat"]["healthy"], 120, "steps after the thaw")
        time.sleep(1.5)
        assert not _withheld(notify, thawed, time.monotonic()), "WATCHDOG=1 resumes once steps progress"
        # SIGHUP: a live key is applied at the next step; a key that needs a restart is refused.
        write_config(config_b, settings | {"train.lr": 1e-5, "bridge.reload": "restart"})
        second.proc.send_signal(signal.SIGHUP)
        changed = second.wait_for(lambda s: s["config_changes"], 120, "the SIGHUP change applied")
        assert [(c["key"], c["new"], c["origin"]) for c in changed["config_changes"]] == [("train.lr", 1e-5, "SIGHUP")]
        assert changed["last_metrics"]["lr"] in (1e-5, settings["train.lr"])
        second.proc.send_signal(signal.SIGTERM)
        assert second.wait_exit(300) == 0, second.tail()
    finally:
        if frozen is not None:
            os.killpg(frozen, signal.SIGCONT)
        second.close()
        notify.close()
    stopping = notify.times("STOPPING")
    assert stopping and stopping[-1] >= max(notify.times("READY")), "STOPPING=1 on SIGTERM"
    for pgid in first.vllm_pgids | second.vllm_pgids:
        assert group_processes(pgid) == []
    steps = [r["step"] for r in metrics(run_dir) if r["kind"] == "step"]
    assert steps[: stopped_at + 1] == list(range(1, stopped_at + 2)), "the resumed run continues at the next step"
    assert len(steps) == len(set(steps)), "no step trained twice"
    log = (run_dir / "grpod.log").read_text()
    assert '"event": "resumed"' in log
    final = _final_checkpoint(run_dir)
    assert json.loads((final / "manifest.json").read_text())["step"] == steps[-1]
    recorded = json.loads((final / "run_state.json").read_text())["extra"]["config_changes"]
    assert recorded and recorded[0]["key"] == "train.lr", "the live change is in the next checkpoint"
    assert '"reload_refused"' in log and "bridge.reload" in log
