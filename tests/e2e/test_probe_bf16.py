"""The alignment probe with bf16 serving (the README's GPU example): real vLLM `--dtype bfloat16`
on CPU against the fp32 trainer. The same weights must pass the dtype-aware tolerance (a 0.02
max-abs bound failed: rounding alone moves single tokens by ~0.2) and one missed training step
must still fail it."""

from __future__ import annotations

import anyio
import pytest

from grpod.bridges.probe import ProbeTolerance, run_probe
from grpod.config import InferenceConfig, parse_config
from grpod.inference.process import InferenceProcess
from grpod.training.trainer import build_trainer
from tests.training.test_trainer import random_groups

pytestmark = pytest.mark.e2e


def test_bf16_serving_passes_the_probe_and_a_missed_step_fails_it(warm_model_dir, tmp_path):
    cfg = parse_config(
        {"model": {"path": str(warm_model_dir), "dtype": "bfloat16"}, "train": {"threads": 1, "lr": 1e-4}}
    )
    trainer = build_trainer(cfg, warm_model_dir)
    tolerance = ProbeTolerance.for_serving("bfloat16", cfg.bridge)
    process = InferenceProcess(InferenceConfig(start_timeout_s=600.0), cfg.model, tmp_path / "run")
    results = {}

    async def main() -> None:
        await process.start(warm_model_dir)
        try:
            async with process.client() as client:
                probe = lambda: run_probe(client, trainer, model="policy", tolerance=tolerance, timeout_s=120)  # noqa: E731
                results["same"] = await probe()
                await anyio.to_thread.run_sync(trainer.train_step, random_groups(seed=7))
                results["missed"] = await probe()
        finally:
            await process.stop()

    anyio.run(main)
    same, missed = results["same"], results["missed"]
    assert same.max_abs_diff > 0.02, "bf16 rounding should exceed the fp32 bound (else this test proves nothing)"
    assert same.ok, same.as_dict()
    assert not missed.ok, missed.as_dict()
