"""RunStore: a checkpoint of another run (model, source kind, task) is refused on resume."""

from types import SimpleNamespace

import pytest

from grpod.config import load_config
from grpod.daemon.state import ResumeMismatch, RunStore
from grpod.models.tiny import build_model, save_model
from grpod.training.trainer import Trainer


@pytest.fixture()
def run(tmp_path):
    save_model(*build_model(seed=0), tmp_path / "model")
    base = [f"run.dir={str(tmp_path / 'run')!r}", f"model.path={str(tmp_path / 'model')!r}", "train.threads=1"]
    cfg = load_config(None, base)
    RunStore(cfg, cfg.run.dir).save(Trainer(cfg, cfg.model.path), 3, 1, [], {"kind": "builtin", "next_index": 9}, {})
    return base


def test_the_same_run_resumes(run):
    cfg = load_config(None, run)
    restored = RunStore(cfg, cfg.run.dir).load_trainer()
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
        RunStore(cfg, cfg.run.dir).load_trainer()
    assert named in str(caught.value) and 'run.resume_mismatch = "allow"' in str(caught.value)


def test_a_different_model_is_refused_and_allow_overrides(run, tmp_path):
    save_model(*build_model(seed=1), tmp_path / "other")
    cfg = load_config(None, [*run, f"model.path={str(tmp_path / 'other')!r}"])
    with pytest.raises(ResumeMismatch, match="model: checkpoint"):
        RunStore(cfg, cfg.run.dir).load_trainer()
    allowed = load_config(None, [*run, f"model.path={str(tmp_path / 'other')!r}", "run.resume_mismatch=allow"])
    assert RunStore(allowed, allowed.run.dir).load_trainer().step == 3


def test_the_atropos_source_counts_conversion_rejects_in_the_daemons_counter(run):
    # Issue: conversion rejects were missing from `ctl status` and Prometheus (a second counter).
    from grpod.rollouts.validation import RejectionCounter

    cfg = load_config(None, [*run, "source.kind=atropos", "run.resume=never"])
    counter = RejectionCounter()
    source = RunStore(cfg, cfg.run.dir).make_source(None, SimpleNamespace(policy_version=0), None, rejections=counter)
    source._accept([{"tokens": "garbage"}, {"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1.0]}])
    assert counter.as_dict() == {"bad_type": 1}


def test_the_dataset_source_is_made_from_the_config_and_resumes_its_cursor(run, tmp_path):
    from grpod.models.tiny import build_tokenizer
    from grpod.rollouts.dataset import DatasetSource

    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(5)))
    cfg = load_config(None, [*run, "source.kind=dataset", f"source.dataset.path={str(data)!r}",
                             'source.dataset.rewards=[{function = "last_number"}]'])
    cursor = {"kind": "dataset", "epoch": 2, "position": 3}
    source = RunStore(cfg, cfg.run.dir).make_source(build_tokenizer(), SimpleNamespace(policy_version=0), cursor)
    assert isinstance(source, DatasetSource) and source.cursor() == cursor and len(source.items) == 5
    # A checkpoint of the builtin run is not resumed by a dataset run.
    with pytest.raises(ResumeMismatch, match="source_kind: checkpoint 'builtin', config 'dataset'"):
        RunStore(cfg, cfg.run.dir).load_trainer()
