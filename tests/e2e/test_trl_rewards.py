"""A reward module written for TRL trains under grpod unchanged: the shipped example
(etc/examples/trl-rewards.toml; keyword functions, **kwargs, an async function, one answering None
for rows without a carry, log_metric) run by `grpod start` as a user runs it, on real vLLM and the
tiny model. The same module trains under TRL's GRPOTrainer in tests/rollouts/test_trl_rewards.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.e2e

FUNCTIONS = ("correct", "reward_len", "digits_only", "carry_bonus")


@pytest.mark.timeout(400)
def test_the_trl_style_example_trains_under_grpod(tmp_path):
    from grpod.models.tiny import build_model, save_model

    model_dir = tmp_path / "model"  # the tiny model, random weights, its own generation defaults
    save_model(*build_model(seed=0), model_dir)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "grpod", "start", "--config", "etc/examples/trl-rewards.toml",
         "--set", f"run.dir={json.dumps(str(run_dir))}", "--set", f"model.path={json.dumps(str(model_dir))}",
         "--set", "train.steps=6", "--set", "eval.size=8", "--set", "eval.every=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=360,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r and "loss" in r]
    assert len(steps) == 6
    for function in FUNCTIONS:
        assert any(f"reward/{function}" in r for r in steps), function
    assert all("reward_log/carry_rows" in r for r in steps)
    # Every group was scored: no reward failure, nothing unscorable (every row has `correct`).
    assert "reward_failed" not in done.stderr and "reward_unscorable" not in done.stderr
    evals = [r for r in records if "eval_accuracy" in r]
    assert evals and all(r["eval_reward_failures"] == 0 for r in evals)
