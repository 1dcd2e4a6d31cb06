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
    kl_penalty,
    masked_for_truncation,
    mismatch_weights,
    policy_loss,
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
    cfg = LossConfig(aggregation=aggregation, tis_mode="off", kl_coef=0.0)
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
    has = torch.tensor([True, True])
    w = mismatch_weights(old, torch.tensor([0.5, -3.0]), has, torch.arange(2), "token_truncate", cap=2.0).weights
    assert not w.requires_grad
    assert w.tolist() == pytest.approx([math.exp(-0.5), 2.0])


@pytest.mark.parametrize("reference", ["inference", "model"])
def test_k3_kl_term_value_and_reverse_kl_gradient(reference):
    cfg = LossConfig(aggregation="token_mean", tis_mode="off", kl_coef=0.1, kl_reference=reference)
    ref = INFERENCE
    loss, grad, stats = loss_and_grad(
        cfg,
        inference=INFERENCE if reference == "inference" else None,
        reference=INFERENCE if reference == "model" else None,
    )
    c = 1 / 8
    kl = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(LOGP, ref)]
    # The value is k3's; the gradient is the score-function gradient of KL(pi || ref):
    # (logp - logp_ref) per token (the old k3-as-loss gradient was 1 - exp(ref - logp)).
    dkl = [lp - r for lp, r in zip(LOGP, ref)]
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
    cfg = LossConfig(aggregation="token_mean", tis_mode="off", clip_low=0.2, clip_high=0.28)
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


# ---- the IS correction modes against hand-computed weights -------------------------------------
# Two sequences: tokens 0-2 belong to sequence 0, token 3 to sequence 1 (as in the module's tables).
SEQUENCE = torch.tensor([0, 0, 0, 1])


def weights_for(mode, cap=2.0, floor=0.0, inference=INFERENCE):
    old = torch.tensor(LOGP)
    inf = torch.tensor(inference)
    return mismatch_weights(old, inf, ~torch.isnan(inf), SEQUENCE, mode, cap, floor)


def test_token_modes_truncate_or_mask_each_token():
    rho = [math.exp(lp - inf) for lp, inf in zip(LOGP, INFERENCE)]  # [1.22, 0.37, 1.0, 4.48]
    assert weights_for("token_truncate").weights.tolist() == pytest.approx([rho[0], rho[1], rho[2], 2.0])
    masked = weights_for("token_mask", floor=0.5)
    assert masked.weights.tolist() == pytest.approx([rho[0], 0.0, rho[2], 0.0])
    assert masked.masked.tolist() == [False, True, False, True]
    # icepop is the two-sided token mask; the same band gives the same weights
    assert weights_for("icepop", floor=0.5).weights.tolist() == masked.weights.tolist()
    assert weights_for("off").weights.tolist() == [1.0] * 4


def test_sequence_modes_use_the_product_of_the_sequences_token_ratios():
    rho0 = math.exp(sum(lp - inf for lp, inf in zip(LOGP[:3], INFERENCE[:3])))  # exp(-0.8) = 0.449
    rho1 = math.exp(LOGP[3] - INFERENCE[3])  # 4.48
    assert weights_for("sequence_truncate").weights.tolist() == pytest.approx([rho0] * 3 + [2.0])
    assert weights_for("sequence_mask", cap=3.0).weights.tolist() == pytest.approx([rho0] * 3 + [0.0])
    assert weights_for("sequence_mask", cap=5.0, floor=0.5).weights.tolist() == pytest.approx([0.0] * 3 + [rho1])


def test_sequence_weights_ignore_tokens_without_inference_logprobs():
    inference = [float("nan"), -1.0, -0.5, float("nan")]
    w = weights_for("sequence_truncate", cap=10.0, inference=inference).weights
    rho0 = math.exp((LOGP[1] - -1.0) + (LOGP[2] - -0.5))
    # a token without logprobs is uncorrected (w = 1) and adds nothing to its sequence's ratio
    assert w.tolist() == pytest.approx([1.0, rho0, rho0, 1.0])


def test_mismatch_diagnostics_ess_masked_share_and_kl():
    cfg = LossConfig(tis_mode="token_mask", tis_cap=2.0, tis_floor=0.5)
    _, _, stats = loss_and_grad(cfg, inference=INFERENCE)
    m = stats.as_metrics()
    rho = [math.exp(lp - inf) for lp, inf in zip(LOGP, INFERENCE)]
    kept = [rho[0], 0.0, rho[2], 0.0]
    assert m["tis_masked_fraction"] == 0.5
    assert m["tis_ess"] == pytest.approx(sum(kept) ** 2 / (4 * sum(w * w for w in kept)), rel=1e-6)
    d = [lp - inf for lp, inf in zip(LOGP, INFERENCE)]
    assert m["mismatch_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 4, rel=1e-6)


def test_tis_cap_can_be_switched_off_from_toml():
    # F10: TOML cannot say None; tis_mode = "off" is the documented switch.
    from grpod.config import parse_config

    cfg = parse_config({"train": {"loss": {"tis_mode": "off"}}})
    _, grad, stats = loss_and_grad(cfg.train.loss, inference=INFERENCE)
    assert grad == pytest.approx([-a / 8 for a in ADV], rel=1e-6)
    assert stats.tis_tokens == 0


# ---- KL: the exact reverse-KL gradient on a small vocabulary -----------------------------------


def _exact_kl_gradient_check(estimator, sample_from_inference):
    """Enumerate a 6-token vocabulary: the expected gradient of the per-token KL term under the
    sampling distribution (IS-weighted when it is pi_inference) must equal grad KL(pi || ref)."""
    torch.manual_seed(0)
    logits = torch.randn(6, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6), dim=0)
    inference = torch.log_softmax(torch.randn(6), dim=0)
    logp = torch.log_softmax(logits, dim=0)
    exact = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits)[0]

    cfg = LossConfig(kl_coef=1.0, kl_reference="model", kl_estimator=estimator, tis_mode="token_truncate", tis_cap=1e6)
    sampler = inference if sample_from_inference else logp.detach()
    expected = torch.zeros(6)
    for token in range(6):
        lp = torch.log_softmax(logits, dim=0)
        tokens = LossTokens(
            logprobs=lp[token : token + 1],
            old_logprobs=lp[token : token + 1].detach(),
            advantages=torch.zeros(1),
            weights=torch.ones(1),
            inference_logprobs=sampler[token : token + 1].detach(),
            reference_logprobs=ref[token : token + 1],
        )
        loss, _ = policy_loss(tokens, cfg)
        expected += sampler[token].exp().detach() * torch.autograd.grad(loss, logits)[0]
    return expected, exact


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("sample_from_inference", [False, True])
def test_kl_term_has_the_exact_reverse_kl_gradient(estimator, sample_from_inference):
    expected, exact = _exact_kl_gradient_check(estimator, sample_from_inference)
    assert expected.tolist() == pytest.approx(exact.tolist(), abs=1e-6)


def test_kl_estimator_values():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = [0.5, -1.0]
    assert kl_penalty(logp, ref, "k1", 10.0).tolist() == pytest.approx(d)
    assert kl_penalty(logp, ref, "k2", 10.0).tolist() == pytest.approx([x * x / 2 for x in d])
    assert kl_penalty(logp, ref, "k3", 10.0).tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d])


def test_kl_gradient_is_clamped_for_a_mismatched_token():
    # F7c: vLLM gave -0.05, the trainer -12: the coefficient logp - ref = -11.95 is cut at -kl_clamp.
    logp = torch.tensor([-12.0], requires_grad=True)
    kl_penalty(logp, torch.tensor([-0.05]), "k3", 2.0).sum().backward()
    assert logp.grad.tolist() == pytest.approx([-2.0])


def test_the_largest_kl_clamp_and_tis_cap_a_config_takes_run_in_float32():
    """kl_clamp and tis_cap end in float32 clamps, which refuse a bound beyond float32 (a config
    of 1e308 failed every step): the config bounds them, and its largest values work."""
    from pydantic import ValidationError

    cfg = LossConfig(kl_clamp=100, tis_cap=1e9)
    logp, ref = torch.tensor([-1.0, -130.0], requires_grad=True), torch.tensor([-1.5, -0.05])
    value = kl_penalty(logp, ref, "k3", cfg.kl_clamp)
    assert torch.isfinite(value).all() and value[1].item() == 100.0
    weights = mismatch_weights(logp.detach(), ref, torch.ones(2, dtype=torch.bool), torch.arange(2),
                               "token_truncate", cap=cfg.tis_cap).weights
    assert torch.isfinite(weights).all()
    for key, above in (("kl_clamp", 101.0), ("tis_cap", 2e9)):
        with pytest.raises(ValidationError, match=key):
            LossConfig(**{key: above})
    with pytest.raises(RuntimeError, match="overflow"):
        kl_penalty(logp, ref, "k3", 1e308)


# ---- CISPO and GSPO against hand-computed values ------------------------------------------------


def test_cispo_weight_is_the_clipped_detached_ratio_and_never_zeroes_a_token():
    cfg = LossConfig(type="cispo", tis_mode="off", clip_low=0.2, clip_high=0.28)
    old = [-1.5, -1.0, -0.5, -1.0]  # r = exp(0.5) = 1.65, exp(-1) = 0.37, 1, exp(-0.5) = 0.61
    loss, grad, stats = loss_and_grad(cfg, old=old)
    r = [math.exp(lp - o) for lp, o in zip(LOGP, old)]
    clipped = [min(max(x, 0.8), 1.28) for x in r]
    c = 1 / 8
    assert grad == pytest.approx([-c * w * a for w, a in zip(clipped, ADV)], rel=1e-6)
    assert loss == pytest.approx(sum(-c * w * a for w, a in zip(clipped, ADV)), rel=1e-6)
    assert stats.clipped_high == 1 and stats.clipped_low == 2  # bounded, yet every gradient is non-zero
    assert all(g != 0 for g in grad)


def test_ppo_clip_zeroes_the_gradient_where_cispo_does_not():
    old = [-1.5, -1.0, -0.5, -1.0]
    _, grad, _ = loss_and_grad(LossConfig(type="grpo", tis_mode="off"), old=old)
    assert grad[0] == 0.0  # A > 0, r = 1.65 > 1.28: PPO stops pushing


def test_gspo_uses_the_sequences_geometric_mean_ratio():
    cfg = LossConfig(type="gspo", tis_mode="off", clip_low=0.2, clip_high=0.28)
    assert cfg.aggregation == "seq_mean_token_mean"
    old = [-1.1, -2.1, -0.4, -1.2]  # seq 0: mean(0.1, 0.1, -0.1) = 0.0333; seq 1: -0.3
    logp = torch.tensor(LOGP, requires_grad=True)
    weights = aggregation_weights(cfg.aggregation, torch.tensor(SEQ_TOKENS), NORM)
    tokens = LossTokens(
        logprobs=logp, old_logprobs=torch.tensor(old), advantages=torch.tensor(ADV), weights=weights,
        sequence_index=SEQUENCE,
    )
    loss, stats = policy_loss(tokens, cfg)
    loss.backward()
    q0, q1 = math.exp(0.1 / 3), math.exp(-0.3)  # 1.034 (unclipped), 0.741 (< 0.8 with A < 0: clipped)
    c0, c1 = 1 / (3 * 3), 1 / (3 * 1)
    # seq 0: d/dlogp_t of c0 * -q0 * A summed over its tokens = -c0 * A * q0 / 3 ... per token: each
    # token's coefficient is c0 (aggregation) times q0 A (the token form's gradient is q0 d logp_t).
    assert logp.grad.tolist()[:3] == pytest.approx([-c0 * q0 * 1.0] * 3, rel=1e-5)
    assert logp.grad.tolist()[3] == 0.0
    assert loss.item() == pytest.approx(-3 * c0 * q0 * 1.0 - c1 * 0.8 * -0.5, rel=1e-5)
    assert stats.clipped_low == 1 and stats.ratio_min == pytest.approx(q1, rel=1e-5)


def test_dapo_is_token_mean_and_dr_grpo_picks_its_normaliser_and_no_std():
    from grpod.config import ConfigError, parse_config

    assert LossConfig(type="dapo").aggregation == "token_mean"
    dr = parse_config({"train": {"loss": {"type": "dr_grpo"}}})
    assert dr.train.loss.aggregation == "seq_mean_token_sum_norm" and dr.train.advantages.scale == "none"
    explicit = parse_config({"train": {"loss": {"type": "dr_grpo"}, "advantages": {"scale": "group"}}})
    assert explicit.train.advantages.scale == "group"
    with pytest.raises(ConfigError, match="dapo"):
        parse_config({"train": {"loss": {"type": "dapo", "aggregation": "seq_mean_token_mean"}}})
    with pytest.raises(ConfigError, match="icepop"):
        parse_config({"train": {"loss": {"tis_mode": "icepop"}}})


def test_entropy_bonus_adds_minus_eta_times_entropy():
    logp = torch.tensor(LOGP, requires_grad=True)
    entropy = torch.tensor([0.5, 1.0, 1.5, 2.0], requires_grad=True)
    cfg = LossConfig(tis_mode="off", entropy_coef=0.01)
    weights = aggregation_weights("token_mean", torch.tensor(SEQ_TOKENS), NORM)
    tokens = LossTokens(logprobs=logp, old_logprobs=logp.detach(), advantages=torch.tensor(ADV), weights=weights, entropy=entropy)
    loss, stats = policy_loss(tokens, cfg)
    loss.backward()
    assert entropy.grad.tolist() == pytest.approx([-0.01 / 8] * 4)
    assert loss.item() == pytest.approx(sum(-a / 8 for a in ADV) - 0.01 * 5.0 / 8, rel=1e-6)
    assert stats.as_metrics()["entropy"] == pytest.approx(1.25)


def test_a_floor_raises_small_weights_in_the_truncate_modes_as_trls_clip_min():
    rho = [math.exp(lp - inf) for lp, inf in zip(LOGP, INFERENCE)]  # [1.22, 0.37, 1.0, 4.48]
    floored = weights_for("token_truncate", floor=0.5)
    assert floored.weights.tolist() == pytest.approx([rho[0], 0.5, rho[2], 2.0])
    assert floored.truncated.tolist() == [False, True, False, True]
    rho0 = math.exp(sum(lp - inf for lp, inf in zip(LOGP[:3], INFERENCE[:3])))  # 0.449
    assert weights_for("sequence_truncate", floor=0.5).weights.tolist() == pytest.approx([0.5] * 3 + [2.0])
    assert weights_for("sequence_truncate").weights.tolist() == pytest.approx([rho0] * 3 + [2.0])  # no floor: as before


def test_the_k3_value_of_a_badly_mismatched_token_is_clamped_not_inf():
    logp = torch.tensor([-95.0, -1.0], requires_grad=True)
    ref = torch.tensor([-3.0, -1.0])  # d = logp_ref - logp = 92: exp(92) overflows fp32
    term = kl_penalty(logp, ref, "k3", clamp=10.0)
    assert torch.isfinite(term).all() and term.detach().tolist() == pytest.approx([10.0, 0.0])
    term.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-10.0, 0.0])  # the gradient's clamp, unchanged
