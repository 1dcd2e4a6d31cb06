"""RunStore: a checkpoint of another run (model, source kind, task) is refused on resume."""

import pytest

from grpod.config import load_config
from grpod.models.tiny import build_model, save_model
from grpod.run.compatibility import ResumeMismatch
from grpod.run.store import RunSnapshot, RunStore
from grpod.training.trainer import build_trainer


@pytest.fixture()
def run(tmp_path):
    save_model(*build_model(seed=0), tmp_path / "model")
    base = [f"run.dir={str(tmp_path / 'run')!r}", f"model.path={str(tmp_path / 'model')!r}", "train.threads=1"]
    cfg = load_config(None, base)
    RunStore(cfg, cfg.run.dir).save(build_trainer(cfg), RunSnapshot(3, 1, [], {"kind": "builtin", "next_index": 9}, {}))
    return base


def test_the_same_run_resumes(run):
    cfg = load_config(None, run)
    restored = RunStore(cfg, cfg.run.dir).resume_point()
    assert restored.step == 3 and restored.source_cursor["next_index"] == 9


@pytest.mark.parametrize(
    ("change", "named"),
    [("source.kind=atropos", "source_kind: checkpoint 'builtin', config 'atropos'"),
     ("source.task_seed=7", "task: checkpoint 'arithmetic, task_seed 1234', config 'arithmetic, task_seed 7'")],
)
def test_a_checkpoint_of_another_run_is_refused_naming_both(run, change, named):
    # Issue: after `make run`, `--set source.kind=atropos` on the same run dir resumed the builtin
    # run's final checkpoint, trained nothing and exited 0.
    cfg = load_config(None, [*run, change])
    with pytest.raises(ResumeMismatch) as caught:
        RunStore(cfg, cfg.run.dir).resume_point()
    assert named in str(caught.value) and 'run.resume_mismatch = "allow"' in str(caught.value)


def test_a_different_model_is_refused_and_allow_overrides(run, tmp_path):
    save_model(*build_model(seed=1), tmp_path / "other")
    cfg = load_config(None, [*run, f"model.path={str(tmp_path / 'other')!r}"])
    with pytest.raises(ResumeMismatch, match="model: checkpoint"):
        RunStore(cfg, cfg.run.dir).resume_point()
    allowed = load_config(None, [*run, f"model.path={str(tmp_path / 'other')!r}", "run.resume_mismatch=allow"])
    assert RunStore(allowed, allowed.run.dir).resume_point().step == 3


def test_a_resumed_trainer_continues_from_the_checkpoint(run):
    cfg = load_config(None, run)
    store = RunStore(cfg, cfg.run.dir)
    restored = store.resume_point()
    assert restored.weights == restored.checkpoint / "model"
    trainer = store.load_trainer(restored)
    assert trainer.model_path == restored.weights


@pytest.mark.parametrize("broken", ["weights", "optimizer"])
def test_a_broken_trainer_is_never_checkpointed(run, broken):
    """Issue #30, 2: non-finite weights or optimizer state → BrokenTrainerState, nothing written,
    the last good checkpoint stays the newest (and is named)."""
    import torch

    from grpod.run.checkpoint import latest_checkpoint
    from grpod.run.store import BrokenTrainerState

    cfg = load_config(None, run)
    store = RunStore(cfg, cfg.run.dir)
    trainer = store.load_trainer(store.resume_point())
    param = trainer.trainable[0]
    if broken == "weights":
        with torch.no_grad():
            param.view(-1)[0] = float("nan")
    else:
        trainer.optimizer.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.full_like(param, float("inf")),
                                          "exp_avg_sq": torch.zeros_like(param)}
    with pytest.raises(BrokenTrainerState) as caught:
        store.save(trainer, RunSnapshot(4, 2, [], {"kind": "builtin", "next_index": 12}, {}))
    message = str(caught.value)
    assert "checkpoint of step 4 refused" in message and "non-finite" in message
    assert ("weights" if broken == "weights" else "exp_avg") in message
    assert "step-000003" in message, "names the checkpoint that stays the newest"
    assert latest_checkpoint(store.root).step == 3
    assert sorted(p.name for p in store.root.iterdir()) == ["step-000003"], "nothing of the refused write is left"


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_the_configs_optimizer_settings_win_on_resume_each_change_logged_once(tmp_path, optimizer):
    """Review 6: a changed train.weight_decay was silently replaced by the checkpoint's (the
    optimizer's param groups come back with the state); train.lr already won."""
    import structlog

    save_model(*build_model(seed=0), tmp_path / "model")
    base = [f"run.dir={str(tmp_path / 'run')!r}", f"model.path={str(tmp_path / 'model')!r}", "train.threads=1",
            f"train.optimizer={optimizer}", "train.weight_decay=0.0"]
    cfg = load_config(None, base)
    RunStore(cfg, cfg.run.dir).save(build_trainer(cfg), RunSnapshot(3, 1, [], {"kind": "builtin", "next_index": 9}, {}))

    changed = load_config(None, [*base, "train.weight_decay=0.1"])
    store = RunStore(changed, changed.run.dir)
    with structlog.testing.capture_logs() as logs:
        trainer = store.load_trainer(store.resume_point())
    assert [group["weight_decay"] for group in trainer.optimizer.param_groups] == [0.1] * len(trainer.optimizer.param_groups)
    lines = [e for e in logs if e["event"] == "optimizer_setting_from_config"]
    assert [(e["key"], e["checkpoint"], e["config"]) for e in lines] == [("train.weight_decay", 0.0, 0.1)]

    same = RunStore(cfg, cfg.run.dir)
    with structlog.testing.capture_logs() as logs:
        trainer = same.load_trainer(same.resume_point())
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.0
    assert not [e for e in logs if e["event"] == "optimizer_setting_from_config"]


def test_a_datasets_identity_is_its_file_and_its_order(tmp_path, monkeypatch):
    """The same dataset file named from another directory was another run (a resume refused); a
    changed shuffle_seed was the same run, and the resumed cursor then indexed another permutation
    (rows of the epoch repeated or skipped). Checkpoints that recorded the path as written resume."""
    from grpod.run.compatibility import check_identity, run_identity

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)

    def dataset(path, seed=0):
        return load_config(None, ["source.kind=dataset", f"source.dataset.path={path!r}", f"source.dataset.shuffle_seed={seed}",
                                  "source.dataset.rewards=[{function='exact'}]", "eval.size=0"])

    relative, absolute = dataset("d/train.jsonl"), dataset(str(tmp_path / "d" / "train.jsonl"))
    assert run_identity(relative) == run_identity(absolute)
    check_identity(tmp_path / "ckpt", run_identity(relative), absolute)
    with pytest.raises(ResumeMismatch, match="shuffle_seed 0"):
        check_identity(tmp_path / "ckpt", run_identity(relative), dataset("d/train.jsonl", seed=7))
    written_before = {**run_identity(relative), "task": "dataset d/train.jsonl"}
    check_identity(tmp_path / "ckpt", written_before, relative)
