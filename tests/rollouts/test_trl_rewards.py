"""The shipped TRL-style reward module (etc/examples/trl-rewards/rewards.py) under TRL itself:
TRL's GRPOTrainer trains one step on the example's rows with the module's functions, unchanged,
so "written for TRL" is checked against TRL and not against grpod's reading of it. (grpod runs the
same module in tests/e2e/test_trl_rewards.py.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "examples" / "trl-rewards"


def _module():
    spec = importlib.util.spec_from_file_location("trl_example_rewards", EXAMPLE / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_trls_grpo_trainer_trains_a_step_with_the_example_module(tmp_path):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from grpod.models.tiny import build_model, save_model

    model, tokenizer = build_model(seed=0)
    save_model(model, tokenizer, tmp_path / "model")
    rewards = _module()
    rows = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()[:8]]
    dataset = datasets.Dataset.from_list([{"prompt": row["messages"], "answer": row["answer"]} for row in rows])
    functions = [rewards.correct, rewards.reward_len, rewards.digits_only, rewards.carry_bonus]
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
        reward_weights=[1.0, 0.5, 0.5, 0.5], bf16=False,
    )
    trainer = GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=functions, args=args, train_dataset=dataset)
    trainer.train()
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert trainer.state.global_step == 1
    assert {f"rewards/{f.__name__}/mean" for f in functions} <= logged, logged
