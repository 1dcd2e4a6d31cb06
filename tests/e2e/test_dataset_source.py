"""The dataset source against the session's real vLLM (tiny character-level model): a user's
reward module that raises on some rows drops those groups as `reward_error` while every other
group comes back scored, and the source runs to the end of its epoch; evaluation on a held-out
file gives pass@1 and mean@k with the failing row counted as incorrect."""

from __future__ import annotations

import json

import anyio
import pytest
from transformers import AutoTokenizer

from grpod.config import parse_config
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.dataset import prepare_dataset
from grpod.rollouts.kinds import make_source
from grpod.rollouts.validation import RejectionCounter
from tests.rollouts.conftest import scripted_policy

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

REWARDS = '''
def length_or_raise(prompts, completions, completion_ids, answer, explode, **columns):
    """The number of completion tokens; raises on rows marked explode."""
    if explode[0]:
        raise RuntimeError("user reward bug on " + prompts[0])
    return [float(len(ids)) for ids in completion_ids]
'''


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiohttp needs asyncio


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


async def test_raising_reward_drops_its_groups_and_the_source_keeps_going(vllm_server, tiny_model_dir, tmp_path):
    problems = [(12, 7), (3, 4), (15, 2), (9, 9), (6, 11), (1, 8)]
    exploding = {"3+4=", "6+11="}
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "explode": f"{a}+{b}=" in exploding} for a, b in problems
    ]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [
        {"prompt": "2+2=", "answer": "4", "explode": False},
        {"prompt": "5+1=", "answer": "6", "explode": True},
        {"prompt": "7+3=", "answer": "10", "explode": False},
        {"prompt": "4+4=", "answer": "8", "explode": False},
    ])
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    cfg = parse_config({
        "model": {"path": str(tiny_model_dir)},
        "source": {
            "kind": "dataset", "group_size": 3, "max_tokens": 6, "concurrency": 2,
            "dataset": {"path": str(train), "epochs": 1, "reward_timeout_s": 20.0,
                        "rewards": [{"function": f"{tmp_path / 'user_rewards.py'}:length_or_raise"}]},
        },
        # Every completion has >= 1 token, so every scored completion counts as correct.
        "eval": {"dataset": str(held_out), "size": 4, "k": 2, "correct_threshold": 1.0},
    })
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    buffer = RolloutBuffer(32)

    async def may_generate() -> None:
        pass

    async with vllm_server.client() as client:
        policy, _ = scripted_policy(client, version=0)  # the session's real server, always open
        prepared = await prepare_dataset(cfg)
        source = make_source(cfg, tokenizer, policy, None, RejectionCounter(), prepared)
        try:
            with anyio.fail_after(180):
                await source.run(buffer, may_generate)  # one epoch, then it returns
                result = await source.evaluate(cfg.eval.size, cfg.eval.max_tokens)
        finally:
            await source.aclose()
    groups = await buffer.take_available(len(buffer))

    assert source.stats.exhausted and source.cursor() == {"kind": "dataset", "epoch": 1, "position": 0}
    assert source.stats.drop_reasons == {"reward_error": 2}
    assert source.stats.generated == 4 and len(groups) == 4
    scored_prompts = set()
    for group in groups:
        row = int(group.group_id.rsplit("-", 1)[1])
        scored_prompts.add(rows[row]["prompt"])
        prompt_len = len(source.items[row].prompt_ids)
        completion_lengths = [sum(mask) for mask in group.loss_mask]
        assert group.scores == [float(n) for n in completion_lengths]
        assert all(1 <= n <= 6 for n in completion_lengths)
        assert all(len(seq) == prompt_len + n for seq, n in zip(group.tokens, completion_lengths, strict=True))
        assert group.extra["reward_means"] == {"length_or_raise": pytest.approx(sum(group.scores) / 3)}
    assert scored_prompts == {row["prompt"] for row in rows} - exploding

    assert result["eval_size"] == 4 and result["eval_k"] == 2
    assert result["eval_accuracy"] == 0.75 and result["eval_mean_at_k"] == 0.75
    assert result["eval_reward_failures"] == 2  # the greedy and the sampled completions of 5+1=
