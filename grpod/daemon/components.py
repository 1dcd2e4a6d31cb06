"""How a run's parts are built from the config and started: the wiring, in one place.

Each component gets its own config section and the few values it needs, never the whole tree or
the supervisor: the trainer its `train` and `model` sections, each engine `inference` (an engine
on another node also its agent's URL and token from `cluster`), the bridge
its `bridge` section with the engines, the source its `source` section with the `Policy` handle.

Start-up order (`start_parts`), measured to matter on a CPU machine where vLLM's start dominates:
the resume point is read, the model directory made sure of, and then the trainer loads while the
engines launch; the first alignment probe follows once both are up. A failure anywhere stops
whatever was launched before the error propagates. A cancellation (a stop request) during the
tiny model's build stops the build at its next warm-up step, with nothing published at
`model.path`, and nothing is launched after it.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import structlog

from grpod.agent.remote import remote_engines
from grpod.bridges import bridge_class
from grpod.config import LORA_MODES, GrpodConfig
from grpod.daemon.desk import OperatorDesk
from grpod.service.notify import Heartbeat
from grpod.daemon.progress import RunProgress
from grpod.daemon.torchrun import under_torchrun
from grpod.daemon.step_loop import StepLoop
from grpod.inference import release
from grpod.inference.cores import CoreLoan
from grpod.inference.engine import InferenceEngine
from grpod.inference.process import InferenceProcess, engine_env
from grpod.inference.supervised import SupervisedInference
from grpod.rollouts.admission import BatchAdmission
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.kinds import make_source
from grpod.rollouts.source import RolloutSource
from grpod.rollouts.validation import RejectionCounter
from grpod.run.store import RunStore
from grpod.service.threads import run_stoppable

log = structlog.get_logger(__name__)


@dataclass
class RunParts:
    trainer: object
    bridge: object
    source: RolloutSource
    admission: BatchAdmission
    loop: StepLoop


def trainer_world():
    """The trainer ranks this process joined (`grpod.daemon.ranks` joined them before the
    supervisor started), or None: a single process, which must not import torch here — the engines
    launch before the trainer stack is imported (start-up)."""
    if not under_torchrun():
        return None
    from grpod.training.distributed import current_world

    return current_world()


def trainer_builder(world):
    """How this process builds its trainer: None (the single-process `build_trainer`), or rank 0's
    `DistributedTrainer` over the trainer ranks `world`."""
    if world is None:
        return None
    from grpod.training.distributed import build_distributed_trainer

    return partial(build_distributed_trainer, world=world)


def build_engines(cfg: GrpodConfig, run_dir: Path) -> list[InferenceEngine]:
    """The inference engines: `inference.engines` on this node, then `cluster.engines_per_agent`
    of each agent in `cluster.agents` (grpod agents on other nodes)."""
    gpu = release.nvidia_gpu_count() > 0
    engines: list[InferenceEngine] = []
    for index in range(cfg.inference.engines):
        process = InferenceProcess(
            cfg.inference, cfg.model, run_dir, gpu=gpu, index=index, env=engine_env(cfg.inference, index, gpu)
        )
        engines.append(SupervisedInference(process, cfg.inference, name=f"engine-{index}"))
    return engines + remote_engines(cfg, gpu=gpu)


def build_bridge(cfg: GrpodConfig, run_dir: Path, engines: list[InferenceEngine], *, trainer=None, policy_version: int = 0):
    """The bridge of `bridge.mode` over `engines` (the trainer may be provided later)."""
    extra = {}
    if cfg.bridge.mode in LORA_MODES:
        extra["lora"] = cfg.train.lora_config
    if cfg.bridge.mode == "shared":
        extra["train_device"] = cfg.train.device
    return bridge_class(cfg.bridge.mode)(
        cfg.bridge, engines=engines, trainer=trainer, model=cfg.model, run_dir=run_dir,
        policy_version=policy_version, **extra,
    )


async def start_parts(
    cfg: GrpodConfig,
    run_dir: Path,
    *,
    progress: RunProgress,
    buffer: RolloutBuffer,
    rejections: RejectionCounter,
    desk: OperatorDesk,
    heartbeat: Heartbeat,
    reporter,
    resources: AsyncExitStack,
) -> RunParts:
    """`resources` owns what lives as long as the run (the reward workers, an environment's
    processes), closed after it."""
    began = time.perf_counter()
    phases = progress.startup

    def mark(phase: str, since: float) -> float:
        now = time.perf_counter()
        phases[phase] = round(now - since, 3)
        return now

    # The user's inputs first: a bad row or reward function stops the start before anything launches.
    prepared = None
    if cfg.source.kind == "dataset":
        from grpod.rollouts.dataset import prepare_dataset

        prepared = await prepare_dataset(cfg, log_path=run_dir / "rewards.log")
        resources.push_async_callback(prepared.scorer.aclose)
        began = mark("inputs_s", began)
    elif cfg.source.kind == "environment":
        from grpod.rollouts.environment_source import prepare_environment

        prepared = await prepare_environment(cfg.source, run_dir, resources, max_seq_len=cfg.model.max_seq_len,
                                             model_path=cfg.model.path)
        began = mark("inputs_s", began)
    world = trainer_world()
    reporter.attach(world=world)
    store = RunStore(cfg, run_dir, build_trainer=trainer_builder(world))
    restored = await anyio.to_thread.run_sync(store.resume_point)
    progress.restore_counts(restored.step, restored.extra)
    t = mark("resume_point_s", began)
    await run_stoppable(store.ensure_model)  # a stop during the tiny model's build ends it (~50 ms)
    mark("model_s", t)
    buffer.restore(restored.buffered)
    if restored.checkpoint is not None:
        desk.restore(restored.extra, f"checkpoint {restored.checkpoint}", restored.step)
        reporter.resumed(restored.checkpoint, restored.step, restored.policy_version, len(restored.buffered))
    engines = build_engines(cfg, run_dir)
    bridge = build_bridge(cfg, run_dir, engines, policy_version=restored.policy_version)
    cores = CoreLoan.plan(cfg.inference, cfg.train, cfg.model.path, engines,
                          gpu=release.nvidia_gpu_count() > 0, trainer_ranks=world is not None,
                          leased_requests=cfg.source.kind in ("dataset", "builtin"))
    reporter.attach(bridge=bridge)
    loaded: dict[str, object] = {}

    async def load_trainer() -> None:
        t = time.perf_counter()
        trainer = await anyio.to_thread.run_sync(store.load_trainer, restored)
        t = mark("trainer_load_s", t)
        bridge.provide_trainer(trainer)
        loaded["trainer"] = trainer
        # In a worker thread: the dataset source reads and tokenizes its whole file here.
        loaded["source"] = await anyio.to_thread.run_sync(
            make_source, cfg, trainer.tokenizer, bridge.policy, restored.source_cursor, rejections, prepared
        )
        mark("source_s", t)

    async def start_engines() -> None:
        await bridge.start(resumed_weights=restored.weights)
        phases.update(bridge.stats.startup)

    t = time.perf_counter()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(load_trainer)
            tg.start_soon(start_engines)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await bridge.stop()
        raise
    mark("concurrent_s", t)
    mark("total_s", began)
    log.info("startup", **phases)
    trainer, source = loaded["trainer"], loaded["source"]
    admission = BatchAdmission(cfg.train, vocab_size=trainer.vocab_size, max_seq_len=cfg.model.max_seq_len,
                               rejections=rejections, may_resend=source.may_resend)
    loop = StepLoop(
        cfg, trainer=trainer, bridge=bridge, source=source, buffer=buffer, admission=admission, desk=desk,
        progress=progress, heartbeat=heartbeat, reporter=reporter, store=store, run_dir=run_dir, cores=cores,
    )
    reporter.attach(source=source, admission=admission, evaluations=loop.evaluations, cores=cores)
    return RunParts(trainer, bridge, source, admission, loop)
