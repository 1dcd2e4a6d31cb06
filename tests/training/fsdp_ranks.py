"""A training run of `grpod.training.distributed`'s trainer, without vLLM: one process of it per rank
under torchrun (tests/training/test_distributed.py starts it), or one process alone.

    torchrun --standalone --nproc-per-node 2 tests/training/fsdp_ranks.py CONFIG OUT --steps N
        [--checkpoint-at S] [--idle-s T]

Rank 0 does what the daemon's components and step loop do with the trainer: `RunStore` resumes
(`run.resume` of CONFIG) and builds the trainer (`trainer_builder`), `train_batch` trains the
replayed groups of `source.replay_path` (`train.groups_per_step` per step, in order) up to step
N, `RunStore.save` checkpoints after step S (S = the resumed step: at once); with T, rank 0
makes no call for T seconds after loading the trainer (a paused daemon, an engine launching); then the calls a bridge makes (`score`,
`full_state_dict`, `save_weights`, `set_learning_rate`) and the followers' release. Ranks > 0
run `follow`. Rank 0 writes OUT/result.json (per step: loss, grad norm, idle rounds; the probe
scores; the gathered tensors' names; under torchrun the process group's backend) and OUT/final
(the HF export).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio
import torch.distributed

from grpod.config import load_config
from grpod.daemon.components import trainer_builder, trainer_world
from grpod.daemon.torchrun import under_torchrun
from grpod.daemon.step_loop import train_batch
from grpod.rollouts.group import RolloutGroup
from grpod.run.store import RunSnapshot, RunStore
from grpod.training.distributed import (
    follow,
    join_trainer_world,
    leave_trainer_world,
    stop_followers,
)

PROBE = [3, 9, 14, 20, 7, 11, 5]


class NoFence:
    async def fence(self, update):
        await update()


def lead(cfg, out: Path, steps: int, checkpoint_at: int | None, idle_s: float = 0.0) -> dict:
    store = RunStore(cfg, cfg.run.dir, build_trainer=trainer_builder(trainer_world()))
    restored = store.resume_point()
    trainer = store.load_trainer(restored)
    time.sleep(idle_s)  # not a wait for anything: rank 0 idle between two calls is what is tested
    lines = Path(cfg.source.replay_path).read_text().splitlines()
    groups = [RolloutGroup.from_json(json.loads(line)["group"]) for line in lines]
    per = cfg.train.groups_per_step
    result = {"resumed_from": restored.step, "steps": {}}

    def checkpoint(step: int) -> None:
        store.save(trainer, RunSnapshot(step, 0, [], {"kind": "replay", "next_index": step * per}, {}))

    if checkpoint_at == restored.step:  # the resumed state, as this many ranks write it
        checkpoint(restored.step)
    for step in range(restored.step + 1, steps + 1):
        began = time.perf_counter()
        metrics, _ = anyio.run(train_batch, trainer, NoFence(), groups[(step - 1) * per : step * per])
        result["steps"][step] = {
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "idle_rounds": metrics.get("idle_rounds", 0.0),
            "seconds": time.perf_counter() - began,
        }
        if step == checkpoint_at:
            checkpoint(step)
    result["score"] = trainer.score(PROBE)
    result["gathered"] = sorted(trainer.full_state_dict())
    trainer.save_weights(out / "final")
    trainer.set_learning_rate(cfg.train.lr / 2)
    result["lr_after_set"] = trainer.scheduler.get_last_lr()[0]
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--checkpoint-at", type=int)
    parser.add_argument("--idle-s", type=float, default=0.0)
    args = parser.parse_args()
    cfg = load_config(args.config)
    if not under_torchrun():
        result = lead(cfg, args.out, args.steps, args.checkpoint_at, args.idle_s)
    else:
        world = join_trainer_world(cfg)
        try:
            if not world.leads:
                follow(world)
                return 0
            try:
                result = lead(cfg, args.out, args.steps, args.checkpoint_at, args.idle_s)
                result["backend"] = torch.distributed.get_backend()
            finally:
                stop_followers(world)
        finally:
            leave_trainer_world()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
