"""`EpisodeRunner`: plays multi-turn episodes against the policy's engines, token in / token out.

Each model turn is one `/v1/completions` request whose prompt is the episode's ids so far
(`InferenceClient.generate`); the ids the engine returns, their logprobs and the version that
sampled them are appended as they are (`Episode.add_model_turn`). The environment reads the turn's
text (the engine's own detokenisation), and answers with messages (tool results, user replies) or
with the end of the episode; its messages are rendered once by the chat template
(`ChatTurns.after_model_turn`) and appended as masked ids. Once the episode is over, the
environment gives its final reward. Each turn leases an engine of its own (`Policy.engine`), so a
long episode does not hold an engine between turns, and the prompt of every turn extends the
last one, which vLLM's prefix cache serves.

The environment sees every model turn, the last one too (its final reward may depend on it, and
an OpenEnv-style environment scores each step it is given). An episode ends when the environment
says so, after `max_turns` model turns (what the environment answers to the last one is not
appended), or when the next turn would have no room left in `max_episode_tokens` (the trainer's
`model.max_seq_len`).

Versions: each id carries the version that sampled it, as the engine reports it (vLLM's
token-in / token-out route labels every sampled id with the weight version of the forward pass
that produced it): a sync never waits for an episode or a long turn to end — the engines pause
between two tokens, take the weights and resume (`bridge` modes fence with `pause?mode=keep`) —
and a turn it interrupts trains with the old version on the ids before it and the new one after
(partial rollouts). An engine that reports no labels falls back to the older of the versions the
engine served when the request was sent and when it came back (`EngineLease.sampled_version`).

Every wait is bounded: an engine lease by `engine_wait_s`, a request by the client's timeout, an
environment call by `environment_timeout_s` (`EnvironmentTimeout`). A failed request or
environment call ends the episode (and the group) with the exception: a caller drops the group,
never half of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from jinja2 import TemplateError

from grpod.inference.policy import Policy
from grpod.rollouts.chat_turns import ChatTurns, Message
from grpod.rollouts.environments import (
    EnvironmentFailure,
    EnvironmentTimeout,
    TurnEnvironment,
    checked_reply,
    finite_number,
)
from grpod.rollouts.episode import Episode, episode_group
from grpod.rollouts.group import RolloutGroup


@dataclass(frozen=True)
class EpisodeLimits:
    """How an episode is sampled and how long it may grow."""

    temperature: float
    max_tokens: int  # per model turn
    max_turns: int  # model turns
    max_episode_tokens: int  # the whole sequence, prompt included
    top_p: float = 1.0


def _ids(what: str, render, *args) -> list[int]:
    """`render(*args)`: messages from the environment through the chat template into ids; one
    the template or the tokenizer cannot take (a lone surrogate, a template that rewrites
    earlier turns) is the environment's error, named."""
    try:
        return render(*args)
    except (TypeError, ValueError, TemplateError) as exc:  # a template's raise_exception: "roles must alternate"
        raise EnvironmentFailure(
            "environment_error", f"the environment's {what} cannot be rendered and tokenised: {type(exc).__name__}: "
            f"{str(exc)[:300]}"
        ) from None


def finite_reward(reward: object) -> float:
    """An environment's reward as a float: a finite real number (`finite_number`; a bool counts
    1 / 0, as TRL reads it), else the environment's error, named (a NaN reached the queue as a
    scored group)."""
    number = finite_number(reward)
    if number is None:
        raise EnvironmentFailure("environment_error", f"the environment's reward is {reward!r:.80}: not a finite number")
    return number


def opening_ids(turns: ChatTurns, messages: Sequence[Message], max_episode_tokens: int) -> list[int]:
    """The ids of an episode's opening `messages`: its first model turn's prompt. Opening messages
    that leave no room for a model turn within `max_episode_tokens` are an `EnvironmentFailure`
    "prompt_too_long" (refused by their length before rendering when no tokenisation could fit
    them). Every episode starts here, and `prepare_environment` asks it of task 0 before anything
    launches, so a task that can never fit stops the start instead of dropping every group."""
    if turns.too_long(messages, max_episode_tokens):
        raise EnvironmentFailure(
            "prompt_too_long",
            f"the episode's opening is {turns.chars(messages)} characters: more than "
            f"{max_episode_tokens} tokens of any text (model.max_seq_len / source.environment.max_episode_tokens)",
        )
    ids = _ids("opening", turns.prompt, messages)
    if len(ids) >= max_episode_tokens:
        raise EnvironmentFailure(
            "prompt_too_long",
            f"the episode's opening is {len(ids)} tokens: no room for a model turn within "
            f"{max_episode_tokens} (model.max_seq_len / source.environment.max_episode_tokens)",
        )
    return ids


class EpisodeRunner:
    def __init__(
        self,
        policy: Policy,
        turns: ChatTurns,
        limits: EpisodeLimits,
        *,
        engine_wait_s: float,
        environment_timeout_s: float,
    ) -> None:
        self.policy = policy
        self.turns = turns
        self.limits = limits
        self.engine_wait_s = engine_wait_s
        self.environment_timeout_s = environment_timeout_s

    async def _ask(self, what: str, call):
        try:
            with anyio.fail_after(self.environment_timeout_s):
                return await call
        except TimeoutError:
            raise EnvironmentTimeout(
                f"the environment's {what} took longer than {self.environment_timeout_s:g} s"
            ) from None

    async def play(self, messages: Sequence[Message], environment: TurnEnvironment, *, seed: int | None = None) -> Episode:
        """One episode from the conversation `messages` (module docstring); `seed` seeds turn k's
        sampling with `seed + k`."""
        limits = self.limits
        episode = Episode.start(opening_ids(self.turns, messages, limits.max_episode_tokens))
        for k in range(limits.max_turns):
            room = limits.max_episode_tokens - len(episode.tokens)
            if room < 1:
                episode.cut = True
                break
            async with self.policy.engine(self.engine_wait_s) as lease:
                (completion,) = await lease.client.generate(
                    episode.tokens,
                    n=1,
                    max_tokens=min(limits.max_tokens, room),
                    temperature=limits.temperature,
                    top_p=limits.top_p,
                    seed=None if seed is None else seed + k,
                    model=lease.model,
                    stop_token_ids=self.turns.stop_token_ids,
                    per_token_versions=True,
                )
                version = completion.versions or lease.sampled_version()
            episode.add_model_turn(completion.token_ids, completion.logprobs, version, completion.finish_reason)
            reply = await self._ask("reply", environment.respond(completion.text))
            if reply is None or k + 1 == limits.max_turns:
                break
            reply = checked_reply(reply, f"the environment's reply to turn {k + 1}")
            if self.turns.too_long(reply, limits.max_episode_tokens - len(episode.tokens)):
                episode.cut = True  # as below, decided before rendering or tokenising it: the reply may be megabytes
                break
            following = _ids(f"reply to turn {k + 1}", self.turns.after_model_turn, completion.token_ids, reply)
            if len(episode.tokens) + len(following) >= limits.max_episode_tokens:
                episode.cut = True  # no room for the next turn's first sampled id
                break
            episode.add_environment_turn(following)
        episode.reward = finite_reward(await self._ask("reward", environment.reward()))
        return episode

    async def play_group(
        self,
        messages: Sequence[Message],
        environments: Sequence[TurnEnvironment],
        *,
        group_id: str,
        source: str,
        seed: int | None = None,
    ) -> RolloutGroup:
        """One episode per environment from the same `messages`, played concurrently, as one group
        (episode i seeded with `seed + 1000 i`). Any episode's failure fails the group."""
        episodes: list[Episode | None] = [None] * len(environments)

        async def one(i: int, environment: TurnEnvironment) -> None:
            episodes[i] = await self.play(messages, environment, seed=None if seed is None else seed + 1000 * i)

        async with anyio.create_task_group() as tg:
            for i, environment in enumerate(environments):
                tg.start_soon(one, i, environment)
        return episode_group(
            episodes, temperature=self.limits.temperature, top_p=self.limits.top_p, source=source, group_id=group_id
        )
