"""Live settings: the subset of the config an operator may change while a run goes on.

`ctl set KEY=VALUE` and SIGHUP (re-read the config file) both go through `plan_changes`, which
validates each change against the typed config and refuses any key outside `LIVE_KEYS` with the
reason (it needs a restart). Accepted changes are applied at the next step boundary, logged as
a numbered config change, and recorded in the next checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpod.config import ConfigError, GrpodConfig, parse_config

LIVE_KEYS = (
    "train.lr",
    "train.loss.clip_low",
    "train.loss.clip_high",
    "train.loss.kl_coef",
    "train.loss.entropy_coef",
    "train.max_staleness",
    "source.temperature",
    "source.dataset.rest_epochs",
    "source.dataset.curriculum.band",
    "source.dataset.curriculum.window",
    "bridge.sync_every",
    "bridge.probe_every",
    "checkpoint.every",
)


@dataclass
class SettingChange:
    key: str
    old: Any
    new: Any


class RefusedChange(ConfigError):
    """A change that cannot be applied to a running daemon."""


def get_key(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise RefusedChange(f"{key}: no such key")
        node = node[part]
    return node


def _set_key(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value) and path != "inference.env":
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def plan_changes(current: GrpodConfig, wanted: dict[str, Any], origin: str) -> tuple[GrpodConfig, list[SettingChange]]:
    """Validate `wanted` ({dotted key: value}) against `current`; the new config and the diff.

    Raises RefusedChange naming every key that is not live, and ConfigError for a bad value.
    """
    tree = current.model_dump(mode="json")
    flat = _flatten(tree)
    live = ", ".join(key for key in LIVE_KEYS if key in flat)  # this run's: a source kind's keys only if it is that kind
    unknown = [key for key in wanted if key not in flat and not any(k.startswith(f"{key}.") for k in flat)]
    if unknown:
        raise RefusedChange(f"{origin}: {', '.join(sorted(unknown))}: no such key in the running config; "
                            f"live keys: {live}")
    refused = [key for key in wanted if key not in LIVE_KEYS]
    if refused:
        raise RefusedChange(
            f"{origin}: {', '.join(sorted(refused))}: cannot change while running (needs a restart); "
            f"live keys: {live}"
        )
    changes = []
    for key, value in wanted.items():
        old = get_key(tree, key)
        if old != value:
            _set_key(tree, key, value)
            changes.append(SettingChange(key, old, value))
    updated = parse_config(tree, origin)
    for change in changes:
        change.new = get_key(updated.model_dump(mode="json"), change.key)
    return updated, changes


def diff_file(current: GrpodConfig, reloaded: GrpodConfig) -> dict[str, Any]:
    """Every key whose value differs between the running config and a re-read file."""
    old = _flatten(current.model_dump(mode="json"))
    new = _flatten(reloaded.model_dump(mode="json"))
    return {key: new[key] for key in new if old.get(key) != new[key]}
