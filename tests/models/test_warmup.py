import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpod.models import warmup as warmup_module
from grpod.models.tiny import build_model
from grpod.models.warmup import (
    IGNORE_INDEX,
    generate,
    greedy_accuracy,
    greedy_answers,
    sampled_group_stats,
    teacher_forcing_batch,
    warmup,
)
from grpod.rollouts.arithmetic import (
    ArithmeticTask,
    answer_ids,
    make_problem,
    prompt_ids,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_loss_covers_only_the_answer_and_eos():
    _, tok = build_model(0)
    problems = [make_problem(3, "+", 4), make_problem(12, "-", 19)]
    input_ids, attention, labels = teacher_forcing_batch(tok, problems, {})
    for row, problem in enumerate(problems):
        prompt, answer = prompt_ids(tok, problem), answer_ids(tok, problem)
        end = len(prompt) + len(answer)
        assert input_ids[row, :end].tolist() == prompt + answer
        assert attention[row].tolist() == [1] * end + [0] * (input_ids.shape[1] - end)
        labelled = (labels[row] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert labelled == list(range(len(prompt), end))
        assert labels[row, len(prompt) : end].tolist() == answer
        assert answer[-1] == tok.eos_token_id


def test_warmup_is_deterministic_from_the_seed():
    task = ArithmeticTask(seed=0)
    (a, tok), (b, _) = build_model(1), build_model(1)
    warmup(a, tok, task, steps=3, seed=7, lr=3e-3, batch_size=8)
    warmup(b, tok, task, steps=3, seed=7, lr=3e-3, batch_size=8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    c, _ = build_model(1)
    warmup(c, tok, task, steps=3, seed=8, lr=3e-3, batch_size=8)
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values(), strict=True))


def test_warmup_raises_held_out_accuracy():
    task = ArithmeticTask(seed=0)
    problems = task.eval_set(task.held_out_size)
    model, tok = build_model(0)
    before = greedy_accuracy(model, tok, problems)
    result = warmup(model, tok, task, steps=60, seed=0, lr=3e-3, batch_size=64)
    after = greedy_accuracy(model, tok, problems)
    texts = greedy_answers(model, tok, problems)
    well_formed = sum(bool(re.fullmatch(r"-?\d+<\|im_end\|>", t)) for t in texts) / len(texts)
    print(f"held-out greedy accuracy {before:.3f} -> {after:.3f} after 60 steps; well-formed {well_formed:.2f}")
    assert result["final_loss"] < result["first_loss"]
    assert after > before
    assert well_formed >= 0.9


def test_plus_sign_share_rewrites_that_share_of_non_negative_answers_only(monkeypatch):
    """The style draw has its own stream: the problems are those of an unstyled warm-up."""
    seen = []

    def record(tokenizer, problems, cache):
        seen.append(list(problems))
        return teacher_forcing_batch(tokenizer, problems, cache)

    monkeypatch.setattr(warmup_module, "teacher_forcing_batch", record)
    task = ArithmeticTask(seed=0)
    model, tok = build_model(0)
    warmup(model, tok, task, steps=4, seed=3, lr=1e-4, batch_size=64)
    plain, seen[:] = list(seen), []
    warmup(model, tok, task, steps=4, seed=3, lr=1e-4, batch_size=64, plus_sign_share=0.6)
    pairs = [(a, b) for x, y in zip(plain, seen, strict=True) for a, b in zip(x, y, strict=True)]
    assert all(a.question == b.question for a, b in pairs)
    assert all(b.answer == a.answer for a, b in pairs if a.answer.startswith("-"))
    non_negative = [(a, b) for a, b in pairs if not a.answer.startswith("-")]
    signed = [b for a, b in non_negative if b.answer == "+" + a.answer]
    assert all(b.answer in (a.answer, "+" + a.answer) for a, b in non_negative)
    assert 0.45 <= len(signed) / len(non_negative) <= 0.75
    with pytest.raises(ValueError, match="plus_sign_share"):
        warmup(model, tok, task, steps=1, seed=0, lr=1e-4, batch_size=1, plus_sign_share=1.5)


def test_greedy_loop_matches_hf_generate():
    model, tok = build_model(0)
    warmup(model, tok, ArithmeticTask(seed=0), steps=10, seed=0, lr=3e-3, batch_size=16)
    prompts = [prompt_ids(tok, make_problem(a, op, b)) for a, op, b in [(3, "+", 4), (12, "-", 19), (7, "-", 7), (15, "+", 18)]]
    ours = generate(model, prompts, eos_token_id=tok.eos_token_id, max_new_tokens=6)
    for prompt, completion in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        assert completion == out[0, len(prompt) :].tolist()


def test_sampling_at_low_temperature_is_greedy_and_stats_add_up(warm_model_dir):
    model = AutoModelForCausalLM.from_pretrained(warm_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(warm_model_dir)
    problems = ArithmeticTask(seed=0).eval_set(40)
    cold = sampled_group_stats(model, tok, problems, group_size=4, temperature=1e-4, seed=0)
    assert cold["mixed_share"] == 0.0
    assert cold["sample_accuracy"] == pytest.approx(greedy_accuracy(model, tok, problems))
    warm = sampled_group_stats(model, tok, problems, group_size=8, temperature=1.0, seed=0)
    assert warm["mixed_share"] + warm["all_right_share"] + warm["all_wrong_share"] == pytest.approx(1.0)
    assert warm["mixed_share"] > 0
    assert warm == sampled_group_stats(model, tok, problems, group_size=8, temperature=1.0, seed=0)
