"""Trainer ranks on CUDA: `tests/training/fsdp_ranks.py` under torchrun with `train.device = "cuda"`,
so the ranks form NCCL's process group (gloo beside it for commands and object gathers) and FSDP2
shards on the GPU. One machine here has one GPU, and NCCL puts no two ranks on one device, so this
is one rank: what it proves is the CUDA path of `join_trainer_world`, FSDP2, the sharded (DCP)
checkpoint and rank 0's gathers on a real device, not a split across GPUs (the 2-rank gloo tests
in tests/training/test_distributed.py cover the split).

- one NCCL rank trains as the single-process trainer does on the same GPU and groups (the
  workload of test_distributed: tied embeddings, 2 PPO minibatches, a KL reference model,
  gradient checkpointing);
- its sharded checkpoint resumes under torchrun and reaches the same weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.faults.injection import write_replay_rollouts
from tests.harness import ROOT
from tests.training.test_distributed import (
    CHECKPOINT_AT,
    RANKS_SCRIPT,
    STEPS,
    Run,
    _bitwise,
    _config,
    _in_process,
    _max_abs,
    _resumed_from,
)

LAUNCH_TIMEOUT_S = 240
CUDA = {"train.device": "cuda"}


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    from grpod.models.tiny import build_model, save_model

    root = tmp_path_factory.mktemp("cuda-ranks-workload")
    save_model(*build_model(seed=0, tie_word_embeddings=True), root / "model")
    write_replay_rollouts(root / "rollouts.jsonl", root / "model", groups=STEPS * 2, completion_len=40)
    return root


def _one_rank(config: Path, out: Path, *extra: str) -> tuple[Run, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         str(RANKS_SCRIPT), str(config), str(out), "--steps", str(STEPS), *extra],
        check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return Run.read(out), output


@pytest.fixture(scope="module")
def one_rank(workload, tmp_path_factory) -> tuple[Run, str]:
    out = tmp_path_factory.mktemp("cuda-one-rank")
    return _one_rank(_config(workload, out, **CUDA), out, "--checkpoint-at", str(CHECKPOINT_AT))


def test_one_nccl_rank_on_cuda_trains_as_the_single_process_trainer_does(one_rank, workload, tmp_path):
    ranked, output = one_rank
    assert "trainer_rank_joined" in output and "cuda:nccl" in output, "the rank did not form NCCL's group"
    single = _in_process(_config(workload, tmp_path, **CUDA), tmp_path)
    for step, reference in single.result["steps"].items():
        mine = ranked.result["steps"][step]
        print(f"step {step}: loss {mine['loss']:.8f} / {reference['loss']:.8f}, "
              f"grad norm {mine['grad_norm']:.6f} / {reference['grad_norm']:.6f}, {mine['seconds']:.2f} s")
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-7), step
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), step
    assert ranked.result["score"] == pytest.approx(single.result["score"], abs=1e-5)
    assert ranked.result["gathered"] == single.result["gathered"], "rank 0 gathers every tensor, tied head included"
    drift = _max_abs(ranked.weights, single.weights)
    print(f"weights: max |one rank - one process| = {drift:.3g}")
    assert drift <= 1e-5
    sharded = ranked.checkpoint(CHECKPOINT_AT) / "sharded"
    assert {p.name for p in sharded.iterdir()} >= {".metadata", "__0_0.distcp"}, "the rank wrote no shards"


def test_the_cuda_ranks_sharded_checkpoint_resumes_to_the_same_weights(one_rank, workload, tmp_path):
    ranked, _ = one_rank
    config = _resumed_from(ranked.checkpoint(CHECKPOINT_AT), workload, tmp_path, **CUDA)
    resumed, _ = _one_rank(config, tmp_path)
    assert resumed.result["resumed_from"] == CHECKPOINT_AT
    for step in range(CHECKPOINT_AT + 1, STEPS + 1):
        assert resumed.result["steps"][str(step)]["loss"] == pytest.approx(
            ranked.result["steps"][str(step)]["loss"], rel=1e-6, abs=1e-9
        ), step
    # CUDA's scatter-add backward (the loss's token gather) sums in no fixed order: within
    # rounding, not necessarily bit for bit as on the CPU.
    drift = _max_abs(resumed.weights, ranked.weights)
    print(f"resumed: {len(_bitwise(resumed.weights, ranked.weights))} tensors not bit-equal, max diff {drift:.3g}")
    assert drift <= 1e-6
