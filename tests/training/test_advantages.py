import math

import pytest

from grpod.config import AdvantageConfig
from grpod.rollouts.group import RolloutGroup
from grpod.training.advantages import EPS, compute_advantages


def group(scores, **kwargs):
    n = len(scores)
    return RolloutGroup(tokens=[[1, 2, 3]] * n, loss_mask=[[0, 1, 1]] * n, scores=list(scores), **kwargs)


def pstd(values):
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def test_group_scale_is_mean_centred_and_divided_by_the_group_std():
    groups = [group([1.0, 0.0, 0.0, 1.0]), group([3.0, 1.0, 2.0, 2.0])]
    result = compute_advantages(groups, AdvantageConfig(scale="group", std="population"))
    assert result.dropped_zero_variance == 0
    a = 0.5 / (0.5 + EPS)
    assert result.advantages[0] == pytest.approx([a, -a, -a, a])
    s = pstd([3, 1, 2, 2])
    assert result.advantages[1] == pytest.approx([1 / (s + EPS), -1 / (s + EPS), 0.0, 0.0])


def test_none_scale_is_dr_grpo_mean_centring_only():
    result = compute_advantages([group([1.0, 0.0, 0.0, 0.0])], AdvantageConfig(scale="none"))
    assert result.advantages[0] == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_batch_scale_uses_one_std_over_all_centred_values():
    groups = [group([1.0, 0.0]), group([10.0, 0.0])]
    result = compute_advantages(groups, AdvantageConfig(scale="batch", std="population"))
    s = pstd([0.5, -0.5, 5.0, -5.0])
    assert result.advantages[0] == pytest.approx([0.5 / (s + EPS), -0.5 / (s + EPS)])
    assert result.advantages[1] == pytest.approx([5 / (s + EPS), -5 / (s + EPS)])


def test_zero_variance_groups_are_dropped_and_counted():
    groups = [group([1.0, 1.0]), group([1.0, 0.0]), group([0.0, 0.0])]
    result = compute_advantages(groups, AdvantageConfig(drop_zero_variance=True))
    assert result.dropped_zero_variance == 2
    assert result.groups == [groups[1]]
    assert len(result.advantages) == 1


def test_zero_variance_groups_kept_with_zero_advantage_when_not_dropping():
    groups = [group([1.0, 1.0]), group([1.0, 0.0])]
    result = compute_advantages(groups, AdvantageConfig(drop_zero_variance=False, scale="group"))
    assert result.dropped_zero_variance == 0
    assert result.advantages[0] == [0.0, 0.0]


def test_all_groups_dropped_gives_an_empty_result():
    result = compute_advantages([group([0.5, 0.5])], AdvantageConfig())
    assert result.groups == [] and result.advantages == [] and result.dropped_zero_variance == 1


def test_override_zeroes_one_sequence_but_keeps_the_group_baseline():
    g = group([1.0, 0.0, 0.0, 0.0], overrides=[{}, {"set_advantage_to_zero": True}, None, {"temperature": 0.7}])
    result = compute_advantages([g], AdvantageConfig(scale="none"))
    assert result.advantages[0] == pytest.approx([0.75, 0.0, -0.25, -0.25])


def test_group_weight_multiplies_the_advantages():
    result = compute_advantages([group([1.0, 0.0], weight=0.5)], AdvantageConfig(scale="none"))
    assert result.advantages[0] == pytest.approx([0.25, -0.25])


def test_source_advantages_used_only_when_enabled_and_present():
    g = group([1.0, 0.0], advantages=[2.0, -3.0], weight=0.5)
    plain = group([1.0, 0.0])
    on = compute_advantages([g, plain], AdvantageConfig(scale="none", use_source_advantages=True))
    assert on.advantages == [pytest.approx([1.0, -1.5]), pytest.approx([0.5, -0.5])]
    off = compute_advantages([g], AdvantageConfig(scale="none", use_source_advantages=False))
    assert off.advantages[0] == pytest.approx([0.25, -0.25])


def test_source_advantages_all_zero_count_as_zero_variance():
    g = group([1.0, 0.0], advantages=[0.0, 0.0])
    result = compute_advantages([g], AdvantageConfig(use_source_advantages=True))
    assert result.dropped_zero_variance == 1


def test_sample_std_is_the_default_and_matches_the_peers():
    # scores [1, 0, 0, 0]: mean 0.25, sample std sqrt(0.75 / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    result = compute_advantages([group([1.0, 0.0, 0.0, 0.0])], AdvantageConfig())
    assert AdvantageConfig().std == "sample"
    assert result.advantages[0] == pytest.approx([0.75 / (0.5 + EPS)] + [-0.25 / (0.5 + EPS)] * 3)
    population = compute_advantages([group([1.0, 0.0, 0.0, 0.0])], AdvantageConfig(std="population"))
    assert population.advantages[0][0] == pytest.approx(0.75 / (math.sqrt(0.1875) + EPS))


def test_rloo_is_the_leave_one_out_baseline():
    # r = [3, 1, 2, 2]: A_0 = 3 - (1 + 2 + 2) / 3 = 4/3, A_1 = 1 - 7/3 = -4/3, A_2 = A_3 = 2 - 2 = 0
    result = compute_advantages([group([3.0, 1.0, 2.0, 2.0])], AdvantageConfig(estimator="rloo"))
    assert result.advantages[0] == pytest.approx([4 / 3, -4 / 3, 0.0, 0.0])


def test_reinforce_pp_normalises_raw_scores_over_the_step():
    # all kept scores [1, 0, 3, 1]: mean 1.25, sample std sqrt(((-.25)^2 + 1.25^2 + 1.75^2 + .25^2) / 3)
    groups = [group([1.0, 0.0]), group([3.0, 1.0])]
    result = compute_advantages(groups, AdvantageConfig(estimator="reinforce_pp"))
    s = math.sqrt((0.0625 + 1.5625 + 3.0625 + 0.0625) / 3)
    assert result.advantages[0] == pytest.approx([-0.25 / (s + EPS), -1.25 / (s + EPS)])
    assert result.advantages[1] == pytest.approx([1.75 / (s + EPS), -0.25 / (s + EPS)])


def test_overlong_shaping_is_dapos_soft_punishment():
    from grpod.rollouts.signal import overlong_penalty

    # budget 16, buffer 4: no penalty up to 12 tokens, linear to -penalty at 16, capped beyond
    assert [overlong_penalty(n, 16, 4, 1.0) for n in (12, 13, 14, 16, 20)] == [0.0, -0.25, -0.5, -1.0, -1.0]
    g = RolloutGroup(tokens=[[1] * 20, [1] * 20], loss_mask=[[0] * 6 + [1] * 14, [0] * 10 + [1] * 10], scores=[1.0, 1.0])
    cfg = AdvantageConfig(scale="none", overlong_buffer=4, overlong_penalty=2.0)
    result = compute_advantages([g], cfg, completion_budget=16)
    # shaped scores [1 - 2 * 0.5, 1] = [0, 1]: no longer zero-variance, advantages [-0.5, 0.5]
    assert result.dropped_zero_variance == 0 and result.overlong_penalized == 1
    assert result.advantages[0] == pytest.approx([-0.5, 0.5])


def test_reinforce_pp_keeps_all_equal_groups_that_carry_signal_against_the_batch():
    cfg = AdvantageConfig(estimator="reinforce_pp", drop_zero_variance=True)
    groups = [group([1, 1, 1, 1]), group([1, 0, 0, 0]), group([0, 0, 1, 0])]
    result = compute_advantages(groups, cfg)
    assert result.dropped_zero_variance == 0 and len(result.groups) == 3
    every = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0]
    m = sum(every) / len(every)
    s = math.sqrt(sum((r - m) ** 2 for r in every) / (len(every) - 1))
    assert result.advantages[0] == pytest.approx([(1 - m) / (s + EPS)] * 4)  # 0.96 each, not dropped
    # Under grpo the same all-correct group has nothing against its siblings and is dropped.
    assert compute_advantages(groups, AdvantageConfig(drop_zero_variance=True)).dropped_zero_variance == 1


def test_reinforce_pp_drops_a_step_whose_every_score_is_equal():
    # Every completion of the step failed: the step's baseline is 0 and every advantage would be 0,
    # so the step is dropped whole (the trainer skips it) instead of trained for no gradient.
    cfg = AdvantageConfig(estimator="reinforce_pp", drop_zero_variance=True)
    flat = [group([0.0, 0.0, 0.0, 0.0]), group([0.0, 0.0, 0.0, 0.0])]
    result = compute_advantages(flat, cfg)
    assert result.groups == [] and result.dropped_zero_variance == 2
    # A group that brings its own advantages is kept, and the flat ones are still dropped.
    sourced = group([0.0, 0.0], advantages=[1.0, -1.0])
    mixed = compute_advantages([*flat, sourced], cfg.model_copy(update={"use_source_advantages": True}))
    assert mixed.groups == [sourced] and mixed.dropped_zero_variance == 2
    assert mixed.advantages == [[1.0, -1.0]]
    # One differing score anywhere in the step keeps every group, each against the step's mean.
    kept = compute_advantages([group([0.0, 0.0, 0.0, 0.0]), group([0.0, 0.0, 1.0, 0.0])], cfg)
    assert len(kept.groups) == 2 and kept.dropped_zero_variance == 0 and kept.advantages[0][0] < 0
    # With drop_zero_variance off the flat step stays, every advantage 0.
    off = compute_advantages(flat, cfg.model_copy(update={"drop_zero_variance": False}))
    assert len(off.groups) == 2 and off.advantages == [[0.0] * 4, [0.0] * 4]


def test_an_unscorable_completion_is_left_out_of_the_baseline_and_gets_zero():
    unscorable = [{}, {"unscorable": True}, {}, {}]
    result = compute_advantages([group([1.0, 0.0, 0.0, 1.0], overrides=unscorable)], AdvantageConfig())
    scored = [1.0, 0.0, 1.0]  # the three scored completions; the placeholder 0.0 enters nothing
    m = sum(scored) / 3
    s = math.sqrt(sum((r - m) ** 2 for r in scored) / 2)
    assert result.advantages[0] == pytest.approx([(1 - m) / (s + EPS), 0.0, (0 - m) / (s + EPS), (1 - m) / (s + EPS)])
    # Equal scores among the scored ones: zero variance, whatever the placeholder says.
    equal = compute_advantages([group([1.0, 0.0, 1.0, 1.0], overrides=unscorable)], AdvantageConfig(drop_zero_variance=True))
    assert equal.dropped_zero_variance == 1


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_scores_near_floats_range_get_the_advantages_small_ones_get(scale):
    """Scores of 1e308 (a calculator `tool_bonus` of 1e308): the sum in the mean overflowed to inf
    and every advantage came out NaN; the std-scaled advantage does not depend on the scores' scale."""
    small = compute_advantages([group([0.0, 1.0, 0.0, 1.0])], AdvantageConfig(scale=scale))
    huge = compute_advantages([group([0.0, 1e308, 0.0, 1e308])], AdvantageConfig(scale=scale))
    assert all(math.isfinite(a) for a in huge.advantages[0])
    assert huge.advantages[0] == pytest.approx(small.advantages[0], rel=1e-5)  # EPS aside
    # Both ends of float's range at once: deviations of 1.6e308 square to inf unless scaled too.
    spread = compute_advantages([group([-8e307, 8e307])], AdvantageConfig(scale=scale, std="population"))
    assert spread.advantages[0] == pytest.approx([-1.0, 1.0])
    if scale == "group":  # deviations beyond float's range: 1.7e308 - (-5.7e307) overflowed, every advantage NaN
        ends = compute_advantages([group([1.7e308, 1.7e308, -1.7e308])], AdvantageConfig(scale=scale))
        assert ends.advantages[0] == pytest.approx(
            compute_advantages([group([1.0, 1.0, -1.0])], AdvantageConfig(scale=scale)).advantages[0], rel=1e-6)


def test_scores_equal_but_for_float_noise_are_zero_variance_at_any_magnitude():
    """Equal scores of 1e12 that differ by one float step (1.2e-4 there: a weighted sum taken in
    another order) passed the absolute 1e-9 as varied, and the group scale, whose eps shrinks with
    the scores, made that noise whole advantages of +-1. The tolerance is relative to the scores."""
    noisy = [1e12, math.nextafter(1e12, math.inf), 1e12, 1e12]
    assert noisy[1] - noisy[0] > 1e-9
    result = compute_advantages([group(noisy), group([1e12, 0.0, 1e12, 0.0])], AdvantageConfig(scale="group"))
    assert result.dropped_zero_variance == 1 and len(result.groups) == 1 and result.groups[0].scores[1] == 0.0
    kept = compute_advantages([group(noisy)], AdvantageConfig(scale="group", drop_zero_variance=False))
    assert kept.advantages == [[0.0, 0.0, 0.0, 0.0]], kept.advantages
    # Small scores keep the absolute tolerance: 1e-6 apart is a signal, 1e-12 apart is not.
    assert compute_advantages([group([0.5, 0.5 + 1e-6])], AdvantageConfig()).dropped_zero_variance == 0
    assert compute_advantages([group([0.5, 0.5 + 1e-12])], AdvantageConfig()).dropped_zero_variance == 1
