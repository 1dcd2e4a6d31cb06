"""`RolloutGroup`: the one record every rollout source produces and the trainer consumes.

A group is `k` completions of one prompt, scored. Positions are aligned across the per-sequence
lists: `tokens[i][t]`, `loss_mask[i][t]` (1 where the token is a completion token the loss uses),
`inference_logprobs[i][t]` (the logprob vLLM reported for `tokens[i][t]` given `tokens[i][:t]`;
meaningless where `loss_mask` is 0). Logprobs are the temperature-processed ones
(`--logprobs-mode processed_logprobs`): the trainer divides its logits by `temperature` to compute
the same quantity (see `grpod.training.logprobs`).

A sequence may be a whole multi-turn episode (`grpod.rollouts.episode`): model turns interleaved
with tool or user turns, the latter masked out. Its tokens may then come from several policy
versions: `token_versions[i][t]` is the version that sampled `tokens[i][t]` (meaningless, and 0,
where `loss_mask` is 0). Without it every token is taken to be `policy_version`'s. What the
staleness bound reads is `oldest_version`: the oldest version any loss token was sampled by.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RolloutGroup:
    tokens: list[list[int]]
    loss_mask: list[list[int]]
    scores: list[float]
    inference_logprobs: list[list[float]] | None = None
    # Advantages computed by the source (used only when train.advantages.use_source_advantages).
    advantages: list[float] | None = None
    # Per-sequence overrides, e.g. {"set_advantage_to_zero": true}.
    overrides: list[dict[str, Any]] | None = None
    # True where a completion hit max_tokens without finishing.
    truncated: list[bool] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # The policy version the completions were generated under (the oldest, if they span several).
    policy_version: int = 0
    # Per sequence, per token: the policy version that sampled it (None: all `policy_version`).
    token_versions: list[list[int]] | None = None
    source: str = "builtin"
    group_id: str = ""
    # Staleness-policy weight (1.0 = full weight; set when stale groups are down-weighted).
    weight: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(seq) for seq in self.tokens)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that sampled a loss token (`policy_version` without
        `token_versions`, or when no sequence has a loss token). Call on validated groups only."""
        if self.token_versions is None:
            return self.policy_version
        sampled = [
            version
            for versions, mask in zip(self.token_versions, self.loss_mask, strict=True)
            for version, m in zip(versions, mask, strict=True)
            if m
        ]
        return min(sampled, default=self.policy_version)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutGroup:
        return cls(**data)
