"""The Atropos wire format (grpod/rollouts/atropos_wire.py): items of run-api's `/batch` become
groups, garbage raises `MalformedGroup` with a reason, and what converts is left to validation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpod.rollouts.atropos_wire import group_from_atropos
from grpod.rollouts.validation import (
    MalformedGroup,
    Rejection,
    RejectionReason,
    validate_group,
)


def atropos_item(**changes) -> dict:
    item = {
        "tokens": [[1, 2, 3, 4, 5], [1, 2, 3, 9, 8]],
        "masks": [[-100, -100, -100, 4, 5], [-100, -100, -100, 9, 8]],
        "scores": [1.0, 0.0],
        "advantages": None,
        "ref_logprobs": None,
        "messages": None,
        "generation_params": {"temperature": 0.7, "top_p": 1.0},
        "inference_logprobs": [[1.0, 1.0, 1.0, -0.2, -0.3], [1.0, 1.0, 1.0, -1.5, -0.1]],
        "overrides": None,
        "group_overrides": None,
        "images": None,
        "env_id": 0,
    }
    item.update(changes)
    return item


def test_atropos_item_converts_and_validates() -> None:
    group = group_from_atropos(atropos_item(), default_version=5)
    assert group.tokens == [[1, 2, 3, 4, 5], [1, 2, 3, 9, 8]]
    assert group.loss_mask == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert group.inference_logprobs == [[0.0, 0.0, 0.0, -0.2, -0.3], [0.0, 0.0, 0.0, -1.5, -0.1]]
    assert group.scores == [1.0, 0.0]
    assert (group.temperature, group.top_p) == (0.7, 1.0)
    assert group.policy_version == 5 and group.source == "atropos"
    assert group.group_id.startswith("atropos-") and group.extra == {"env_id": 0}
    assert group.advantages is None and group.overrides is None
    assert validate_group(group, vocab_size=16, max_seq_len=8, group_normalised=True) is None
    assert group_from_atropos(atropos_item(), default_version=5, group_id="b1-0").group_id == "b1-0"


def test_atropos_optional_fields_may_all_be_null() -> None:
    item = {k: None for k in atropos_item()}
    item.update(tokens=[[1, 2], [1, 3]], masks=[[-100, 2], [-100, 3]], scores=[0.5, 0.25])
    group = group_from_atropos(item, default_version=0)
    assert group.inference_logprobs is None and group.temperature == 1.0 and group.top_p == 1.0
    assert group.extra == {"temperature_from": "source.temperature"}
    no_keys = group_from_atropos({"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1]}, default_version=0)
    assert no_keys.scores == [1.0] and isinstance(no_keys.scores[0], float)
    assert validate_group(group, vocab_size=8, max_seq_len=8, group_normalised=True).reason == "missing_logprobs"


def test_atropos_advantages_overrides_and_temperature_precedence() -> None:
    item = atropos_item(
        advantages=[[0.0, 0.0, 0.0, 0.5, 0.5], [9.0, 9.0, 9.0, -0.5, -0.5]],
        overrides=[{"temperature": 0.3}, None],
        generation_params=None,
        group_overrides={"temperature": 0.3, "top_p": 0.95},
    )
    group = group_from_atropos(item, default_version=1)
    assert group.advantages == [0.5, -0.5]
    assert group.overrides == [{"temperature": 0.3}, {}]
    assert (group.temperature, group.top_p) == (0.3, 0.95)
    assert group.extra["group_overrides"] == {"temperature": 0.3, "top_p": 0.95}


@pytest.mark.parametrize(
    ("changes", "reason", "detail"),
    [
        ({"masks": [[-100, -100, -100, 4, 5], [-100, -100, 9, 8]]}, "length_mismatch", "sequence 1: 5 tokens, 4 mask"),
        ({"masks": [[-100, -100, -100, 4, 6], [-100, -100, -100, 9, 8]]}, "mask_token_mismatch", "masks[0][4] = 6"),
        ({"scores": [1.0]}, "count_mismatch", "scores: 1 entries for 2"),
        ({"scores": ["good", 0.0]}, "bad_type", "scores[0]"),
        ({"scores": [10**400, 0.0]}, "bad_type", "does not fit a float"),
        ({"tokens": "12345"}, "bad_type", "tokens: expected a list, got str"),
        ({"tokens": None}, "bad_type", "tokens: expected a list, got None"),
        ({"tokens": []}, "empty_group", ""),
        ({"tokens": [[1, 2, 3, 4, 5], [1, 2, None, 9, 8]]}, "bad_type", "tokens[1][2]"),
        ({"masks": None}, "bad_type", "masks"),
        ({"inference_logprobs": [[1.0, 1.0, 1.0, -0.2], [1.0, 1.0, 1.0, -1.5, -0.1]]}, "length_mismatch", "4 logprobs"),
        ({"inference_logprobs": [[1.0, 1.0, 1.0, None, -0.3], [1.0] * 5]}, "bad_type", "null at a loss position"),
        ({"inference_logprobs": [[1.0] * 5]}, "count_mismatch", "inference_logprobs: 1 entries"),
        ({"advantages": [[0, 0, 0, 0.1, 0.9], [0] * 5]}, "per_token_advantages", "advantages[0] varies"),
        ({"advantages": [[0.1, 0.1], [0.2, 0.2]]}, "length_mismatch", "2 advantages"),
        ({"overrides": [{"temperature": 0.3}, {"temperature": 0.9}]}, "mixed_temperature", "[0.3, 0.9]"),
        ({"overrides": ["x", {}]}, "bad_type", "overrides[0]"),
        ({"generation_params": {"temperature": "hot"}}, "bad_type", "generation_params.temperature"),
        ({"generation_params": [0.7]}, "bad_type", "generation_params"),
    ],
)
def test_atropos_garbage_raises_malformed_group(changes: dict, reason: str, detail: str) -> None:
    with pytest.raises(MalformedGroup) as caught:
        group_from_atropos(atropos_item(**changes), default_version=0)
    assert caught.value.reason == reason
    assert detail in caught.value.detail
    assert caught.value.rejection == Rejection(caught.value.reason, caught.value.detail)


def test_atropos_values_that_convert_are_left_to_validation() -> None:
    item = atropos_item(scores=[math.nan, 0.0], inference_logprobs=[[1.0, 1.0, 1.0, 0.5, -0.3], [1.0] * 3 + [-1.0] * 2])
    group = group_from_atropos(item, default_version=0)
    assert validate_group(group, vocab_size=16, max_seq_len=8, group_normalised=True).reason == "nonfinite_score"
    group.scores[0] = 1.0
    assert validate_group(group, vocab_size=16, max_seq_len=8, group_normalised=True).reason == "positive_logprob"
    assert validate_group(group, vocab_size=4, max_seq_len=8, group_normalised=True).reason == "token_out_of_vocab"
    with pytest.raises(MalformedGroup, match="not_a_group"):
        group_from_atropos(["not", "a", "dict"], default_version=0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)


@st.composite
def garbled_atropos_items(draw):
    item = atropos_item(
        advantages=[[0.0] * 5, [0.0] * 5], overrides=[{}, {}], group_overrides={"temperature": 0.7}
    )
    for key in draw(st.lists(st.sampled_from(sorted(item)), max_size=4)):
        item[key] = draw(json_values)
    if draw(st.booleans()):
        field = draw(st.sampled_from(["tokens", "masks", "inference_logprobs", "advantages"]))
        row = draw(st.integers(0, 1))
        if isinstance(item.get(field), list) and len(item[field]) > row and isinstance(item[field][row], list):
            item[field][row] = draw(json_values)
    return item


@settings(max_examples=400, deadline=None)
@given(garbled_atropos_items())
def test_fuzz_atropos_conversion_raises_only_malformed_group(item) -> None:
    try:
        group = group_from_atropos(item, default_version=0)
    except MalformedGroup as exc:
        assert exc.reason != RejectionReason.INTERNAL_ERROR, exc
        assert exc.reason in set(RejectionReason) and exc.detail
        return
    rejection = validate_group(group, vocab_size=16, max_seq_len=8, group_normalised=True)
    assert rejection is None or rejection.reason != RejectionReason.INTERNAL_ERROR


def test_atropos_truncation_reaches_mask_truncated() -> None:
    # F13: group_from_atropos never set `truncated`, so train.loss.mask_truncated did nothing.
    item = atropos_item(overrides=[{"finish_reason": "length"}, {"truncated": False}])
    assert group_from_atropos(item, default_version=0).truncated == [True, False]
    item = atropos_item(overrides=[{"truncated": True}, None])
    assert group_from_atropos(item, default_version=0).truncated == [True, False]
    assert group_from_atropos(atropos_item(), default_version=0).truncated is None


def test_override_temperatures_are_validated() -> None:
    # F2: a null override is "not overridden"; anything else that is not a positive number is refused.
    group = group_from_atropos(atropos_item(overrides=[{"temperature": None}, {}]), default_version=0)
    assert validate_group(group, vocab_size=16, max_seq_len=8, group_normalised=True) is None
    for bad in ("hot", 0.0, -1.0, float("nan"), True):
        group.overrides = [{"temperature": bad}, {}]
        rejection = validate_group(group, vocab_size=16, max_seq_len=8, group_normalised=True)
        assert rejection is not None and rejection.reason == "bad_temperature", bad


def test_truncated_sampling_is_refused_with_a_reason() -> None:
    # Nucleus / top-k truncation is not replicated by the trainer: its IS weights would be biased.
    group = group_from_atropos(atropos_item(generation_params={"temperature": 0.7, "top_p": 0.9}), default_version=0)
    rejection = validate_group(group, vocab_size=16, max_seq_len=8, group_normalised=True)
    assert rejection.reason == "truncated_sampling" and "top_p = 0.9" in rejection.detail
    with pytest.raises(MalformedGroup, match="truncated_sampling: generation_params.top_k = 20"):
        group_from_atropos(atropos_item(generation_params={"temperature": 0.7, "top_k": 20}), default_version=0)
    assert group_from_atropos(atropos_item(generation_params={"temperature": 0.7, "top_k": -1}), default_version=0)


def test_a_config_asking_for_top_p_below_one_is_refused() -> None:
    from grpod.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="source.top_p = 0.9 is refused"):
        parse_config({"source": {"top_p": 0.9}})


def test_an_undeclared_temperature_comes_from_config_and_is_recorded_or_is_refused() -> None:
    """Issue #12 (F5): a group without a declared temperature is not silently trained at 1.0."""
    item = atropos_item(generation_params=None)
    group = group_from_atropos(item, default_version=0, undeclared_temperature=0.7)
    assert group.temperature == 0.7 and group.extra["temperature_from"] == "source.temperature"
    declared = group_from_atropos(atropos_item(), default_version=0, undeclared_temperature=0.3)
    assert declared.temperature == 0.7 and "temperature_from" not in declared.extra
    per_sequence = atropos_item(generation_params=None, overrides=[{"temperature": 0.5}, {"temperature": 0.5}])
    assert group_from_atropos(per_sequence, default_version=0, undeclared_temperature=None).temperature == 0.5
    with pytest.raises(MalformedGroup) as refused:
        group_from_atropos(item, default_version=0, undeclared_temperature=None)
    assert refused.value.reason == "undeclared_temperature"
    assert "generation_params.temperature" in refused.value.detail
