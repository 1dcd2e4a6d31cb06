"""The rollout source kinds, and the one place that builds the one `source.kind` names.

The kinds import what they share from `grpod.rollouts.source` (the protocol, `SourceStats`); this
module imports the kinds, so nothing imports back. The kinds are imported when asked for: the
daemon's start-up needs only the configured one (Atropos' client, the dataset loaders and the
arithmetic task each cost import time).
"""

from __future__ import annotations

from typing import Any

from grpod.config import GrpodConfig
from grpod.inference.policy import Policy
from grpod.rollouts.source import RolloutSource
from grpod.rollouts.validation import RejectionCounter


def make_source(
    cfg: GrpodConfig,
    tokenizer,
    policy: Policy,
    cursor: dict[str, Any] | None,
    rejections: RejectionCounter,
    prepared: Any = None,
) -> RolloutSource:
    """The source `cfg.source.kind` names, handed its own section and the values it needs
    (`prepared`: the dataset source's inputs, checked before launch by `prepare_dataset`; the
    environment source's adapter, started before launch by `prepare_environment`).
    Blocking (the dataset source tokenizes its rows): run it in a worker thread."""
    src = cfg.source
    if src.kind == "replay":
        from grpod.rollouts.replay import ReplaySource

        return ReplaySource(src, cursor=cursor)
    if src.kind == "atropos":
        from grpod.rollouts.atropos import AtroposSource, Registration

        registration = Registration(
            run_name=cfg.run.dir.name or "grpod",
            max_token_len=cfg.model.max_seq_len,
            checkpoint_dir=cfg.run.dir / "checkpoints",
            checkpoint_every=cfg.checkpoint.every,
            steps=cfg.train.steps,
        )
        return AtroposSource(
            src, policy, groups_per_step=cfg.train.groups_per_step, registration=registration,
            cursor=cursor, rejections=rejections, progress=cfg.run.progress,
        )
    from grpod.rollouts.dynamic_sampling import DynamicSampling

    dynamic = DynamicSampling(
        src.dynamic_sampling, src.dynamic_sampling_max_filtered, cfg.train.advantages, cfg.completion_budget
    )
    if src.kind == "environment":
        from grpod.rollouts.environment_source import EnvironmentSource

        return EnvironmentSource(
            src, tokenizer, policy, prepared, max_seq_len=cfg.model.max_seq_len, eval_cfg=cfg.eval,
            engine_wait_s=cfg.inference.start_timeout_s, dynamic_sampling=dynamic, cursor=cursor,
        )
    if src.kind == "dataset":
        from grpod.rollouts.dataset import DatasetSource

        return DatasetSource(
            src, tokenizer, policy, prepared=prepared, eval_cfg=cfg.eval, max_seq_len=cfg.model.max_seq_len,
            engine_wait_s=cfg.inference.start_timeout_s, dynamic_sampling=dynamic, cursor=cursor,
            steps=cfg.train.steps,
        )
    from grpod.rollouts.builtin import BuiltinSource

    return BuiltinSource(
        src, tokenizer, policy, engine_wait_s=cfg.inference.start_timeout_s, dynamic_sampling=dynamic,
        cursor=cursor, progress=cfg.run.progress,
    )
