"""bench/gpu_trainer.py runs where it is tried out (`--device cpu`, the tiny model): the GPU
machine is lent rarely and for minutes, so the script must not fail there for a reason a CPU
shows first. It measures; nothing here asserts on time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_trainer_bench_runs_each_setting_on_the_tiny_model(tmp_path):
    out = tmp_path / "gpu_trainer.json"
    done = subprocess.run(
        [sys.executable, "bench/gpu_trainer.py", "--device", "cpu", "--models", "tiny", "--steps", "2",
         "--groups", "2", "--group-size", "3", "--same-batch", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    plain = ["float32", "bfloat16-lora", "float32-large-micro", "bfloat16-lora-large-micro"]
    assert [r["setting"] for r in results] == plain + [f"{name}-pad128" for name in plain]
    for r in results:
        assert r["model"] == "tiny" and len(r["steps"]) == 2
        # --same-batch: both steps train the same 2 groups x 3 completions
        assert r["steps"][0]["tokens"] == r["steps"][1]["tokens"] > 0
        assert all(s["skipped"] == 0 and math.isfinite(s["tflops"]) and s["seconds"] > 0 for s in r["steps"])
        assert "train_step" in r["cold_profile"]
    assert "| tiny | bfloat16-lora |" in done.stdout
