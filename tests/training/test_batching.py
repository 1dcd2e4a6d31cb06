import math
import random

import pytest
import torch

from grpod.models.tiny import build_model
from grpod.rollouts.group import RolloutGroup
from grpod.training.advantages import AdvantageResult
from grpod.training.batching import (
    TrainingSequence,
    collate,
    common_prefix,
    plan_micro_batches,
    training_sequences,
)


@pytest.mark.parametrize("budget", [16, 64, 100, 512, 100_000])
def test_plan_covers_every_sequence_once_within_the_budget(budget):
    rng = random.Random(budget)
    lengths = [rng.randint(5, 60) for _ in range(50)]
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for batch in plan.batches for i in batch) == list(range(50))
    processed = 0
    for batch in plan.batches:
        width = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * width <= budget
        processed += len(batch) * width
    assert plan.processed_tokens == processed
    assert plan.real_tokens == sum(lengths)
    assert plan.efficiency == pytest.approx(sum(lengths) / processed)
    # Sorted: every micro-batch's sequences are no longer than the next micro-batch's.
    flat = [lengths[i] for batch in plan.batches for i in batch]
    assert flat == sorted(flat)


@pytest.mark.parametrize("floor", [0.5, 0.9, 0.95, 1.0])
def test_efficiency_floor_holds_for_every_micro_batch(floor):
    rng = random.Random(7)
    lengths = [rng.randint(17, 41) for _ in range(64)]
    plan = plan_micro_batches(lengths, 4096, min_efficiency=floor)
    for batch in plan.batches:
        width = max(lengths[i] for i in batch)
        assert sum(lengths[i] for i in batch) >= floor * len(batch) * width
    assert plan.efficiency >= floor
    assert len(plan_micro_batches(lengths, 4096, min_efficiency=0.0).batches) == 1


def test_plan_known_example():
    plan = plan_micro_batches([10, 3, 4, 10, 4], micro_batch_tokens=12)
    assert plan.batches == [[1, 2, 4], [0], [3]]
    assert (plan.real_tokens, plan.processed_tokens) == (31, 12 + 10 + 10)
    # With room for all, a floor of 0.8 still separates the 3-4 run from the 10s: (11 + 10) / 40 < 0.8.
    plan = plan_micro_batches([10, 3, 4, 10, 4], micro_batch_tokens=1000, min_efficiency=0.8)
    assert plan.batches == [[1, 2, 4], [0, 3]]


def test_sequence_longer_than_budget_gets_its_own_micro_batch():
    plan = plan_micro_batches([5, 50, 5], micro_batch_tokens=16)
    assert plan.batches == [[0, 2], [1]]


def test_plan_refuses_a_non_positive_budget():
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        plan_micro_batches([3], 0)


def _result(**group_kwargs):
    g = RolloutGroup(
        tokens=[[5, 6, 7, 8], [5, 6, 9], [5, 6, 7]],
        loss_mask=[[0, 0, 1, 1], [0, 0, 1], [1, 0, 0]],
        scores=[1.0, 0.0, 0.0],
        inference_logprobs=[[0.0, 0.0, -0.1, -0.2], [0.0, 0.0, -0.3], [0.0, 0.0, 0.0]],
        temperature=0.7,
        **group_kwargs,
    )
    return AdvantageResult(groups=[g], advantages=[[1.0, -0.5, -0.5]])


def test_training_sequences_flatten_and_drop_sequences_without_loss_tokens():
    sequences = training_sequences(_result(), mask_truncated=False)
    # The third has loss only at position 0, which nothing predicts: dropped.
    assert [s.tokens for s in sequences] == [[5, 6, 7, 8], [5, 6, 9]]
    assert [s.advantage for s in sequences] == [1.0, -0.5]
    assert [s.loss_positions for s in sequences] == [[2, 3], [2]]
    assert all(s.temperature == 0.7 for s in sequences)


def test_per_sequence_temperature_override_wins_over_the_group_temperature():
    sequences = training_sequences(_result(overrides=[{"temperature": 1.3}, None, {}]), mask_truncated=False)
    assert [s.temperature for s in sequences] == [1.3, 0.7]


def test_truncated_sequences_are_dropped_when_masked():
    result = _result(truncated=[True, False, False])
    assert len(training_sequences(result, mask_truncated=False)) == 2
    assert [s.tokens for s in training_sequences(result, mask_truncated=True)] == [[5, 6, 9]]


def test_collate_gathers_loss_tokens_from_the_padded_block():
    seqs = [
        TrainingSequence([5, 6, 7, 8], [0, 0, 1, 1], 1.0, 0.7, [0.0, 0.0, -0.1, -0.2]),
        TrainingSequence([5, 9], [0, 1], -0.5, 1.0, None),
    ]
    batch = collate(seqs, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.rows.tolist() == [0, 0, 1]
    assert batch.positions.tolist() == [2, 3, 1]
    assert batch.targets.tolist() == [7, 8, 9]
    assert batch.temperatures.tolist() == pytest.approx([0.7, 0.7, 1.0])
    assert batch.advantages.tolist() == [1.0, 1.0, -0.5]
    assert batch.sequence_loss_tokens.tolist() == [2, 2, 1]
    inference = batch.inference_logprobs.tolist()
    assert inference[:2] == pytest.approx([-0.1, -0.2]) and math.isnan(inference[2])
    assert (batch.real_tokens, batch.processed_tokens) == (6, 8)


def test_right_padding_without_attention_mask_leaves_real_positions_unchanged():
    """The module's claim: with a causal LM, a padded row's real positions see only real tokens."""
    model, _ = build_model(seed=3)
    model.eval()
    long, short = [1, 7, 8, 9, 10, 11, 12], [1, 13, 14]
    batch = collate(
        [TrainingSequence(long, [1] * 7, 0.0, 1.0), TrainingSequence(short, [1] * 3, 0.0, 1.0)], pad_id=0
    )
    with torch.no_grad():
        padded = model(input_ids=batch.input_ids).logits
        alone = model(input_ids=torch.tensor([short])).logits
    torch.testing.assert_close(padded[1, :3], alone[0], rtol=1e-5, atol=1e-5)


def test_packed_micro_batches_hold_one_group_within_the_budget_and_count_its_prompt_once():
    """`plan_packed`: sequences sort by group then rest length, a micro-batch holds one group, its
    prompt plus its rests within the budget, and the plan counts each micro-batch's prompt once."""
    from grpod.training.batching import PACKED_POSITIONS, plan_packed

    rests = [5, 3, 9, 4, 7, 2]
    groups = [1, 0, 1, 0, 1, 0]
    prompts = [10, 6, 10, 6, 10, 6]
    plan = plan_packed(prompts, rests, groups, micro_batch_tokens=1000)
    assert plan.packed and plan.batches == [[5, 1, 3], [0, 4, 2]]
    assert plan.processed_tokens == plan.real_tokens == 6 + 9 + 10 + 21
    assert plan.shared_tokens == 6 * 2 + 10 * 2
    # 6 + 2 + 3 fits 11; 6 + 4 does not fit 11 with them; 10 + 5 + 7 fits 22, + 9 does not.
    assert plan_packed(prompts, rests, groups, micro_batch_tokens=11).batches == [[5, 1], [3], [0], [4], [2]]
    assert plan_packed(prompts, rests, groups, micro_batch_tokens=22).batches == [[5, 1, 3], [0, 4], [2]]
    # The dense mask bounds a packed row whatever the budget.
    big = plan_packed([0] * 3, [PACKED_POSITIONS // 2] * 3, [0] * 3, micro_batch_tokens=100_000)
    assert big.batches == [[0, 1], [2]]


def test_a_packed_row_gives_each_sequence_the_logits_it_has_alone():
    """One group packed: its shared prompt once, then each completion at the positions it has in
    its own sequence, masked to see the prompt and its own tokens only; the logits gathered at
    `predict_index` equal those of each sequence forwarded alone, and the targets are its tokens."""
    from grpod.training.forward import predicting_logits

    model, _ = build_model(seed=3)
    model.eval()
    prompt = [7, 8, 9, 10]
    rows = [TrainingSequence(prompt + [11, 12, 13], [0] * 4 + [1, 1, 1], 1.0, 1.0),
            TrainingSequence(prompt + [14], [0] * 4 + [1], -1.0, 0.7),
            TrainingSequence(prompt + [15, 16], [0] * 4 + [0, 1], 0.5, 1.0)]
    batch = collate(rows, pad_id=0, pack=True)
    assert batch.shared_prefix == 3  # the last prompt token predicts the first completion token
    assert batch.input_ids.tolist() == [[7, 8, 9, 10, 11, 12, 13, 10, 14, 10, 15, 16]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 3, 4, 3, 4, 5]]
    assert batch.targets.tolist() == [11, 12, 13, 14, 16]
    with torch.no_grad():
        packed = predicting_logits(model, batch)
        alone = [model(input_ids=torch.tensor([s.tokens])).logits[0] for s in rows]
    expected = torch.stack([alone[r][t - 1] for r, t in zip(batch.rows.tolist(), batch.positions.tolist(), strict=True)])
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
    padded = collate(rows, pad_id=0)
    assert padded.attention_mask is None and padded.input_ids.shape == (3, 7)
    with torch.no_grad():
        torch.testing.assert_close(predicting_logits(model, padded), expected, rtol=1e-5, atol=1e-5)
    lone = collate(rows[:1], pad_id=0, pack=True)
    assert lone.shared_prefix == 0 and lone.attention_mask is None, "a lone sequence shares nothing: no dense mask"
    with torch.no_grad():
        torch.testing.assert_close(predicting_logits(model, lone), expected[:3], rtol=1e-5, atol=1e-5)
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 5]], limit=10) == 1
    assert common_prefix([[1, 2, 3], [1, 2, 3]], limit=2) == 2


def test_rounded_micro_batches_are_planned_and_laid_out_to_the_multiple():
    """pad_to_multiple rounds a padded block's width and a packed row's positions up; the plans
    count those positions as processed, and the padding of a packed row is seen by no real position."""
    from grpod.training.batching import plan_packed, round_up

    assert [round_up(n, 8) for n in (1, 8, 9)] == [8, 8, 16] and round_up(9, 0) == round_up(9, 1) == 9
    lengths = [5, 9, 17, 30]
    plan = plan_micro_batches(lengths, 1000, pad_to_multiple=16)
    assert plan.batches == [[0, 1, 2, 3]] and plan.processed_tokens == 4 * 32 and plan.real_tokens == 61
    packed = plan_packed([4, 4], [3, 2], [0, 0], 1000, pad_to_multiple=8)
    assert packed.processed_tokens == 16 and packed.real_tokens == 9
    rows = [TrainingSequence([7, 8, 9, 10, 11, 12, 13], [0] * 4 + [1] * 3, 1.0, 1.0),
            TrainingSequence([7, 8, 9, 10, 14], [0] * 4 + [1], -1.0, 1.0)]
    assert collate(rows, pad_id=0, pad_to_multiple=8).input_ids.shape == (2, 8)
    batch = collate(rows, pad_id=0, pack=True, pad_to_multiple=8)
    assert batch.input_ids[0, :9].tolist() == [7, 8, 9, 10, 11, 12, 13, 10, 14]
    assert batch.input_ids.shape == (1, 16) and batch.input_ids[0, 9:].eq(0).all()
    mask = batch.attention_mask[0, 0]
    assert not mask[:9, 9:].any(), "a real position sees the padding"
    assert mask.any(dim=1).all(), "every position attends to something (no all-masked softmax row)"
    assert batch.position_ids[0, 9:].eq(0).all()
