"""`RolloutGroup`: the one record every rollout source produces and the trainer consumes.

A group is `k` completions of one prompt, scored. Positions are aligned across the per-sequence
lists: `tokens[i][t]`, `loss_mask[i][t]` (1 where the token is a completion token the loss uses),
`inference_logprobs[i][t]` (the logprob vLLM reported for `tokens[i][t]` given `tokens[i][:t]`;
meaningless where `loss_mask` is 0). Logprobs are the temperature-processed ones
(`--logprobs-mode processed_logprobs`): the trainer divides its logits by `temperature` to compute
the same quantity (see `grpod.training.logprobs`).
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutGroup:
        return cls(**data)
