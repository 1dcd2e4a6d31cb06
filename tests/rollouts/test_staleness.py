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


def test_an_episode_is_as_old_as_its_oldest_model_token_and_trains_on_its_fresh_ones():
    """Tokens of one sequence sampled by versions 7 and 9 (a sync between turns): the group's age
    is counted from 7, whatever its policy_version says; masked positions do not count. Beyond the
    bound, the tokens of version 7 leave the loss and those of 9 train; a group with no fresh
    token left is dropped."""
    group = RolloutGroup(
        tokens=[[1, 2, 3, 4, 5, 6], [1, 2, 3]], loss_mask=[[0, 1, 1, 0, 1, 1], [0, 1, 1]], scores=[0.0, 1.0],
        policy_version=7, token_versions=[[0, 7, 7, 0, 9, 9], [0, 7, 8]],
    )
    assert group.oldest_version == 7
    stats = StalenessStats()
    kept, ages = apply_staleness([group], 10, 2, "drop", stats)
    assert ages == [3] and kept == [group] and stats.dropped == 0
    assert group.loss_mask == [[0, 0, 0, 0, 1, 1], [0, 0, 1]] and stats.masked_tokens == 3

    stale = RolloutGroup(
        tokens=[[1, 2, 3]], loss_mask=[[0, 1, 1]], scores=[0.0], policy_version=7, token_versions=[[0, 7, 7]],
    )
    kept, ages = apply_staleness([stale], 10, 2, "drop", stats)
    assert ages == [3] and kept == [] and stats.dropped == 1 and stale.loss_mask == [[0, 1, 1]]

    newer = RolloutGroup(
        tokens=[[1, 2, 3, 4]], loss_mask=[[0, 1, 0, 1]], scores=[0.0], policy_version=5,
        token_versions=[[0, 9, 0, 10]],
    )
    assert newer.oldest_version == 9  # policy_version 5 is only a lower bound
    kept, ages = apply_staleness([newer], 10, 2, "drop", StalenessStats())
    assert ages == [1] and kept == [newer]
