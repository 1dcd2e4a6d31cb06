"""The GRPO policy-loss family as pure functions of per-token tensors.

Every tensor here is flat: one entry per loss token (a completion token at position t >= 1 whose
loss-mask entry is 1), gathered from the padded micro-batch, so padding never enters the maths.
`sequence_index[t]` names the micro-batch sequence token t belongs to (whole sequences are never
split across micro-batches). For loss token t of sequence s with advantage A (its sequence's):

    r_t   = exp(logp_t - logp_old_t)                             token ratio, pi_theta / pi_old
    rho_t = exp(logp_old_t - logp_inf_t)                         mismatch ratio, pi_old / pi_inference
    w_t   = IS weight from rho (train.loss.tis_mode, below), detached

and the per-token loss is

    l_t = -w_t S_t  -  eta H_t  +  beta w_t sg(r_t) K_t

with the objective S_t of `train.loss.type`:

    grpo, dapo, dr_grpo   S = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)         PPO clip
    cispo                 S = sg(clip(r, 1 - eps_low, 1 + eps_high)) A r~              r~ = exp(logp - sg(logp))
    gspo                  S = min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)          per sequence,
                          s_t = sg(q_s) r~_t,  q_s = exp(mean over s's tokens of (logp - logp_old))

r~ has the value 1 and the gradient of logp, so CISPO's gradient is clip(r) A grad logp with the
weight never zeroing a token (the clip only bounds it), and GSPO's is the sequence-level ratio's
(a geometric mean; the clip acts on whole sequences). H_t is the entropy of the trainer's sampling
distribution at t (an optional bonus, eta = `entropy_coef`). K_t is the KL penalty (below).

The step's loss is  L = sum_t c_t l_t  with the aggregation coefficient c_t:

    token_mean               c_t = 1 / N_tok          N_tok: loss tokens in the whole (mini)batch
    seq_mean_token_mean      c_t = 1 / (N_seq n_s)    n_s: loss tokens of t's sequence s
    seq_mean_token_sum_norm  c_t = 1 / (N_seq M)      M: the completion budget (Dr. GRPO)

N_tok and N_seq count the whole optimizer step (`StepNormalizer`), not the micro-batch, so the sum
of the micro-batches' losses is L and gradient accumulation gives exactly the big-batch gradient.

What "old" means. pi_old is the policy before the batch's first update. With one update per batch
(train.epochs = train.minibatches = 1) it is the current weights, logp_old = logp.detach(), r = 1
in value and the clip never binds: S = r A with gradient A grad logp. With several updates
(PPO epochs / minibatches) the trainer records logp_old once before the first one, r moves, and
the clip (and the clip metrics) mean what PPO means.

The trainer/inference mismatch. vLLM's logprobs logp_inf reflect both numerical differences and
staleness (async rollouts from older versions). `tis_mode` corrects for them with rho:

    token_truncate     w_t = clamp(rho_t, F, C)                         (Yao et al.'s TIS; F = 0: no floor)
    token_mask         w_t = rho_t if F <= rho_t <= C else 0
    sequence_truncate  w_t = clamp(rho_s, F, C),  rho_s = prod over s's tokens of rho_t
    sequence_mask      w_t = rho_s if F <= rho_s <= C else 0
    icepop             token_mask with a required floor F > 0 (a two-sided token mask)
    off                w_t = 1

(C = `tis_cap`, F = `tis_floor`; log rho is clamped to +-20 before exp.) Tokens whose source sent
no inference logprobs get w = 1, are counted as `is_uncorrected_tokens`, and have no KL term when
the reference is the inference policy. Diagnostics: mean weight, share truncated and masked, the
effective sample size (sum w)^2 / (n sum w^2), and the mismatch KL(pi_inf || pi_old) (k3 estimate).

The KL penalty toward a reference (vLLM's logprobs or a frozen model), d_t = logp_t - logp_ref_t:

    k1: K = d        k2: K = d^2 / 2        k3: K = exp(-d) + d - 1

K is what is reported and added to the loss value (k3's value clamped to at most kl_clamp: exp
overflows for one badly mismatched token). Its gradient is the same for the three: the
exact score-function gradient of KL(pi || ref), clamp(d, -kl_clamp, kl_clamp) grad logp (a
sample's k3 differentiated as it stands would give the gradient of KL(ref || pi) instead). The
tokens were sampled from pi_inference, so K is weighted like the objective: by w_t, and by sg(r_t)
to move from pi_old to pi_theta; the clamp bounds what one mismatched token can do to a step.

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

# exp() of a summed sequence log-ratio overflows quickly; verl clamps at the same bound.
LOG_RATIO_CLAMP = 20.0


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


def _per_sequence_sum(values: Tensor, sequence_index: Tensor) -> Tensor:
    """sum over each token's sequence, broadcast back to the tokens."""
    if not values.numel():
        return values
    sums = torch.zeros(int(sequence_index.max()) + 1, dtype=values.dtype, device=values.device)
    return sums.index_add(0, sequence_index, values)[sequence_index]


def _per_sequence_mean(values: Tensor, sequence_index: Tensor) -> Tensor:
    counts = _per_sequence_sum(torch.ones_like(values), sequence_index)
    return _per_sequence_sum(values, sequence_index) / counts


@dataclass
class Surrogate:
    objective: Tensor  # S per token, to be maximised
    ratio: Tensor  # the ratio the clip looks at (r, or GSPO's sequence ratio), detached
    clipped_low: Tensor  # bool: the ratio is below 1 - eps_low (and, for PPO, the clip binds)
    clipped_high: Tensor  # bool: the ratio is above 1 + eps_high (and, for PPO, the clip binds)


def ppo_objective(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> Surrogate:
    """PPO's clipped objective min(r A, clip(r) A) written as a selection, so that the gradient is
    exactly zero where the clip binds and exactly d(r A) elsewhere (equal in value to the min).
    `ratio` carries the gradient; the decision looks at its value."""
    r = ratio.detach()
    clipped_high = (advantages > 0) & (r > 1 + clip_high)
    clipped_low = (advantages < 0) & (r < 1 - clip_low)
    bound = r.clamp(1 - clip_low, 1 + clip_high)
    objective = torch.where(clipped_high | clipped_low, bound * advantages, ratio * advantages)
    return Surrogate(objective, r, clipped_low, clipped_high)


def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> Surrogate:
    """The PPO objective of token ratios r = exp(logp - logp_old)."""
    return ppo_objective(torch.exp(logprobs - old_logprobs), advantages, clip_low, clip_high)


def cispo_objective(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> Surrogate:
    """CISPO: sg(clip(r)) A r~ -- the clipped ratio is a detached weight, so no token's gradient
    is ever zeroed, only bounded."""
    r = torch.exp(logprobs - old_logprobs).detach()
    weight = r.clamp(1 - clip_low, 1 + clip_high)
    unit = torch.exp(logprobs - logprobs.detach())  # value 1, gradient d logp
    return Surrogate(weight * advantages * unit, r, r < 1 - clip_low, r > 1 + clip_high)


def gspo_objective(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    sequence_index: Tensor,
    clip_low: float,
    clip_high: float,
) -> Surrogate:
    """GSPO: the PPO clip on each sequence's geometric-mean ratio q_s, in the token form
    s_t = sg(q_s) r~_t whose gradient is q_s's spread over the sequence's tokens."""
    log_q = _per_sequence_mean((logprobs - old_logprobs).detach(), sequence_index).clamp(max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_q) * torch.exp(logprobs - logprobs.detach())
    return ppo_objective(ratio, advantages, clip_low, clip_high)


def surrogate_for(tokens: LossTokens, cfg: LossConfig) -> Surrogate:
    """The objective S of `cfg.type` (see the module docstring)."""
    logp, old, adv = tokens.logprobs, tokens.old_logprobs, tokens.advantages
    if cfg.type == "cispo":
        return cispo_objective(logp, old, adv, cfg.clip_low, cfg.clip_high)
    if cfg.type == "gspo":
        return gspo_objective(logp, old, adv, tokens.sequence_index, cfg.clip_low, cfg.clip_high)
    return clipped_surrogate(logp, old, adv, cfg.clip_low, cfg.clip_high)


def k3_kl(logprobs: Tensor, reference_logprobs: Tensor) -> Tensor:
    """k3 estimate of KL(pi || ref) per token: exp(d) - d - 1, d = logp_ref - logp (>= 0, unbiased)."""
    d = reference_logprobs - logprobs
    return torch.exp(d) - d - 1


def kl_penalty(logprobs: Tensor, reference_logprobs: Tensor, estimator: str, clamp: float) -> Tensor:
    """Per token: the value of the `estimator` of KL(pi || ref), with the exact reverse-KL gradient
    clamp(logp - logp_ref) d logp (the same for k1, k2 and k3; see the module docstring)."""
    d = (logprobs - reference_logprobs).detach()
    if estimator == "k1":
        value = d
    elif estimator == "k2":
        value = 0.5 * d * d
    elif estimator == "k3":
        # exp(d) overflows for one badly mismatched token (d = -92 logged loss = inf): the value is
        # clamped like its gradient (verl clamps it to +-10 too).
        value = k3_kl(logprobs.detach(), reference_logprobs.detach()).clamp(max=clamp)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}: use k1, k2 or k3")
    return value + d.clamp(-clamp, clamp) * (logprobs - logprobs.detach())


@dataclass
class MismatchWeights:
    weights: Tensor  # w per token, detached (1 where no inference logprob)
    rho: Tensor  # the ratio w was taken from (token or sequence), detached
    truncated: Tensor  # bool: rho > cap and w = cap
    masked: Tensor  # bool: w = 0 because rho left [floor, cap]


def mismatch_weights(
    old_logprobs: Tensor,
    inference_logprobs: Tensor,
    has_inference: Tensor,
    sequence_index: Tensor,
    mode: str,
    cap: float,
    floor: float = 0.0,
) -> MismatchWeights:
    """The IS weight of every token for `tis_mode` (see the module docstring)."""
    log_rho = torch.where(has_inference, old_logprobs - inference_logprobs, torch.zeros_like(old_logprobs)).detach()
    if mode.startswith("sequence"):
        log_rho = _per_sequence_sum(log_rho, sequence_index)
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    nothing = torch.zeros_like(has_inference)
    if mode == "off":
        return MismatchWeights(torch.ones_like(rho), rho, nothing, nothing)
    if mode.endswith("truncate"):
        # tis_floor > 0 also raises small weights to the floor (TRL's clip_min).
        truncated = has_inference & ((rho > cap) | (rho < floor))
        clamped = rho.clamp(min=floor if floor > 0 else None, max=cap)
        return MismatchWeights(torch.where(has_inference, clamped, 1.0), rho, truncated, nothing)
    if mode.endswith("mask") or mode == "icepop":
        masked = has_inference & ((rho > cap) | (rho < floor))
        weights = torch.where(has_inference, torch.where(masked, 0.0, rho), 1.0)
        return MismatchWeights(weights, rho, nothing, masked)
    raise ValueError(f"unknown tis_mode {mode!r}")


@dataclass
class LossTokens:
    """Per-token inputs of `policy_loss`, all `[n]` over the micro-batch's loss tokens.

    `inference_logprobs` holds NaN for tokens whose source sent none. `reference_logprobs` is the
    frozen reference model's (used when `kl_reference = "model"`). `entropy` is the differentiable
    entropy of each token's distribution when an entropy bonus is on, else a detached diagnostic.
    `sequence_index` names each token's sequence in the micro-batch (GSPO, sequence-level IS).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    weights: Tensor
    inference_logprobs: Tensor | None = None
    reference_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    sequence_index: Tensor | None = None

    def __post_init__(self) -> None:
        if self.sequence_index is None:  # one sequence per token: token-level maths only
            self.sequence_index = torch.arange(self.logprobs.numel(), device=self.logprobs.device)


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
    mismatch_kl_sum: float = 0.0
    tis_sum: float = 0.0
    tis_sq_sum: float = 0.0
    tis_capped: int = 0
    tis_masked: int = 0
    tis_tokens: int = 0
    uncorrected_tokens: int = 0

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
            "clipped_fraction": mean(self.clipped_low + self.clipped_high, self.tokens),
            "kl": mean(self.kl_sum, self.kl_tokens),
            "entropy": mean(self.entropy_sum, self.entropy_tokens),
            "logprob_diff_mean": mean(self.diff_sum, self.diff_tokens),
            "logprob_diff_abs_mean": mean(self.diff_abs_sum, self.diff_tokens),
            "logprob_diff_max": self.diff_abs_max if self.diff_tokens else float("nan"),
            "mismatch_kl": mean(self.mismatch_kl_sum, self.diff_tokens),
            "tis_weight_mean": mean(self.tis_sum, self.tis_tokens),
            "tis_capped_fraction": mean(self.tis_capped, self.tis_tokens),
            "tis_masked_fraction": mean(self.tis_masked, self.tis_tokens),
            "tis_ess": self.tis_sum**2 / (self.tis_tokens * self.tis_sq_sum) if self.tis_sq_sum else float("nan"),
            "is_uncorrected_tokens": float(self.uncorrected_tokens),
        }


def policy_loss(tokens: LossTokens, cfg: LossConfig) -> tuple[Tensor, LossStats]:
    """This micro-batch's share of the step loss, sum_t c_t l_t (see the module docstring)."""
    logp, old = tokens.logprobs, tokens.old_logprobs
    surrogate = surrogate_for(tokens, cfg)
    stats = LossStats(tokens=logp.numel())
    token_ratio = torch.exp(logp - old).detach()
    weights = torch.ones_like(token_ratio)

    inference = tokens.inference_logprobs
    has_inference = None
    if inference is not None:
        has_inference = ~torch.isnan(inference)
        # Missing values take pi_old's, so w = 1 and the KL term is 0 there (and no NaN reaches
        # a gradient through torch.where's unselected branch).
        inference = torch.where(has_inference, inference, old.detach())
        mismatch = mismatch_weights(
            old, inference, has_inference, tokens.sequence_index, cfg.tis_mode, cfg.tis_cap, cfg.tis_floor
        )
        weights = mismatch.weights
        stats.uncorrected_tokens = int((~has_inference).sum())
        if cfg.tis_mode != "off":
            kept = weights[has_inference]
            stats.tis_sum = float(kept.sum())
            stats.tis_sq_sum = float((kept * kept).sum())
            stats.tis_capped = int(mismatch.truncated.sum())
            stats.tis_masked = int(mismatch.masked.sum())
            stats.tis_tokens = int(has_inference.sum())
        diff = (old - inference).detach()[has_inference]
        stats.diff_tokens = diff.numel()
        if diff.numel():
            stats.diff_sum = float(diff.sum())
            stats.diff_abs_sum = float(diff.abs().sum())
            stats.diff_abs_max = float(diff.abs().max())
            stats.mismatch_kl_sum = float((torch.exp(diff) - diff - 1).sum())
    else:
        stats.uncorrected_tokens = logp.numel()
    per_token = -weights * surrogate.objective

    reference, has_reference = None, None
    if cfg.kl_reference == "model" and tokens.reference_logprobs is not None:
        reference, has_reference = tokens.reference_logprobs, torch.ones_like(logp, dtype=torch.bool)
    elif cfg.kl_reference == "inference" and inference is not None:
        reference, has_reference = inference, has_inference
    if reference is not None:
        kl = kl_penalty(logp, reference.detach(), cfg.kl_estimator, cfg.kl_clamp)
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * weights * token_ratio * torch.where(has_reference, kl, 0.0)
        stats.kl_sum = float(kl.detach()[has_reference].sum())
        stats.kl_tokens = int(has_reference.sum())

    if cfg.entropy_coef > 0 and tokens.entropy is not None:
        per_token = per_token - cfg.entropy_coef * tokens.entropy

    loss = (per_token * tokens.weights).sum()

    stats.loss = float(loss.detach())
    if logp.numel():
        stats.ratio_sum = float(surrogate.ratio.sum())
        stats.ratio_min = float(surrogate.ratio.min())
        stats.ratio_max = float(surrogate.ratio.max())
    stats.clipped_low = int(surrogate.clipped_low.sum())
    stats.clipped_high = int(surrogate.clipped_high.sum())
    if tokens.entropy is not None:
        stats.entropy_sum = float(tokens.entropy.detach().sum())
        stats.entropy_tokens = tokens.entropy.numel()
    return loss, stats
