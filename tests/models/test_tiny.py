import json
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpod.models import tiny, warmup
from grpod.models.tiny import (
    CHARACTERS,
    IM_END,
    IM_START,
    MODEL_RECORD,
    PAD,
    ROLE_WORDS,
    build_model,
    build_tokenizer,
    init_model,
    save_model,
)
from grpod.models.warmup import ModelInitStopped, greedy_accuracy
from grpod.rollouts.arithmetic import ArithmeticTask

TOKENIZER = build_tokenizer()


@given(st.text(alphabet=CHARACTERS, max_size=40))
def test_tokenizer_round_trips_text(text):
    assert TOKENIZER.decode(TOKENIZER.encode(text)) == text


def test_tokenizer_units():
    assert TOKENIZER.encode("12+7=") == [TOKENIZER.convert_tokens_to_ids(c) for c in "12+7="]
    chat = f"{IM_START}user\nwhat is 3-4?{IM_END}\n{IM_START}assistant\n-1{IM_END}"
    ids = TOKENIZER.encode(chat)
    assert TOKENIZER.decode(ids) == chat
    assert ids.count(TOKENIZER.convert_tokens_to_ids("user")) == 1
    assert ids.count(TOKENIZER.convert_tokens_to_ids("assistant")) == 1
    assert len(TOKENIZER) == 3 + len(CHARACTERS) + len(ROLE_WORDS)
    assert TOKENIZER.eos_token == IM_END and TOKENIZER.pad_token == PAD
    assert TOKENIZER.decode(ids, skip_special_tokens=True) == "user\nwhat is 3-4?\nassistant\n-1"


@given(st.lists(st.sampled_from(CHARACTERS + ROLE_WORDS + [IM_START, IM_END]), max_size=30).map("".join))
def test_reloaded_tokenizer_encodes_the_same(saved_tokenizer, text):
    assert saved_tokenizer.encode(text) == TOKENIZER.encode(text)
    assert saved_tokenizer.decode(saved_tokenizer.encode(text)) == text


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    """The tokenizer as everyone else gets it: AutoTokenizer on a saved model directory."""
    out = tmp_path_factory.mktemp("tiny")
    model, tokenizer = build_model(0)
    save_model(model, tokenizer, out)
    return AutoTokenizer.from_pretrained(out)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_build_model_is_deterministic_from_the_seed():
    a, b, c = _state(build_model(3)[0]), _state(build_model(3)[0]), _state(build_model(4)[0])
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_init_model_is_deterministic_and_records_itself(tmp_path):
    records = [init_model(tmp_path / name, seed=2, warmup_steps=4, eval_size=8) for name in ("a", "b")]
    weights_a = load_file(tmp_path / "a" / "model.safetensors")
    weights_b = load_file(tmp_path / "b" / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    untrained = build_model(2)[0].state_dict()
    assert not torch.equal(weights_a["model.layers.0.mlp.up_proj.weight"], untrained["model.layers.0.mlp.up_proj.weight"])
    saved = json.loads((tmp_path / "a" / MODEL_RECORD).read_text())
    assert saved == json.loads(json.dumps(records[0]))
    assert {"seed", "warmup_steps", "eval_accuracy", "eval_size", "seconds"} <= saved.keys()
    assert saved["seed"] == 2 and saved["warmup_steps"] == 4 and saved["eval_size"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary directory left


def test_init_model_never_overwrites(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="never overwritten"):
        init_model(out, warmup_steps=1, eval_size=1)
    assert (out / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    init_model(empty, warmup_steps=1, eval_size=1)
    assert (empty / "config.json").exists()


def test_init_model_failure_leaves_nothing(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiny, "save_model", disk_full)
    with pytest.raises(OSError, match="No space left"):
        init_model(tmp_path / "model", warmup_steps=1, eval_size=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stop_during", ["warm-up", "measurements"])
def test_a_stopped_init_model_ends_at_its_next_safe_point_and_leaves_nothing(tmp_path, monkeypatch, stop_during):
    stop = threading.Event()
    warmed = []
    if stop_during == "warm-up":
        batch = warmup.teacher_forcing_batch

        def batch_then_stop(*args, **kwargs):  # the stop arrives during the third step
            warmed.append(1)
            if len(warmed) == 3:
                stop.set()
            return batch(*args, **kwargs)

        monkeypatch.setattr(warmup, "teacher_forcing_batch", batch_then_stop)
    else:
        accuracy = tiny.greedy_accuracy

        def accuracy_then_stop(*args, **kwargs):
            stop.set()
            return accuracy(*args, **kwargs)

        monkeypatch.setattr(tiny, "greedy_accuracy", accuracy_then_stop)
    with pytest.raises(ModelInitStopped):
        init_model(tmp_path / "model", warmup_steps=50, eval_size=1, stop=stop)
    assert list(tmp_path.iterdir()) == []
    if stop_during == "warm-up":
        assert len(warmed) == 3, "the warm-up went on after the stop"


def test_init_model_restores_the_thread_count(tmp_path):
    before = torch.get_num_threads()
    record = init_model(tmp_path / "m", warmup_steps=1, eval_size=1, threads=1)
    assert record["torch_threads"] == 1
    assert torch.get_num_threads() == before


def test_warm_model_loads_and_its_record_is_true(warm_model_dir):
    """The session's warm model: loadable by HF, and as good as its record says (calibration band)."""
    record = json.loads((warm_model_dir / MODEL_RECORD).read_text())
    model = AutoModelForCausalLM.from_pretrained(warm_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(warm_model_dir)
    problems = ArithmeticTask(seed=record["seed"]).eval_set(record["eval_size"])
    measured = greedy_accuracy(model, tokenizer, problems)
    # The thread count may differ from init_model's; allow one problem to flip on a near-tie.
    assert abs(measured - record["eval_accuracy"]) <= 1 / len(problems) + 1e-9
    # Calibrated to leave RL room: clearly better than nothing, far from solved, and most groups
    # of 8 samples at T=1 mixed (seed 0 measured 0.21 greedy accuracy and 0.81 mixed).
    assert 0.10 <= record["eval_accuracy"] <= 0.5
    assert record["sampled"]["mixed_share"] >= 0.4
