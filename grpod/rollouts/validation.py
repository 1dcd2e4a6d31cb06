"""Batch validation: every `RolloutGroup` is checked before it can reach the trainer.

A bad group is rejected with a machine-readable reason code and a short detail, counted and
logged (`group_rejected`), and the rest of the batch goes on: bad input never crashes the daemon.
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
  as `truncated_sampling`, as is an Atropos top_k > 0), policy_version an int >= 0, weight finite >= 0.

`group_from_atropos` turns one item of an Atropos `/batch` into a `RolloutGroup`, raising
`MalformedGroup` (with the same reason codes) when the item cannot even be converted.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import compress
from numbers import Integral, Real
from typing import Any

import structlog

from grpod.rollouts.group import RolloutGroup

log = structlog.get_logger(__name__)

# vLLM's float32 log-softmax can round a near-certain token's logprob to a hair above 0.
LOGPROB_TOLERANCE = 1e-4
# Atropos marks "no loss here" in `masks` with this value; elsewhere the mask holds the token id.
ATROPOS_NO_LOSS = -100


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


class _Invalid(Exception):
    """Internal: carries the first rule a group breaks out of the nested checks."""

    def __init__(self, reason: RejectionReason, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


def _is_int(x: Any) -> bool:
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def _is_number(x: Any) -> bool:
    return type(x) is float or type(x) is int or (isinstance(x, Real) and not isinstance(x, bool))


def _is_mask_value(x: Any) -> bool:
    return isinstance(x, Integral)  # bools pass: True/False are 1/0


def _is_finite(x: Any) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _type_name(x: Any) -> str:
    return "None" if x is None else type(x).__name__


def _show(x: Any) -> str:
    """A value for a rejection detail, cut short: garbage can be huge."""
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _first_failing(values: Iterable[Any], ok: Callable[[Any], bool]) -> int | None:
    return next((j for j, x in enumerate(values) if not ok(x)), None)


def _require_list(name: str, value: Any) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise _Invalid(RejectionReason.BAD_TYPE, f"{name}: expected a list, got {_type_name(value)}")
    return value


def _require_elements(
    name: str, values: Sequence[Any], ok: Callable[[Any], bool], what: str, usual_type: type | None = None
) -> None:
    # Checking `type(x) is usual_type` first is ~5x faster on the common all-plain-ints/floats case.
    if usual_type is not None and all(type(x) is usual_type for x in values):
        return
    bad = _first_failing(values, ok)
    if bad is not None:
        raise _Invalid(
            RejectionReason.BAD_TYPE,
            f"{name}[{bad}]: expected {what}, got {_type_name(values[bad])} {_show(values[bad])}",
        )


def _require_count(name: str, values: Sequence[Any], n: int) -> None:
    if len(values) != n:
        raise _Invalid(RejectionReason.COUNT_MISMATCH, f"{name}: {len(values)} entries for {n} sequences")


def _require_finite(name: str, values: Sequence[float], reason: RejectionReason) -> None:
    try:
        if math.isfinite(sum(values)):  # fast path; a sum that overflows falls through to the exact check
            return
    except OverflowError:
        pass
    bad = _first_failing(values, _is_finite)
    if bad is not None:
        raise _Invalid(reason, f"{name}[{bad}] = {_show(values[bad])}")


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
    tokens = _require_list(f"tokens[{i}]", tokens)
    mask = _require_list(f"loss_mask[{i}]", mask)
    if len(tokens) != len(mask):
        raise _Invalid(RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(mask)} mask entries")
    if has_logprobs:
        logprobs = _require_list(f"inference_logprobs[{i}]", logprobs)
        if len(logprobs) != len(tokens):
            raise _Invalid(
                RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(logprobs)} logprobs"
            )
    if not tokens:
        raise _Invalid(RejectionReason.EMPTY_SEQUENCE, f"sequence {i} has no tokens")
    if len(tokens) > max_seq_len:
        raise _Invalid(
            RejectionReason.SEQUENCE_TOO_LONG, f"sequence {i}: {len(tokens)} tokens > max_seq_len {max_seq_len}"
        )
    _require_elements(f"tokens[{i}]", tokens, _is_int, "an int token id", int)
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        bad = _first_failing(tokens, lambda t: 0 <= t < vocab_size)
        raise _Invalid(
            RejectionReason.TOKEN_OUT_OF_VOCAB, f"tokens[{i}][{bad}] = {tokens[bad]} outside [0, {vocab_size})"
        )
    _require_elements(f"loss_mask[{i}]", mask, _is_mask_value, "0 or 1", int)
    if not set(mask) <= {0, 1}:
        bad = _first_failing(mask, lambda m: m == 0 or m == 1)
        raise _Invalid(RejectionReason.BAD_MASK_VALUE, f"loss_mask[{i}][{bad}] = {mask[bad]}, expected 0 or 1")
    if mask[0]:
        raise _Invalid(
            RejectionReason.LOSS_ON_FIRST_TOKEN, f"loss_mask[{i}][0] = 1: no token precedes position 0 to predict it"
        )
    if has_logprobs:
        _require_elements(f"inference_logprobs[{i}]", logprobs, _is_number, "a number", float)
        _require_finite(f"inference_logprobs[{i}]", logprobs, RejectionReason.NONFINITE_LOGPROB)
        if max(compress(logprobs, mask), default=-math.inf) > LOGPROB_TOLERANCE:
            bad = next(t for t, (m, lp) in enumerate(zip(mask, logprobs)) if m and lp > LOGPROB_TOLERANCE)
            raise _Invalid(
                RejectionReason.POSITIVE_LOGPROB,
                f"inference_logprobs[{i}][{bad}] = {_show(logprobs[bad])} > 0 at a loss position",
            )
    return sum(mask)


def _check_scalars(group: RolloutGroup) -> None:
    t = group.temperature
    if not _is_number(t) or not _is_finite(t) or t <= 0:
        raise _Invalid(RejectionReason.BAD_TEMPERATURE, f"temperature = {_show(t)}, expected a finite number > 0")
    p = group.top_p
    if not _is_number(p) or not (0 < p <= 1):
        raise _Invalid(RejectionReason.BAD_TOP_P, f"top_p = {_show(p)}, expected a number in (0, 1]")
    if p < 1:
        raise _Invalid(
            RejectionReason.TRUNCATED_SAMPLING,
            f"top_p = {_show(p)} < 1: the trainer does not replicate nucleus truncation; sample with top_p = 1",
        )
    v = group.policy_version
    if not _is_int(v) or v < 0:
        raise _Invalid(RejectionReason.BAD_POLICY_VERSION, f"policy_version = {_show(v)}, expected an int >= 0")
    w = group.weight
    if not _is_number(w) or not _is_finite(w) or w < 0:
        raise _Invalid(RejectionReason.BAD_WEIGHT, f"weight = {_show(w)}, expected a finite number >= 0")
    for name in ("group_id", "source"):
        if not isinstance(getattr(group, name), str):
            raise _Invalid(RejectionReason.BAD_TYPE, f"{name}: expected a str, got {_type_name(getattr(group, name))}")
    if not isinstance(group.extra, dict):
        raise _Invalid(RejectionReason.BAD_TYPE, f"extra: expected a dict, got {_type_name(group.extra)}")


def _check_group(
    group: Any, *, vocab_size: int, max_seq_len: int, group_normalised: bool, require_logprobs: bool
) -> None:
    if not isinstance(group, RolloutGroup):
        raise _Invalid(RejectionReason.NOT_A_GROUP, f"expected a RolloutGroup, got {_type_name(group)}")
    tokens = _require_list("tokens", group.tokens)
    n = len(tokens)
    if n == 0:
        raise _Invalid(RejectionReason.EMPTY_GROUP, "the group has no sequences")
    if group_normalised and n < 2:
        raise _Invalid(
            RejectionReason.GROUP_TOO_SMALL, f"{n} sequence; group-normalised advantages need at least 2"
        )
    mask = _require_list("loss_mask", group.loss_mask)
    _require_count("loss_mask", mask, n)
    scores = _require_list("scores", group.scores)
    _require_count("scores", scores, n)
    _require_elements("scores", scores, _is_number, "a number")
    _require_finite("scores", scores, RejectionReason.NONFINITE_SCORE)
    logprobs = group.inference_logprobs
    if logprobs is None:
        if require_logprobs:
            raise _Invalid(RejectionReason.MISSING_LOGPROBS, "inference_logprobs is None; the loss needs them")
    else:
        logprobs = _require_list("inference_logprobs", logprobs)
        _require_count("inference_logprobs", logprobs, n)
    if group.advantages is not None:
        advantages = _require_list("advantages", group.advantages)
        _require_count("advantages", advantages, n)
        _require_elements("advantages", advantages, _is_number, "a number")
        _require_finite("advantages", advantages, RejectionReason.NONFINITE_ADVANTAGE)
    if group.overrides is not None:
        overrides = _require_list("overrides", group.overrides)
        _require_count("overrides", overrides, n)
        _require_elements("overrides", overrides, lambda o: isinstance(o, dict), "a dict")
        for i, override in enumerate(overrides):
            t = override.get("temperature")
            if t is not None and (not _is_number(t) or not _is_finite(t) or t <= 0):
                raise _Invalid(
                    RejectionReason.BAD_TEMPERATURE,
                    f"overrides[{i}].temperature = {_show(t)}, expected a finite number > 0 (or null: not overridden)",
                )
    if group.truncated is not None:
        truncated = _require_list("truncated", group.truncated)
        _require_count("truncated", truncated, n)
        _require_elements("truncated", truncated, lambda b: isinstance(b, bool), "a bool")
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
        raise _Invalid(RejectionReason.NO_LOSS_TOKENS, f"none of the {n} sequences has a loss token")


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
    except _Invalid as invalid:
        return Rejection(invalid.reason, invalid.detail)
    except Exception as exc:  # noqa: BLE001 - bad input must never crash the daemon
        return Rejection(RejectionReason.INTERNAL_ERROR, f"validation failed unexpectedly: {exc!r:.200}")
    return None


class RejectionCounter:
    """Rejected groups per reason, over the life of a run (for `ctl status` and metrics)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def add(self, rejection: Rejection) -> None:
        self._counts[str(rejection.reason)] += 1

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self._counts.items()))


def record_rejection(item: Any, rejection: Rejection, counter: RejectionCounter | None = None) -> None:
    """Log one `group_rejected` event (and count it): the one place a rejection is reported."""
    if counter is not None:
        counter.add(rejection)
    log.warning(
        "group_rejected",
        reason=str(rejection.reason),
        detail=rejection.detail,
        group_id=item.group_id if isinstance(item, RolloutGroup) else None,
        source=item.source if isinstance(item, RolloutGroup) else None,
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


def _optional_dict(item: dict[str, Any], name: str) -> dict[str, Any]:
    value = item.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Invalid(RejectionReason.BAD_TYPE, f"{name}: expected an object or null, got {_type_name(value)}")
    return value


def _number_field(where: str, value: Any) -> float:
    """float(value) for a JSON number; NaN and inf pass (validation rejects them with a reason)."""
    if not _is_number(value):
        raise _Invalid(RejectionReason.BAD_TYPE, f"{where}: expected a number, got {_type_name(value)} {_show(value)}")
    try:
        return float(value)
    except OverflowError:
        raise _Invalid(RejectionReason.BAD_TYPE, f"{where}: {_show(value)} does not fit a float") from None


def _atropos_loss_mask(i: int, tokens: Sequence[int], masks: Any) -> list[int]:
    masks = _require_list(f"masks[{i}]", masks)
    if len(masks) != len(tokens):
        raise _Invalid(
            RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(masks)} mask entries"
        )
    _require_elements(f"masks[{i}]", masks, _is_int, f"an int ({ATROPOS_NO_LOSS} or the token id)")
    bad = next((t for t, (tok, m) in enumerate(zip(tokens, masks)) if m != ATROPOS_NO_LOSS and m != tok), None)
    if bad is not None:
        raise _Invalid(
            RejectionReason.MASK_TOKEN_MISMATCH,
            f"masks[{i}][{bad}] = {masks[bad]}, expected {ATROPOS_NO_LOSS} or the token id {tokens[bad]}",
        )
    return [0 if m == ATROPOS_NO_LOSS else 1 for m in masks]


def _atropos_logprobs(i: int, tokens: Sequence[int], loss_mask: list[int], row: Any) -> list[float]:
    """Logprobs aligned with tokens; Atropos's 1.0 placeholders at prompt positions become 0.0."""
    row = _require_list(f"inference_logprobs[{i}]", row)
    if len(row) != len(tokens):
        raise _Invalid(RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(row)} logprobs")
    _require_elements(f"inference_logprobs[{i}]", row, lambda x: _is_number(x) or x is None, "a number")
    bad = next((t for t, (m, lp) in enumerate(zip(loss_mask, row)) if m and lp is None), None)
    if bad is not None:
        raise _Invalid(RejectionReason.BAD_TYPE, f"inference_logprobs[{i}][{bad}] is null at a loss position")
    return [
        _number_field(f"inference_logprobs[{i}][{t}]", lp) if m else 0.0
        for t, (m, lp) in enumerate(zip(loss_mask, row))
    ]


def _atropos_advantage(i: int, loss_mask: list[int], row: Any) -> float:
    """One advantage per sequence: Atropos sends one per token; grpod needs them constant."""
    if _is_number(row):
        return _number_field(f"advantages[{i}]", row)
    row = _require_list(f"advantages[{i}]", row)
    _require_elements(f"advantages[{i}]", row, _is_number, "a number")
    if len(row) == 1:
        return _number_field(f"advantages[{i}][0]", row[0])
    if len(row) != len(loss_mask):
        raise _Invalid(
            RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(loss_mask)} tokens, {len(row)} advantages"
        )
    values = [_number_field(f"advantages[{i}][{t}]", a) for t, a in enumerate(row)]
    at_loss = [a for m, a in zip(loss_mask, values) if m] or values[-1:]
    if not at_loss:
        return 0.0  # an empty sequence; validation rejects it
    if any(not math.isclose(a, at_loss[0], rel_tol=1e-6, abs_tol=1e-6) for a in at_loss):
        raise _Invalid(
            RejectionReason.PER_TOKEN_ADVANTAGES,
            f"advantages[{i}] varies across loss tokens ({min(at_loss)} .. {max(at_loss)}); "
            "grpod takes one advantage per sequence",
        )
    return at_loss[0]


def _atropos_sampling(
    n: int,
    overrides: list[dict[str, Any]] | None,
    generation: dict[str, Any],
    group_overrides: dict[str, Any],
    undeclared_temperature: float | None,
) -> tuple[float, float, bool]:
    """(temperature, top_p, declared): per-sequence override > generation_params > group_overrides
    > `undeclared_temperature` (None: refused); top_p defaults to 1.0."""
    group_level: dict[str, float | None] = {"temperature": None, "top_p": 1.0}
    for key in ("temperature", "top_p"):
        for name, params in (("generation_params", generation), ("group_overrides", group_overrides)):
            if params.get(key) is not None:
                group_level[key] = _number_field(f"{name}.{key}", params[key])
                break
    temperatures = set()
    undeclared = 0
    for i in range(n):
        per_seq = overrides[i].get("temperature") if overrides is not None else None
        if per_seq is None:
            if group_level["temperature"] is None:
                undeclared += 1
                if undeclared_temperature is None:
                    raise _Invalid(
                        RejectionReason.UNDECLARED_TEMPERATURE,
                        "no sampling temperature (generation_params.temperature, group_overrides or "
                        "overrides[i].temperature): the trainer cannot know the distribution the logprobs come from",
                    )
                temperatures.add(undeclared_temperature)
            else:
                temperatures.add(group_level["temperature"])
        else:
            temperatures.add(_number_field(f"overrides[{i}].temperature", per_seq))
    if len(temperatures) > 1:
        raise _Invalid(
            RejectionReason.MIXED_TEMPERATURE,
            f"sequences sampled at different temperatures {sorted(temperatures)}; a group needs one",
        )
    return temperatures.pop(), group_level["top_p"], undeclared == 0


def _content_id(tokens: list[list[int]], scores: list[float]) -> str:
    digest = hashlib.blake2b(digest_size=6)
    digest.update(repr((tokens, scores)).encode())
    return f"atropos-{digest.hexdigest()}"


def _convert_atropos(item: Any, default_version: int, group_id: str, undeclared_temperature: float | None) -> RolloutGroup:
    if not isinstance(item, dict):
        raise _Invalid(RejectionReason.NOT_A_GROUP, f"expected a JSON object, got {_type_name(item)}")
    tokens_in = _require_list("tokens", item.get("tokens"))
    n = len(tokens_in)
    if n == 0:
        raise _Invalid(RejectionReason.EMPTY_GROUP, "tokens is empty")
    tokens = []
    for i, row in enumerate(tokens_in):
        row = _require_list(f"tokens[{i}]", row)
        _require_elements(f"tokens[{i}]", row, _is_int, "an int token id")
        tokens.append([int(t) for t in row])
    masks = _require_list("masks", item.get("masks"))
    _require_count("masks", masks, n)
    loss_mask = [_atropos_loss_mask(i, tokens[i], masks[i]) for i in range(n)]
    scores_in = _require_list("scores", item.get("scores"))
    _require_count("scores", scores_in, n)
    scores = [_number_field(f"scores[{i}]", s) for i, s in enumerate(scores_in)]

    logprobs = None
    if item.get("inference_logprobs") is not None:
        rows = _require_list("inference_logprobs", item["inference_logprobs"])
        _require_count("inference_logprobs", rows, n)
        logprobs = [_atropos_logprobs(i, tokens[i], loss_mask[i], rows[i]) for i in range(n)]
    advantages = None
    if item.get("advantages") is not None:
        rows = _require_list("advantages", item["advantages"])
        _require_count("advantages", rows, n)
        advantages = [_atropos_advantage(i, loss_mask[i], rows[i]) for i in range(n)]
    overrides = None
    if item.get("overrides") is not None:
        rows = _require_list("overrides", item["overrides"])
        _require_count("overrides", rows, n)
        _require_elements("overrides", rows, lambda o: o is None or isinstance(o, dict), "an object or null")
        overrides = [dict(o) if o is not None else {} for o in rows]
    group_overrides = _optional_dict(item, "group_overrides")
    generation = _optional_dict(item, "generation_params")
    temperature, top_p, declared = _atropos_sampling(n, overrides, generation, group_overrides, undeclared_temperature)
    for name, params in (("generation_params", generation), ("group_overrides", group_overrides)):
        top_k = params.get("top_k")
        if top_k is not None and top_k not in (0, -1):
            raise _Invalid(
                RejectionReason.TRUNCATED_SAMPLING,
                f"{name}.top_k = {_show(top_k)}: the trainer does not replicate top-k truncation; sample with top_k = 0",
            )

    truncated = None
    if overrides is not None and any("truncated" in o or "finish_reason" in o for o in overrides):
        # An environment says a completion ran out of tokens either way; mask_truncated needs it.
        truncated = [bool(o.get("truncated")) or o.get("finish_reason") == "length" for o in overrides]

    extra: dict[str, Any] = {}
    if item.get("env_id") is not None:
        extra["env_id"] = item["env_id"]
    if group_overrides:
        extra["group_overrides"] = group_overrides
    if not declared:
        # Recorded with the group (rollouts.jsonl, checkpoints): the temperature came from config.
        extra["temperature_from"] = "source.temperature"
    return RolloutGroup(
        tokens=tokens,
        loss_mask=loss_mask,
        scores=scores,
        inference_logprobs=logprobs,
        advantages=advantages,
        overrides=overrides,
        truncated=truncated,
        temperature=temperature,
        top_p=top_p,
        policy_version=default_version,
        source="atropos",
        group_id=group_id or _content_id(tokens, scores),
        extra=extra,
    )


def group_from_atropos(
    item: dict[str, Any], *, default_version: int, group_id: str = "", undeclared_temperature: float | None = 1.0
) -> RolloutGroup:
    """Convert one Atropos `/batch` item (see notes/atropos.md) into a RolloutGroup.

    `masks` (-100 = no loss, else the token id) become a 0/1 loss mask; `inference_logprobs`
    keep their alignment with tokens, with the prompt placeholders (1.0, or null) set to 0.0;
    per-token `advantages` must be constant over each sequence's loss tokens. A per-sequence
    override `truncated: true` or `finish_reason: "length"` marks a truncated completion (for
    `train.loss.mask_truncated`). Temperature:
    per-sequence override > generation_params > group_overrides > `undeclared_temperature` (the
    source passes `source.temperature` and records `extra["temperature_from"]`; None refuses the
    group as `undeclared_temperature`), and all sequences of a group must agree. Atropos carries no policy version, so `default_version` (the version being
    served when the batch was fetched) is recorded. Values that convert but are out of range
    (NaN scores, positive logprobs, ...) are left for `validate_group` to reject.

    Raises MalformedGroup for anything that cannot be converted; nothing else.
    """
    try:
        return _convert_atropos(item, default_version, group_id, undeclared_temperature)
    except _Invalid as invalid:
        raise MalformedGroup(invalid.reason, invalid.detail) from None
    except Exception as exc:  # noqa: BLE001 - garbage from the network must not crash the daemon
        raise MalformedGroup(RejectionReason.INTERNAL_ERROR, f"conversion failed unexpectedly: {exc!r:.200}") from None
