"""Supervisor pieces that need no vLLM: the watchdog heartbeat tied to training progress."""

import os
import socket

import anyio

from grpod.config import load_config
from grpod.service.notify import SystemdNotifier
from grpod.daemon.supervisor import Supervisor


def test_watchdog_pings_only_while_steps_progress(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # ping every 50 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    daemon = Supervisor(load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", "notify.stall_after_s=0.3"]))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        daemon.notifier = SystemdNotifier(str(path))

        def drain() -> int:
            count = 0
            while True:
                try:
                    count += sock.recv(4096) == b"WATCHDOG=1"
                except BlockingIOError:
                    return count

        async def main():
            async with anyio.create_task_group() as tg:
                tg.start_soon(daemon._watchdog)
                await anyio.sleep(0.4)
                healthy = drain()
                daemon.heartbeat.busy()  # a step starts ... and hangs
                await anyio.sleep(0.35)
                drain()
                await anyio.sleep(0.4)
                hung = drain()
                daemon.heartbeat.progress()  # the step finally completes
                await anyio.sleep(0.3)
                recovered = drain()
                tg.cancel_scope.cancel()
            return healthy, hung, recovered

        healthy, hung, recovered = anyio.run(main)
    assert healthy >= 4
    assert hung == 0, "a step running past notify.stall_after_s must stop WATCHDOG=1"
    assert recovered >= 3
    assert daemon.status()["heartbeat"]["last_heartbeat_age_s"] is not None


def test_the_source_alarm_reaches_status_prometheus_and_systemd_and_fail_after_ends_the_run(tmp_path):
    """Issue #16 hole 5, the daemon's side: a source whose stats report an unbroken run of failures."""
    import time
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from grpod.daemon.exporter import DaemonCollector

    path = tmp_path / "notify.sock"
    daemon = Supervisor(
        load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", "source.error_alarm_s=1", "source.fail_after_s=3"])
    )
    stats = SimpleNamespace(failing_since=time.time(), consecutive_errors=4, last_error="Atropos API /batch: HTTP 500")
    source = SimpleNamespace(kind="atropos", stats=stats, cursor=lambda: {})
    daemon.parts = SimpleNamespace(source=source)
    daemon.reporter.attach(source=source)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon.status))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        daemon.notifier = SystemdNotifier(str(path))

        async def main():
            seen = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(daemon._watch_source)
                with anyio.fail_after(10):
                    while not daemon.source_alarm.active:
                        await anyio.sleep(0.1)
                seen["status"] = daemon.status()["alarms"]["source"]
                seen["prometheus"] = generate_latest(registry).decode()
                with anyio.fail_after(10):
                    while daemon.progress.exit_code == 0:
                        await anyio.sleep(0.1)
                tg.cancel_scope.cancel()
            return seen

        seen = anyio.run(main)
        datagrams = []
        while True:
            try:
                datagrams.append(sock.recv(4096).decode())
            except BlockingIOError:
                break
    assert seen["status"]["active"] and seen["status"]["consecutive_errors"] == 4
    assert "HTTP 500" in seen["status"]["last_error"]
    assert 'grpod_alarm{alarm="source"} 1.0' in seen["prometheus"]
    assert 'grpod_alarm{alarm="logprob_gap"} 0.0' in seen["prometheus"]
    assert "grpod_source_consecutive_errors 4.0" in seen["prometheus"]
    assert any(d.startswith("STATUS=ALARM") and "4 errors in a row" in d for d in datagrams), datagrams
    assert daemon.progress.exit_code == 1
    reason = daemon.progress.stop_reason
    assert "source.fail_after_s = 3" in reason and "HTTP 500" in reason


def test_a_run_directory_that_cannot_be_made_is_refused_with_exit_2(tmp_path, capsys):
    """What the host checks miss (a race, a path they cannot judge) is still one line naming
    run.dir and exit 2, not a FileExistsError traceback."""
    (tmp_path / "afile").write_text("x")
    daemon = Supervisor(load_config(None, [f"run.dir={str(tmp_path / 'afile' / 'run')!r}"]))
    assert anyio.run(daemon.run) == 2
    err = capsys.readouterr().err
    assert f"run.dir {tmp_path / 'afile' / 'run'}: Not a directory" in err, err
    assert daemon.progress.exit_code == 2


def test_a_checkpoint_the_config_cannot_resume_is_refused_with_exit_2_before_anything_launches(tmp_path, capsys, monkeypatch):
    """Review 7: train.lora = true on a full run's checkpoint launched vLLM, then failed at the
    trainer load with exit 1 (systemd's Restart=on-failure started it into the same failure); a
    checkpoint of another run (identity) exited 1 too."""
    import grpod.daemon.components
    from grpod.models.tiny import build_model, save_model
    from grpod.run.store import RunSnapshot, RunStore
    from grpod.training.trainer import build_trainer

    save_model(*build_model(seed=0), tmp_path / "model")
    base = [f"run.dir={str(tmp_path / 'run')!r}", f"model.path={str(tmp_path / 'model')!r}", "train.threads=1"]
    cfg = load_config(None, base)
    RunStore(cfg, cfg.run.dir).save(build_trainer(cfg), RunSnapshot(3, 1, [], {"kind": "builtin", "next_index": 9}, {}))

    def launched(*args, **kwargs):
        raise AssertionError("engines built for a resume that cannot work")

    monkeypatch.setattr(grpod.daemon.components, "build_engines", launched)
    for change, named in [(["train.lora=true", "bridge.mode=lora_only"], "train.lora: checkpoint false, config true"),
                          (["source.task_seed=7"], "belongs to another run")]:
        daemon = Supervisor(load_config(None, [*base, *change]))
        assert anyio.run(daemon.run) == 2, daemon.progress.stop_reason
        err = capsys.readouterr().err
        assert str(tmp_path / "run" / "checkpoints" / "step-000003") in err and named in err, err


def test_a_stop_writes_its_checkpoint_before_the_last_evaluation_and_labels_it_with_the_served_step(tmp_path):
    """A SIGTERM's grace period may end during the last evaluation (a minute on SmolLM2): the
    checkpoint comes first. The engines serve step 36's weights (one step trained since the last
    sync), so that is the step the evaluation is recorded as."""
    from types import SimpleNamespace

    from grpod.daemon.evaluation import Evaluations
    from grpod.daemon.sync_schedule import SyncSchedule

    daemon = Supervisor(load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", "run.progress=false", "eval.size=4"]))
    order = []

    class Source:
        async def evaluate(self, size, max_tokens):
            order.append("evaluation")
            return {"eval_accuracy": 0.5, "eval_size": size, "policy_version": 18}

    class Loop:
        evaluations = Evaluations(daemon.cfg.eval, source=Source(), reporter=daemon.reporter, progress=daemon.progress,
                                  beside_training=False)
        schedule = SyncSchedule(cadence=lambda step: False, unsynced=1)
        served_step = property(lambda self: daemon.progress.step - self.schedule.unsynced)

        def checkpoint_state(self):
            return [daemon.progress.step]

        async def checkpoint(self):
            order.append("checkpoint")

    class Bridge:
        available = True
        policy = SimpleNamespace(version=18)

        async def stop(self):
            order.append("engines stopped")

    daemon.progress.step = 37
    daemon.progress.last_eval = {"policy_version": 16, "when": "periodic", "step": 33, "eval_accuracy": 0.4}
    daemon.parts = SimpleNamespace(loop=Loop(), bridge=Bridge(), source=None)
    daemon.desk.request_stop("SIGTERM")
    anyio.run(daemon._shutdown)
    assert order == ["checkpoint", "evaluation", "engines stopped"]
    assert (daemon.progress.last_eval["when"], daemon.progress.last_eval["step"]) == ("end", 36)


def test_commands_during_the_shutdown_of_a_run_that_ended_by_itself_are_refused(tmp_path):
    """Steps done (no stop requested): while the shutdown's last evaluation runs, `ctl checkpoint`
    and `ctl sync` were queued for a boundary that never comes (the client saw no answer) and
    `ctl set` / `ctl pause` were promised "at the next step boundary"; now each is refused, over
    the real control socket."""
    from types import SimpleNamespace

    from grpod.daemon import control
    from grpod.daemon.control import ControlServer
    from grpod.daemon.evaluation import Evaluations
    from grpod.daemon.sync_schedule import SyncSchedule

    daemon = Supervisor(load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", "run.progress=false", "eval.size=4",
                                           "control.request_timeout_s=2"]))
    evaluating, finish = anyio.Event(), anyio.Event()

    class Source:
        async def evaluate(self, size, max_tokens):
            evaluating.set()
            await finish.wait()
            return {"eval_accuracy": 0.5, "eval_size": size}

    class Loop:
        evaluations = Evaluations(daemon.cfg.eval, source=Source(), reporter=daemon.reporter, progress=daemon.progress,
                                  beside_training=False)
        schedule = SyncSchedule(cadence=lambda step: False)
        served_step = 3

        def checkpoint_state(self):
            return [daemon.progress.step]

        async def checkpoint(self):
            return {}

    class Bridge:
        available = True
        policy = SimpleNamespace(version=3)

        async def stop(self):
            return None

    daemon.progress.step = 3
    daemon.progress.stop_reason = "steps done"
    daemon.parts = SimpleNamespace(loop=Loop(), bridge=Bridge(), source=None)
    server = ControlServer(daemon.cfg.socket_path, daemon.desk.handlers(), daemon.cfg.control.request_timeout_s)
    commands = [("checkpoint", {}), ("sync", {}), ("set", {"key": "train.lr", "value": 3e-4}), ("pause", {})]
    replies = {}

    async def main():
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve)
                tg.start_soon(daemon._shutdown)
                await evaluating.wait()
                for cmd, args in commands:
                    replies[cmd] = await anyio.to_thread.run_sync(control.request, daemon.cfg.socket_path, cmd, args, 5)
                finish.set()
                tg.cancel_scope.cancel()

    anyio.run(main)
    assert replies == {cmd: {"ok": False, "error": f"{cmd}: the daemon is stopping"} for cmd, _ in commands}
    assert not daemon.desk.paused and not daemon.desk.operator_values
    assert daemon.progress.stop_reason == "steps done"
