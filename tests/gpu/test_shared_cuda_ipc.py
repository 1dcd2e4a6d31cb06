"""Bridge mode `shared` on CUDA: one copy of the weights, exported by grpod's CUDA IPC handle.

vLLM cannot run here, so `IpcConsumer` stands in for the vLLM process an engine launches: a child
process (`ipc_consumer.py`, torch + `grpod.weights.shared_layout` only) that maps the trainer's
buffer through the handle grpod writes and reads it back on request. Everything else is grpod's
own code: the trainer on the GPU, `SharedBridge` (share, attach, fence, probe), the engine owner
`SupervisedInference` and the step loop's `train_batch`, which runs the optimizer update inside
the bridge's fence. The stand-in answers the alignment probe with the trainer's own scores: the
probe is proved against a real vLLM in tests/e2e; here it only has to let the sync through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import pytest
import torch

from grpod.bridges.shared import SharedBridge
from grpod.config import parse_config
from grpod.daemon.step_loop import train_batch
from grpod.inference.supervised import SupervisedInference
from grpod.models.tiny import build_model, save_model
from grpod.training.trainer import build_trainer
from tests.gpu.conftest import HERE, REPO, read_line, stop_child
from tests.training.test_trainer import random_groups


class IpcConsumer:
    """Stands in for `InferenceProcess`: `start` launches the consumer child; its client answers
    the bridge's calls from it. `seen` holds what the child read at the fence's pause and resume."""

    gpu = True
    base_url = "http://127.0.0.1:9"

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.proc: subprocess.Popen | None = None
        self.calls: list[tuple[str, object]] = []
        self.watch: list[int] = []  # buffer indices the child reads at the fence
        self.seen: dict[str, dict] = {}
        self.attached: dict | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self, weights, **kwargs) -> None:
        self.calls.append(("start", kwargs.get("worker_extension")))
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "ipc_consumer.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path},
        )
        ready = await anyio.to_thread.run_sync(read_line, self.proc)
        assert json.loads(ready) == {"ready": True}

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(read_line(self.proc))
        assert "error" not in answer, answer
        return answer

    async def stop(self) -> None:
        if self.proc is not None:
            await anyio.to_thread.run_sync(stop_child, self.proc)

    @asynccontextmanager
    async def client(self):
        yield IpcConsumerClient(self)

    async def wait_exit(self) -> int:
        return await anyio.to_thread.run_sync(partial(self.proc.wait, timeout=3600), abandon_on_cancel=True)


class IpcConsumerClient:
    """The calls `SharedBridge` makes on vLLM's client, answered by the consumer child."""

    def __init__(self, consumer: IpcConsumer) -> None:
        self.consumer = consumer

    async def _ask(self, **request) -> dict:
        return await anyio.to_thread.run_sync(partial(self.consumer.ask, **request))

    async def health(self, timeout_s=None) -> bool:
        return self.consumer.running

    async def is_paused(self, timeout_s=None) -> bool:
        return False  # the consumer's core is the consumer: /health says whether it lives

    async def update_weight_version(self, version: int) -> None:
        self.consumer.calls.append(("version", version))

    async def collective_rpc(self, method, args=(), kwargs=None) -> list[dict]:
        assert method == "attach_shared", method
        self.consumer.calls.append((method, args[1]))
        self.consumer.attached = await self._ask(op="attach", dir=args[0])
        return [self.consumer.attached]

    async def pause(self, mode="keep") -> None:
        self.consumer.calls.append(("pause", mode))
        self.consumer.seen["paused"] = await self._ask(op="read", indices=self.consumer.watch)

    async def end_fence(self, version: int) -> None:
        self.consumer.seen["resumed"] = await self._ask(op="read", indices=self.consumer.watch)
        self.consumer.calls.append(("end_fence", version))

    async def score_many(self, sequences, model) -> list[list[float]]:
        trainer = self.consumer.trainer
        return await anyio.to_thread.run_sync(lambda: [trainer.score(ids) for ids in sequences])


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """The tiny model made wide (hidden 1024, 4 layers: ~54 M parameters, ~215 MB in fp32), so
    that a second copy would stand out from allocator noise in the memory accounting."""
    out = tmp_path_factory.mktemp("gpu-wide") / "wide"
    save_model(*build_model(seed=0, hidden_size=1024, layers=4), out)
    return out


def test_shared_mode_maps_one_copy_over_cuda_ipc_and_the_fenced_step_is_seen_in_place(wide_model_dir, tmp_path):
    """The trainer's parameters move into one CUDA buffer (no second copy in the trainer), a
    separate process maps it through grpod's IPC handle without allocating it again, and the
    optimizer step that `train_batch` runs inside the bridge's fence is what that process reads
    after the fence (before it, at the pause, it still reads the old weights)."""
    cfg = parse_config({
        "run": {"dir": str(tmp_path / "run")},
        "model": {"path": str(wide_model_dir), "init_if_missing": False},
        "train": {"device": "cuda", "lr": 1e-3},
        "bridge": {"mode": "shared"},
    })
    trainer = build_trainer(cfg, wide_model_dir)
    consumer = IpcConsumer(trainer)
    engine = SupervisedInference(consumer, cfg.inference)
    bridge = SharedBridge(
        cfg.bridge, engines=[engine], trainer=trainer, model=cfg.model, run_dir=tmp_path / "run", train_device="cuda"
    )

    # Measured right after the parameters move into the buffer: later in `start` the probe's first
    # matmuls allocate cuBLAS workspaces through torch's allocator (one per thread and stream, tens
    # of MiB on Hopper), which are not weights.
    share = bridge._share_trainer_weights
    shared_at = {}

    def share_and_measure(trainer):
        shared = share(trainer)
        torch.cuda.synchronize()
        shared_at["allocated"] = torch.cuda.memory_allocated()
        return shared

    bridge._share_trainer_weights = share_and_measure

    async def main():
        torch.cuda.synchronize()
        allocated_before = torch.cuda.memory_allocated()
        await bridge.start()
        allocated_after = shared_at["allocated"]
        flat = bridge.shared.flat
        # The middle element of every slot that is not an embedding (their pad rows stay zero).
        consumer.watch = [s.offset + s.numel // 2 for s in bridge.shared.layout.slots if "embed" not in s.name]
        before = flat[consumer.watch].tolist()
        try:
            metrics, fenced = await train_batch(trainer, bridge, random_groups())
            torch.cuda.synchronize()
            after = flat[consumer.watch].tolist()
            final = await anyio.to_thread.run_sync(partial(consumer.ask, op="read", indices=[]))
        finally:
            await bridge.stop()
        return allocated_before, allocated_after, before, after, final, flat.double().sum().item(), metrics, fenced

    allocated_before, allocated_after, before, after, final, trainer_sum, metrics, fenced = anyio.run(main)
    attached, nbytes = consumer.attached, bridge.shared.layout.nbytes
    print(
        f"\nshared buffer {nbytes / 2**20:.1f} MiB; trainer allocated {allocated_before / 2**20:.1f} -> "
        f"{allocated_after / 2**20:.1f} MiB after sharing; consumer pid {attached['pid']}: device free memory "
        f"-{attached['free_drop'] / 2**20:.1f} MiB, torch allocated {attached['allocated']} B after mapping; "
        f"fence phases {fenced[0].phases if fenced else None}"
    )

    assert nbytes > 150 * 2**20
    assert all(bridge.shared.holds(p) for p in trainer.model.parameters()), "a parameter lives outside the buffer"
    assert allocated_after - allocated_before < 0.02 * nbytes + 2**20, "sharing left a second copy in the trainer"
    assert attached["same_device"] and attached["nbytes"] == nbytes and attached["pid"] != os.getpid()
    assert attached["free_drop"] < nbytes / 4, "mapping the handle allocated the weights again"
    assert attached["allocated"] < nbytes / 100

    assert [c[0] for c in consumer.calls] == ["start", "version", "attach_shared", "pause", "end_fence"]
    assert consumer.calls[0][1] == "grpod.weights.shared_ext.SharedWeightsExtension"
    assert len(fenced) == 1 and bridge.policy_version == 1 and metrics["skipped"] == 0
    changed = sum(a != b for a, b in zip(before, after, strict=True))
    assert changed >= len(before) * 3 // 4, f"the step changed only {changed} of {len(before)} watched weights"
    assert consumer.seen["paused"]["values"] == before, "at the fence's pause the consumer must see the old weights"
    assert consumer.seen["resumed"]["values"] == after, "after the step the consumer must see the trainer's edit"
    assert final["sum"] == pytest.approx(trainer_sum, rel=1e-12, abs=1e-9)
    assert not consumer.running, "bridge.stop stopped the consumer"
