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

import pytest

from tests.training.test_distributed import (  # noqa: F401 — `workload` is test_distributed's fixture
    CHECKPOINT_AT,
    STEPS,
    _bitwise,
    _config,
    _in_process,
    _max_abs,
    _resumed_from,
    _torchrun,
    workload,
)

CUDA = {"train.device": "cuda"}


@pytest.fixture(scope="module")
def ranked(workload, tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda-one-rank")
    return _torchrun(_config(workload, out, **CUDA), out, "--checkpoint-at", str(CHECKPOINT_AT), ranks=1)


def test_one_nccl_rank_on_cuda_trains_as_the_single_process_trainer_does(ranked, workload, tmp_path):
    assert "nccl" in ranked.result["backend"], f"the rank formed {ranked.result['backend']!r}, not NCCL's group"
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


def test_the_cuda_ranks_sharded_checkpoint_resumes_to_the_same_weights(ranked, workload, tmp_path):
    config = _resumed_from(ranked.checkpoint(CHECKPOINT_AT), workload, tmp_path, **CUDA)
    resumed = _torchrun(config, tmp_path, ranks=1)
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
