"""The GRPO policy loss as pure functions of per-token tensors.

Every tensor here is flat: one entry per loss token (a completion token at position t >= 1 whose
loss-mask entry is 1), gathered from the padded micro-batch, so padding never enters the maths.
For loss token t with advantage A (its sequence's), current logprob logp, and

    r   = exp(logp - logp_old)                                    policy ratio
    w   = min(exp(logp_old - logp_inf), C)   (detached)           truncated importance weight
    kl  = exp(logp_ref - logp) - (logp_ref - logp) - 1            k3 estimator of KL(pi || ref)

the per-token loss is

    l_t = -w * S(r, A) + beta * kl,    S(r, A) = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

and the step's loss is  L = sum_t c_t l_t  with the aggregation coefficient c_t:

    token_mean               c_t = 1 / N_tok          N_tok: loss tokens in the whole step
    seq_mean_token_mean      c_t = 1 / (N_seq n_s)    n_s: loss tokens of t's sequence s
    seq_mean_token_sum_norm  c_t = 1 / (N_seq M)      M: a constant, the completion budget (Dr. GRPO)

N_tok and N_seq count the WHOLE step (`StepNormalizer`), not the micro-batch, so the sum of the
micro-batches' losses is L and gradient accumulation gives exactly the big-batch gradient.

What "old" means. grpod takes one optimizer step per batch, so the policy before the step, pi_old,
is the trainer's current weights: logp_old = logp.detach() and r = 1 in value, with gradient
d r = d logp. The clip therefore never binds in this trainer (it would with several updates per
batch, and `clipped_surrogate` is correct for that case). What does differ from pi_old is the
policy that generated the tokens: vLLM's logprobs logp_inf reflect both the inference/trainer
numerical mismatch and staleness (async rollouts from older versions). That off-policy gap is
corrected by the truncated importance weight w (Yao et al., "truncated importance sampling"), cut
at C = `tis_cap` so that one token vLLM found unlikely cannot dominate the step; `tis_cap = None`
switches the correction off. Tokens without inference logprobs (a source that sent none) get
w = 1 and no KL-to-inference term.

Clipping for both signs (the seed trainer inverted it for A < 0). The clipped term is selected,
and the gradient is exactly zero, only where the update would push r further out of the trust
region: A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low. Everywhere else S = r A.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from grpod.config import LossConfig


@dataclass(frozen=True)
class StepNormalizer:
    """The loss normalisers of one optimizer step, computed over all of its sequences up front."""

    loss_tokens: int
    sequences: int
    max_tokens: int

    @classmethod
    def for_step(cls, loss_tokens_per_sequence: Sequence[int], max_tokens: int) -> StepNormalizer:
        """Sequences without a loss token contribute nothing and are not counted."""
        counted = [n for n in loss_tokens_per_sequence if n > 0]
        return cls(loss_tokens=sum(counted), sequences=len(counted), max_tokens=max_tokens)


def masked_for_truncation(loss_mask: list[int], truncated: bool, mask_truncated: bool) -> list[int]:
    """The loss mask to train on: all zeros for a truncated completion when `mask_truncated`.

    A completion cut off at max_tokens has no verified ending; its score says little about its
    tokens (DAPO's overlong filtering). Masked sequences also leave the step's normalisers.
    """
    if truncated and mask_truncated:
        return [0] * len(loss_mask)
    return loss_mask


def aggregation_weights(
    aggregation: str, sequence_loss_tokens: Tensor, normalizer: StepNormalizer
) -> Tensor:
    """The coefficient c_t of each loss token; `sequence_loss_tokens[t]` is n_s of t's sequence."""
    n_s = sequence_loss_tokens.to(torch.float32)
    if aggregation == "token_mean":
        return torch.full_like(n_s, 1.0 / max(normalizer.loss_tokens, 1))
    if aggregation == "seq_mean_token_mean":
        return 1.0 / (max(normalizer.sequences, 1) * n_s)
    if aggregation == "seq_mean_token_sum_norm":
        return torch.full_like(n_s, 1.0 / (max(normalizer.sequences, 1) * normalizer.max_tokens))
    raise ValueError(
        f"unknown loss aggregation {aggregation!r}: use token_mean, seq_mean_token_mean or seq_mean_token_sum_norm"
    )


@dataclass
class Surrogate:
    objective: Tensor  # S(r, A) per token, to be maximised
    ratio: Tensor  # r, detached
    clipped_low: Tensor  # bool: A < 0 and r < 1 - eps_low (zero gradient)
    clipped_high: Tensor  # bool: A > 0 and r > 1 + eps_high (zero gradient)


def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> Surrogate:
    """PPO's clipped objective min(r A, clip(r) A) written as a selection, so that the gradient is
    exactly zero where the clip binds and exactly d(r A) elsewhere (equal in value to the min)."""
    ratio = torch.exp(logprobs - old_logprobs)
    r = ratio.detach()
    clipped_high = (advantages > 0) & (r > 1 + clip_high)
    clipped_low = (advantages < 0) & (r < 1 - clip_low)
    bound = r.clamp(1 - clip_low, 1 + clip_high)
    objective = torch.where(clipped_high | clipped_low, bound * advantages, ratio * advantages)
    return Surrogate(objective, r, clipped_low, clipped_high)


def k3_kl(logprobs: Tensor, reference_logprobs: Tensor) -> Tensor:
    """k3 estimate of KL(pi || ref) per token: exp(d) - d - 1, d = logp_ref - logp (>= 0, unbiased)."""
    d = reference_logprobs - logprobs
    return torch.exp(d) - d - 1


def tis_weights(old_logprobs: Tensor, inference_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance weight min(pi_old / pi_inf, cap) per token, detached."""
    return torch.exp(old_logprobs - inference_logprobs).clamp(max=cap).detach()


@dataclass
class LossTokens:
    """Per-token inputs of `policy_loss`, all `[n]` over the micro-batch's loss tokens.

    `inference_logprobs` holds NaN for tokens whose source sent none. `reference_logprobs` is the
    frozen reference model's (used when `kl_reference = "model"`). `entropy` is a diagnostic only.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    weights: Tensor
    inference_logprobs: Tensor | None = None
    reference_logprobs: Tensor | None = None
    entropy: Tensor | None = None


_EXTREMES = {"ratio_min": min, "ratio_max": max, "diff_abs_max": max}


@dataclass
class LossStats:
    """Sums, counts and extremes over loss tokens; merge micro-batches, then `as_metrics`."""

    loss: float = 0.0
    tokens: int = 0
    ratio_sum: float = 0.0
    ratio_min: float = float("inf")
    ratio_max: float = float("-inf")
    clipped_low: int = 0
    clipped_high: int = 0
    kl_sum: float = 0.0
    kl_tokens: int = 0
    entropy_sum: float = 0.0
    entropy_tokens: int = 0
    diff_sum: float = 0.0
    diff_abs_sum: float = 0.0
    diff_abs_max: float = 0.0
    diff_tokens: int = 0
    tis_sum: float = 0.0
    tis_capped: int = 0
    tis_tokens: int = 0

    def merge(self, other: LossStats) -> None:
        for f in fields(self):
            combine = _EXTREMES.get(f.name)
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, combine(mine, theirs) if combine else mine + theirs)

    def as_metrics(self) -> dict[str, float]:
        def mean(total: float, count: int) -> float:
            return total / count if count else float("nan")

        return {
            "loss": self.loss,
            "loss_tokens": float(self.tokens),
            "ratio_mean": mean(self.ratio_sum, self.tokens),
            "ratio_min": self.ratio_min if self.tokens else float("nan"),
            "ratio_max": self.ratio_max if self.tokens else float("nan"),
            "clipped_low_fraction": mean(self.clipped_low, self.tokens),
            "clipped_high_fraction": mean(self.clipped_high, self.tokens),
            "kl": mean(self.kl_sum, self.kl_tokens),
            "entropy": mean(self.entropy_sum, self.entropy_tokens),
            "logprob_diff_mean": mean(self.diff_sum, self.diff_tokens),
            "logprob_diff_abs_mean": mean(self.diff_abs_sum, self.diff_tokens),
            "logprob_diff_max": self.diff_abs_max if self.diff_tokens else float("nan"),
            "tis_weight_mean": mean(self.tis_sum, self.tis_tokens),
            "tis_capped_fraction": mean(self.tis_capped, self.tis_tokens),
        }


def policy_loss(tokens: LossTokens, cfg: LossConfig) -> tuple[Tensor, LossStats]:
    """This micro-batch's share of the step loss, sum_t c_t l_t (see the module docstring)."""
    logp, old = tokens.logprobs, tokens.old_logprobs
    surrogate = clipped_surrogate(logp, old, tokens.advantages, cfg.clip_low, cfg.clip_high)
    per_token = -surrogate.objective
    stats = LossStats(tokens=logp.numel())

    inference = tokens.inference_logprobs
    has_inference = None
    if inference is not None:
        has_inference = ~torch.isnan(inference)
        # Missing values take pi_old's, so w = 1 and the KL term is 0 there (and no NaN reaches
        # a gradient through torch.where's unselected branch).
        inference = torch.where(has_inference, inference, old.detach())
        if cfg.tis_cap is not None:
            w = tis_weights(old, inference, cfg.tis_cap)
            per_token = per_token * w
            stats.tis_sum = float(w[has_inference].sum())
            stats.tis_capped = int((has_inference & (w >= cfg.tis_cap)).sum())
            stats.tis_tokens = int(has_inference.sum())
        diff = (old - inference).detach()[has_inference]
        stats.diff_tokens = diff.numel()
        if diff.numel():
            stats.diff_sum = float(diff.sum())
            stats.diff_abs_sum = float(diff.abs().sum())
            stats.diff_abs_max = float(diff.abs().max())

    reference, has_reference = None, None
    if cfg.kl_reference == "model" and tokens.reference_logprobs is not None:
        reference, has_reference = tokens.reference_logprobs, torch.ones_like(logp, dtype=torch.bool)
    elif cfg.kl_reference == "inference" and inference is not None:
        reference, has_reference = inference, has_inference
    if reference is not None:
        kl = k3_kl(logp, reference.detach())
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
        stats.kl_sum = float(kl.detach()[has_reference].sum())
        stats.kl_tokens = int(has_reference.sum())

    loss = (per_token * tokens.weights).sum()

    stats.loss = float(loss.detach())
    if logp.numel():
        stats.ratio_sum = float(surrogate.ratio.sum())
        stats.ratio_min = float(surrogate.ratio.min())
        stats.ratio_max = float(surrogate.ratio.max())
    stats.clipped_low = int(surrogate.clipped_low.sum())
    stats.clipped_high = int(surrogate.clipped_high.sum())
    if tokens.entropy is not None:
        stats.entropy_sum = float(tokens.entropy.sum())
        stats.entropy_tokens = tokens.entropy.numel()
    return loss, stats
