import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpod.models.tiny import build_tokenizer
from grpod.rollouts.arithmetic import (
    END_OF_TURN,
    ArithmeticTask,
    answer_ids,
    completion_answer,
    is_held_out,
    make_problem,
    prompt_ids,
    score,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_problem_text_and_answer():
    assert make_problem(12, "+", 7).question == "12+7="
    assert make_problem(12, "+", 7).answer == "19"
    assert make_problem(3, "-", 15).answer == "-12"
    assert make_problem(3, "-", 15).id == "arith:3-15"
    with pytest.raises(ValueError, match="unsupported operator"):
        make_problem(1, "*", 2)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("19", 1.0),
        ("19<|im_end|>", 1.0),
        (" 19 \n", 1.0),
        ("19<|im_end|>\n", 1.0),
        ("019", 0.0),
        ("+19<|im_end|>", 0.0),  # the style the default warm-up teaches 60 % of the time
        ("18", 0.0),
        ("-19", 0.0),
        ("1 9", 0.0),
        ("19 is the answer", 0.0),
        ("", 0.0),
        ("<|im_end|>", 0.0),
        ("19<|im_end|>19", 0.0),
    ],
)
def test_score_is_exact_match(completion, expected):
    assert score(make_problem(12, "+", 7), completion) == expected


def test_negative_answers_score():
    problem = make_problem(3, "-", 15)
    assert score(problem, "-12<|im_end|>") == 1.0
    assert score(problem, "12") == 0.0


def test_format_reward_goes_to_wrong_integers_only():
    task = ArithmeticTask(seed=0, format_reward=0.1)
    problem = make_problem(12, "+", 7)
    assert task.score(problem, "19") == 1.0
    assert task.score(problem, "18<|im_end|>") == 0.1
    assert task.score(problem, "-4") == 0.1
    assert task.score(problem, "x") == 0.0
    assert ArithmeticTask(seed=0).score(problem, "18") == 0.0


@given(st.integers(0, 19), st.sampled_from(["+", "-"]), st.integers(0, 19), st.integers(-50, 50))
def test_only_the_true_value_scores(a, operator, b, guess):
    problem = make_problem(a, operator, b)
    truth = a + b if operator == "+" else a - b
    assert score(problem, f"{guess}{END_OF_TURN}") == (1.0 if guess == truth else 0.0)


def test_eval_set_is_disjoint_from_training_samples():
    task = ArithmeticTask(seed=0)
    held_out = {p.question for p in task.eval_set(task.held_out_size)}
    assert len(held_out) == task.held_out_size > 100
    rng = random.Random(1)
    drawn = {task.sample(rng).question for _ in range(20_000)}
    assert not drawn & held_out
    # The split partitions the space: every problem is on exactly one side, and sampling reaches
    # all of the training side (20 000 draws over ~650 problems).
    space = {make_problem(a, op, b).question for op in "+-" for a in range(20) for b in range(20)}
    assert drawn | held_out == space


def test_split_does_not_depend_on_the_seed():
    a, b = ArithmeticTask(seed=0), ArithmeticTask(seed=1)
    assert {p.question for p in a.eval_set(a.held_out_size)} == {p.question for p in b.eval_set(b.held_out_size)}
    assert all(is_held_out(p.question) for p in a.eval_set(20))
    # The seed picks the order, hence which problems a smaller eval set holds.
    assert a.eval_set(20) != b.eval_set(20)


def test_eval_set_is_deterministic_and_prefix_stable():
    first = ArithmeticTask(seed=5).eval_set(50)
    assert first == ArithmeticTask(seed=5).eval_set(50)
    assert ArithmeticTask(seed=5).eval_set(10) == first[:10]
    assert len({p.id for p in first}) == 50


def test_eval_set_larger_than_split_is_refused():
    task = ArithmeticTask(seed=0)
    with pytest.raises(ValueError, match="held-out split has"):
        task.eval_set(task.held_out_size + 1)


def test_sample_is_reproducible_from_the_rng():
    task = ArithmeticTask(seed=0)
    assert [task.sample(random.Random(3)) for _ in range(5)] == [task.sample(random.Random(3)) for _ in range(5)]
    rng_a, rng_b = random.Random(9), random.Random(9)
    assert [task.sample(rng_a) for _ in range(50)] == [task.sample(rng_b) for _ in range(50)]


def test_bad_task_settings_are_refused():
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticTask(seed=0, max_operand=0)
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(seed=0, operators=("*",))
    with pytest.raises(ValueError, match="format_reward"):
        ArithmeticTask(seed=0, format_reward=1.0)


def test_prompt_is_the_chat_template_and_the_answer_ends_with_eos(tokenizer):
    problem = make_problem(12, "+", 7)
    ids = prompt_ids(tokenizer, problem)
    assert tokenizer.decode(ids) == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    assert len(ids) <= 16
    answer = answer_ids(tokenizer, problem)
    assert answer[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(answer) == "19<|im_end|>"
    assert completion_answer(tokenizer.decode(answer)) == problem.answer


# ---- the instruct prompt style (a real chat model) --------------------------------------------


class _BigVocab:
    chat_template = "x"

    def __len__(self):
        return 49152


def test_prompt_style_follows_the_vocabulary_unless_configured():
    from grpod.models.tiny import build_tokenizer
    from grpod.rollouts.arithmetic import prompt_style_for

    assert prompt_style_for(build_tokenizer()) == "bare"
    assert prompt_style_for(_BigVocab()) == "instruct"
    assert prompt_style_for(_BigVocab(), "bare") == "bare"


def test_instruct_scoring_extracts_the_last_integer():
    # What SmolLM2-135M-Instruct answered greedily (notes/real-model.md and a run here): exact
    # matching scored all of these 0.0.
    from grpod.rollouts.arithmetic import make_problem

    task = ArithmeticTask(seed=0, prompt_style="instruct")
    assert task.score(make_problem(17, "+", 25), "17 + 25 = 42.<|im_end|>") == 1.0
    assert task.score(make_problem(17, "+", 25), "17 + 25 = 32.<|im_end|>") == 0.0
    assert task.score(make_problem(8, "+", 8), "The answer is 16.<|im_end|>") == 1.0
    assert task.score(make_problem(3, "-", 9), "3 - 9 = -6") == 1.0
    assert task.score(make_problem(3, "-", 9), "I cannot say") == 0.0
    bare = ArithmeticTask(seed=0)
    assert bare.score(make_problem(17, "+", 25), "17 + 25 = 42.<|im_end|>") == 0.0


def test_instruct_prompt_asks_for_the_number():
    from grpod.models.tiny import build_tokenizer
    from grpod.rollouts.arithmetic import instruct_question, make_problem

    assert instruct_question(make_problem(12, "-", 7)) == "What is 12 - 7? Answer with the number only."
    tokenizer = build_tokenizer()
    task = ArithmeticTask(seed=0, prompt_style="instruct")
    text = tokenizer.decode(task.prompt_for(tokenizer, make_problem(12, "-", 7)))
    assert "12 - 7" in text and text.rstrip().endswith("assistant")


def test_the_builtin_source_gives_an_instruct_model_room_to_answer():
    from grpod.config import parse_config
    from grpod.rollouts.kinds import make_source
    from grpod.rollouts.validation import RejectionCounter

    source = make_source(parse_config({"source": {"max_tokens": 8}}), _BigVocab(), None, None, RejectionCounter())
    assert source.task.prompt_style == "instruct" and source.max_tokens == 24
    explicit = make_source(parse_config({"source": {"max_tokens": 40}}), _BigVocab(), None, None, RejectionCounter())
    assert explicit.max_tokens == 40
