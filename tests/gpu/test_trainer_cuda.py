"""The trainer on CUDA with grpod's tiny model (no download): one GRPO step in fp32 (full
fine-tuning) and in bf16 (LoRA over a bf16 base, what `model.dtype = "bfloat16"` trains), and the
logprob contract: the trainer's fp32 log-softmax of fp32 / bf16 logits against an fp64 reference
on the same weights, judged by the tolerances grpod's alignment probe applies to that dtype
(`ProbeTolerance.for_serving`); and a step padded by `train.pad_to_multiple` against the unpadded
one. Step time and peak memory are printed (`-rA` shows them); no test asserts on time.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpod.bridges.probe import PROBE_TEXTS, ProbeResult, ProbeTolerance
from grpod.config import parse_config
from grpod.training.trainer import build_trainer
from tests.training.test_trainer import random_groups

SETTINGS = {
    "float32": {"train": {"device": "cuda"}},
    "bfloat16": {"train": {"device": "cuda", "lora": True}, "model": {"dtype": "bfloat16"}, "bridge": {"mode": "lora_only"}},
}


def cuda_trainer(model_dir, dtype: str, device: str = "cuda", **train):
    """The config and trainer of `SETTINGS[dtype]` on `device` (cpu only to try a test's body out),
    with `train` settings added."""
    tree = SETTINGS[dtype]
    tree = {**tree, "train": {**tree["train"], "device": device, **train}}
    cfg = parse_config({**tree, "model": {"path": str(model_dir), "init_if_missing": False, **tree.get("model", {})}})
    return cfg, build_trainer(cfg, model_dir)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_train_step_on_cuda(tiny_model_dir, dtype):
    """A step runs on the GPU in `dtype`: every parameter is on CUDA (the frozen base in bf16 for
    LoRA, trainable ones in fp32), the step trains (finite loss, not skipped) and changes trainable
    parameters only."""
    _, trainer = cuda_trainer(tiny_model_dir, dtype)
    params = dict(trainer.model.named_parameters())
    assert all(p.is_cuda for p in params.values())
    assert all(p.dtype == torch.float32 for p in trainer.trainable)
    frozen = [p for p in params.values() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen) and bool(frozen) == (dtype == "bfloat16")
    before = {name: p.detach().clone() for name, p in params.items()}

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    metrics = trainer.train_step(random_groups())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated()
    print(f"\n{dtype}: step {seconds * 1e3:.1f} ms (trainer's step_time_s {metrics['step_time_s'] * 1e3:.1f} ms), "
          f"peak memory {peak / 2**20:.1f} MiB on {torch.cuda.get_device_name()}")

    assert metrics["skipped"] == 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    moved = {name for name, p in params.items() if not torch.equal(p.detach(), before[name])}
    # LoRA's A matrices get no gradient while B is still zero (its first step); B moves.
    assert moved and moved <= {name for name, p in params.items() if p.requires_grad}


def padded_and_unpadded_steps(model_dir, dtype: str, device: str = "cuda") -> tuple[dict, dict]:
    """One step of the same groups by two fresh trainers, `train.pad_to_multiple` 0 and 128."""
    plain, padded = (cuda_trainer(model_dir, dtype, device, pad_to_multiple=m)[1] for m in (0, 128))
    return plain.train_step(random_groups(seed=3)), padded.train_step(random_groups(seed=3))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_padded_to_a_multiple_is_the_unpadded_step_on_cuda(tiny_model_dir, dtype):
    """train.pad_to_multiple on the GPU's attention kernels (SDPA with the packed row's mask, its
    padding rows included): the same loss and gradient norm as the unpadded step, within what
    the dtype's different kernel shapes round (fp32 1e-4 relative; bf16 2e-2), and more positions
    processed (the padding)."""
    plain, padded = padded_and_unpadded_steps(tiny_model_dir, dtype)
    print(f"\n{dtype}: loss {plain['loss']:.6g} / padded {padded['loss']:.6g}; grad norm {plain['grad_norm']:.6g} / "
          f"{padded['grad_norm']:.6g}; processed tokens {plain['processed_tokens']:.0f} / {padded['processed_tokens']:.0f}")
    rel = 1e-4 if dtype == "float32" else 2e-2
    assert padded["skipped"] == plain["skipped"] == 0
    assert padded["loss"] == pytest.approx(plain["loss"], rel=rel, abs=1e-6)
    assert padded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=rel)
    assert padded["processed_tokens"] > plain["processed_tokens"]


def fp64_reference(model_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax in fp64 of an fp64 copy of the checkpoint: the exact value both dtypes approximate."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).to("cuda").eval()
    with torch.no_grad():
        tokens = torch.tensor([ids], device="cuda")
        logits = model(input_ids=tokens, use_cache=False).logits[0, :-1]
        return torch.log_softmax(logits, dim=-1).gather(1, tokens[0, 1:, None]).squeeze(1).cpu()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_match_an_fp64_reference_within_the_probe_tolerance(tiny_model_dir, dtype):
    """The trainer's scores (`Trainer.score`: fp32 log-softmax of `dtype` logits) of the probe
    sequences, on untrained weights (LoRA adds zero), differ from the fp64 reference by no more
    than the alignment probe tolerates for `dtype` (fp32: max 0.02; bf16: mean 0.07, p95 0.3)."""
    cfg, trainer = cuda_trainer(tiny_model_dir, dtype)
    diffs = []
    for text in PROBE_TEXTS:
        ids = trainer.tokenizer(text, add_special_tokens=False)["input_ids"]
        ours = torch.tensor(trainer.score(ids), dtype=torch.float64)
        diffs.append((ours - fp64_reference(tiny_model_dir, ids)).abs())
    diffs = torch.cat(diffs)
    tolerance = ProbeTolerance.for_serving(dtype, cfg.bridge)
    result = ProbeResult(
        diffs.max().item(), diffs.mean().item(), diffs.numel(), tolerance, p95_abs_diff=diffs.quantile(0.95).item()
    )
    print(f"\n{dtype} vs fp64: {result.as_dict()}")
    assert result.ok, result.as_dict()
    if dtype == "float32":
        assert result.max_abs_diff < 1e-4, "fp32 should agree with fp64 far inside the probe's bound"
