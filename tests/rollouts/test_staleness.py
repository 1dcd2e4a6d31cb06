from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.staleness import StalenessStats, apply_staleness


def _g(version):
    return RolloutGroup(tokens=[[1]], loss_mask=[[1]], scores=[0.0], policy_version=version)


def test_drop_beyond_bound_and_histogram():
    stats = StalenessStats()
    kept, ages = apply_staleness([_g(10), _g(8), _g(5), _g(2)], 10, 2, "drop", stats)
    assert ages == [0, 2, 5, 8]
    assert [g.policy_version for g in kept] == [10, 8]
    assert stats.dropped == 2
    assert stats.as_dict()["histogram"] == {"0": 1, "2": 1, "5": 1, "8": 1}


def test_downweight_keeps_with_smaller_weight():
    stats = StalenessStats()
    kept, _ = apply_staleness([_g(10), _g(6)], 10, 2, "downweight", stats)
    assert len(kept) == 2
    assert kept[0].weight == 1.0
    assert kept[1].weight == 1.0 / 3
    assert stats.downweighted == 1
