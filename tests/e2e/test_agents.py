"""An agent trained by `grpod start` as a user runs it, on real vLLM and SmolLM2-135M-Instruct: a
verifiers environment (the shipped calculator taskset, in the verifiers venv's worker process)
trains 5 steps of multi-turn episodes and leaves no environment process behind. (An OpenEnv
environment served by the process grpod starts trains 8 steps under faults in
tests/faults/test_environment_faults.py; the shipped guess game is played in
tests/rollouts/test_openenv_adapter.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.e2e

ADAPTERS = {
    "verifiers": [
        'source.environment.adapter="verifiers"',
        'source.environment.name="vf_calculator"',
        'source.environment.path=["etc/examples/agent-envs"]',
        "source.environment.args={}",
        "source.environment.max_turns=2",
    ],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_an_environment_trains_an_agent_under_grpod_start(tmp_path, smollm2_dir, adapter):
    run_dir = tmp_path / "run"
    overrides = [
        f"run.dir={json.dumps(str(run_dir))}", f"model.path={json.dumps(str(smollm2_dir))}",
        "train.steps=5", "train.groups_per_step=2", "source.group_size=3", "source.max_tokens=24",
        "source.concurrency=4", "source.dynamic_sampling=true", "source.dynamic_sampling_max_filtered=6",
        "eval.size=4", "eval.every=0", "checkpoint.every=5", *ADAPTERS[adapter],
    ]
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = subprocess.run(
        [sys.executable, "-m", "grpod", "start", "--config", "etc/examples/agent-calculator.toml",
         *[arg for override in overrides for arg in ("--set", override)]],
        cwd=ROOT, capture_output=True, text=True, timeout=560,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r or "skipped" in r]
    assert len(steps) == 5
    assert any(r["skipped"] == 0.0 for r in steps), "at least one step trained on episodes"
    # Multi-turn: some episode had a second model turn (an environment reply between two turns).
    assert steps[-1]["model_turns"] > steps[-1]["episodes"] > 0
    evals = [r for r in records if "eval_accuracy" in r]
    assert evals and all(r["eval_failed"] == 0 for r in evals)
    assert "environment_crash" not in done.stderr and "environment_error" not in done.stderr
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children_before, "a process outlived the run"
