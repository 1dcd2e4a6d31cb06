"""Session fixtures for end-to-end tests: the tiny model on disk and one real vLLM serving it.

A vLLM start costs ~25 s on these machines, so every e2e test that only needs *a* server shares
`vllm_server` (one `InferenceProcess` for the whole session, stopped at the end). Tests that
change the server's weights or adapters must restore them or start their own. The fixtures are
synchronous (each lifecycle call runs in its own `anyio.run`), so any test style can use them.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from grpod.config import InferenceConfig, ModelConfig
from grpod.inference.process import InferenceProcess
from grpod.models.tiny import build_model, save_model

# Sampling defaults like those real instruct models publish in generation_config.json (SmolLM2,
# Qwen2.5: top_k, repetition penalty, ...), made strong so that any leak into what vLLM samples
# moves its logprobs far from the trainer's: every e2e test on this model runs under them.
HOSTILE_GENERATION_DEFAULTS = {"top_k": 3, "min_p": 0.2, "repetition_penalty": 1.5, "temperature": 0.3, "top_p": 0.5}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny built-in model, random weights from seed 0, saved in HF format (no warm-up), whose
    generation_config.json carries `HOSTILE_GENERATION_DEFAULTS`."""
    out = tmp_path_factory.mktemp("tiny-model")
    model, tokenizer = build_model(seed=0)
    save_model(model, tokenizer, out)
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(generation | HOSTILE_GENERATION_DEFAULTS))
    return out


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory) -> InferenceProcess:
    """One healthy vLLM (grpod's server entry, dev routes on) on `tiny_model_dir`, on a free port."""
    run_dir = tmp_path_factory.mktemp("vllm-session")
    process = InferenceProcess(
        InferenceConfig(start_timeout_s=300.0, request_timeout_s=60.0),
        ModelConfig(path=tiny_model_dir),
        run_dir,
    )
    anyio.run(process.start, tiny_model_dir)
    try:
        yield process
    finally:
        anyio.run(process.stop)


def bridge_for(cfg, run_dir, trainer, policy_version: int = 0):
    """The bridge `cfg` names over one real engine, wired as the daemon wires it."""
    from grpod.daemon.components import build_bridge, build_engines

    return build_bridge(cfg, run_dir, build_engines(cfg, run_dir), trainer=trainer, policy_version=policy_version)


def source_for(cfg, tokenizer, bridge):
    """The source `cfg` names, sampling through `bridge`'s policy."""
    from grpod.rollouts.kinds import make_source
    from grpod.rollouts.validation import RejectionCounter

    return make_source(cfg, tokenizer, bridge.policy, None, RejectionCounter())
