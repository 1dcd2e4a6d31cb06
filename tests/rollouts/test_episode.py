"""An episode keeps the engine's ids, logprobs and versions per model turn, masks everything else,
and a group of episodes is a valid `RolloutGroup` scored by their final rewards."""

from __future__ import annotations

import pytest

from grpod.rollouts.episode import Episode, EpisodeError, episode_group
from grpod.rollouts.validation import validate_group

LIMITS = {"vocab_size": 64, "max_seq_len": 64, "group_normalised": True}


def two_turn_episode(first_version: int = 3, second_version: int = 5, reward: float = 1.0, last: str = "length") -> Episode:
    episode = Episode.start([1, 2, 3])
    episode.add_model_turn([10, 11], [-0.5, -0.25], first_version, "stop")
    episode.add_environment_turn([20, 21, 22])
    episode.add_model_turn([12, 13, 14], [-1.0, -2.0, -3.0], second_version, last)
    episode.reward = reward
    return episode


def test_model_turns_keep_their_prompt_ids_logprobs_and_versions_and_nothing_else_is_trained():
    episode = two_turn_episode()
    assert episode.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12, 13, 14]
    assert episode.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert episode.logprobs == [0.0] * 3 + [-0.5, -0.25] + [0.0] * 3 + [-1.0, -2.0, -3.0]
    assert episode.versions == [0] * 3 + [3, 3] + [0] * 3 + [5, 5, 5]
    first, second = episode.turns
    assert episode.prompt_of(first) == [1, 2, 3] and episode.sampled_by(first) == [10, 11]
    # The second turn was given everything before it: the first turn's ids and the tool's.
    assert episode.prompt_of(second) == [1, 2, 3, 10, 11, 20, 21, 22] and episode.sampled_by(second) == [12, 13, 14]
    assert episode.model_tokens == 5 and episode.truncated and episode.oldest_version == 3


def test_a_turn_may_carry_one_version_per_id_and_must_be_consistent():
    episode = Episode.start([1])
    episode.add_model_turn([5, 6, 7], [-1.0, -1.0, -1.0], [4, 4, 5])  # a sync landed mid-turn
    assert episode.versions == [0, 4, 4, 5] and episode.oldest_version == 4
    with pytest.raises(EpisodeError, match="2 ids has 1 logprobs"):
        episode.add_model_turn([8, 9], [-1.0], 5)
    with pytest.raises(EpisodeError, match="empty model turn"):
        episode.add_model_turn([], [], [])
    empty = episode.add_model_turn([], [], 3)  # the engine sampled nothing; the turn still has a version
    assert empty.start == empty.end and episode.oldest_version == 3
    with pytest.raises(EpisodeError, match="non-empty prompt"):
        Episode.start([])


def test_a_group_of_episodes_is_one_valid_rollout_group_scored_by_final_rewards():
    episodes = [two_turn_episode(3, 5, 1.0), two_turn_episode(4, 4, 0.0, last="stop")]
    group = episode_group(episodes, temperature=0.7, top_p=1.0, source="environment", group_id="task-1")
    assert group.tokens == [e.tokens for e in episodes] and group.loss_mask == [e.loss_mask for e in episodes]
    assert group.inference_logprobs == [e.logprobs for e in episodes]
    assert group.token_versions == [e.versions for e in episodes]
    assert group.scores == [1.0, 0.0] and group.truncated == [True, False]
    assert group.policy_version == 3 == group.oldest_version and group.temperature == 0.7
    assert validate_group(group, **LIMITS) is None


def test_a_single_completion_is_a_one_turn_episode():
    episode = Episode.start([1, 2])
    episode.add_model_turn([7, 8], [-0.1, -0.2], 6, "stop")
    episode.reward = 0.5
    group = episode_group([episode], temperature=1.0, top_p=1.0, source="builtin", group_id="g")
    assert group.tokens == [[1, 2, 7, 8]] and group.loss_mask == [[0, 0, 1, 1]] and group.policy_version == 6
    assert group.token_versions is None, "one version: policy_version says it all"
    assert validate_group(group, **{**LIMITS, "group_normalised": False}) is None


def test_a_group_needs_every_episode_scored():
    unscored = two_turn_episode()
    unscored.reward = None
    with pytest.raises(EpisodeError, match=r"episodes \[1\] have no reward"):
        episode_group([two_turn_episode(), unscored], temperature=1.0, top_p=1.0, source="s", group_id="g")
