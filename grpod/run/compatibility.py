"""Whether a config can resume a checkpoint: the run it belongs to, and what its trainer state fits.

Both are asked at the resume point (`RunStore.resume_point`), before anything launches:

- **identity** (`run_identity`): the model, the source kind and the task. A checkpoint of another
  run is refused (`ResumeMismatch`), or resumed anyway with `run.resume_mismatch = "allow"`.
- **training shape** (`TrainingShape`): full weights or a LoRA adapter (its rank, alpha and target
  modules), and the optimizer whose state the checkpoint holds. An adapter loads only into the
  shape it was made with, and full weights are no adapter at all: a LoRA difference is refused
  (`TrainingShapeMismatch`) whatever `run.resume_mismatch` says. One optimizer's state means nothing
  to another (AdamW's moments are not Adafactor's factored second moment; loading one into the other
  failed at the first step, vLLM already launched): a changed `train.optimizer` is refused, or with
  "allow" the optimizer starts afresh (its state dropped, with a warning; the weights, the schedule
  and the counters are resumed).

What may change over a restart (`train.lr`, `train.weight_decay`, the loss...) the trainer applies
from the config when it loads the checkpoint's state (`Trainer.load_state_dict`).

`run_state.json` records both (`identity`, `training`). A checkpoint written before the training
shape was recorded is read from its files: the adapter from peft's `model/adapter_config.json` (full
weights without one), the optimizer from the param groups in `trainer_state.pt` (read through a
memory map: its tensors stay on disk). Where that says nothing, the optimizer goes unchecked, with
a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from grpod.config import GrpodConfig, TrainConfig
from grpod.run.checkpoint import ResumeError

log = structlog.get_logger(__name__)


class ResumeMismatch(ResumeError):
    """The checkpoint to resume belongs to another run: a different model, source kind or task."""


class TrainingShapeMismatch(ResumeError):
    """The checkpoint's adapter or optimizer state does not fit the config's `[train]`."""


def run_identity(cfg: GrpodConfig) -> dict[str, str]:
    """What a checkpoint must share with the config to be resumed by it. File paths are resolved
    (the same file named from another directory is the same run), and a dataset's order is part of
    it: its cursor (epoch, position) indexes the permutation `shuffle_seed` draws."""
    source = cfg.source
    task = {
        "builtin": lambda: f"arithmetic, task_seed {source.task_seed}",
        "atropos": lambda: f"atropos at {source.atropos_url}",
        "replay": lambda: f"replay of {Path(source.replay_path).resolve()}",
        "dataset": lambda: f"dataset {Path(source.dataset.path).resolve()}, shuffle_seed {source.dataset.shuffle_seed}",
        "environment": lambda: (
            f"environment {source.environment.adapter} {source.environment.name or source.environment.url or ''}"
            f", task_seed {source.environment.task_seed}"
        ),
    }[source.kind]()
    return {"model": str(Path(cfg.model.path).resolve()), "source_kind": source.kind, "task": task}


def _recorded_before(cfg: GrpodConfig) -> str | None:
    """The task as checkpoints written before paths were resolved recorded it (still resumable)."""
    source = cfg.source
    if source.kind == "dataset":
        return f"dataset {source.dataset.path}"
    if source.kind == "replay":
        return f"replay of {source.replay_path}"
    return None


def check_identity(checkpoint: Path, recorded: dict[str, str] | None, cfg: GrpodConfig) -> None:
    """Refuse (ResumeMismatch naming both sides) to resume a checkpoint of another run, unless
    `run.resume_mismatch = "allow"`. Checkpoints written before identities were recorded pass."""
    if recorded is None:
        return
    wanted = run_identity(cfg)
    differ = {key: (recorded.get(key), value) for key, value in wanted.items()
              if recorded.get(key) != value and not (key == "task" and recorded.get(key) == _recorded_before(cfg))}
    if not differ:
        return
    described = "; ".join(f"{key}: checkpoint {old!r}, config {new!r}" for key, (old, new) in differ.items())
    if cfg.run.resume_mismatch == "allow":
        log.warning("resume_mismatch_allowed", checkpoint=str(checkpoint), differences=described)
        return
    raise ResumeMismatch(
        f"{checkpoint} belongs to another run ({described}); use another run.dir, run.resume = \"never\", "
        f"or run.resume_mismatch = \"allow\" to resume it anyway"
    )


@dataclass(frozen=True)
class LoraShape:
    """What a saved adapter's tensors are made for."""

    rank: int
    alpha: float
    target_modules: frozenset[str]


@dataclass(frozen=True)
class TrainingShape:
    """What a checkpoint's weights and optimizer state fit: `lora` None = full weights;
    `optimizer` None = not known (an old checkpoint whose files do not say)."""

    lora: LoraShape | None
    optimizer: str | None

    @classmethod
    def of(cls, train: TrainConfig) -> TrainingShape:
        lcfg = train.lora_config
        lora = LoraShape(lcfg.rank, float(lcfg.alpha), frozenset(lcfg.target_modules)) if train.lora else None
        return cls(lora, train.optimizer)

    def to_json(self) -> dict[str, Any]:
        lora = self.lora
        return {
            "lora": None if lora is None else
            {"rank": lora.rank, "alpha": lora.alpha, "target_modules": sorted(lora.target_modules)},
            "optimizer": self.optimizer,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingShape:
        lora = data.get("lora")
        return cls(
            None if lora is None else LoraShape(int(lora["rank"]), float(lora["alpha"]), frozenset(lora["target_modules"])),
            data.get("optimizer"),
        )

    def differences(self, wanted: TrainingShape) -> list[tuple[str, Any, Any]]:
        """(config key, this checkpoint's value, `wanted`'s) of every difference."""
        found: list[tuple[str, Any, Any]] = []
        if (self.lora is None) != (wanted.lora is None):
            found.append(("train.lora", self.lora is not None, wanted.lora is not None))
        elif self.lora is not None and wanted.lora is not None:
            for key in ("rank", "alpha", "target_modules"):
                old, new = getattr(self.lora, key), getattr(wanted.lora, key)
                if old != new:
                    found.append((f"train.lora_config.{key}", old, new))
        if self.optimizer is not None and self.optimizer != wanted.optimizer:
            found.append(("train.optimizer", self.optimizer, wanted.optimizer))
        return found


def _toml(value: Any) -> str:
    """A value as the config file writes it."""
    if isinstance(value, (set, frozenset)):
        value = sorted(value)
    return json.dumps(value)


def _read_optimizer_kind(trainer_state: Path) -> str | None:
    """The optimizer whose state an old checkpoint's `trainer_state.pt` holds, by the settings in
    its param groups (which every optimizer keeps, even before its first step): Adafactor's
    relative_step, torch AdamW's amsgrad, bitsandbytes' 8-bit AdamW betas without it."""
    import torch

    try:
        state = torch.load(trainer_state, map_location="cpu", weights_only=True, mmap=True)
        groups = state.get("optimizer", {}).get("param_groups") or [{}]
    except Exception as exc:  # noqa: BLE001 — an unreadable file is the trainer load's to report
        log.warning("resume_optimizer_unreadable", path=str(trainer_state), error=f"{type(exc).__name__}: {exc}"[:300])
        return None
    keys = set(groups[0])
    if "relative_step" in keys:
        return "adafactor"
    if "amsgrad" in keys:
        return "adamw"
    if "betas" in keys:
        return "adamw_8bit"
    return None


def read_training_shape(checkpoint: Path, *, sharded: bool) -> TrainingShape:
    """The training shape of a checkpoint that does not record it, from its files. `sharded`: it
    holds the sharded state of trainer ranks, which train AdamW only."""
    adapter = checkpoint / "model" / "adapter_config.json"
    lora = None
    if adapter.is_file():
        try:
            saved = json.loads(adapter.read_text())
            modules = saved["target_modules"]
            lora = LoraShape(int(saved["r"]), float(saved["lora_alpha"]),
                             frozenset([modules] if isinstance(modules, str) else modules))
        except (ValueError, KeyError, TypeError) as exc:
            raise TrainingShapeMismatch(
                f"{adapter}: not an adapter config grpod can read ({type(exc).__name__}: {exc}); resume from "
                "another checkpoint (run.resume = PATH) or start afresh with run.resume = \"never\""
            ) from None
    optimizer = "adamw" if sharded else _read_optimizer_kind(checkpoint / "trainer_state.pt")
    return TrainingShape(lora, optimizer)


def check_training_shape(checkpoint: Path, recorded: dict[str, Any] | None, cfg: GrpodConfig, *,
                         sharded: bool) -> bool:
    """Refuse (TrainingShapeMismatch naming the checkpoint, each key with both values and what to
    do) a checkpoint whose adapter or optimizer state does not fit the config. True when its
    optimizer state is to be dropped: another optimizer, let through by run.resume_mismatch = "allow"."""
    shape = TrainingShape.from_json(recorded) if recorded is not None else read_training_shape(checkpoint, sharded=sharded)
    wanted = TrainingShape.of(cfg.train)
    if shape.optimizer is None:
        log.warning("resume_optimizer_unchecked", checkpoint=str(checkpoint), optimizer=cfg.train.optimizer,
                    reason="the checkpoint does not say which optimizer wrote its state; resumed as train.optimizer")
    differ = shape.differences(wanted)
    if not differ:
        return False
    allow = cfg.run.resume_mismatch == "allow"
    adapter = [key for key, _, _ in differ if key != "train.optimizer"]
    if allow and not adapter:
        log.warning("resume_optimizer_restarted", checkpoint=str(checkpoint), checkpoint_optimizer=shape.optimizer,
                    config_optimizer=wanted.optimizer,
                    reason='run.resume_mismatch = "allow": the optimizer starts afresh, its state in the checkpoint '
                    "dropped; the weights, schedule and counters are resumed")
        return True
    why = []
    if adapter:
        why.append("; ".join(dict.fromkeys(_ADAPTER_WHY[key] for key in adapter))
                   + " (refused whatever run.resume_mismatch says)")
    if len(adapter) < len(differ):
        why.append("the checkpoint's optimizer state is another optimizer's" + (
            "" if adapter else ' (run.resume_mismatch = "allow" resumes it with the optimizer started afresh)'))
    described = "; ".join(f"{key}: checkpoint {_toml(old)}, config {_toml(new)}" for key, old, new in differ)
    restore = ", ".join(f"{key} = {_toml(old)}" for key, old, _ in differ)
    raise TrainingShapeMismatch(
        f"{checkpoint} cannot be resumed with this [train] ({described}): {'; '.join(why)}. Put the config back "
        f"({restore}), start afresh from step 0 with run.resume = \"never\" (its checkpoints replace the run's), or "
        f"resume from another checkpoint with run.resume = PATH"
    )


# Why a LoRA difference can never be resumed.
_ADAPTER_WHY = {
    "train.lora": "full weights and a LoRA adapter cannot stand for each other",
    "train.lora_config.rank": "an adapter's tensors keep the shape it was made with",
    "train.lora_config.target_modules": "an adapter's tensors keep the shape it was made with",
    "train.lora_config.alpha": "an adapter's weights were trained for its scale alpha / rank (another alpha is "
    "another policy)",
}
