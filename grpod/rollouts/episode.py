"""`Episode`: a multi-turn trajectory kept as the engine's own token ids, and its training sequence.

Token in / token out. An episode is one growing list of token ids. Each model turn gives the
engine the whole list so far as its prompt and appends exactly the ids it sampled, with the
logprob it sampled each with and the policy version that sampled it. Each tool or user turn is
appended as ids rendered once (`grpod.rollouts.chat_turns.ChatTurns`) and masked out of the loss.
Nothing is ever decoded and tokenised again: the text of a model turn is for the environment to
read, never the source of what the trainer trains on. A re-rendering of the conversation's text
through the chat template can differ from what the model actually saw and sampled (special tokens
the detokeniser drops, merges a tokeniser makes across turn boundaries, templates that rewrite
earlier turns): the trainer would then compute logprobs of a sequence no engine sampled.

What an episode guarantees, by construction:
- `tokens`, `loss_mask`, `logprobs` and `versions` have one entry per token;
- `loss_mask[t] == 1` exactly at the ids a model turn sampled; `logprobs[t]` and `versions[t]` are
  then the engine's logprob and the version that sampled `tokens[t]` (0.0 and 0 elsewhere);
- model turn k was given `tokens[:turns[k].start]` and sampled `tokens[turns[k].start:turns[k].end]`,
  and every later token comes after it (the prompt of turn k+1 extends turn k's prompt and ids).

One episode is one training sequence; a group of episodes of one task, scored by their final
rewards, is one `RolloutGroup` (`episode_group`), whose advantages are the group's as for any
other source. A single completion is a one-turn episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grpod.rollouts.group import RolloutGroup


class EpisodeError(ValueError):
    """An episode built against its rules (an empty prompt, ids without logprobs, no reward)."""


@dataclass(frozen=True)
class ModelTurn:
    """Where one model turn sits in its episode: its prompt was `tokens[:start]`, its sampled ids
    are `tokens[start:end]`, `version` the oldest policy version that sampled them (kept for an
    empty turn too); `finish_reason` is the engine's (`length`: cut off at max_tokens)."""

    start: int
    end: int
    version: int
    finish_reason: str | None


@dataclass
class Episode:
    """One trajectory (module docstring); build it with `start`, `add_model_turn` and
    `add_environment_turn`, set `reward` when the environment has scored it."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[ModelTurn] = field(default_factory=list)
    reward: float | None = None
    # Ended by the episode's token budget while the environment would have gone on (its reply, or
    # the next turn, did not fit): unfinished, like a model turn cut off at max_tokens.
    cut: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, prompt_ids: Sequence[int]) -> Episode:
        """An episode whose first model turn will be given `prompt_ids` (not trained on)."""
        if not prompt_ids:
            raise EpisodeError("an episode needs a non-empty prompt: no token precedes the first sampled one")
        n = len(prompt_ids)
        return cls(tokens=list(prompt_ids), loss_mask=[0] * n, logprobs=[0.0] * n, versions=[0] * n)

    def add_model_turn(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        version: int | Sequence[int],
        finish_reason: str | None = None,
    ) -> ModelTurn:
        """Append the ids the engine sampled given `tokens` as they were, with their logprobs and
        the version that sampled them (one for the turn, or one per id when the weights changed
        while it ran)."""
        if isinstance(version, int):
            versions, oldest = [version] * len(token_ids), version
        elif version:
            versions = list(version)
            oldest = min(versions)
        else:
            raise EpisodeError("an empty model turn names the version that ran it as one int")
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise EpisodeError(
                f"a model turn of {len(token_ids)} ids has {len(logprobs)} logprobs and {len(versions)} versions"
            )
        turn = ModelTurn(len(self.tokens), len(self.tokens) + len(token_ids), oldest, finish_reason)
        self.tokens += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += [float(lp) for lp in logprobs]
        self.versions += versions
        self.turns.append(turn)
        return turn

    def add_environment_turn(self, token_ids: Sequence[int]) -> None:
        """Append ids that no model turn sampled (a tool's or user's rendered message, the closing
        of the model's turn, the next turn's opening): in the next prompt, out of the loss."""
        n = len(token_ids)
        self.tokens += token_ids
        self.loss_mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [0] * n

    def prompt_of(self, turn: ModelTurn) -> list[int]:
        """The ids `turn` was given."""
        return self.tokens[: turn.start]

    def sampled_by(self, turn: ModelTurn) -> list[int]:
        """The ids `turn` sampled."""
        return self.tokens[turn.start : turn.end]

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def truncated(self) -> bool:
        """True when the last model turn was cut off at its token budget, or the episode at its
        (`cut`): `train.loss.mask_truncated` trains neither."""
        return self.cut or (bool(self.turns) and self.turns[-1].finish_reason == "length")

    @property
    def oldest_version(self) -> int | None:
        """The oldest version that sampled one of its model turns (None before the first)."""
        return min((turn.version for turn in self.turns), default=None)


def episode_group(
    episodes: Sequence[Episode],
    *,
    temperature: float,
    top_p: float,
    source: str,
    group_id: str,
    extra: dict[str, Any] | None = None,
    overrides: list[dict[str, Any]] | None = None,
) -> RolloutGroup:
    """The `RolloutGroup` of a task's episodes: one training sequence each, scored by its final
    reward, `policy_version` the oldest version of any sampled id. `token_versions` is written
    only when the sampled ids span several versions: without it every loss token is
    `policy_version`'s, which is then exact (and a one-version group, the common case, keeps the
    size and the wire shape it always had)."""
    if not episodes:
        raise EpisodeError(f"group {group_id!r} has no episodes")
    unscored = [i for i, e in enumerate(episodes) if e.reward is None]
    if unscored:
        raise EpisodeError(f"group {group_id!r}: episodes {unscored} have no reward; score every episode first")
    sampled = {v for e in episodes for v, m in zip(e.versions, e.loss_mask, strict=True) if m}
    oldest = [e.oldest_version for e in episodes if e.oldest_version is not None]
    return RolloutGroup(
        tokens=[list(e.tokens) for e in episodes],
        loss_mask=[list(e.loss_mask) for e in episodes],
        scores=[float(e.reward) for e in episodes],
        inference_logprobs=[list(e.logprobs) for e in episodes],
        truncated=[e.truncated for e in episodes],
        temperature=temperature,
        top_p=top_p,
        policy_version=min(oldest, default=0),
        token_versions=[list(e.versions) for e in episodes] if len(sampled) > 1 else None,
        source=source,
        group_id=group_id,
        extra=dict(extra or {}),
        overrides=overrides,
    )
