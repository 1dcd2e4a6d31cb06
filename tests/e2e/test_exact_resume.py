"""Exact resume: a run killed with SIGKILL and started again ends bitwise where a straight run ends.

Both runs replay the same recorded rollouts (source.kind = "replay"). The interrupted run is
killed (not stopped) after its step-3 checkpoint; `grpod start` on the same run directory
resumes from the newest complete checkpoint, with the buffered-but-untrained groups it recorded.
"""

from __future__ import annotations

import json
import random
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from grpod.rollouts.arithmetic import ArithmeticTask, prompt_ids
from grpod.rollouts.group import RolloutGroup
from tests.harness import DaemonProcess, base_settings, group_processes, metrics, write_config

pytestmark = pytest.mark.e2e

STEPS = 6


def _recorded_rollouts(path, model_dir, groups: int) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = ArithmeticTask(seed=7)
    rng = random.Random(5)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    with open(path, "w") as f:
        for index in range(groups):
            problem = task.sample(rng)
            prompt = prompt_ids(tok, problem)
            tokens, masks, logprobs, scores = [], [], [], []
            for seq in range(4):
                completion = [rng.choice(digits) for _ in range(rng.randint(1, 3))] + [eos]
                tokens.append(prompt + completion)
                masks.append([0] * len(prompt) + [1] * len(completion))
                logprobs.append([0.0] * len(prompt) + [-rng.uniform(0.05, 3.0) for _ in completion])
                scores.append(float(seq % 2) if index % 3 else rng.random())
            group = RolloutGroup(tokens, masks, scores, logprobs, group_id=f"rec-{index}")
            f.write(json.dumps({"step": 0, "group": group.to_json()}) + "\n")


def _settings(run_dir, model_dir, replay):
    return base_settings(run_dir, model_dir) | {
        "train.steps": STEPS,
        "train.max_staleness": 1000,
        "source.kind": "replay",
        "source.replay_path": str(replay),
        "source.prefetch_groups": 3,
        "checkpoint.every": 1,
        "checkpoint.keep_last": 10,
        "bridge.sync_every": 2,
    }


def _final_weights(run_dir):
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert final.name == f"step-{STEPS:06d}"
    return load_file(final / "model" / "model.safetensors")


def _trained_lineage(run_dir):
    """group ids per step, the last record of each step winning (a step redone after a kill)."""
    per_step = {}
    for record in metrics(run_dir):
        if record["kind"] == "step":
            per_step[record["step"]] = record["group_ids"]
    return per_step


def test_kill_9_and_resume_matches_straight_run_bitwise(tmp_path, warm_model_dir):
    replay = tmp_path / "rollouts.jsonl"
    _recorded_rollouts(replay, warm_model_dir, groups=STEPS * 2 + 2)

    straight_dir = tmp_path / "straight"
    straight = DaemonProcess(write_config(tmp_path / "s.toml", _settings(straight_dir, warm_model_dir, replay)), straight_dir)
    try:
        assert straight.wait_exit(400) == 0, straight.tail()
    finally:
        straight.close()

    run_dir = tmp_path / "interrupted"
    config = write_config(tmp_path / "i.toml", _settings(run_dir, warm_model_dir, replay))
    first = DaemonProcess(config, run_dir)
    try:
        first.wait_for(lambda s: s["bridge"] is not None and s["bridge"]["vllm"]["pid"], 300, "vLLM started")
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "step-000003" / "manifest.json").exists():
            assert time.monotonic() < deadline, first.tail()
            assert first.proc.poll() is None, first.tail()
            time.sleep(0.05)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
        first.close(stop_vllm=False)
        orphans = [p for pgid in first.vllm_pgids for p in group_processes(pgid)]
        assert orphans, "SIGKILL of the daemon leaves its vLLM running (its own session)"

        second = DaemonProcess(config, run_dir)
        try:
            assert second.wait_exit(400) == 0, second.tail()
        finally:
            second.close()
        for pgid in first.vllm_pgids:
            assert group_processes(pgid) == [], "the restarted daemon stops the vLLM its killed predecessor left"
    finally:
        first.close()
    log = (run_dir / "grpod.log").read_text()
    assert '"event": "resumed"' in log and '"event": "inference_left_behind"' in log

    lineage, reference = _trained_lineage(run_dir), _trained_lineage(straight_dir)
    assert sorted(lineage) == list(range(1, STEPS + 1))
    assert lineage == reference, "the same groups trained at the same steps: none lost, none twice"
    trained = [gid for step in sorted(lineage) for gid in lineage[step]]
    assert len(trained) == len(set(trained))

    a, b = _final_weights(straight_dir), _final_weights(run_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
