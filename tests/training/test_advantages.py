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
    result = compute_advantages(groups, AdvantageConfig(scale="group"))
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
    result = compute_advantages(groups, AdvantageConfig(scale="batch"))
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
