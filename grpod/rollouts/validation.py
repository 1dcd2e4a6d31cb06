"""Batch validation: every `RolloutGroup` is checked before it can reach the trainer.

A bad group is rejected with a machine-readable reason code and a short detail, counted and
logged (`group_rejected`: a reason's first, then one per 30 s with how many were not shown), and
the rest of the batch goes on: bad input never crashes the daemon.
Validation never raises, whatever the group holds (strings where lists belong, None, NaN, ...).

Rules a valid group satisfies (`validate_group`):
- at least one sequence (two when advantages are group-normalised);
- per sequence: `tokens`, `loss_mask` and `inference_logprobs` are lists of the same length,
  1..max_seq_len; token ids are ints in [0, vocab_size); mask values are 0 or 1, and 0 at
  position 0 (no token precedes it to predict it from);
- `scores` (and `advantages`, `overrides`, `truncated` when present) have one entry per sequence;
  scores and advantages are finite numbers;
- logprobs are finite everywhere (NaN at a masked position still poisons a masked sum) and
  <= LOGPROB_TOLERANCE at loss positions;
- at least one loss token in the group (a sequence without any simply contributes nothing);
- temperature finite and > 0 (also a per-sequence `overrides[i]["temperature"]`, where null means
  not overridden), top_p exactly 1 (truncated sampling is not replicated by the trainer: rejected
  as `truncated_sampling`, as is an Atropos top_k > 0), policy_version an int >= 0, weight finite >= 0;
- `token_versions`, when present (an episode's per-token sampling versions): one list of ints per
  sequence, as long as its tokens, and at every loss position an int >= `policy_version` (the
  group's version is its oldest; a token older than that would escape the staleness bound:
  `bad_token_version`). Masked positions carry no version and are not checked beyond their type.

The Atropos wire format is converted in `grpod.rollouts.atropos_wire` with the same reason codes.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import compress
from numbers import Integral, Real
from typing import Any

import structlog

from grpod.rollouts.group import RolloutGroup
from grpod.service.logs import RepeatThrottle

log = structlog.get_logger(__name__)

# vLLM's float32 log-softmax can round a near-certain token's logprob to a hair above 0.
LOGPROB_TOLERANCE = 1e-4


class RejectionReason(StrEnum):
    NOT_A_GROUP = "not_a_group"
    EMPTY_GROUP = "empty_group"
    EMPTY_SEQUENCE = "empty_sequence"
    GROUP_TOO_SMALL = "group_too_small"
    BAD_TYPE = "bad_type"
    COUNT_MISMATCH = "count_mismatch"
    LENGTH_MISMATCH = "length_mismatch"
    SEQUENCE_TOO_LONG = "sequence_too_long"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    BAD_MASK_VALUE = "bad_mask_value"
    LOSS_ON_FIRST_TOKEN = "loss_on_first_token"
    NO_LOSS_TOKENS = "no_loss_tokens"
    MISSING_LOGPROBS = "missing_logprobs"
    NONFINITE_LOGPROB = "nonfinite_logprob"
    POSITIVE_LOGPROB = "positive_logprob"
    NONFINITE_SCORE = "nonfinite_score"
    NONFINITE_ADVANTAGE = "nonfinite_advantage"
    BAD_TEMPERATURE = "bad_temperature"
    BAD_TOP_P = "bad_top_p"
    # top_p < 1 or top_k > 0: sampling the trainer does not replicate (biased IS weights).
    TRUNCATED_SAMPLING = "truncated_sampling"
    BAD_POLICY_VERSION = "bad_policy_version"
    # A loss token's sampling version missing, not an int, or older than the group's policy_version.
    BAD_TOKEN_VERSION = "bad_token_version"
    BAD_WEIGHT = "bad_weight"
    # Only from group_from_atropos:
    MASK_TOKEN_MISMATCH = "mask_token_mismatch"
    MIXED_TEMPERATURE = "mixed_temperature"
    # No sampling temperature declared, with source.atropos_undeclared_temperature = "refuse".
    UNDECLARED_TEMPERATURE = "undeclared_temperature"
    PER_TOKEN_ADVANTAGES = "per_token_advantages"
    # A group whose content the trainer has already received (grpod.rollouts.duplicates).
    DUPLICATE = "duplicate"
    # A bug in this module, never bad data; counted rather than crashing the daemon.
    INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True)
class Rejection:
    reason: RejectionReason
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


class MalformedGroup(ValueError):
    """An Atropos batch item that cannot be converted into a RolloutGroup."""

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    @property
    def rejection(self) -> Rejection:
        return Rejection(self.reason, self.detail)


class InvalidField(Exception):
    """Internal: carries the first rule a group breaks out of the nested checks."""

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def is_int(x: Any) -> bool:
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def is_number(x: Any) -> bool:
    return type(x) is float or type(x) is int or (isinstance(x, Real) and not isinstance(x, bool))


def _is_mask_value(x: Any) -> bool:
    return isinstance(x, Integral)  # bools pass: True/False are 1/0


def _is_finite(x: Any) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def type_name(x: Any) -> str:
    return "None" if x is None else type(x).__name__


def show(x: Any) -> str:
    """A value for a rejection detail, cut short: garbage can be huge."""
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _first_failing(values: Iterable[Any], ok: Callable[[Any], bool]) -> int | None:
    return next((j for j, x in enumerate(values) if not ok(x)), None)


def require_list(name: str, value: Any) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise InvalidField(RejectionReason.BAD_TYPE, f"{name}: expected a list, got {type_name(value)}")
    return value


def require_elements(
    name: str, values: Sequence[Any], ok: Callable[[Any], bool], what: str, usual_type: type | None = None
) -> None:
    # Checking `type(x) is usual_type` first is ~5x faster on the common all-plain-ints/floats case.
    if usual_type is not None and all(type(x) is usual_type for x in values):
        return
    bad = _first_failing(values, ok)
    if bad is not None:
        raise InvalidField(
            RejectionReason.BAD_TYPE,
            f"{name}[{bad}]: expected {what}, got {type_name(values[bad])} {show(values[bad])}",
        )


def require_count(name: str, values: Sequence[Any], n: int) -> None:
    if len(values) != n:
        raise InvalidField(RejectionReason.COUNT_MISMATCH, f"{name}: {len(values)} entries for {n} sequences")


def _require_finite(name: str, values: Sequence[float], reason: RejectionReason) -> None:
    try:
        if math.isfinite(sum(values)):  # fast path; a sum that overflows falls through to the exact check
            return
    except OverflowError:
        pass
    bad = _first_failing(values, _is_finite)
    if bad is not None:
        raise InvalidField(reason, f"{name}[{bad}] = {show(values[bad])}")


def _check_sequence(
    i: int,
    tokens: Any,
    mask: Any,
    logprobs: Any,
    *,
    has_logprobs: bool,
    vocab_size: int,
    max_seq_len: int,
) -> int:
    """Check sequence i (and its logprobs row when the group has logprobs); return its loss tokens."""
    tokens = require_list(f"tokens[{i}]", tokens)
    mask = require_list(f"loss_mask[{i}]", mask)
    if len(tokens) != len(mask):
        raise InvalidField(RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(mask)} mask entries")
    if has_logprobs:
        logprobs = require_list(f"inference_logprobs[{i}]", logprobs)
        if len(logprobs) != len(tokens):
            raise InvalidField(
                RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(logprobs)} logprobs"
            )
    if not tokens:
        raise InvalidField(RejectionReason.EMPTY_SEQUENCE, f"sequence {i} has no tokens")
    if len(tokens) > max_seq_len:
        raise InvalidField(
            RejectionReason.SEQUENCE_TOO_LONG, f"sequence {i}: {len(tokens)} tokens > max_seq_len {max_seq_len}"
        )
    require_elements(f"tokens[{i}]", tokens, is_int, "an int token id", int)
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        bad = _first_failing(tokens, lambda t: 0 <= t < vocab_size)
        raise InvalidField(
            RejectionReason.TOKEN_OUT_OF_VOCAB, f"tokens[{i}][{bad}] = {tokens[bad]} outside [0, {vocab_size})"
        )
    require_elements(f"loss_mask[{i}]", mask, _is_mask_value, "0 or 1", int)
    if not set(mask) <= {0, 1}:
        bad = _first_failing(mask, lambda m: m == 0 or m == 1)
        raise InvalidField(RejectionReason.BAD_MASK_VALUE, f"loss_mask[{i}][{bad}] = {mask[bad]}, expected 0 or 1")
    if mask[0]:
        raise InvalidField(
            RejectionReason.LOSS_ON_FIRST_TOKEN, f"loss_mask[{i}][0] = 1: no token precedes position 0 to predict it"
        )
    if has_logprobs:
        require_elements(f"inference_logprobs[{i}]", logprobs, is_number, "a number", float)
        _require_finite(f"inference_logprobs[{i}]", logprobs, RejectionReason.NONFINITE_LOGPROB)
        if max(compress(logprobs, mask), default=-math.inf) > LOGPROB_TOLERANCE:
            bad = next(t for t, (m, lp) in enumerate(zip(mask, logprobs)) if m and lp > LOGPROB_TOLERANCE)
            raise InvalidField(
                RejectionReason.POSITIVE_LOGPROB,
                f"inference_logprobs[{i}][{bad}] = {show(logprobs[bad])} > 0 at a loss position",
            )
    return sum(mask)


def _check_token_versions(group: RolloutGroup, n: int) -> None:
    """`token_versions` against the already checked tokens and masks (module docstring)."""
    rows = require_list("token_versions", group.token_versions)
    require_count("token_versions", rows, n)
    for i, (versions, mask) in enumerate(zip(rows, group.loss_mask, strict=True)):
        versions = require_list(f"token_versions[{i}]", versions)
        if len(versions) != len(mask):
            raise InvalidField(
                RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(mask)} tokens, {len(versions)} token versions"
            )
        require_elements(f"token_versions[{i}]", versions, is_int, "an int policy version", int)
        bad = next((t for t, (m, v) in enumerate(zip(mask, versions)) if m and v < group.policy_version), None)
        if bad is not None:
            raise InvalidField(
                RejectionReason.BAD_TOKEN_VERSION,
                f"token_versions[{i}][{bad}] = {versions[bad]} at a loss position, older than the group's "
                f"policy_version {group.policy_version} (set policy_version to the oldest token's version)",
            )


def _check_scalars(group: RolloutGroup) -> None:
    t = group.temperature
    if not is_number(t) or not _is_finite(t) or t <= 0:
        raise InvalidField(RejectionReason.BAD_TEMPERATURE, f"temperature = {show(t)}, expected a finite number > 0")
    p = group.top_p
    if not is_number(p) or not (0 < p <= 1):
        raise InvalidField(RejectionReason.BAD_TOP_P, f"top_p = {show(p)}, expected a number in (0, 1]")
    if p < 1:
        raise InvalidField(
            RejectionReason.TRUNCATED_SAMPLING,
            f"top_p = {show(p)} < 1: the trainer does not replicate nucleus truncation; sample with top_p = 1",
        )
    v = group.policy_version
    if not is_int(v) or v < 0:
        raise InvalidField(RejectionReason.BAD_POLICY_VERSION, f"policy_version = {show(v)}, expected an int >= 0")
    w = group.weight
    if not is_number(w) or not _is_finite(w) or w < 0:
        raise InvalidField(RejectionReason.BAD_WEIGHT, f"weight = {show(w)}, expected a finite number >= 0")
    for name in ("group_id", "source"):
        if not isinstance(getattr(group, name), str):
            raise InvalidField(RejectionReason.BAD_TYPE, f"{name}: expected a str, got {type_name(getattr(group, name))}")
    if not isinstance(group.extra, dict):
        raise InvalidField(RejectionReason.BAD_TYPE, f"extra: expected a dict, got {type_name(group.extra)}")


def _check_group(
    group: Any, *, vocab_size: int, max_seq_len: int, group_normalised: bool, require_logprobs: bool
) -> None:
    if not isinstance(group, RolloutGroup):
        raise InvalidField(RejectionReason.NOT_A_GROUP, f"expected a RolloutGroup, got {type_name(group)}")
    tokens = require_list("tokens", group.tokens)
    n = len(tokens)
    if n == 0:
        raise InvalidField(RejectionReason.EMPTY_GROUP, "the group has no sequences")
    if group_normalised and n < 2:
        raise InvalidField(
            RejectionReason.GROUP_TOO_SMALL, f"{n} sequence; group-normalised advantages need at least 2"
        )
    mask = require_list("loss_mask", group.loss_mask)
    require_count("loss_mask", mask, n)
    scores = require_list("scores", group.scores)
    require_count("scores", scores, n)
    require_elements("scores", scores, is_number, "a number")
    _require_finite("scores", scores, RejectionReason.NONFINITE_SCORE)
    logprobs = group.inference_logprobs
    if logprobs is None:
        if require_logprobs:
            raise InvalidField(RejectionReason.MISSING_LOGPROBS, "inference_logprobs is None; the loss needs them")
    else:
        logprobs = require_list("inference_logprobs", logprobs)
        require_count("inference_logprobs", logprobs, n)
    if group.advantages is not None:
        advantages = require_list("advantages", group.advantages)
        require_count("advantages", advantages, n)
        require_elements("advantages", advantages, is_number, "a number")
        _require_finite("advantages", advantages, RejectionReason.NONFINITE_ADVANTAGE)
    if group.overrides is not None:
        overrides = require_list("overrides", group.overrides)
        require_count("overrides", overrides, n)
        require_elements("overrides", overrides, lambda o: isinstance(o, dict), "a dict")
        for i, override in enumerate(overrides):
            t = override.get("temperature")
            if t is not None and (not is_number(t) or not _is_finite(t) or t <= 0):
                raise InvalidField(
                    RejectionReason.BAD_TEMPERATURE,
                    f"overrides[{i}].temperature = {show(t)}, expected a finite number > 0 (or null: not overridden)",
                )
    if group.truncated is not None:
        truncated = require_list("truncated", group.truncated)
        require_count("truncated", truncated, n)
        require_elements("truncated", truncated, lambda b: isinstance(b, bool), "a bool")
    _check_scalars(group)
    loss_tokens = 0
    for i in range(n):
        loss_tokens += _check_sequence(
            i,
            tokens[i],
            mask[i],
            None if logprobs is None else logprobs[i],
            has_logprobs=logprobs is not None,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
        )
    if loss_tokens == 0:
        raise InvalidField(RejectionReason.NO_LOSS_TOKENS, f"none of the {n} sequences has a loss token")
    if group.token_versions is not None:
        _check_token_versions(group, n)


def validate_group(
    group: RolloutGroup,
    *,
    vocab_size: int,
    max_seq_len: int,
    group_normalised: bool,
    require_logprobs: bool = True,
) -> Rejection | None:
    """None when the group is valid, else the first rule it breaks. Never raises.

    `require_logprobs=False` accepts groups without `inference_logprobs` (for a trainer that
    recomputes the behaviour logprobs itself).
    """
    try:
        _check_group(
            group,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            group_normalised=group_normalised,
            require_logprobs=require_logprobs,
        )
    except InvalidField as invalid:
        return Rejection(invalid.reason, invalid.detail)
    except Exception as exc:  # noqa: BLE001 - bad input must never crash the daemon
        return Rejection(RejectionReason.INTERNAL_ERROR, f"validation failed unexpectedly: {exc!r:.200}")
    return None


class RejectionCounter:
    """Rejected groups per reason, over the life of a run (for `ctl status` and metrics), and how
    often each reason is logged: its first, then one per REPEAT_EVERY_S with the count
    held back (a converged model's duplicate groups printed a warning each, 157 by step 400)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self.warnings = RepeatThrottle()

    def add(self, rejection: Rejection) -> None:
        self._counts[str(rejection.reason)] += 1

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self._counts.items()))


def record_rejection(item: Any, rejection: Rejection, counter: RejectionCounter | None = None) -> None:
    """Log one `group_rejected` event (and count it): the one place a rejection is reported."""
    held = 0
    if counter is not None:
        counter.add(rejection)
        held = counter.warnings.admit(str(rejection.reason), time.monotonic())
        if held is None:
            return
    log.warning(
        "group_rejected",
        reason=str(rejection.reason),
        detail=rejection.detail,
        group_id=item.group_id if isinstance(item, RolloutGroup) else None,
        source=item.source if isinstance(item, RolloutGroup) else None,
        **({"same_reason_not_shown": held} if held else {}),
    )


def validate_batch(
    groups: Iterable[Any],
    *,
    vocab_size: int,
    max_seq_len: int,
    group_normalised: bool,
    require_logprobs: bool = True,
    counter: RejectionCounter | None = None,
) -> tuple[list[RolloutGroup], list[tuple[Any, Rejection]]]:
    """Split a batch into valid groups and (item, rejection) pairs; order is kept within each.

    Each rejection is logged once and added to `counter`. Never raises on bad groups.
    """
    valid: list[RolloutGroup] = []
    rejected: list[tuple[Any, Rejection]] = []
    for group in groups:
        rejection = validate_group(
            group,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            group_normalised=group_normalised,
            require_logprobs=require_logprobs,
        )
        if rejection is None:
            valid.append(group)
        else:
            rejected.append((group, rejection))
            record_rejection(group, rejection, counter)
    return valid, rejected
