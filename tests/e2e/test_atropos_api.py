"""AtroposSource against the real Atropos `run-api` (atroposlib 0.4.0) and a minimal environment.

No vLLM is needed: the environment posts synthetic but well-formed scored groups over the tiny
model's vocabulary (ids < 52). Each test starts its own run-api on a free loopback port and stops
it by PID (tests/atropos_env.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from grpod.config import parse_config
from grpod.rollouts.atropos import AtroposConfigError
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.validation import validate_batch
from tests.atropos_env import (
    ScoredGroupEnv,
    TrajectoryApiProcess,
    api_get,
    scored_group,
    wait_until,
)
from tests.rollouts.test_atropos import AtroposSource

pytestmark = pytest.mark.e2e

GROUP_SIZE = 4
GROUPS_PER_STEP = 2


def _cfg(tmp_path, url, *, group_size=GROUP_SIZE, groups_per_step=GROUPS_PER_STEP):
    return parse_config(
        {
            "run": {"dir": str(tmp_path / "run")},
            "source": {"kind": "atropos", "atropos_url": url, "group_size": group_size, "atropos_poll_s": 0.05},
            "train": {"groups_per_step": groups_per_step, "steps": 50},
            "model": {"max_seq_len": 64},
        }
    )


async def _never_paused() -> None:
    return None


def _key(tokens) -> tuple:
    return tuple(tuple(seq) for seq in tokens)


def test_source_registers_and_receives_exactly_the_posted_groups(tmp_path):
    with TrajectoryApiProcess(tmp_path) as api:
        source = AtroposSource(_cfg(tmp_path, api.url), SimpleNamespace(version=5), cursor=None)
        posted = [scored_group(seed, group_size=GROUP_SIZE, temperature=0.7) for seed in range(6)]

        async def main():
            buffer = RolloutBuffer(capacity=16)
            env = ScoredGroupEnv(api.url, group_size=GROUP_SIZE)
            assert await env.try_register() is None, "run-api let an environment in before the trainer's first /batch"
            async with anyio.create_task_group() as tg:
                tg.start_soon(source.run, buffer, _never_paused)
                await env.register()
                for group in posted[:2]:
                    await env.post(group)
                await wait_until(lambda: len(buffer) == 2, 10, "the first batch", lambda: vars(source.stats))
                await env.post_many(posted[2:])
                await wait_until(lambda: len(buffer) == 6, 10, "all 6 groups", lambda: vars(source.stats))
                await anyio.sleep(0.3)  # a few more polls: nothing else may arrive
                tg.cancel_scope.cancel()
            return await buffer.take_available(100), await api_get(api.url, "/info"), await api_get(api.url, "/status")

        received, info, status = anyio.run(main)
    assert info == {"batch_size": GROUP_SIZE * GROUPS_PER_STEP, "max_token_len": 64}
    assert status == {"current_step": 3, "queue_size": 0}
    assert sum(g.size for g in received) == sum(len(p["tokens"]) for p in posted) == 24
    assert sorted(_key(g.tokens) for g in received) == sorted(_key(p["tokens"]) for p in posted)
    by_tokens = {_key(p["tokens"]): p for p in posted}
    for group in received:
        sent = by_tokens[_key(group.tokens)]
        assert group.scores == sent["scores"]
        assert group.loss_mask == [[0 if m == -100 else 1 for m in row] for row in sent["masks"]]
        assert group.inference_logprobs == [[0.0 if m == -100 else lp for m, lp in zip(mr, lr)] for mr, lr in zip(sent["masks"], sent["inference_logprobs"])]
        assert group.temperature == 0.7
        assert group.policy_version == 5
        assert group.source == "atropos"
    valid, rejected = validate_batch(received, vocab_size=52, max_seq_len=64, group_normalised=True)
    assert len(valid) == 6 and rejected == []
    assert source.cursor() == {"kind": "atropos", "batches": 3, "step": 3}
    stats = source.stats
    assert (stats.batches, stats.accepted_groups, stats.accepted_sequences, source.rejections.total) == (3, 6, 24, 0)
    assert stats.registrations == 1 and stats.api_errors == 0 and stats.api_state in ("polling", "buffer_full")


def test_bad_items_are_rejected_with_a_reason_and_the_rest_of_the_batch_kept(tmp_path):
    with TrajectoryApiProcess(tmp_path) as api:
        source = AtroposSource(_cfg(tmp_path, api.url, groups_per_step=4), SimpleNamespace(version=0), cursor=None)
        good = [scored_group(seed, group_size=GROUP_SIZE) for seed in (10, 11)]
        wrong_mask = scored_group(12, group_size=GROUP_SIZE)
        wrong_mask["masks"][1][-1] = (wrong_mask["tokens"][1][-1] + 1) % 52
        short_logprobs = scored_group(13, group_size=GROUP_SIZE)
        short_logprobs["inference_logprobs"][2] = short_logprobs["inference_logprobs"][2][:-1]

        async def main():
            buffer = RolloutBuffer(capacity=8)
            env = ScoredGroupEnv(api.url, group_size=GROUP_SIZE)
            async with anyio.create_task_group() as tg:
                tg.start_soon(source.run, buffer, _never_paused)
                await env.register()
                await env.post_many([good[0], wrong_mask, short_logprobs, good[1]])
                await wait_until(
                    lambda: source.stats.batches == 1 and source.stats.pending_groups == 0,
                    10,
                    "the batch, delivered",
                    lambda: vars(source.stats),
                )
                tg.cancel_scope.cancel()
            return await buffer.take_available(100)

        received = anyio.run(main)
    assert sorted(_key(g.tokens) for g in received) == sorted(_key(g["tokens"]) for g in good)
    assert source.rejections.as_dict() == {"length_mismatch": 1, "mask_token_mismatch": 1}
    assert source.stats.accepted_groups == 2


def test_source_survives_a_run_api_restart(tmp_path):
    with TrajectoryApiProcess(tmp_path) as api:
        source = AtroposSource(_cfg(tmp_path, api.url), SimpleNamespace(version=1), cursor=None)
        env = ScoredGroupEnv(api.url, group_size=GROUP_SIZE)
        states_seen: list[str] = []

        def state() -> str:
            if not states_seen or states_seen[-1] != source.stats.api_state:
                states_seen.append(source.stats.api_state)
            return source.stats.api_state

        async def main():
            buffer = RolloutBuffer(capacity=16)
            async with anyio.create_task_group() as tg:
                tg.start_soon(source.run, buffer, _never_paused)
                await env.register()
                await env.post_many([scored_group(s, group_size=GROUP_SIZE) for s in (1, 2)])
                await wait_until(lambda: len(buffer) == 2, 10, "the batch before the restart")

                await anyio.to_thread.run_sync(api.stop)
                await wait_until(lambda: state() == "waiting_for_api", 10, "waiting_for_api", lambda: vars(source.stats))
                down = dict(vars(source.stats))
                await anyio.sleep(1.0)  # down for a while: several failed attempts, growing waits
                await anyio.to_thread.run_sync(api.start)

                await wait_until(
                    lambda: state() == "polling" and source.stats.registrations == 2, 30, "re-registration", lambda: vars(source.stats)
                )
                after = await env.register()  # the new run-api forgot the environment too
                await env.post_many([scored_group(s, group_size=GROUP_SIZE) for s in (3, 4)])
                await wait_until(lambda: len(buffer) == 4, 10, "the batch after the restart", lambda: vars(source.stats))
                tg.cancel_scope.cancel()
            return down, after, await buffer.take_available(100), await api_get(api.url, "/info")

        down, after, received, info = anyio.run(main)
    assert down["api_state"] == "waiting_for_api"
    assert down["last_error"].startswith("Atropos API /") and "no response" in down["last_error"]
    assert source.stats.api_errors >= 2
    assert "waiting_for_api" in states_seen and states_seen[-1] == "polling"
    assert after["starting_step"] == 1, "re-registration must carry the step reached before the restart"
    assert info["batch_size"] == GROUP_SIZE * GROUPS_PER_STEP
    assert sorted(_key(g.tokens) for g in received) == sorted(
        _key(scored_group(s, group_size=GROUP_SIZE)["tokens"]) for s in (1, 2, 3, 4)
    )
    assert source.cursor() == {"kind": "atropos", "batches": 2, "step": 2}


def test_group_size_misconfiguration_is_explained_before_registering(tmp_path):
    with TrajectoryApiProcess(tmp_path) as api:
        with pytest.raises(AtroposConfigError) as err:
            AtroposSource(_cfg(tmp_path, api.url, group_size=6, groups_per_step=2), SimpleNamespace(version=0), cursor=None)
        info = anyio.run(api_get, api.url, "/info")
    message = str(err.value)
    assert "batch_size = 12" in message and "source.group_size = 6" in message
    assert "may never form a batch" in message and "(4 or 8)" in message
    # Refused before any request: the API keeps no batch size from this run (its first one wins).
    assert info == {"batch_size": -1, "max_token_len": -1}
