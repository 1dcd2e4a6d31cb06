"""The Atropos wire format: one item of run-api's `/batch` turned into a `RolloutGroup`.

`group_from_atropos` converts what an environment sent (tokens, masks with -100 for "no loss",
scores, optional inference logprobs, advantages, per-sequence overrides, generation parameters)
and raises `MalformedGroup`, with the reason codes of `grpod.rollouts.validation`, when an item
cannot even be converted. Range checks (vocabulary, lengths, NaN, ...) are validation's, as for
every source.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.validation import (
    InvalidField,
    MalformedGroup,
    RejectionReason,
    is_int,
    is_number,
    require_count,
    require_elements,
    require_list,
    show,
    type_name,
)

# Atropos marks "no loss here" in `masks` with this value; elsewhere the mask holds the token id.
ATROPOS_NO_LOSS = -100


def _optional_dict(item: dict[str, Any], name: str) -> dict[str, Any]:
    value = item.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidField(RejectionReason.BAD_TYPE, f"{name}: expected an object or null, got {type_name(value)}")
    return value


def _number_field(where: str, value: Any) -> float:
    """float(value) for a JSON number; NaN and inf pass (validation rejects them with a reason)."""
    if not is_number(value):
        raise InvalidField(RejectionReason.BAD_TYPE, f"{where}: expected a number, got {type_name(value)} {show(value)}")
    try:
        return float(value)
    except OverflowError:
        raise InvalidField(RejectionReason.BAD_TYPE, f"{where}: {show(value)} does not fit a float") from None


def _atropos_loss_mask(i: int, tokens: Sequence[int], masks: Any) -> list[int]:
    masks = require_list(f"masks[{i}]", masks)
    if len(masks) != len(tokens):
        raise InvalidField(
            RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(masks)} mask entries"
        )
    require_elements(f"masks[{i}]", masks, is_int, f"an int ({ATROPOS_NO_LOSS} or the token id)")
    bad = next((t for t, (tok, m) in enumerate(zip(tokens, masks)) if m != ATROPOS_NO_LOSS and m != tok), None)
    if bad is not None:
        raise InvalidField(
            RejectionReason.MASK_TOKEN_MISMATCH,
            f"masks[{i}][{bad}] = {masks[bad]}, expected {ATROPOS_NO_LOSS} or the token id {tokens[bad]}",
        )
    return [0 if m == ATROPOS_NO_LOSS else 1 for m in masks]


def _atropos_logprobs(i: int, tokens: Sequence[int], loss_mask: list[int], row: Any) -> list[float]:
    """Logprobs aligned with tokens; Atropos's 1.0 placeholders at prompt positions become 0.0."""
    row = require_list(f"inference_logprobs[{i}]", row)
    if len(row) != len(tokens):
        raise InvalidField(RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(tokens)} tokens, {len(row)} logprobs")
    require_elements(f"inference_logprobs[{i}]", row, lambda x: is_number(x) or x is None, "a number")
    bad = next((t for t, (m, lp) in enumerate(zip(loss_mask, row)) if m and lp is None), None)
    if bad is not None:
        raise InvalidField(RejectionReason.BAD_TYPE, f"inference_logprobs[{i}][{bad}] is null at a loss position")
    return [
        _number_field(f"inference_logprobs[{i}][{t}]", lp) if m else 0.0
        for t, (m, lp) in enumerate(zip(loss_mask, row))
    ]


def _atropos_advantage(i: int, loss_mask: list[int], row: Any) -> float:
    """One advantage per sequence: Atropos sends one per token; grpod needs them constant."""
    if is_number(row):
        return _number_field(f"advantages[{i}]", row)
    row = require_list(f"advantages[{i}]", row)
    require_elements(f"advantages[{i}]", row, is_number, "a number")
    if len(row) == 1:
        return _number_field(f"advantages[{i}][0]", row[0])
    if len(row) != len(loss_mask):
        raise InvalidField(
            RejectionReason.LENGTH_MISMATCH, f"sequence {i}: {len(loss_mask)} tokens, {len(row)} advantages"
        )
    values = [_number_field(f"advantages[{i}][{t}]", a) for t, a in enumerate(row)]
    at_loss = [a for m, a in zip(loss_mask, values) if m] or values[-1:]
    if not at_loss:
        return 0.0  # an empty sequence; validation rejects it
    if any(not math.isclose(a, at_loss[0], rel_tol=1e-6, abs_tol=1e-6) for a in at_loss):
        raise InvalidField(
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
                    raise InvalidField(
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
        raise InvalidField(
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
        raise InvalidField(RejectionReason.NOT_A_GROUP, f"expected a JSON object, got {type_name(item)}")
    tokens_in = require_list("tokens", item.get("tokens"))
    n = len(tokens_in)
    if n == 0:
        raise InvalidField(RejectionReason.EMPTY_GROUP, "tokens is empty")
    tokens = []
    for i, row in enumerate(tokens_in):
        row = require_list(f"tokens[{i}]", row)
        require_elements(f"tokens[{i}]", row, is_int, "an int token id")
        tokens.append([int(t) for t in row])
    masks = require_list("masks", item.get("masks"))
    require_count("masks", masks, n)
    loss_mask = [_atropos_loss_mask(i, tokens[i], masks[i]) for i in range(n)]
    scores_in = require_list("scores", item.get("scores"))
    require_count("scores", scores_in, n)
    scores = [_number_field(f"scores[{i}]", s) for i, s in enumerate(scores_in)]

    logprobs = None
    if item.get("inference_logprobs") is not None:
        rows = require_list("inference_logprobs", item["inference_logprobs"])
        require_count("inference_logprobs", rows, n)
        logprobs = [_atropos_logprobs(i, tokens[i], loss_mask[i], rows[i]) for i in range(n)]
    advantages = None
    if item.get("advantages") is not None:
        rows = require_list("advantages", item["advantages"])
        require_count("advantages", rows, n)
        advantages = [_atropos_advantage(i, loss_mask[i], rows[i]) for i in range(n)]
    overrides = None
    if item.get("overrides") is not None:
        rows = require_list("overrides", item["overrides"])
        require_count("overrides", rows, n)
        require_elements("overrides", rows, lambda o: o is None or isinstance(o, dict), "an object or null")
        overrides = [dict(o) if o is not None else {} for o in rows]
    group_overrides = _optional_dict(item, "group_overrides")
    generation = _optional_dict(item, "generation_params")
    temperature, top_p, declared = _atropos_sampling(n, overrides, generation, group_overrides, undeclared_temperature)
    for name, params in (("generation_params", generation), ("group_overrides", group_overrides)):
        top_k = params.get("top_k")
        if top_k is not None and top_k not in (0, -1):
            raise InvalidField(
                RejectionReason.TRUNCATED_SAMPLING,
                f"{name}.top_k = {show(top_k)}: the trainer does not replicate top-k truncation; sample with top_k = 0",
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
    except InvalidField as invalid:
        raise MalformedGroup(invalid.reason, invalid.detail) from None
    except Exception as exc:  # noqa: BLE001 - garbage from the network must not crash the daemon
        raise MalformedGroup(RejectionReason.INTERNAL_ERROR, f"conversion failed unexpectedly: {exc!r:.200}") from None
