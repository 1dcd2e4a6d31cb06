"""Weights updated in flight, on the session's real vLLM: a weight update lands in the middle of a
long generation (pause `keep` between two tokens, new version, resume) and the completion says
which of its ids each version sampled; an episode whose turns span updates trains with the
per-token versions, and the staleness bound reads the oldest of them."""

from __future__ import annotations

import math
import re

import anyio
import pytest
from transformers import AutoTokenizer

from grpod.config import parse_config
from grpod.rollouts.chat_turns import ChatTurns
from grpod.rollouts.episode_runner import EpisodeLimits, EpisodeRunner
from grpod.rollouts.staleness import StalenessStats, apply_staleness
from grpod.rollouts.validation import validate_group
from grpod.training.trainer import build_trainer
from tests.rollouts.conftest import scripted_policy

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

PROMPT = [1, 5, 9, 12, 7, 3]
GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def generated_tokens(client) -> float:
    text = await client._request("GET", "/metrics")
    return sum(float(v) for v in GENERATED.findall(text))


async def test_an_update_in_the_middle_of_a_generation_splits_its_ids_between_versions(vllm_server):
    async with vllm_server.client() as client:
        await client.update_weight_version(40)
        done: dict[str, object] = {}

        async def long_generation() -> None:
            (done["completion"],) = await client.generate(
                PROMPT, n=1, max_tokens=200, min_tokens=200, temperature=1.0, seed=3, per_token_versions=True
            )

        with anyio.fail_after(120):
            before = await generated_tokens(client)
            async with anyio.create_task_group() as tg:
                tg.start_soon(long_generation)
                # Wait (bounded) until the engine has sampled some of its ids, then sync.
                while await generated_tokens(client) < before + 20:
                    assert "completion" not in done, "the generation ended before the update could land"
                    await anyio.sleep(0.005)
                await client.pause(mode="keep")
                await client.end_fence(41)
    completion = done["completion"]
    assert len(completion.token_ids) == len(completion.logprobs) == len(completion.versions) == 200
    first_new = completion.versions.index(41)
    assert 0 < first_new < 200, "ids were sampled by both versions"
    assert completion.versions == [40] * first_new + [41] * (200 - first_new)


class SyncingTool:
    """After each model turn, the engine takes a new weight version (a sync between the turns of
    a running episode), then a fixed tool reply; the third turn ends the episode."""

    def __init__(self, client, policy, engine, versions, score: float) -> None:
        self.client, self.policy, self.engine, self.versions = client, policy, engine, list(versions)
        self.turns, self.score = 0, score

    async def respond(self, text: str):
        self.turns += 1
        if self.turns == 3:
            return None
        version = self.versions.pop(0)
        await self.client.pause(mode="keep")
        await self.client.end_fence(version)
        self.engine.version = version
        self.policy.publish(version, "policy")
        return [{"role": "tool", "content": "42"}]

    async def reward(self) -> float:
        return self.score

    async def aclose(self) -> None:
        pass


async def test_an_episode_spanning_weight_updates_trains_with_per_token_versions(vllm_server, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with vllm_server.client() as client:
        await client.update_weight_version(5)
        policy, engine = scripted_policy(client, version=5)
        runner = EpisodeRunner(
            policy, ChatTurns(tokenizer),
            EpisodeLimits(temperature=1.0, max_tokens=12, max_turns=3, max_episode_tokens=256),
            engine_wait_s=30.0, environment_timeout_s=30.0,
        )
        tool = SyncingTool(client, policy, engine, [6, 7], score=1.0)
        with anyio.fail_after(120):
            episode = await runner.play([{"role": "user", "content": "count with the tool"}], tool)
        other = await runner.play([{"role": "user", "content": "count with the tool"}], SyncingTool(client, policy, engine, [7, 7], score=0.0))
    assert [turn.version for turn in episode.turns] == [5, 6, 7]
    for turn, version in zip(episode.turns, (5, 6, 7), strict=True):
        assert set(episode.versions[turn.start : turn.end]) <= {version}
    from grpod.rollouts.episode import episode_group

    group = episode_group([episode, other], temperature=1.0, top_p=1.0, source="environment", group_id="spans")
    cfg = parse_config({"model": {"path": str(tiny_model_dir)}, "train": {"threads": 1}})
    assert validate_group(group, vocab_size=len(tokenizer), max_seq_len=256, group_normalised=True) is None
    assert group.token_versions is not None and group.policy_version == 5 and group.oldest_version == 5
    # Staleness reads the oldest token (age 2 at version 7), and the bound holds per token: with
    # max_staleness 1 the first turns' ids (version 5) leave the loss, the later turns' train.
    # (`other` started once the engine served 7: none of its ids is stale.)
    first_turn_ids = episode.turns[0].end - episode.turns[0].start
    assert [turn.version for turn in other.turns] == [7, 7, 7]
    stats = StalenessStats()
    kept, ages = apply_staleness([group], 7, 1, "drop", stats)
    assert ages == [2] and kept == [group] and stats.masked_tokens == first_turn_ids > 0
    for mask, versions in zip(group.loss_mask, group.token_versions, strict=True):
        assert all(v >= 6 for m, v in zip(mask, versions, strict=True) if m)
    trainer = build_trainer(cfg, tiny_model_dir)
    metrics = trainer.train_step([group])
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"])
    assert metrics["loss_tokens"] == sum(map(sum, group.loss_mask))
