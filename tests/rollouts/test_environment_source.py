"""The environment source over a scripted engine: a group is the episodes of one task (opened
together), tool turns go back to the model, an environment that fails, hangs or opens two tasks
for one index drops its group with a reason (the next group trains), the cursor resumes the task
stream, evaluation plays greedy held-out episodes, and a start-up that cannot open the environment
is a config error."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from types import SimpleNamespace

import anyio
import pytest
from structlog.testing import capture_logs

from grpod.config import ConfigError, parse_config
from grpod.inference.client import Completion
from grpod.models.tiny import build_tokenizer
from grpod.rollouts.calculator import CalculatorAdapter, word_problem
from grpod.rollouts.dynamic_sampling import DynamicSampling
from grpod.rollouts import environment_source
from grpod.rollouts.environment_source import ADAPTER_MARGIN_S, EnvironmentSource, _failure, prepare_environment
from grpod.rollouts.environments import EnvironmentFailure, EnvironmentTimeout
from grpod.rollouts.validation import validate_group
from tests.rollouts.conftest import scripted_policy

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def config(**environment):
    return parse_config({
        "source": {"kind": "environment", "group_size": 3, "max_tokens": 6,
                   "environment": {"timeout_s": 0.5, "max_turns": 3, **environment}},
        "eval": {"size": 4},
        "model": {"max_seq_len": 512},
    })


def source_over(generate, tokenizer, adapter, cfg=None, cursor=None):
    cfg = cfg or config()
    policy, _ = scripted_policy(SimpleNamespace(generate=generate), version=5)
    dynamic = DynamicSampling(False, 8, cfg.train.advantages, cfg.completion_budget)
    return EnvironmentSource(
        cfg.source, tokenizer, policy, adapter, max_seq_len=cfg.model.max_seq_len, eval_cfg=cfg.eval,
        engine_wait_s=2.0, dynamic_sampling=dynamic, cursor=cursor,
    )


def solver(tokenizer, *, call: bool = True, wrong: bool = False):
    """A scripted model that calls the calculator with the task's expression, then answers with the
    tool's result (or a wrong number); it reads the task from the prompt ids it is given."""

    async def generate(prompt, *, max_tokens, temperature, **kwargs):
        text = tokenizer.decode(prompt)
        tool_turns = text.rsplit("<|im_start|>user", 1)[1].count("<|im_start|>tool")  # after the task's question
        if call and tool_turns == 0:
            out = "<tool>expr</tool>"
        else:
            out = "Answer: 0" if wrong else "Answer: ANSWER"
        ids = tokenizer.encode("ab", add_special_tokens=False)[:max_tokens]
        return [Completion(ids, [-0.5] * len(ids), "stop", out)]

    return generate


class KnownAnswers(CalculatorAdapter):
    """The calculator adapter whose environments evaluate `expr` to the task's answer, so the
    scripted model's text needs no arithmetic."""

    async def open(self, index, split):
        messages, environment = await super().open(index, split)
        answer = environment.answer
        respond = environment.respond

        async def scripted(text: str):
            return await respond(text.replace("expr", str(answer)).replace("ANSWER", str(answer)))

        environment.respond = scripted
        return messages, environment


async def test_a_group_is_the_episodes_of_one_task_with_tool_turns_appended(tokenizer):
    cfg = config(args={"tool_bonus": 0.25})
    source = source_over(solver(tokenizer), tokenizer, KnownAnswers(cfg.source.environment), cfg)
    with anyio.fail_after(10):
        group = await source.generate_group()
    assert group is not None and group.group_id == "environment-0" and len(group.tokens) == 3
    assert group.scores == [1.25] * 3, "correct with a calculator call: 1.0 + the tool bonus"
    assert validate_group(group, vocab_size=len(tokenizer), max_seq_len=cfg.model.max_seq_len, group_normalised=True) is None
    text = tokenizer.decode(group.tokens[0])
    question, answer = word_problem(cfg.source.environment.task_seed, "train", 0)
    assert "<|im_start|>tool" in text and f"\n{answer}<|im_end|>" in text, "the tool's result is in the next prompt"
    assert source.stats.episodes == 3 and source.stats.model_turns == 6 and source.stats.generated == 1
    assert source.stats.sampled_tokens == sum(map(sum, group.loss_mask))
    import json

    from grpod.daemon.status import _source_status

    json.dumps(_source_status(source))  # what `ctl status` sends
    metrics = source.stats.step_metrics()
    assert metrics["env/tool_calls"] == 1.0 and metrics["env/tool_errors"] == 0.0 and metrics["model_turns"] == 6
    assert metrics["sampled_tokens"] == source.stats.sampled_tokens and metrics["dynamic_filtered"] == 0
    assert group.policy_version == 5
    assert source.cursor() == {"kind": "environment", "next_index": 1}


async def test_an_opening_longer_than_the_episode_budget_drops_the_group(tokenizer, monkeypatch):
    """Each dropped group is counted (the source alarm reads the run of failures), and said on the
    console once per reason and interval: a task stream that never fits printed a line per episode
    (258 lines in 45 s)."""
    monkeypatch.setattr(environment_source, "GENERATION_RETRY_S", 0.0)
    cfg = parse_config({"source": {"kind": "environment", "group_size": 2}, "model": {"max_seq_len": 128}})
    source = source_over(solver(tokenizer), tokenizer, KnownAnswers(cfg.source.environment), cfg)
    with capture_logs() as logs:
        for _ in range(3):
            assert await source.generate_group() is None
    assert source.stats.drop_reasons == {"prompt_too_long": 3} and "128" in source.stats.last_error
    assert source.stats.consecutive_errors == 3
    assert [(e["event"], e["reason"], e["task"]) for e in logs if e["log_level"] == "warning"] == [
        ("episode_failed", "prompt_too_long", 0)
    ]
    # Every step record says what the source dropped so far, by reason (metrics.jsonl had none of it).
    metrics = source.stats.step_metrics()
    assert metrics["source_dropped"] == 3 and metrics["source_drops/prompt_too_long"] == 3


async def test_a_first_task_that_leaves_no_room_for_a_model_turn_stops_the_start(tmp_path, tokenizer):
    """`grpod check-config` said ok, and `grpod start` then dropped every group forever."""
    cfg = parse_config({"source": {"kind": "environment", "group_size": 2}, "model": {"max_seq_len": 128}})
    with pytest.raises(ConfigError, match=r"adapter 'calculator'\): task 0 does not fit: the episode's opening is "
                                          r"\d+ tokens: no room for a model turn within 128 .*model.max_seq_len = 128: "
                                          r"raise model.max_seq_len"):
        async with AsyncExitStack() as stack:
            await prepare_environment(cfg.source, tmp_path, stack, max_seq_len=128, model_path=tmp_path,
                                      tokenizer=tokenizer)
    capped = config(max_episode_tokens=128)  # model.max_seq_len 512: the episode's own cap binds
    with pytest.raises(ConfigError, match=r"within 128 .*source.environment.max_episode_tokens = 128: raise "
                                          r"source.environment.max_episode_tokens"):
        async with AsyncExitStack() as stack:
            await prepare_environment(capped.source, tmp_path, stack, max_seq_len=512, model_path=tmp_path,
                                      tokenizer=tokenizer)
    async with AsyncExitStack() as stack:  # the episode's limit as the source takes it: 512 fits
        await prepare_environment(config().source, tmp_path, stack, max_seq_len=512, model_path=tmp_path,
                                  tokenizer=tokenizer)


async def test_a_chat_template_that_refuses_the_openings_roles_stops_the_start_with_a_config_error(tmp_path, tokenizer):
    """A template's raise_exception (Gemma: "System role not supported") is a jinja2 TemplateError:
    the start ended in a traceback instead of exit 2 naming what failed."""
    import copy

    from grpod.models.tiny import CHAT_TEMPLATE

    gemma_like = copy.deepcopy(tokenizer)
    gemma_like.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE)
    with pytest.raises(ConfigError, match="task 0: the environment's opening cannot be rendered and tokenised: "
                                          "TemplateError: System role not supported"):
        async with AsyncExitStack() as stack:
            await prepare_environment(config().source, tmp_path, stack, max_seq_len=512, model_path=tmp_path,
                                      tokenizer=gemma_like)


async def test_a_resumed_source_continues_the_task_stream(tokenizer):
    cfg = config()
    source = source_over(solver(tokenizer), tokenizer, KnownAnswers(cfg.source.environment), cfg, cursor={"next_index": 7})
    group = await source.generate_group()
    assert group.group_id == "environment-7" and source.cursor()["next_index"] == 8


class SlowOpening(KnownAnswers):
    """Every open takes 0.4 s, as an environment that sets up a sandbox per episode does."""

    async def open(self, index, split):
        await anyio.sleep(0.4)
        return await super().open(index, split)


async def test_a_groups_environments_open_together(tokenizer):
    cfg = config()
    source = source_over(solver(tokenizer), tokenizer, SlowOpening(cfg.source.environment), cfg)
    started = anyio.current_time()
    with anyio.fail_after(10):
        group = await source.generate_group()
    assert group is not None and len(group.tokens) == 3 and group.scores == [1.0] * 3
    # One set-up's time for the group's three episodes: one after another would take 1.2 s (the
    # bound leaves a loaded machine most of the rest).
    assert anyio.current_time() - started < 1.1


class Failing(CalculatorAdapter):
    """Episodes of task `bad` fail the way `how` says; other tasks play normally."""

    def __init__(self, cfg, how: str, bad: int = 0) -> None:
        super().__init__(cfg)
        self.how, self.bad, self.closed = how, bad, 0

    async def open(self, index, split):
        messages, environment = await super().open(index, split)
        if index == self.bad and self.how == "different openings":
            messages = [*messages, {"role": "user", "content": f"extra {id(environment)}"}]
        close = environment.aclose

        async def aclose():
            self.closed += 1
            await close()

        environment.aclose = aclose
        if index == self.bad and self.how in ("crash", "hang"):
            async def respond(text):
                if self.how == "hang":
                    await anyio.sleep(3600)
                raise EnvironmentFailure("environment_crash", "the environment server died")

            environment.respond = respond
        return messages, environment


@pytest.mark.parametrize(
    ("how", "reason"),
    [("crash", "environment_crash"), ("hang", "environment_timeout"), ("different openings", "environment_error")],
)
async def test_a_failing_environment_drops_its_group_and_the_next_one_trains(tokenizer, how, reason):
    cfg = config()
    adapter = Failing(cfg.source.environment, how)
    source = source_over(solver(tokenizer, call=False), tokenizer, adapter, cfg)
    started = anyio.current_time()
    with anyio.fail_after(15):
        assert await source.generate_group() is None
    # A hang is cut at source.environment.timeout_s (+ the margin left to adapters that bound
    # their own calls; this one does not).
    assert anyio.current_time() - started < 0.5 + ADAPTER_MARGIN_S + 2.0
    assert source.stats.drop_reasons == {reason: 1}
    assert str(0) in source.stats.last_error
    # Every environment opened was closed (the group's three open together).
    assert adapter.closed == 3
    with anyio.fail_after(10):
        group = await source.generate_group()
    assert group is not None and group.group_id == "environment-1"
    assert source.stats.consecutive_errors == 0


def test_a_group_with_a_timed_out_episode_is_dropped_as_a_timeout_whatever_ended_first():
    # The timed-out call had the server killed: its siblings' lost connections end first, and
    # follow from it. Elsewhere, the first failure names the drop.
    crash = EnvironmentFailure("environment_crash", "connection lost")
    timeout = EnvironmentTimeout("step took longer than 8 s")
    nested = BaseExceptionGroup("group", [crash, BaseExceptionGroup("inner", [asyncio.CancelledError(), timeout])])
    assert _failure(nested) is timeout
    error = EnvironmentFailure("environment_error", "a reply with role assistant")
    assert _failure(BaseExceptionGroup("group", [crash, error])) is crash
    assert _failure(BaseExceptionGroup("group", [ValueError("bad"), error])) is error


async def test_evaluation_plays_greedy_held_out_episodes(tokenizer):
    cfg = config()
    temperatures = []
    inner = solver(tokenizer)

    async def generate(prompt, **kwargs):
        temperatures.append(kwargs["temperature"])
        return await inner(prompt, **kwargs)

    source = source_over(generate, tokenizer, KnownAnswers(cfg.source.environment), cfg)
    with anyio.fail_after(10):
        result = await source.evaluate(4, 16)
    assert result["eval_accuracy"] == 1.0 and result["eval_size"] == 4 and result["eval_failed"] == 0
    assert set(temperatures) == {0.0}
    wrong = source_over(solver(tokenizer, wrong=True), tokenizer, KnownAnswers(cfg.source.environment), cfg)
    assert (await wrong.evaluate(4, 16))["eval_accuracy"] == 0.0


def test_calculator_tasks_are_a_function_of_seed_split_and_index():
    assert word_problem(1, "train", 3) == word_problem(1, "train", 3)
    train = {word_problem(1, "train", i)[0] for i in range(200)}
    held_out = {word_problem(1, "eval", i)[0] for i in range(200)}
    assert not train & held_out, "no held-out question is ever a training task"


async def test_an_environment_that_cannot_start_stops_the_start(tmp_path):
    with pytest.raises(ConfigError, match=r"adapter 'calculator'.*cannot start.*tool_bonus"):
        async with AsyncExitStack() as stack:
            await prepare_environment(config(args={"bonus": 1}).source, tmp_path, stack, max_seq_len=512,
                                      model_path=tmp_path)
