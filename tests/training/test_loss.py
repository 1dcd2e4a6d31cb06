"""Loss values and gradients against hand-computed references (plain Python maths on 4 tokens)."""

import math

import pytest
import torch

from grpod.config import LossConfig
from grpod.training.loss import (
    LossStats,
    LossTokens,
    StepNormalizer,
    aggregation_weights,
    clipped_surrogate,
    k3_kl,
    masked_for_truncation,
    policy_loss,
    tis_weights,
)

# Four loss tokens: three from sequence 0 (advantage +1), one from sequence 1 (advantage -0.5).
# The step has more tokens elsewhere: 8 loss tokens in 3 sequences, completion budget 10.
LOGP = [-1.0, -2.0, -0.5, -1.5]
ADV = [1.0, 1.0, 1.0, -0.5]
SEQ_TOKENS = [3, 3, 3, 1]
INFERENCE = [-1.2, -1.0, -0.5, -3.0]
NORM = StepNormalizer(loss_tokens=8, sequences=3, max_tokens=10)


def coefficients(aggregation):
    if aggregation == "token_mean":
        return [1 / 8] * 4
    if aggregation == "seq_mean_token_mean":
        return [1 / (3 * n) for n in SEQ_TOKENS]
    return [1 / (3 * 10)] * 4


def loss_and_grad(cfg, old=None, inference=None, reference=None):
    logp = torch.tensor(LOGP, requires_grad=True)
    weights = aggregation_weights(cfg.aggregation, torch.tensor(SEQ_TOKENS), NORM)
    tokens = LossTokens(
        logprobs=logp,
        old_logprobs=logp.detach() if old is None else torch.tensor(old),
        advantages=torch.tensor(ADV),
        weights=weights,
        inference_logprobs=None if inference is None else torch.tensor(inference),
        reference_logprobs=None if reference is None else torch.tensor(reference),
    )
    loss, stats = policy_loss(tokens, cfg)
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_on_policy_loss_is_minus_weighted_advantage(aggregation):
    cfg = LossConfig(aggregation=aggregation, tis_cap=None, kl_coef=0.0)
    loss, grad, stats = loss_and_grad(cfg)
    c = coefficients(aggregation)
    # r = 1 in value, d r / d logp = 1: l_t = -A_t, dL/dlogp_t = -c_t A_t.
    assert loss == pytest.approx(sum(-a * ci for a, ci in zip(ADV, c)), rel=1e-6)
    assert grad == pytest.approx([-a * ci for a, ci in zip(ADV, c)], rel=1e-6)
    assert stats.ratio_min == stats.ratio_max == 1.0


def test_dr_grpo_normaliser_is_constant_across_sequence_lengths():
    weights = aggregation_weights("seq_mean_token_sum_norm", torch.tensor([1, 5, 5, 9]), NORM)
    assert weights.tolist() == pytest.approx([1 / 30] * 4)
    weights = aggregation_weights("seq_mean_token_mean", torch.tensor([1, 5, 5, 9]), NORM)
    assert weights.tolist() == pytest.approx([1 / 3, 1 / 15, 1 / 15, 1 / 27])


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregation_weights("mean", torch.tensor([1]), NORM)


def test_truncated_importance_weight_scales_the_policy_gradient():
    cfg = LossConfig(aggregation="token_mean", tis_cap=2.0, kl_coef=0.0)
    loss, grad, stats = loss_and_grad(cfg, inference=INFERENCE)
    w = [min(math.exp(lp - inf), 2.0) for lp, inf in zip(LOGP, INFERENCE)]
    assert w[3] == 2.0  # exp(1.5) = 4.48 is cut at the cap
    c = coefficients("token_mean")
    assert loss == pytest.approx(sum(-a * wi * ci for a, wi, ci in zip(ADV, w, c)), rel=1e-6)
    assert grad == pytest.approx([-a * wi * ci for a, wi, ci in zip(ADV, w, c)], rel=1e-6)
    assert stats.tis_capped == 1
    assert stats.tis_sum == pytest.approx(sum(w), rel=1e-6)
    diffs = [lp - inf for lp, inf in zip(LOGP, INFERENCE)]
    metrics = stats.as_metrics()
    assert metrics["logprob_diff_mean"] == pytest.approx(sum(diffs) / 4, rel=1e-6)
    assert metrics["logprob_diff_abs_mean"] == pytest.approx(sum(map(abs, diffs)) / 4, rel=1e-6)
    assert metrics["logprob_diff_max"] == pytest.approx(1.5, rel=1e-6)


def test_tis_weights_are_detached_and_capped():
    old = torch.tensor([0.0, 0.0], requires_grad=True)
    w = tis_weights(old, torch.tensor([0.5, -3.0]), cap=2.0)
    assert not w.requires_grad
    assert w.tolist() == pytest.approx([math.exp(-0.5), 2.0])


@pytest.mark.parametrize("reference", ["inference", "model"])
def test_k3_kl_term_value_and_gradient(reference):
    cfg = LossConfig(aggregation="token_mean", tis_cap=None, kl_coef=0.1, kl_reference=reference)
    ref = INFERENCE
    loss, grad, stats = loss_and_grad(
        cfg,
        inference=INFERENCE if reference == "inference" else None,
        reference=INFERENCE if reference == "model" else None,
    )
    c = 1 / 8
    kl = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(LOGP, ref)]
    dkl = [-math.exp(r - lp) + 1 for lp, r in zip(LOGP, ref)]
    assert loss == pytest.approx(sum(c * (-a + 0.1 * k) for a, k in zip(ADV, kl)), rel=1e-6)
    assert grad == pytest.approx([c * (-a + 0.1 * d) for a, d in zip(ADV, dkl)], rel=1e-5)
    assert stats.as_metrics()["kl"] == pytest.approx(sum(kl) / 4, rel=1e-6)


def test_k3_is_zero_at_the_reference_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -1.0, -1.0])
    assert k3_kl(logp, torch.tensor([-1.0, -0.5, -3.0])).tolist()[0] == 0.0
    assert all(v > 0 for v in k3_kl(logp, torch.tensor([-1.0, -0.5, -3.0])).tolist()[1:])


def test_missing_inference_logprobs_give_unit_weight_no_kl_and_finite_gradient():
    cfg = LossConfig(aggregation="token_mean", tis_cap=2.0, kl_coef=0.1, kl_reference="inference")
    inference = [float("nan"), -1.0, float("nan"), -3.0]
    loss, grad, stats = loss_and_grad(cfg, inference=inference)
    assert all(math.isfinite(g) for g in grad)
    c = 1 / 8
    # Tokens 0 and 2: w = 1, no KL.
    assert grad[0] == pytest.approx(-ADV[0] * c, rel=1e-6)
    assert grad[2] == pytest.approx(-ADV[2] * c, rel=1e-6)
    assert stats.diff_tokens == stats.kl_tokens == stats.tis_tokens == 2


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_clip_zeroes_the_gradient_exactly_where_ppo_says(sign):
    clip_low, clip_high = 0.2, 0.28
    ratios = [0.5, 0.79, 0.9, 1.0, 1.1, 1.27, 1.5]
    logp = torch.zeros(len(ratios), requires_grad=True)
    old = -torch.log(torch.tensor(ratios))
    adv = torch.full((len(ratios),), sign * 0.7)
    s = clipped_surrogate(logp, old, adv, clip_low, clip_high)
    s.objective.sum().backward()
    for r, g, lo, hi in zip(ratios, logp.grad.tolist(), s.clipped_low.tolist(), s.clipped_high.tolist()):
        bound = (sign > 0 and r > 1 + clip_high) or (sign < 0 and r < 1 - clip_low)
        assert lo == (sign < 0 and r < 1 - clip_low)
        assert hi == (sign > 0 and r > 1 + clip_high)
        # d(r A)/d logp = r A where the clip does not bind, exactly 0 where it does.
        assert g == (0.0 if bound else pytest.approx(r * sign * 0.7, rel=1e-6)), (r, g)
    # Selection form equals PPO's min(rA, clip(r)A) in value everywhere.
    r = torch.tensor(ratios)
    ppo = torch.minimum(r * adv, r.clamp(1 - clip_low, 1 + clip_high) * adv)
    torch.testing.assert_close(s.objective.detach(), ppo)


def test_clip_statistics_reach_the_metrics():
    cfg = LossConfig(aggregation="token_mean", tis_cap=None, clip_low=0.2, clip_high=0.28)
    # ratios 0.5 (A=+1, not clipped), 1.5 (A=+1, clipped high), 1.0, 0.5 (A=-0.5, clipped low)
    old = [lp - math.log(r) for lp, r in zip(LOGP, [0.5, 1.5, 1.0, 0.5])]
    _, grad, stats = loss_and_grad(cfg, old=old)
    assert (stats.clipped_low, stats.clipped_high) == (1, 1)
    assert grad[1] == 0.0 and grad[3] == 0.0
    metrics = stats.as_metrics()
    assert metrics["ratio_min"] == pytest.approx(0.5) and metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["clipped_low_fraction"] == metrics["clipped_high_fraction"] == 0.25


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_losses_sum_to_the_whole_step_loss_and_gradient(aggregation):
    """Gradient accumulation over any split equals one big batch (normalisers are the step's)."""
    gen = torch.Generator().manual_seed(1)
    seq_of_token = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    seq_len = torch.bincount(seq_of_token)
    n = len(seq_of_token)
    logp = (-torch.rand(n, generator=gen) * 3).requires_grad_(True)
    adv = torch.randn(4, generator=gen)[seq_of_token]
    inference = logp.detach() + torch.randn(n, generator=gen) * 0.3
    cfg = LossConfig(aggregation=aggregation, tis_cap=1.5, kl_coef=0.05)
    norm = StepNormalizer.for_step(seq_len.tolist(), max_tokens=8)

    def part(idx):
        tokens = LossTokens(
            logprobs=logp[idx], old_logprobs=logp.detach()[idx], advantages=adv[idx],
            weights=aggregation_weights(aggregation, seq_len[seq_of_token[idx]], norm),
            inference_logprobs=inference[idx],
        )
        return policy_loss(tokens, cfg)

    whole, whole_stats = part(torch.arange(n))
    (g_whole,) = torch.autograd.grad(whole, logp)
    pieces = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9])]
    total = torch.zeros(())
    merged = LossStats()
    for idx in pieces:
        loss, stats = part(idx)
        total = total + loss
        merged.merge(stats)
    (g_split,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_split, g_whole, rtol=1e-6, atol=0)
    for key, value in whole_stats.as_metrics().items():
        assert merged.as_metrics()[key] == pytest.approx(value, rel=1e-6, nan_ok=True), key


def test_step_normalizer_ignores_sequences_without_loss_tokens():
    norm = StepNormalizer.for_step([3, 0, 2], max_tokens=16)
    assert (norm.loss_tokens, norm.sequences, norm.max_tokens) == (5, 2, 16)


def test_truncated_completion_is_masked_only_when_asked():
    assert masked_for_truncation([0, 1, 1], truncated=True, mask_truncated=True) == [0, 0, 0]
    assert masked_for_truncation([0, 1, 1], truncated=True, mask_truncated=False) == [0, 1, 1]
    assert masked_for_truncation([0, 1, 1], truncated=False, mask_truncated=True) == [0, 1, 1]
