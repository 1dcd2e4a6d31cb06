"""`make_source`: the source a config names, built with its own section (and resumed cursor)."""

from types import SimpleNamespace

import anyio
import pytest

from grpod.config import load_config
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.kinds import make_source
from grpod.rollouts.validation import RejectionCounter
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


def test_the_atropos_source_counts_conversion_rejects_in_the_daemons_counter(run):
    # Issue: conversion rejects were missing from `ctl status` and Prometheus (a second counter).
    cfg = load_config(None, [*run, "source.kind=atropos", "run.resume=never"])
    counter = RejectionCounter()
    source = make_source(cfg, None, SimpleNamespace(version=0), None, counter)
    source._accept([{"tokens": "garbage"}, {"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1.0]}])
    assert counter.as_dict() == {"bad_type": 1}


def test_the_dataset_source_is_made_from_the_config_and_resumes_its_cursor(run, tmp_path):
    from grpod.models.tiny import build_tokenizer
    from grpod.rollouts.dataset import DatasetSource, prepare_dataset

    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(5)))
    cfg = load_config(None, [*run, "source.kind=dataset", f"source.dataset.path={str(data)!r}",
                             'source.dataset.rewards=[{function = "last_number"}]'])
    cursor = {"kind": "dataset", "epoch": 2, "position": 3}
    prepared = anyio.run(prepare_dataset, cfg)
    source = make_source(cfg, build_tokenizer(), SimpleNamespace(version=0), cursor, RejectionCounter(), prepared)
    assert isinstance(source, DatasetSource) and source.cursor() == cursor and len(source.items) == 5
    # A checkpoint of the builtin run is not resumed by a dataset run.
    with pytest.raises(ResumeMismatch, match="source_kind: checkpoint 'builtin', config 'dataset'"):
        RunStore(cfg, cfg.run.dir).resume_point()
