"""The multi-turn driver over a scripted engine: every turn's prompt is the episode so far (the
engine's own ids, never re-tokenised text), tool turns are appended as rendered ids, versions come
from the lease, budgets end episodes, and every environment wait is bounded."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from grpod.inference.client import Completion
from grpod.models.tiny import build_tokenizer
from grpod.rollouts.chat_turns import ChatTurns
from grpod.rollouts.episode_runner import EnvironmentTimeout, EpisodeLimits, EpisodeRunner
from grpod.rollouts.validation import validate_group
from tests.rollouts.conftest import scripted_policy

USER = [{"role": "user", "content": "what is 3+4"}]


class FixedTool:
    """Replies with the next of `replies` after each model turn, then ends; reward = turns seen."""

    def __init__(self, replies: list[str], delay_s: float = 0.0) -> None:
        self.replies = list(replies)
        self.seen: list[str] = []
        self.delay_s = delay_s

    async def respond(self, text: str):
        await anyio.sleep(self.delay_s)
        self.seen.append(text)
        return [{"role": "tool", "content": self.replies.pop(0)}] if self.replies else None

    async def reward(self) -> float:
        return float(len(self.seen))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def runner_over(generate, tokenizer, *, version=3, environment_timeout_s=5.0, **limits):
    policy, engine = scripted_policy(SimpleNamespace(generate=generate), version=version)
    limits = {"temperature": 0.9, "max_tokens": 4, "max_turns": 3, "max_episode_tokens": 200} | limits
    runner = EpisodeRunner(
        policy, ChatTurns(tokenizer), EpisodeLimits(**limits), engine_wait_s=5.0,
        environment_timeout_s=environment_timeout_s,
    )
    return runner, engine


def test_each_turn_is_given_the_episode_so_far_and_tool_turns_are_appended_as_ids(tokenizer):
    prompts, replies = [], iter([[5, 6, 2], [7, 8, 9, 10], [11, 2]])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(prompt, **kwargs):
        prompts.append((list(prompt), kwargs))
        ids = next(replies)
        if len(prompts) == 2:
            engine.version = 4  # a sync lands while the second turn runs: it counts as version 3
        return [Completion(ids, [-0.1 * (i + 1) for i in range(len(ids))], "stop" if ids[-1] == end else "length", "x")]

    runner, engine = runner_over(generate, tokenizer)
    tool = FixedTool(["12", "19", "never appended"])
    episode = anyio.run(lambda: runner.play(USER, tool, seed=40))

    turns = ChatTurns(tokenizer)
    first_prompt = turns.prompt(USER)
    after_first = turns.after_model_turn([5, 6, 2], [{"role": "tool", "content": "12"}])
    after_second = turns.after_model_turn([7, 8, 9, 10], [{"role": "tool", "content": "19"}])
    assert [p for p, _ in prompts] == [
        first_prompt,
        first_prompt + [5, 6, 2] + after_first,
        first_prompt + [5, 6, 2] + after_first + [7, 8, 9, 10] + after_second,
    ]
    assert episode.tokens == prompts[-1][0] + [11, 2]
    assert [kw["seed"] for _, kw in prompts] == [40, 41, 42]
    assert all(kw["stop_token_ids"] == [end] and kw["temperature"] == 0.9 for _, kw in prompts)
    assert [episode.sampled_by(t) for t in episode.turns] == [[5, 6, 2], [7, 8, 9, 10], [11, 2]]
    assert sum(episode.loss_mask) == 9 and episode.versions[-1] == 4
    assert [episode.versions[t.start] for t in episode.turns] == [3, 3, 4]
    # The environment saw all three turns (its reward may need the last); the third is the last
    # allowed, so nothing follows it.
    assert tool.seen == ["x", "x", "x"] and episode.reward == 3.0


def test_a_group_of_episodes_trains_as_one_rollout_group(tokenizer):
    async def generate(prompt, **kwargs):
        return [Completion([5, 2], [-0.5, -0.5], "stop", "x")]

    runner, _ = runner_over(generate, tokenizer, max_turns=2)
    group = anyio.run(lambda: runner.play_group(USER, [FixedTool(["1"]), FixedTool([])], group_id="t-0", source="env"))
    assert group.scores == [2.0, 1.0] and group.policy_version == 3 and group.group_id == "t-0"
    assert [sum(m) for m in group.loss_mask] == [4, 2]  # the second environment ended after turn one
    assert validate_group(group, vocab_size=len(tokenizer), max_seq_len=200, group_normalised=True) is None


def test_the_episode_token_budget_bounds_every_turn(tokenizer):
    asked = []

    async def generate(prompt, *, max_tokens, **kwargs):
        asked.append(max_tokens)
        return [Completion([5] * max_tokens, [-1.0] * max_tokens, "length", "x")]

    prompt_len = len(ChatTurns(tokenizer).prompt(USER))
    runner, _ = runner_over(generate, tokenizer, max_tokens=8, max_episode_tokens=prompt_len + 3)
    episode = anyio.run(lambda: runner.play(USER, FixedTool(["1", "2"])))
    assert asked == [3] and len(episode.tokens) == prompt_len + 3 and episode.truncated


def test_an_environment_that_does_not_answer_ends_the_episode_with_a_clear_error(tokenizer):
    async def generate(prompt, **kwargs):
        return [Completion([5, 2], [-0.5, -0.5], "stop", "x")]

    runner, _ = runner_over(generate, tokenizer, environment_timeout_s=0.05)
    with pytest.raises(EnvironmentTimeout, match="reply took longer than 0.05 s"):
        anyio.run(lambda: runner.play(USER, FixedTool(["1"], delay_s=5.0)))


def test_a_reply_or_opening_of_megabytes_is_refused_without_being_tokenised(tokenizer):
    """An environment's 8 MB tool output cannot fit in the room left: the episode ends before it,
    decided from its length (tokenising it took 12 s on the event loop, and gigabytes); an opening
    of 8 MB is prompt_too_long the same way. A reply that fits is still appended."""
    from grpod.rollouts.environments import EnvironmentFailure

    async def generate(prompt, **kwargs):
        return [Completion([5, 2], [-0.5, -0.5], "stop", "x")]

    runner, _ = runner_over(generate, tokenizer, max_turns=3)
    encoded = []
    real_encode = runner.turns.encode
    runner.turns.encode = lambda text: encoded.append(len(text)) or real_encode(text)
    huge = "tool output " * 700_000
    episode = anyio.run(lambda: runner.play(USER, FixedTool([huge, "1"])))
    assert encoded == [] and len(episode.tokens) == len(runner.turns.prompt(USER)) + 2
    assert runner.turns.too_long([{"role": "tool", "content": "x" * 100}], 100) is False
    with pytest.raises(EnvironmentFailure, match="opening is 8400004 characters") as failure:
        anyio.run(lambda: runner.play([{"role": "user", "content": huge + "5+5="}], FixedTool([])))
    assert failure.value.reason == "prompt_too_long"
    fits = anyio.run(lambda: runner.play(USER, FixedTool(["12"])))
    assert encoded and len(fits.tokens) > len(episode.tokens)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ([{"role": "tool", "content": "bad \ud800 surrogate"}], "reply to turn 1 cannot be rendered and tokenised"),
        ([{"role": "assistant", "content": "I answer for the model"}], "reply message 0 has role 'assistant'"),
        ([{"role": "system", "content": "new rules"}], "has role 'system'"),
        ("just text", "its reply is str 'just text'"),
        ([{"role": "tool", "content": 12}], "reply message 0 is {'role': 'tool', 'content': 12}"),
    ],
)
def test_a_reply_the_template_cannot_take_or_that_speaks_as_the_model_is_the_environments_error(tokenizer, reply, expected):
    """Every adapter's replies are checked in one place: a lone surrogate reached the tokenizer
    and failed as a bare TypeError; a verifiers reply with role assistant was appended as if the
    environment could speak for the model."""
    from grpod.rollouts.environments import EnvironmentFailure

    async def generate(prompt, **kwargs):
        return [Completion([5, 2], [-0.5, -0.5], "stop", "x")]

    class Replies(FixedTool):
        async def respond(self, text):
            self.seen.append(text)
            return reply

    runner, _ = runner_over(generate, tokenizer)
    with pytest.raises(EnvironmentFailure) as failure:
        anyio.run(lambda: runner.play(USER, Replies([])))
    assert failure.value.reason == "environment_error" and expected in str(failure.value), str(failure.value)


async def stops_after_two_ids(prompt, **kwargs):
    """A scripted engine's turn: two ids, the second ending the turn."""
    return [Completion([5, 2], [-0.5, -0.5], "stop", "x")]


def test_a_reply_of_many_empty_messages_is_refused_without_being_rendered_and_the_cut_episode_is_truncated(tokenizer):
    """100,000 empty messages weighed 0 characters: they passed the size guard and were rendered
    and tokenised on the event loop (2.8 s) before being thrown away. An episode the budget ends
    while the environment would go on is unfinished: `mask_truncated` must not train it as done."""
    class Empties(FixedTool):
        async def respond(self, text: str):
            self.seen.append(text)
            return [{"role": "tool", "content": ""}] * 100_000

    runner, _ = runner_over(stops_after_two_ids, tokenizer, max_turns=3)
    rendered = []
    runner.turns.after_model_turn = lambda *args: rendered.append(args) or []
    episode = anyio.run(lambda: runner.play(USER, Empties([])))
    assert rendered == [] and episode.cut and episode.truncated
    finished = anyio.run(lambda: runner.play(USER, FixedTool([])))  # the environment ended it: complete
    assert not finished.cut and not finished.truncated


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), None, "1.0", 10**400])
def test_a_reward_that_is_not_a_finite_number_is_the_environments_error(tokenizer, reward):
    """verifiers passed a NaN reward through: the group counted as scored (the source alarm's run
    of failures reset), then validation or dynamic sampling threw it away, naming no environment."""
    from grpod.rollouts.environments import EnvironmentFailure

    class Scores(FixedTool):
        async def reward(self):
            return reward

    runner, _ = runner_over(stops_after_two_ids, tokenizer)
    with pytest.raises(EnvironmentFailure, match="the environment's reward is .*: not a finite number") as failure:
        anyio.run(lambda: runner.play(USER, Scores([])))
    assert failure.value.reason == "environment_error"


def test_a_true_reward_counts_one_and_a_template_that_refuses_a_role_is_the_environments_error(tokenizer):
    from jinja2 import TemplateError

    from grpod.rollouts.environments import EnvironmentFailure

    class Passes(FixedTool):
        async def reward(self):
            return True

    runner, _ = runner_over(stops_after_two_ids, tokenizer)
    assert anyio.run(lambda: runner.play(USER, Passes([]))).reward == 1.0

    def refuses(*args):  # Gemma's and Mistral's templates raise_exception on roles they do not take
        raise TemplateError("Only user and assistant roles are supported!")

    runner.turns.after_model_turn = refuses
    with pytest.raises(EnvironmentFailure, match="reply to turn 1 cannot be rendered.*TemplateError: Only user") as failure:
        anyio.run(lambda: runner.play(USER, FixedTool(["12"])))
    assert failure.value.reason == "environment_error"
