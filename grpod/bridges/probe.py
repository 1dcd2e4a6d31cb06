"""The alignment probe: proof that vLLM serves the weights the trainer holds.

After every sync, vLLM scores fixed probe sequences (prompt logprobs) and the trainer scores the
same sequences in fp32; the differences must stay under the tolerance. A larger one means the
sync did not take (or took half), and the bridge moves to FAILED instead of letting training
continue on silently wrong weights.

The tolerance knows the serving dtype (`ProbeTolerance.for_serving`). fp32 serving: the largest
absolute difference <= `bridge.probe_tolerance` (0.02; measured ~5e-6 when the weights agree).
bf16/fp16 serving of the same weights differs per token by rounding alone, so the criterion is the
mean and the 95th percentile of |diff|. Measured here (tiny model, real vLLM bf16 on CPU vs the
fp32 trainer, 65 probe positions): same weights mean 0.028, p95 0.104, max 0.181; one missed
training step at lr 1e-4 mean 0.168, p95 0.60 (max 0.85). Defaults: mean <= 0.07, p95 <= 0.3.

The trainer's scores at a successful probe are the reference of that policy version: a vLLM
relaunched on the same version's weights (crash recovery) is probed against them, so the probe
never needs the trainer's live weights, which may have moved on since the last sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

PROBE_TEXTS = (
    "<|im_start|>user\n17+25<|im_end|>\n<|im_start|>assistant\n42<|im_end|>",
    "<|im_start|>user\n93-48<|im_end|>\n<|im_start|>assistant\n45<|im_end|>",
    "what is the sum of 3 and 4? it is 7.",
)


class ProbeMismatch(RuntimeError):
    """vLLM and the trainer disagree on the probe beyond the tolerance."""


INF = float("inf")


@dataclass(frozen=True)
class ProbeTolerance:
    """Bounds on |vLLM - trainer| over the probe positions (inf = not checked)."""

    max_abs: float = INF
    mean_abs: float = INF
    p95_abs: float = INF

    @classmethod
    def for_serving(cls, dtype: str, bridge_cfg) -> ProbeTolerance:
        if dtype == "float32":
            return cls(max_abs=bridge_cfg.probe_tolerance)
        return cls(mean_abs=bridge_cfg.probe_low_precision_mean, p95_abs=bridge_cfg.probe_low_precision_p95)

    def describe(self) -> str:
        parts = [f"{name} <= {value}" for name, value in (("max", self.max_abs), ("mean", self.mean_abs), ("p95", self.p95_abs)) if value < INF]
        return ", ".join(parts)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


@dataclass
class ProbeResult:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    tolerance: ProbeTolerance
    # The trainer's scores the probe compared against, one list per probe sequence.
    reference: list[list[float]] = field(default_factory=list, repr=False)
    p95_abs_diff: float = 0.0

    @property
    def ok(self) -> bool:
        t = self.tolerance
        return self.max_abs_diff <= t.max_abs and self.mean_abs_diff <= t.mean_abs and self.p95_abs_diff <= t.p95_abs

    def as_dict(self) -> dict:
        return {
            "max_abs_diff": round(self.max_abs_diff, 6),
            "mean_abs_diff": round(self.mean_abs_diff, 6),
            "p95_abs_diff": round(self.p95_abs_diff, 6),
            "tokens": self.tokens,
            "tolerance": self.tolerance.describe(),
            "ok": self.ok,
        }


def probe_sequences(tokenizer) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXTS]


def trainer_scores(trainer) -> list[list[float]]:
    """The trainer's scores of the probe sequences with its weights now (blocking: run it in a
    thread); what a probe of these weights compares vLLM with."""
    return [trainer.score(ids) for ids in probe_sequences(trainer.tokenizer)]


async def run_probe(
    client,
    trainer,
    *,
    model: str,
    tolerance: ProbeTolerance,
    timeout_s: float,
    reference: list[list[float]] | None = None,
) -> ProbeResult:
    """Score the probe sequences with vLLM and compare with the trainer's scores now, or with
    `reference` (an earlier probe's `reference`, for the weights vLLM should be serving)."""
    sequences = probe_sequences(trainer.tokenizer)
    served: list[list[float]] = []

    async def score_served() -> None:
        served.extend(await client.score_many(sequences, model=model))

    # vLLM scores the sequences (one request) while the trainer scores them in its thread.
    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as group:
            group.start_soon(score_served)
            own = reference
            if own is None:
                own = await anyio.to_thread.run_sync(trainer_scores, trainer)
    diffs: list[float] = []
    for vllm_scores, own_scores in zip(served, own, strict=True):
        if len(vllm_scores) != len(own_scores):
            raise ProbeMismatch(f"probe length differs: vLLM {len(vllm_scores)} positions, trainer {len(own_scores)}")
        diffs.extend(abs(a - b) for a, b in zip(vllm_scores, own_scores, strict=True))
    return ProbeResult(
        max(diffs), sum(diffs) / len(diffs), len(diffs), tolerance, [list(s) for s in own], p95_abs_diff=_p95(diffs)
    )
