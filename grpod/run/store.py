"""`RunStore`: what a run persists and how it comes back — the daemon's side of checkpoints.

A checkpoint of a run holds: the policy (`model/`: HF safetensors, or the PEFT adapter in LoRA
modes), the trainer state (optimizer, scheduler, step; trainer ranks under torchrun keep the
optimizer, with the model, in `sharded/`: each rank's shards, written with
torch.distributed.checkpoint, which reshards them on load at any world size), every RNG stream
(rank 0's), and `run_state.json`:
step, policy version, the rollout source's cursor, and the accepted-but-untrained rollout groups,
and what a config must share with it to resume it (the run's identity, the training shape:
`grpod.run.compatibility`, asked before anything launches).
Restoring all of it is what makes a resume exact: the stream continues where it stopped and no
accepted group is lost or trained twice. The write itself (temp dir, fsync, manifest last,
atomic rename) lives once, in `grpod.run.checkpoint`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from grpod.config import GrpodConfig, ModelConfig
from grpod.rollouts.group import RolloutGroup
from grpod.run.checkpoint import (
    CheckpointError,
    begin_line,
    clean_stale_temp,
    latest_checkpoint,
    load_json,
    load_tensors_state,
    resume_from,
    save_json,
    save_tensors_state,
    write_checkpoint,
)
from grpod.run.compatibility import TrainingShape, check_identity, check_training_shape, run_identity
from grpod.run.rng import capture_rng, restore_rng

log = structlog.get_logger(__name__)

# The sharded state of trainer ranks under torchrun (a DCP checkpoint) inside a checkpoint.
SHARDED_STATE = "sharded"


@dataclass
class Restored:
    """What a run resumes from (all defaults: a fresh run)."""

    step: int = 0
    policy_version: int = 0
    buffered: list[RolloutGroup] = field(default_factory=list)
    source_cursor: dict[str, Any] | None = None
    checkpoint: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # The checkpoint's optimizer state is another optimizer's, let through by
    # run.resume_mismatch = "allow": the optimizer starts afresh (grpod.run.compatibility).
    fresh_optimizer: bool = False

    @property
    def weights(self) -> Path | None:
        """The checkpoint's copy of the policy (HF weights, or the adapter in LoRA modes)."""
        return self.checkpoint / "model" if self.checkpoint is not None else None


@dataclass
class RunSnapshot:
    """What a checkpoint records besides the trainer: where the run is and what it holds."""

    step: int
    policy_version: int
    buffered: list[RolloutGroup]
    source_cursor: dict[str, Any]
    extra: dict[str, Any]


class BrokenTrainerState(CheckpointError):
    """The trainer's weights or optimizer state hold non-finite values: no checkpoint of it is
    written, whatever broke it (a setting, a bad batch, a numeric blow-up), and the run stops."""


def nonfinite(tensors, where: str) -> str | None:
    """The first floating tensor of `tensors` (name, tensor pairs) with a NaN or an infinity,
    described; None when all are finite."""
    import torch

    for name, tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return f"{where} {name!r} ({bad} of {tensor.numel()} values non-finite)"
    return None


def _state_tensors(obj, prefix: str = ""):
    """(dotted name, tensor) of every tensor in a nested state dict."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _state_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _state_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def _weight_tensors(model_dir: Path):
    """(file: name, tensor) of every tensor in the safetensors files a trainer saved."""
    from safetensors import safe_open

    for path in sorted(model_dir.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                yield f"{path.relative_to(model_dir.parent)}: {name}", fh.get_tensor(name)


def model_dir_problem(model: ModelConfig) -> str | None:
    """Why `model.path` can be neither loaded nor built into (None: it holds a model, or grpod
    builds the tiny one there); `grpod check-config` and the start ask before anything launches."""
    path = model.path
    if (path / "config.json").is_file():
        return None
    if path.exists() and not path.is_dir():
        return f"model.path: {path} is a file, not an HF model directory (config.json + weights + tokenizer)"
    if path.is_dir() and any(path.iterdir()):
        return (f"model.path: {path} holds no HF model (no config.json), and grpod builds the tiny model only "
                f"into an empty or missing directory")
    if not model.init_if_missing:
        return (f"model.path: {path} holds no HF model (no config.json); point model.path at one, or set "
                f"model.init_if_missing = true to build the tiny built-in model there")
    return None


class RunStore:
    def __init__(self, cfg: GrpodConfig, run_dir: Path, *, build_trainer: Callable | None = None) -> None:
        """`build_trainer(cfg, model_path, adapter_path=...)` makes the trainer (default
        `grpod.training.trainer.build_trainer`; rank 0 of trainer ranks passes its own)."""
        self.cfg = cfg
        self.root = run_dir / "checkpoints"
        self._build_trainer = build_trainer

    def ensure_model(self, stop: threading.Event | None = None) -> None:
        """Build the tiny model at `model.path` when it has none (`init_model`: published
        complete or not at all); `stop` ends a build early with `ModelInitStopped`."""
        path = self.cfg.model.path
        if (path / "config.json").exists():
            return
        if problem := model_dir_problem(self.cfg.model):
            raise FileNotFoundError(problem)
        from grpod.models.tiny import init_model

        log.info("model_init", path=str(path))
        init_model(path, seed=self.cfg.run.seed, stop=stop)

    def resume_point(self) -> Restored:
        """The newest complete checkpoint's run state (its identity and training shape checked
        against the config: `grpod.run.compatibility`), or a fresh start. The trainer and the RNG
        streams come back in `load_trainer`."""
        clean_stale_temp(self.root)
        info, new_line = resume_from(self.root, self.cfg.run.resume)
        if info is not None:  # checked before a new line moves anything
            state = load_json(info.path, "run_state.json")
            check_identity(info.path, state.get("identity"), self.cfg)
            fresh_optimizer = check_training_shape(
                info.path, state.get("training"), self.cfg, sharded=(info.path / SHARDED_STATE).is_dir()
            )
        if new_line:
            begin_line(self.root, self.cfg.run.resume, info)
        if info is None:
            return Restored()
        return Restored(
            step=state["step"],
            policy_version=state["policy_version"],
            buffered=[RolloutGroup.from_json(g) for g in state["buffered"]],
            source_cursor=state.get("source_cursor"),
            checkpoint=info.path,
            extra=state.get("extra", {}),
            fresh_optimizer=fresh_optimizer,
        )

    def load_trainer(self, restored: Restored):
        """The trainer, fresh or as `restored` left it (weights, optimizer unless
        `restored.fresh_optimizer`, schedule, step), and then every RNG stream as the checkpoint
        recorded it."""
        from grpod.training.trainer import build_trainer

        build = self._build_trainer or build_trainer
        self.ensure_model()
        if restored.checkpoint is None:
            return build(self.cfg)
        if self.cfg.train.lora:
            trainer = build(self.cfg, adapter_path=restored.weights)
        else:
            trainer = build(self.cfg, restored.weights)
        sharded = restored.checkpoint / SHARDED_STATE
        if sharded.is_dir():  # written by trainer ranks (any number of them)
            trainer.load_sharded(sharded, not restored.fresh_optimizer)
        state = load_tensors_state(restored.checkpoint, "trainer_state.pt")
        if restored.fresh_optimizer:
            state.pop("optimizer", None)
        trainer.load_state_dict(state)
        restore_rng(load_json(restored.checkpoint, "rng.json"))
        return trainer

    def save(self, trainer, snapshot: RunSnapshot) -> Path:
        """Write a checkpoint of the trainer and `snapshot`. BrokenTrainerState, and nothing
        written, when its weights (as saved) or its optimizer state hold a non-finite value."""

        def populate(tmp: Path) -> None:
            trainer.save_weights(tmp / "model")
            state = trainer.state_dict()
            broken = nonfinite(_state_tensors(state), "trainer state") or nonfinite(_weight_tensors(tmp / "model"), "weights")
            if broken:
                latest = latest_checkpoint(self.root)
                raise BrokenTrainerState(
                    f"checkpoint of step {snapshot.step} refused: the trainer is broken, {broken} (a setting such as "
                    "train.lr, a bad batch or a numeric blow-up); the newest complete checkpoint stays "
                    f"{latest.path if latest else '(none)'}: start grpod again to resume from it"
                )
            if getattr(trainer, "sharded", False):
                trainer.save_sharded(tmp / SHARDED_STATE)
            save_tensors_state(tmp, "trainer_state.pt", state)
            save_json(tmp, "rng.json", capture_rng())
            save_json(
                tmp,
                "run_state.json",
                {
                    "step": snapshot.step,
                    "policy_version": snapshot.policy_version,
                    "source_cursor": snapshot.source_cursor,
                    "buffered": [g.to_json() for g in snapshot.buffered],
                    "extra": snapshot.extra,
                    "identity": run_identity(self.cfg),
                    "training": TrainingShape.of(self.cfg.train).to_json(),
                },
            )

        meta = {"policy_version": snapshot.policy_version, "config_hash": self.cfg.digest(), "mode": self.cfg.bridge.mode}
        return write_checkpoint(self.root, snapshot.step, populate, meta, self.cfg.checkpoint.keep_last)
