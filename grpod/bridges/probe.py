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
import structlog

log = structlog.get_logger(__name__)

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


async def probe_engines(
    engines,
    trainer,
    *,
    model: str,
    tolerance: ProbeTolerance,
    timeout_s: float,
    reference: list[list[float]] | None,
    version: int,
) -> ProbeResult:
    """Probe each engine (its `client`) against `reference`, else the trainer's weights now (then
    the first engine's reference serves the others). Raises ProbeMismatch naming the first engine
    that fails; returns the last result."""
    result: ProbeResult | None = None
    for engine in engines:
        result = await run_probe(
            engine.client, trainer, model=model, tolerance=tolerance, timeout_s=timeout_s, reference=reference
        )
        log.info("engine_probed", engine=engine.name, version=version, ok=result.ok, **{
            k: v for k, v in result.as_dict().items() if k.endswith("_diff")
        })
        if not result.ok:
            raise ProbeMismatch(
                f"alignment probe failed on {engine.name}: vLLM's logprobs differ from the trainer's by up to "
                f"{result.max_abs_diff:.4g} (mean {result.mean_abs_diff:.4g}, p95 {result.p95_abs_diff:.4g}; "
                f"tolerance {result.tolerance.describe()}); vLLM is not serving the "
                f"trainer's weights (policy version {version})"
            )
        reference = result.reference
    assert result is not None, "no engine to probe"
    return result


class ProbeSchedule:
    """Which syncs are probed, and the reference a relaunched engine is probed against.

    `bridge.probe_every = N` probes every N-th sync; the first sync after any engine launch is
    always probed (`launched`). Every sync, probed or not, records the trainer's scores of its
    version (`record`): a relaunch between syncs (crash recovery) is probed against them, never
    against the trainer's live weights, which may have moved on since.
    """

    def __init__(self, bridge_cfg) -> None:
        self.cfg = bridge_cfg  # live: probe_every may change while running
        self.unprobed = 0
        self.launched_since_probe = True
        self._reference: tuple[int, list[list[float]]] | None = None

    def launched(self) -> None:
        self.launched_since_probe = True

    def due(self) -> bool:
        return self.launched_since_probe or self.unprobed + 1 >= self.cfg.probe_every

    def probed(self, version: int, reference: list[list[float]]) -> None:
        self.launched_since_probe, self.unprobed = False, 0
        self._reference = (version, reference)

    def skipped(self, version: int, reference: list[list[float]]) -> None:
        self.unprobed += 1
        self._reference = (version, reference)

    def reference_for(self, version: int) -> list[list[float]] | None:
        """The trainer's scores recorded at `version`'s sync (None: none recorded)."""
        if self._reference is None or self._reference[0] != version:
            return None
        return self._reference[1]
