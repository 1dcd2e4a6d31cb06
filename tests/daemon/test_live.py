"""Live settings: `ctl set` and SIGHUP validate, refuse what needs a restart, apply at a boundary."""

import json

import anyio
import pytest
import structlog
import structlog.testing

from grpod.config import ConfigError, load_config
from grpod.daemon.control import ControlError
from grpod.daemon.desk import CONFIG_HISTORY, OperatorDesk
from grpod.daemon.live import RefusedChange, diff_file, plan_changes
from grpod.daemon.progress import RunProgress
from grpod.models.tiny import build_model, save_model
from grpod.run.checkpoint import load_json
from grpod.run.store import RunSnapshot, RunStore
from grpod.training.trainer import build_trainer
from tests.harness import write_config


def test_plan_changes_validates_and_refuses():
    cfg = load_config(None)
    _, changes = plan_changes(cfg, {"train.lr": 1e-3, "train.loss.clip_high": 0.3}, "test")
    assert {(c.key, c.new) for c in changes} == {("train.lr", 1e-3), ("train.loss.clip_high", 0.3)}
    with pytest.raises(RefusedChange, match="bridge.mode: cannot change while running"):
        plan_changes(cfg, {"bridge.mode": "shared"}, "test")
    # A key the config does not have is not "needs a restart": it is no key at all.
    with pytest.raises(RefusedChange, match="nonsense.key: no such key in the running config"):
        plan_changes(cfg, {"nonsense.key": 1}, "test")
    with pytest.raises(RefusedChange, match="train: cannot change while running"):
        plan_changes(cfg, {"train": 1}, "test")
    with pytest.raises(ConfigError, match="train.lr"):
        plan_changes(cfg, {"train.lr": -1}, "test")
    assert cfg.train.lr == load_config(None).train.lr, "planning never mutates the running config"


def test_diff_file_finds_changed_keys():
    a = load_config(None)
    b = load_config(None, ["train.lr=1e-3", "inference.env={A = '1'}"])
    assert diff_file(a, b) == {"train.lr": 1e-3, "inference.env": {"A": "1"}}


class Desk(OperatorDesk):
    """The desk with what applying a change at a boundary touches: the trainer's learning rate."""

    def boundary(self) -> None:
        def on_change(change):
            if change.key == "train.lr":
                self.trainer.set_learning_rate(change.new)

        self.apply_changes(self.progress.step, on_change)


@pytest.fixture()
def desk(tmp_path):
    model, tok = build_model(seed=0)
    save_model(model, tok, tmp_path / "model")
    config = write_config(
        tmp_path / "grpod.toml",
        {"run.dir": str(tmp_path / "run"), "model.path": str(tmp_path / "model"), "train.lr": 1e-4},
    )
    cfg = load_config(config)
    d = Desk(cfg, RunProgress(cfg.train.steps), config_path=config)
    d.trainer = build_trainer(cfg)
    d.store = RunStore(cfg, cfg.run.dir)
    return d


def test_ctl_set_applies_at_boundary_and_lands_in_checkpoint(desk):
    reply = anyio.run(desk.ctl_set, {"key": "train.lr", "value": 5e-4})
    assert reply["accepted"][0]["new"] == 5e-4
    assert desk.cfg.train.lr == 1e-4, "not before the step boundary"
    assert desk.pending()
    desk.boundary()
    assert desk.cfg.train.lr == 5e-4
    assert desk.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert desk.config_changes[0]["key"] == "train.lr" and desk.config_changes[0]["version"] == 1
    snapshot = RunSnapshot(1, 0, [], {"kind": "builtin"}, {"config_changes": desk.config_changes})
    state = load_json(desk.store.save(desk.trainer, snapshot), "run_state.json")
    assert state["extra"]["config_changes"][0]["new"] == 5e-4

    with pytest.raises(ControlError, match="cannot change while running"):
        anyio.run(desk.ctl_set, {"key": "model.path", "value": "/elsewhere"})
    with pytest.raises(ControlError, match="train.loss.clip_low"):
        anyio.run(desk.ctl_set, {"key": "train.loss.clip_low", "value": 3})
    with pytest.raises(ControlError, match="expected args"):
        anyio.run(desk.ctl_set, {"value": 1})
    assert not desk.pending()


def test_sighup_applies_safe_subset_and_refuses_the_rest(desk, tmp_path):
    text = desk.config_path.read_text().replace("lr = 0.0001", "lr = 0.002")
    text += '\n[bridge]\nmode = "shared"\n[source]\ntemperature = 0.7\n'
    desk.config_path.write_text(text)
    with structlog.testing.capture_logs() as events:
        anyio.run(desk.reload_file)
    desk.boundary()
    assert desk.cfg.train.lr == 0.002 and desk.cfg.source.temperature == 0.7
    assert desk.cfg.bridge.mode == "none", "a key that needs a restart is refused"
    refused = [e for e in events if e["event"] == "reload_refused"]
    assert refused and refused[0]["keys"] == ["bridge.mode"] and "restart" in refused[0]["reason"]
    keys = [c["key"] for c in desk.config_changes]
    assert sorted(keys) == ["source.temperature", "train.lr"]
    assert all(c["origin"] == "SIGHUP" for c in desk.config_changes)


def test_sighup_with_broken_file_changes_nothing(desk):
    desk.config_path.write_text("[train\n")
    anyio.run(desk.reload_file)
    assert not desk.pending()
    assert json.dumps(desk.cfg.model_dump(mode="json"))


@pytest.mark.parametrize("cut", ["emptied", "truncated"])
def test_sighup_with_a_file_that_lost_keys_changes_nothing(desk, cut):
    """An emptied or half-written file parses: its reload put every key it lost back to the
    default (`train.lr` 1e-4 -> 2e-05, `checkpoint.every` 10 -> 0) while the run went on. It is
    refused with the keys named; the whole file again, with one value changed, is a reload."""
    whole = desk.config_path.read_text()
    lines = whole.splitlines(keepends=True)
    desk.config_path.write_text("" if cut == "emptied" else "".join(lines[: len(lines) // 2]))
    with structlog.testing.capture_logs() as events:
        anyio.run(desk.reload_file)
    assert not desk.pending()
    (refused,) = [e for e in events if e["event"] == "reload_refused"]
    assert "no longer sets" in refused["reason"] and "train.lr" in refused["reason"], refused

    desk.config_path.write_text(whole.replace("lr = 0.0001", "lr = 0.0002"))
    anyio.run(desk.reload_file)
    desk.boundary()
    assert desk.cfg.train.lr == 0.0002


def test_a_queued_set_is_corrected_by_the_next_one(desk):
    """Issue #30, 6: a second `ctl set` of a key compares against the pending value, not the running
    one: setting it back to the running value withdraws the pending change."""
    assert anyio.run(desk.ctl_set, {"key": "train.loss.clip_high", "value": 5.0})["accepted"][0]["new"] == 5.0
    reply = anyio.run(desk.ctl_set, {"key": "train.loss.clip_high", "value": 0.28})
    assert not reply["unchanged"] and reply["replaced_pending"] == 5.0
    assert reply["accepted"][0]["old"] == 5.0 and reply["accepted"][0]["new"] == 0.28
    assert not desk.pending(), "back to the running value: nothing left to apply"
    desk.boundary()
    assert desk.cfg.train.loss.clip_high == 0.28 and desk.config_changes == []

    anyio.run(desk.ctl_set, {"key": "train.lr", "value": 5e-4})
    assert anyio.run(desk.ctl_set, {"key": "train.lr", "value": 5e-4})["unchanged"], "the pending value"
    anyio.run(desk.ctl_set, {"key": "train.lr", "value": 7e-4})
    desk.boundary()
    assert desk.cfg.train.lr == 7e-4
    assert [(c["old"], c["new"]) for c in desk.config_changes] == [(1e-4, 7e-4)], "one change, from the running value"


def test_a_set_is_validated_with_the_pending_changes(desk):
    """Cross-key rules see what the boundary will apply: tis_floor below a pending tis_cap."""
    anyio.run(desk.ctl_set, {"key": "train.loss.clip_low", "value": 0.5})
    with pytest.raises(ControlError, match="finite number"):
        anyio.run(desk.ctl_set, {"key": "train.loss.clip_high", "value": json.loads("1e999")})
    with pytest.raises(ControlError, match="boolean"):
        anyio.run(desk.ctl_set, {"key": "train.lr", "value": True})
    with pytest.raises(ControlError, match="less than or equal to 100"):
        anyio.run(desk.ctl_set, {"key": "train.loss.kl_coef", "value": 1e308})
    # Accepted once, it failed the run at the next step (float32 clamp overflow; the fault
    # suite's random requests found it).
    with pytest.raises(ControlError, match="less than or equal to 100"):
        anyio.run(desk.ctl_set, {"key": "train.loss.clip_high", "value": 1e308})
    desk.boundary()
    assert desk.cfg.train.loss.clip_low == 0.5 and desk.cfg.train.loss.clip_high == 0.28


def test_sighup_keeps_set_overrides_and_ctl_set_values(tmp_path):
    """Issue #30, 5: file < --set < ctl set, across reloads. An unchanged file changes nothing and
    refuses nothing (a --set of a key that needs a restart is not a change); a ctl set value stays
    when the file changes that key; the file's other changes apply."""
    config = write_config(
        tmp_path / "grpod.toml",
        {"run.dir": str(tmp_path / "run"), "train.lr": 1e-4, "source.temperature": 1.0, "train.loss.clip_high": 0.28},
    )
    overrides = ["train.lr=3e-5", "metrics.prometheus_port=9400"]
    cfg = load_config(config, overrides)
    desk = OperatorDesk(cfg, RunProgress(cfg.train.steps), config_path=config, overrides=overrides)
    anyio.run(desk.ctl_set, {"key": "train.loss.clip_high", "value": 0.4})
    desk.apply_changes(1, lambda change: None)
    with structlog.testing.capture_logs() as events:
        anyio.run(desk.reload_file)
    assert not desk.pending(), events
    assert not [e for e in events if e["event"] == "reload_refused"], events
    assert cfg.train.lr == 3e-5 and cfg.train.loss.clip_high == 0.4

    config.write_text(config.read_text().replace("clip_high = 0.28", "clip_high = 0.3").replace("temperature = 1.0", "temperature = 0.7"))
    with structlog.testing.capture_logs() as events:
        anyio.run(desk.reload_file)
    desk.apply_changes(2, lambda change: None)
    assert cfg.source.temperature == 0.7, "the file's own change applies"
    assert cfg.train.loss.clip_high == 0.4 and cfg.train.lr == 3e-5
    (kept,) = [e for e in events if e["event"] == "reload_kept_ctl_set"]
    assert kept["keys"] == ["train.loss.clip_high"]


def test_sighup_with_a_file_that_is_not_utf8_changes_nothing(desk):
    """Issue #30, 4: the reload is refused (logged); the daemon goes on."""
    desk.config_path.write_bytes(b"[train]\nlr = 0.002\n# \xff\n")
    with structlog.testing.capture_logs() as events:
        anyio.run(desk.reload_file)
    assert not desk.pending()
    assert any(e["event"] == "reload_refused" and "UTF-8" in e["reason"] for e in events), events


def test_a_resumed_run_applies_the_stopped_runs_ctl_set_values_again(tmp_path):
    """A restart (systemd after a crash, `grpod start` after a stop) does not undo `ctl set`: the
    checkpoint's operator values go over the file and `--set` again, before anything reads the
    config, and a reload keeps them; a value the config refuses now is logged and left out."""
    model, tok = build_model(seed=0)
    save_model(model, tok, tmp_path / "model")
    config = write_config(
        tmp_path / "grpod.toml",
        {"run.dir": str(tmp_path / "run"), "model.path": str(tmp_path / "model"), "train.lr": 1e-4,
         "source.temperature": 1.0, "train.loss.clip_high": 0.28},
    )
    cfg = load_config(config)
    stopped = OperatorDesk(cfg, RunProgress(cfg.train.steps), config_path=config)
    anyio.run(stopped.ctl_set, {"key": "train.lr", "value": 2e-5})
    anyio.run(stopped.ctl_set, {"key": "source.temperature", "value": 0.8})
    stopped.apply_changes(3, lambda change: None)
    # As the checkpoint stores them; one value the config no longer takes.
    extra = json.loads(json.dumps({"config_changes": stopped.config_changes, "operator_values": stopped.operator_values}))
    extra["operator_values"]["train.loss.clip_high"] = 1e308

    overrides = ["train.lr=3e-5"]
    resumed = load_config(config, overrides)
    desk = OperatorDesk(resumed, RunProgress(resumed.train.steps), config_path=config, overrides=overrides)
    with structlog.testing.capture_logs() as events:
        applied = desk.restore(extra, "checkpoint step-3", 3)
    assert resumed.train.lr == 2e-5 and resumed.source.temperature == 0.8, "ctl set over the file and --set"
    assert resumed.train.loss.clip_high == 0.28
    (refused,) = [e for e in events if e["event"] == "config_restore_refused"]
    assert refused["key"] == "train.loss.clip_high" and "less than or equal to 100" in refused["reason"]
    assert [(c["version"], c["key"], c["old"], c["origin"]) for c in applied] == [
        (3, "train.lr", 3e-5, "checkpoint step-3"), (4, "source.temperature", 1.0, "checkpoint step-3")]
    assert [c["version"] for c in desk.config_changes] == [1, 2, 3, 4], "the stopped run's changes go on"
    assert build_trainer(resumed).optimizer.param_groups[0]["lr"] == pytest.approx(2e-5)

    anyio.run(desk.reload_file)
    assert not desk.pending() and resumed.train.lr == 2e-5, "a reload keeps them, as it keeps a ctl set"


def test_the_change_history_keeps_its_newest_records_however_often_the_run_restarts(tmp_path):
    config = write_config(
        tmp_path / "grpod.toml", {"run.dir": str(tmp_path / "run"), "model.path": str(tmp_path / "model")}
    )
    extra = {"config_changes": [], "operator_values": {"train.lr": 3e-6, "source.temperature": 0.8}}
    for restart in range(1, 61):  # each resume applies both operator values again: 120 changes
        cfg = load_config(config)
        desk = OperatorDesk(cfg, RunProgress(cfg.train.steps), config_path=config)
        desk.restore(extra, f"checkpoint step-{restart}", restart)
        extra = json.loads(json.dumps({"config_changes": desk.config_changes, "operator_values": desk.operator_values}))
    assert [c["version"] for c in extra["config_changes"]] == list(range(121 - CONFIG_HISTORY, 121))
    assert extra["config_changes"][-1]["origin"] == "checkpoint step-60" and cfg.train.lr == 3e-6


def test_a_refusal_lists_the_live_keys_this_run_has():
    """On a builtin run the refusal of `source.dataset.rest_epochs` listed it among the live keys."""
    with pytest.raises(RefusedChange) as refused:
        plan_changes(load_config(None), {"source.dataset.rest_epochs": 1}, "ctl set")
    message = str(refused.value)
    assert "source.dataset.rest_epochs: no such key in the running config" in message
    assert "live keys: train.lr," in message and "source.dataset" not in message.split("live keys:")[1]


def test_a_temperature_vllm_refuses_is_refused_by_ctl_set_and_the_config(tmp_path):
    """vLLM refuses every generation above temperature 2 (HTTP 400 "temperature must be in
    [0, 2]"): `ctl set source.temperature=2.5` was accepted and every later request failed."""
    cfg = load_config(None, [f"run.dir={str(tmp_path)!r}"])
    desk = OperatorDesk(cfg, RunProgress(cfg.train.steps))
    with pytest.raises(ControlError, match=r"source.temperature.*less than or equal to 2"):
        anyio.run(desk.ctl_set, {"key": "source.temperature", "value": 2.5})
    assert not desk.pending() and not desk.operator_values
    assert anyio.run(desk.ctl_set, {"key": "source.temperature", "value": 2.0})["accepted"][0]["new"] == 2.0
    with pytest.raises(ConfigError, match="source.temperature"):
        load_config(None, ["source.temperature=2.5"])


def test_a_reload_refuses_a_fifo_without_blocking_the_daemon(desk, tmp_path):
    """SIGHUP with a FIFO as the config path blocked the event loop in its read until a writer
    came (forever: no ctl, no steps). Now it is refused, read off the loop; the run goes on."""
    import os
    import threading
    import time

    fifo = tmp_path / "grpod.fifo"
    os.mkfifo(fifo)
    desk.config_path = fifo

    def unblock_an_old_reader():  # the old read waited in open() for a writer: end it after 2 s
        time.sleep(2)
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # nobody reads it: as it should be
            pass

    threading.Thread(target=unblock_an_old_reader, daemon=True).start()
    ticks = []

    async def main():
        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.sleep(0.05)
            await desk.reload_file()
            tg.cancel_scope.cancel()

    with structlog.testing.capture_logs() as events:
        anyio.run(main)
    (refused,) = [e for e in events if e["event"] == "reload_refused"]
    assert refused["path"] == str(fifo) and "not a regular file" in refused["reason"], refused
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 1.0, "the event loop went on"
    assert not desk.pending()


def test_a_reload_refuses_a_file_over_1_mib(desk):
    """A 16 MB TOML held the event loop 15 s in its parse; a config file is a few kB."""
    text = desk.config_path.read_text().replace("lr = 0.0001", "lr = 0.002")
    desk.config_path.write_text(text + "#" * (1 << 20) + "\n")
    with structlog.testing.capture_logs() as events:
        anyio.run(desk.reload_file)
    (refused,) = [e for e in events if e["event"] == "reload_refused"]
    assert refused["path"] == str(desk.config_path) and "1048576 bytes" in refused["reason"], refused
    assert not desk.pending() and desk.cfg.train.lr == 1e-4
    desk.config_path.write_text(text)
    anyio.run(desk.reload_file)
    desk.boundary()
    assert desk.cfg.train.lr == 0.002, "a file of a config's size is reloaded"
