"""The alignment probe: proof that vLLM serves the weights the trainer holds.

After every sync, vLLM scores fixed probe sequences (prompt logprobs) and the trainer scores the
same sequences in fp32; the largest absolute difference must stay under the tolerance. A larger
one means the sync did not take (or took half), and the bridge moves to FAILED instead of letting
training continue on silently wrong weights.

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


@dataclass
class ProbeResult:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    tolerance: float
    # The trainer's scores the probe compared against, one list per probe sequence.
    reference: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def as_dict(self) -> dict:
        return {
            "max_abs_diff": round(self.max_abs_diff, 6),
            "mean_abs_diff": round(self.mean_abs_diff, 6),
            "tokens": self.tokens,
            "tolerance": self.tolerance,
            "ok": self.ok,
        }


def probe_sequences(tokenizer) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXTS]


def trainer_scores(trainer) -> list[list[float]]:
    """The trainer's scores of the probe sequences with its weights now (blocking: run it in a
    thread); what a probe of these weights compares vLLM with."""
    return [trainer.score(ids) for ids in probe_sequences(trainer.tokenizer)]


async def run_probe(
    client, trainer, *, model: str, tolerance: float, timeout_s: float, reference: list[list[float]] | None = None
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
    return ProbeResult(max(diffs), sum(diffs) / len(diffs), len(diffs), tolerance, [list(s) for s in own])
