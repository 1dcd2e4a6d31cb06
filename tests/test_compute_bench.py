"""bench/compute.py counts a group's prompt as vLLM computes it: once in full, then per other
completion all but the whole KV blocks its prefix cache gives back; the block comes from the
run's own vLLM launch line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPE = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "intermediate_size": 1536, "vocab_size": 49152}


def load_compute():
    spec = importlib.util.spec_from_file_location("bench_compute", ROOT / "bench" / "compute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_groups_prompt_is_computed_again_for_each_completion_but_its_cached_whole_blocks():
    compute = load_compute()
    flops = compute.Flops(SMOLLM2_SHAPE)
    once = flops.forward(52)
    # 128-token blocks: a 52-token prompt fills none, so each of the 8 completions computes all of it.
    assert compute.prefill_flops(flops, 52, 8, 128) == 8 * once
    # 32-token blocks: the first block is shared, the other 20 tokens computed per completion.
    shared = compute.prefill_flops(flops, 52, 8, 32)
    assert shared == once + 7 * flops.forward(20, start=32)
    assert 0.4 * 8 * once < shared < 0.5 * 8 * once
    # vLLM always computes a prompt's last token: a prompt of exactly one block shares nothing.
    assert compute.prefill_flops(flops, 32, 8, 32) == 8 * flops.forward(32)


def test_the_block_is_read_from_the_runs_vllm_launch_line(tmp_path):
    compute = load_compute()
    assert compute.block_size(tmp_path) == 128, "no vllm.log: vLLM's CPU default"
    (tmp_path / "vllm.log").write_text(
        "=== grpod launch 2026-11-28T01:40:00+0000: python -m grpod.inference.server --model m --block-size 32 --port 1\n"
        "INFO ... --block-size 64 in a later line is not the launch\n"
    )
    assert compute.block_size(tmp_path) == 32


def test_a_step_is_counted_as_the_trainer_forwarded_it():
    """With a shared prompt the trainer forwards a group's prompt once: the step record's
    processed_tokens say how many positions went through the linear layers."""
    compute = load_compute()
    flops = compute.Flops(SMOLLM2_SHAPE)
    group = {"tokens": [[1] * 40, [1] * 34], "loss_mask": [[0] * 30 + [1] * 10, [0] * 30 + [1] * 4],
             "scores": [1.0, 0.0]}
    flat = dict(group, scores=[1.0, 1.0])
    plain = compute.training_flops(flops, {"processed_tokens": 80}, [group, flat])
    assert plain == 3 * (2 * flops.linear * 80 + flops.attention * (flops.context(40) + flops.context(34)))
    shared = compute.training_flops(flops, {"processed_tokens": 44, "shared_prompt_tokens": 30}, [group])
    context = flops.context(30) + flops.context(10, start=30) + flops.context(4, start=30)
    assert shared == 3 * (2 * flops.linear * 44 + flops.attention * context)
    assert shared < plain / 1.5
    # A record from before processed_tokens: every trained sequence in full.
    assert compute.training_flops(flops, {}, [group, flat]) == 3 * (flops.forward(40) + flops.forward(34))
