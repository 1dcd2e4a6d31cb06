"""The trainer's step on one CUDA device: time per step (cold first step, then warm), peak memory
and training FLOP/s, in fp32 (full fine-tuning) and bf16 (LoRA over a bf16 base), on grpod's tiny
model and on a SmolLM2-135M-shaped model (its config.json and tokenizer, random weights: no
download, nothing large to carry). Needs CUDA; the GPU suite (tests/gpu) proves correctness, this
only measures.

    python bench/gpu_trainer.py [--smollm2-config DIR] [--steps 5] [--out bench/results/gpu_trainer.json]

DIR (default models/smollm2-135m) holds SmolLM2's config.json, tokenizer.json and
tokenizer_config.json; only those three files need to travel to a GPU machine (3.5 MB), with the
wheels tests/gpu/fetch_wheels.sh gathers. Batches: `--groups` groups of `--group-size` completions of 64-256 tokens
after a 100-140 token prompt (SmolLM2) or the unit tests' arithmetic-shaped groups (tiny).
FLOPs are nominal: forward + backward = 3 x the forward of every trained sequence, prompt
included, whatever the plan (a shared prompt is forwarded once per group, so the work the device
executes is less: bench/compute.py counts that); every setting is credited the same work and they
compare by time. The first step of each setting is also profiled with cProfile (host
side, cumulative time): the top entries say where a slow cold step goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compute import Flops  # noqa: E402
from grpod.config import parse_config  # noqa: E402
from grpod.models.tiny import build_model, save_model  # noqa: E402
from grpod.rollouts.group import RolloutGroup  # noqa: E402
from grpod.training.trainer import build_trainer  # noqa: E402

_LORA = ({"train": {"lora": True}, "bridge": {"mode": "lora_only"}}, {"dtype": "bfloat16"})
# Whole-batch micro-batches: the defaults (one group per micro-batch, its prompt forwarded once,
# 4096 padded tokens at most) are sized for a CPU; a GPU may want fewer, larger launches.
_LARGE_MICRO = {"share_prompt": False, "micro_batch_tokens": 65536}
# Micro-batch lengths rounded up to a multiple of 128 (train.pad_to_multiple): a few shapes that
# repeat across steps, for kernel choices made per shape.
_PAD = {"pad_to_multiple": 128}
SETTINGS = {
    "float32": ({"train": {}}, {}),
    "bfloat16-lora": _LORA,
    "float32-large-micro": ({"train": _LARGE_MICRO}, {}),
    "bfloat16-lora-large-micro": ({**_LORA[0], "train": {**_LORA[0]["train"], **_LARGE_MICRO}}, _LORA[1]),
    "float32-pad128": ({"train": _PAD}, {}),
    "bfloat16-lora-pad128": ({**_LORA[0], "train": {**_LORA[0]["train"], **_PAD}}, _LORA[1]),
    "float32-large-micro-pad128": ({"train": {**_LARGE_MICRO, **_PAD}}, {}),
    "bfloat16-lora-large-micro-pad128": ({**_LORA[0], "train": {**_LORA[0]["train"], **_LARGE_MICRO, **_PAD}}, _LORA[1]),
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def smollm2_shaped(config_dir: Path, out: Path) -> Path:
    """A random-weight model with SmolLM2-135M's config and tokenizer, saved in `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(config_dir / name, out / name)
    return out


def groups(vocab: int, n_groups: int, size: int, prompt: tuple[int, int], completion: tuple[int, int], seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))]
        tokens, masks, logprobs = [], [], []
        for _ in range(size):
            c = [rng.randrange(3, vocab) for _ in range(rng.randint(*completion))]
            tokens.append(p + c)
            masks.append([0] * len(p) + [1] * len(c))
            logprobs.append([0.0] * len(p) + [rng.uniform(-2.0, -0.5) for _ in c])
        scores = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(size - 2)]
        out.append(RolloutGroup(tokens, masks, scores, inference_logprobs=logprobs, temperature=1.0))
    return out


def torch_profile(trainer, batch) -> str:
    """torch.profiler over one more (warm) step: the ops with the most device and host self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        trainer.train_step(batch)
        sync()
    table = prof.key_averages()
    device_sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return (table.table(sort_by=device_sort, row_limit=25) + "\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=15))


def measure(model_dir: Path, setting: str, batches: list, flops: Flops, device: str, deep: bool = False) -> dict:
    tree, model = SETTINGS[setting]
    train = {**tree["train"], "device": device}
    cfg = parse_config({**tree, "train": train, "model": {"path": str(model_dir), "init_if_missing": False, **model}})
    began = time.perf_counter()
    trainer = build_trainer(cfg, model_dir)
    sync()
    load_s = time.perf_counter() - began
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps, profile = [], ""
    for i, batch in enumerate(batches):
        train_flops = sum(3 * flops.forward(len(seq)) for g in batch for seq in g.tokens)
        profiler = cProfile.Profile() if i == 0 else None
        sync()
        began = time.perf_counter()
        if profiler:
            profiler.enable()
        metrics = trainer.train_step(batch)
        sync()
        seconds = time.perf_counter() - began
        if profiler:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(18)
            profile = text.getvalue()
        steps.append({
            "seconds": round(seconds, 4), "tokens": sum(len(s) for g in batch for s in g.tokens),
            "tflops": round(train_flops / seconds / 1e12, 3), "skipped": metrics["skipped"],
        })
        print(f"  {setting} step {i + 1}: {seconds * 1e3:.1f} ms, {steps[-1]['tflops']} TFLOP/s", flush=True)
    warm = steps[1:] or steps
    deep_profile = torch_profile(trainer, batches[-1]) if deep else ""
    return {
        "setting": setting, "load_s": round(load_s, 3), "steps": steps,
        "cold_step_s": steps[0]["seconds"], "warm_step_s": round(sum(s["seconds"] for s in warm) / len(warm), 4),
        "warm_tflops": round(sum(s["tflops"] for s in warm) / len(warm), 3),
        "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device == "cuda" else None, "cold_profile": profile,
        "warm_torch_profile": deep_profile,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2-config", type=Path, default=ROOT / "models" / "smollm2-135m",
                        help="a folder with SmolLM2's config.json, tokenizer.json and tokenizer_config.json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-shaped"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--same-batch", action="store_true",
                        help="every step trains the first batch (same shapes: no new kernel or cuBLAS plan after step 1)")
    parser.add_argument("--torch-profile", action="store_true", help="also torch.profiler one warm step of each")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script out")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/gpu_trainer.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_trainer.py needs a CUDA device (--device cpu only tries it out)")
    work = Path(tempfile.mkdtemp(prefix="grpod-gpu-bench-"))
    models = {}
    if "tiny" in args.models:
        save_model(*build_model(seed=0), work / "tiny")
        models["tiny"] = work / "tiny"
    if "smollm2-135m-shaped" in args.models:
        models["smollm2-135m-shaped"] = smollm2_shaped(args.smollm2_config, work / "smollm2")
    results = []
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu", "torch": torch.__version__, "groups": args.groups,
           "group_size": args.group_size, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, path in models.items():
        config = json.loads((path / "config.json").read_text())
        flops, vocab = Flops(config), config["vocab_size"]
        shape = ((15, 25), (2, 16)) if name == "tiny" else ((100, 140), (64, 256))
        batches = [groups(min(vocab, 52) if name == "tiny" else vocab, args.groups, args.group_size, *shape, seed=i)
                   for i in range(1 if args.same_batch else args.steps)]
        batches = batches * args.steps if args.same_batch else batches
        for setting in args.settings:
            print(f"{name} / {setting}", flush=True)
            results.append({"model": name, **measure(path, setting, batches, flops, args.device, args.torch_profile)})
            args.out.write_text(json.dumps(out, indent=1) + "\n")  # after each setting: a run cut short keeps its rows
            if results[-1]["warm_torch_profile"]:
                print(f"\n--- warm step, torch.profiler: {name} / {setting} ---\n{results[-1]['warm_torch_profile']}", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    print(f"\n{out['device']}, torch {out['torch']}, {args.groups} groups x {args.group_size} per step")
    print("| model | setting | load s | cold step s | warm step s | warm TFLOP/s | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['setting']} | {r['load_s']} | {r['cold_step_s']} | {r['warm_step_s']} | "
              f"{r['warm_tflops']} | {r['peak_mib']} |")
    for r in results:
        print(f"\n--- cold step profile: {r['model']} / {r['setting']} ---\n{r['cold_profile']}")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
