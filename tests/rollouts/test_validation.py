"""Bad groups are rejected with a reason, never crash validation, and never take good ones down."""

from __future__ import annotations

import copy
import math

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.validation import (
    Rejection,
    RejectionCounter,
    RejectionReason,
    validate_batch,
    validate_group,
)

VOCAB = 50
MAX_LEN = 12
LIMITS = {"vocab_size": VOCAB, "max_seq_len": MAX_LEN, "group_normalised": True}


def make_group(size: int = 4, prompt: int = 3, completion: int = 4, group_id: str = "g") -> RolloutGroup:
    """A valid group: `prompt` tokens without loss, then `completion` loss tokens."""
    length = prompt + completion
    return RolloutGroup(
        tokens=[[(7 * i + t) % VOCAB for t in range(length)] for i in range(size)],
        loss_mask=[[0] * prompt + [1] * completion for _ in range(size)],
        scores=[float(i % 2) for i in range(size)],
        inference_logprobs=[[0.0] * prompt + [-0.5 - 0.1 * t for t in range(completion)] for _ in range(size)],
        temperature=0.8,
        top_p=1.0,
        policy_version=3,
        source="builtin",
        group_id=group_id,
    )


def _set(attr: str, value):
    return lambda g: setattr(g, attr, value)


def _set_item(attr: str, index: tuple[int, ...], value):
    def mutate(g: RolloutGroup) -> None:
        target = getattr(g, attr)
        for i in index[:-1]:
            target = target[i]
        target[index[-1]] = value

    return mutate


def _keep_first_sequence(g: RolloutGroup) -> None:
    for field in (g.tokens, g.loss_mask, g.scores, g.inference_logprobs):
        del field[1:]


HAND_CASES = [
    (lambda g: setattr(g, "tokens", []), "empty_group", "no sequences"),
    (lambda g: g.tokens[1].append(3), "length_mismatch", "sequence 1: 8 tokens, 7 mask entries"),
    (lambda g: g.inference_logprobs[2].pop(), "length_mismatch", "sequence 2: 7 tokens, 6 logprobs"),
    (lambda g: g.scores.pop(), "count_mismatch", "scores: 3 entries for 4 sequences"),
    (lambda g: g.loss_mask.pop(), "count_mismatch", "loss_mask: 3 entries"),
    (_set("advantages", [0.1, 0.2]), "count_mismatch", "advantages: 2 entries"),
    (_set("overrides", [{}] * 5), "count_mismatch", "overrides: 5 entries"),
    (_set("truncated", [False]), "count_mismatch", "truncated: 1 entries"),
    (_set("loss_mask", [[0] * 7 for _ in range(4)]), "no_loss_tokens", "none of the 4"),
    (_set_item("scores", (2,), math.nan), "nonfinite_score", "scores[2]"),
    (_set_item("scores", (0,), math.inf), "nonfinite_score", "scores[0] = inf"),
    (_set("advantages", [0.0, -math.inf, 0.0, 0.0]), "nonfinite_advantage", "advantages[1]"),
    (_set_item("inference_logprobs", (1, 5), math.nan), "nonfinite_logprob", "inference_logprobs[1][5]"),
    (_set_item("inference_logprobs", (1, 0), math.inf), "nonfinite_logprob", "inference_logprobs[1][0]"),
    (_set_item("inference_logprobs", (3, 4), 0.3), "positive_logprob", "inference_logprobs[3][4] = 0.3"),
    (_set_item("tokens", (0, 2), VOCAB), "token_out_of_vocab", f"tokens[0][2] = {VOCAB} outside [0, {VOCAB})"),
    (_set_item("tokens", (0, 2), -1), "token_out_of_vocab", "tokens[0][2] = -1"),
    (
        lambda g: [seq.extend([0] * 6) for field in (g.tokens, g.loss_mask, g.inference_logprobs) for seq in field],
        "sequence_too_long",
        "13 tokens > max_seq_len 12",
    ),
    (_keep_first_sequence, "group_too_small", "1 sequence"),
    (_set_item("loss_mask", (0, 4), 2), "bad_mask_value", "loss_mask[0][4] = 2"),
    (_set_item("loss_mask", (0, 4), 0.5), "bad_type", "loss_mask[0][4]"),
    (_set_item("loss_mask", (2, 0), 1), "loss_on_first_token", "loss_mask[2][0]"),
    (_set("temperature", 0.0), "bad_temperature", "temperature = 0.0"),
    (_set("temperature", math.nan), "bad_temperature", "temperature = nan"),
    (_set("top_p", 1.5), "bad_top_p", "top_p = 1.5"),
    (_set("policy_version", -1), "bad_policy_version", "policy_version = -1"),
    (_set("weight", math.inf), "bad_weight", "weight = inf"),
    (_set("tokens", "abc"), "bad_type", "tokens: expected a list, got str"),
    (_set_item("tokens", (1,), "hello"), "bad_type", "tokens[1]: expected a list, got str"),
    (_set_item("tokens", (1, 3), "7"), "bad_type", "tokens[1][3]: expected an int token id, got str"),
    (_set_item("tokens", (1, 3), 7.0), "bad_type", "tokens[1][3]"),
    (_set_item("tokens", (1, 3), True), "bad_type", "tokens[1][3]"),
    (_set_item("scores", (0,), None), "bad_type", "scores[0]: expected a number, got None"),
    (_set("scores", None), "bad_type", "scores: expected a list, got None"),
    (_set_item("inference_logprobs", (0, 5), "x"), "bad_type", "inference_logprobs[0][5]"),
    (_set("inference_logprobs", None), "missing_logprobs", "inference_logprobs is None"),
    (_set("overrides", [{}, None, {}, {}]), "bad_type", "overrides[1]: expected a dict"),
    (_set("truncated", [False, 0, False, False]), "bad_type", "truncated[1]: expected a bool"),
    (lambda g: [field.__setitem__(1, []) for field in (g.tokens, g.loss_mask, g.inference_logprobs)],
     "empty_sequence", "sequence 1 has no tokens"),
    (_set("token_versions", [[3] * 7] * 3), "count_mismatch", "token_versions: 3 entries for 4 sequences"),
    (_set("token_versions", [[3] * 7] * 3 + [[3] * 6]), "length_mismatch", "sequence 3: 7 tokens, 6 token versions"),
    (_set("token_versions", [[3] * 7] * 3 + [[3, 3, 3, 3, "4", 4, 4]]), "bad_type", "token_versions[3][4]"),
    (_set("token_versions", [[3] * 7] * 3 + [None]), "bad_type", "token_versions[3]: expected a list"),
    # An episode's loss token sampled before the group's policy_version: it would escape the bound.
    (_set("token_versions", [[3] * 7] * 2 + [[3, 3, 3, 3, 4, 2, 4], [3] * 7]), "bad_token_version",
     "token_versions[2][5] = 2 at a loss position, older than the group's policy_version 3"),
]


@pytest.mark.parametrize(
    ("mutate", "reason", "detail"), HAND_CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(HAND_CASES)]
)
def test_each_rule_rejects_with_its_reason(mutate, reason: str, detail: str) -> None:
    group = make_group()
    assert validate_group(group, **LIMITS) is None
    mutate(group)
    rejection = validate_group(group, **LIMITS)
    assert rejection is not None, "the mutated group should have been rejected"
    assert rejection.reason == reason
    assert detail in rejection.detail


def test_accepted_edge_cases() -> None:
    group = make_group()
    # A sequence without loss tokens contributes nothing but does not spoil the group.
    group.loss_mask[1] = [0] * 7
    # Tiny positive logprobs (float rounding of a near-certain token) are tolerated.
    group.inference_logprobs[0][4] = 5e-5
    # Logprobs at masked positions are not held to <= 0 (Atropos puts 1.0 there).
    group.inference_logprobs[0][1] = 1.0
    group.advantages = [0.5, -0.5, 0.0, 1]
    group.truncated = [False, True, False, False]
    group.overrides = [{}, {"set_advantage_to_zero": True}, {}, {}]
    assert validate_group(group, **LIMITS) is None

    single = make_group(size=1)
    assert validate_group(single, **LIMITS).reason == "group_too_small"
    assert validate_group(single, **{**LIMITS, "group_normalised": False}) is None

    no_logprobs = make_group()
    no_logprobs.inference_logprobs = None
    assert validate_group(no_logprobs, **LIMITS, require_logprobs=False) is None

    # An episode spanning a sync: loss tokens from versions 3 and 5; masked positions carry 0.
    episode = make_group()
    episode.token_versions = [[0, 0, 0, 3, 3, 5, 5] for _ in range(4)]
    assert validate_group(episode, **LIMITS) is None


def test_validate_batch_splits_counts_and_logs_each_rejection() -> None:
    good = [make_group(group_id=f"good-{i}") for i in range(3)]
    bad_nan = make_group(group_id="bad-nan")
    bad_nan.scores[0] = math.nan
    bad_len = make_group(group_id="bad-len")
    bad_len.tokens[0].append(1)
    counter = RejectionCounter()

    with structlog.testing.capture_logs() as logs:
        valid, rejected = validate_batch(
            [good[0], bad_nan, good[1], "not a group", bad_len, good[2]], **LIMITS, counter=counter
        )

    assert valid == good and all(a is b for a, b in zip(valid, good))
    assert [(item if isinstance(item, str) else item.group_id, r.reason) for item, r in rejected] == [
        ("bad-nan", "nonfinite_score"),
        ("not a group", "not_a_group"),
        ("bad-len", "length_mismatch"),
    ]
    assert counter.as_dict() == {"length_mismatch": 1, "nonfinite_score": 1, "not_a_group": 1}
    assert counter.total == 3
    events = [e for e in logs if e["event"] == "group_rejected"]
    assert [(e["reason"], e["group_id"], e["source"]) for e in events] == [
        ("nonfinite_score", "bad-nan", "builtin"),
        ("not_a_group", None, None),
        ("length_mismatch", "bad-len", "builtin"),
    ]
    assert all(e["detail"] for e in events)


def test_a_reason_rejected_again_and_again_is_logged_once_per_interval_and_counted_every_time(monkeypatch) -> None:
    """A converged model's identical groups, rejected as duplicates, printed a warning each."""
    import grpod.rollouts.validation as validation
    from grpod.service.logs import REPEAT_EVERY_S

    clock = [100.0]
    monkeypatch.setattr(validation.time, "monotonic", lambda: clock[0])
    counter = RejectionCounter()
    bad = [make_group(group_id=f"bad-{i}") for i in range(7)]
    for group in bad:
        group.scores[0] = math.nan
    with structlog.testing.capture_logs() as logs:
        validate_batch(bad[:5], **LIMITS, counter=counter)
        clock[0] += REPEAT_EVERY_S
        validate_batch(bad[5:], **LIMITS, counter=counter)
    events = [e for e in logs if e["event"] == "group_rejected"]
    assert [(e["group_id"], e.get("same_reason_not_shown")) for e in events] == [("bad-0", None), ("bad-5", 4)]
    assert counter.as_dict() == {"nonfinite_score": 7}


# --- fuzz: mutations of valid groups ----------------------------------------------------------

BAD_VALUES = [None, "x", "", [], {}, math.nan, math.inf, -math.inf, 1e9, -1, VOCAB, 2.5, True, [1, 2], 10**400]

# Each mutation makes a valid group invalid, so the mutated group must be rejected.
SEQ_FIELDS = ["tokens", "loss_mask", "inference_logprobs"]
COUNT_FIELDS = ["scores", "advantages", "overrides", "truncated"]


def _mutations(draw, group: RolloutGroup) -> None:
    kind = draw(
        st.sampled_from(
            ["drop_pos", "extend_pos", "drop_seq", "extend_count", "replace_elem", "replace_row", "replace_field",
             "nan_score", "positive_logprob", "nonfinite_logprob", "oov_token", "bad_scalar"]
        )
    )
    i = draw(st.integers(0, group.size - 1))
    if kind == "drop_pos":
        getattr(group, draw(st.sampled_from(SEQ_FIELDS)))[i].pop()
    elif kind == "extend_pos":
        getattr(group, draw(st.sampled_from(SEQ_FIELDS)))[i].append(draw(st.sampled_from([0, 1, -0.5])))
    elif kind == "drop_seq":
        field = draw(st.sampled_from(SEQ_FIELDS + COUNT_FIELDS))
        getattr(group, field).pop(i)
    elif kind == "extend_count":
        field = draw(st.sampled_from(COUNT_FIELDS))
        getattr(group, field).append(copy.deepcopy(getattr(group, field)[0]))
    elif kind == "replace_elem":
        field = draw(st.sampled_from(["tokens", "loss_mask"]))
        t = draw(st.integers(0, len(getattr(group, field)[i]) - 1))
        getattr(group, field)[i][t] = draw(st.sampled_from([v for v in BAD_VALUES if v not in (0, 1)]))
    elif kind == "replace_row":
        field = draw(st.sampled_from(SEQ_FIELDS))
        getattr(group, field)[i] = draw(st.sampled_from([None, "abc", 3, 1.5, {"a": 1}]))
    elif kind == "replace_field":
        field = draw(st.sampled_from(["tokens", "loss_mask", "scores", "inference_logprobs"]))
        setattr(group, field, draw(st.sampled_from([None, "abc", 3, {"a": 1}, []])))
    elif kind == "nan_score":
        group.scores[i] = draw(st.sampled_from([math.nan, math.inf, -math.inf, None, "1.0", 10**400]))
    elif kind == "positive_logprob":
        t = draw(st.sampled_from([t for t, m in enumerate(group.loss_mask[i]) if m == 1]))
        group.inference_logprobs[i][t] = draw(st.floats(min_value=1e-3, max_value=1e6))
    elif kind == "nonfinite_logprob":
        t = draw(st.integers(0, len(group.tokens[i]) - 1))
        group.inference_logprobs[i][t] = draw(st.sampled_from([math.nan, math.inf, -math.inf, None, "x"]))
    elif kind == "oov_token":
        t = draw(st.integers(0, len(group.tokens[i]) - 1))
        group.tokens[i][t] = draw(st.sampled_from([VOCAB, VOCAB + 1000, -1, -(10**30)]))
    elif kind == "bad_scalar":
        attr, value = draw(
            st.sampled_from(
                [("temperature", 0), ("temperature", -1.0), ("temperature", math.nan), ("temperature", "hot"),
                 ("top_p", 0.0), ("top_p", None), ("policy_version", -3), ("policy_version", 1.5),
                 ("weight", -0.1), ("weight", math.nan), ("group_id", 5), ("extra", None)]
            )
        )
        setattr(group, attr, value)


@st.composite
def batches(draw):
    """Valid groups with mutated (invalid) ones mixed in; returns (batch, is_bad flags)."""
    items, flags = [], []
    for k in range(draw(st.integers(1, 6))):
        group = make_group(
            size=draw(st.integers(2, 4)),
            prompt=draw(st.integers(1, 3)),
            completion=draw(st.integers(1, 5)),
            group_id=f"g{k}",
        )
        group.advantages = [0.0] * group.size
        group.overrides = [{} for _ in range(group.size)]
        group.truncated = [False] * group.size
        bad = draw(st.booleans())
        if bad:
            # One mutation: two could cancel out (drop a position, then append one).
            _mutations(draw, group)
        items.append(group)
        flags.append(bad)
    return items, flags


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_fuzz_validate_batch_never_raises_and_keeps_valid_groups(batch) -> None:
    items, flags = batch
    counter = RejectionCounter()
    valid, rejected = validate_batch(items, **LIMITS, counter=counter)

    assert len(valid) + len(rejected) == len(items)
    expected_valid = [g for g, bad in zip(items, flags) if not bad]
    assert len(valid) == len(expected_valid) and all(a is b for a, b in zip(valid, expected_valid))
    assert [id(g) for g, _ in rejected] == [id(g) for g, bad in zip(items, flags) if bad]
    for _, rejection in rejected:
        assert isinstance(rejection, Rejection)
        assert rejection.reason in set(RejectionReason) - {RejectionReason.INTERNAL_ERROR}, rejection
        assert rejection.detail
    assert counter.total == len(rejected)
