"""AtroposSource: the group-size rule, its cursor, and how it waits out a failing API.

The real `run-api` starts in about a second, so the cases that talk to an API use it
(tests/atropos_env.py). Failures run-api cannot produce on demand (HTTP 500, an answer that never
comes, a body that is not JSON, a `batch` of the wrong type) come from a small scripted aiohttp
server in `test_errors_timeouts_and_garbage_are_waited_out`.
"""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from grpod.config import parse_config
from grpod.rollouts.atropos import AtroposConfigError, check_batch_geometry
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.kinds import make_source
from grpod.rollouts.validation import RejectionCounter
from tests.atropos_env import (
    ScoredGroupEnv,
    TrajectoryApiProcess,
    api_get,
    free_port,
    scored_group,
    wait_until,
)


def _cfg(tmp_path, url="http://127.0.0.1:9", *, group_size=4, groups_per_step=2, poll_s=0.05, **extra):
    return parse_config(
        {
            "run": {"dir": str(tmp_path / "run")},
            "source": {"kind": "atropos", "atropos_url": url, "group_size": group_size, "atropos_poll_s": poll_s},
            "train": {"groups_per_step": groups_per_step, "steps": 10},
            **extra,
        }
    )


async def _never_paused() -> None:
    return None


def AtroposSource(cfg, policy, cursor=None, *, request_timeout_s=None, rejections=None):  # noqa: N802
    """The source as the daemon builds it from `cfg` (`policy`: anything with a `version`)."""
    policy = policy if policy is not None else SimpleNamespace(version=0)
    source = make_source(cfg, None, policy, cursor, rejections if rejections is not None else RejectionCounter())
    if request_timeout_s is not None:
        source.request_timeout_s = request_timeout_s
    return source


@pytest.mark.parametrize("batch_size,group_size", [(8, 4), (4, 4), (16, 1), (64, 16)])
def test_power_of_two_group_dividing_batch_is_accepted(batch_size, group_size):
    check_batch_geometry(batch_size, group_size)


@pytest.mark.parametrize("batch_size,group_size", [(6, 3), (12, 6), (8, 16), (10, 5)])
def test_other_group_sizes_are_refused_with_the_reason(batch_size, group_size):
    with pytest.raises(AtroposConfigError, match="powers of two dividing batch_size") as err:
        check_batch_geometry(batch_size, group_size)
    assert f"batch_size = {batch_size}" in str(err.value)
    assert "never form a batch" in str(err.value)


def test_source_refuses_a_non_power_of_two_group_size_at_construction(tmp_path):
    cfg = _cfg(tmp_path, group_size=3, groups_per_step=2)
    with pytest.raises(AtroposConfigError) as err:
        AtroposSource(cfg, SimpleNamespace(version=0), cursor=None)
    message = str(err.value)
    assert "train.groups_per_step = 2 × source.group_size = 3" in message
    assert "Set source.group_size to a power of two (2 or 4)" in message


def test_registration_carries_every_required_field(tmp_path):
    cfg = _cfg(tmp_path, group_size=4, groups_per_step=3, model={"max_seq_len": 128}, checkpoint={"every": 5})
    source = AtroposSource(cfg, SimpleNamespace(version=0), cursor={"kind": "atropos", "batches": 2, "step": 9})
    body = source.registration()
    assert body == {
        "wandb_group": "run",
        "wandb_project": "grpod",
        "batch_size": 12,
        "max_token_len": 128,
        "checkpoint_dir": str(tmp_path / "run" / "checkpoints"),
        "save_checkpoint_interval": 5,
        "starting_step": 9,
        "num_steps": 10,
    }
    daemon_step = AtroposSource(cfg, None, cursor={"kind": "atropos", "batches": 2, "step": 9, "starting_step": 4})
    assert daemon_step.registration()["starting_step"] == 4


def test_foreign_cursor_is_ignored(tmp_path):
    source = AtroposSource(_cfg(tmp_path), None, cursor={"kind": "builtin", "next_index": 17})
    assert source.cursor() == {"kind": "atropos", "batches": 0, "step": 0}


def test_pending_groups_in_a_cursor_are_delivered_before_any_request(tmp_path):
    group = RolloutGroup(tokens=[[5, 6, 7]], loss_mask=[[0, 1, 1]], scores=[1.0], source="atropos", group_id="atropos-3-1")
    cursor = {"kind": "atropos", "batches": 3, "step": 3, "pending": [group.to_json()]}
    # Port 9 (discard) has no listener: any request would fail and the fill would never end.
    source = AtroposSource(_cfg(tmp_path, "http://127.0.0.1:9"), None, cursor=cursor)
    assert source.cursor() == cursor
    assert source.stats.pending_groups == 1

    async def main():
        buffer = RolloutBuffer(capacity=4)
        with anyio.fail_after(5):
            await source.fill(buffer, 1)
        return await buffer.take(1)

    [delivered] = anyio.run(main)
    assert delivered == group
    assert source.cursor() == {"kind": "atropos", "batches": 3, "step": 3}
    assert source.stats.registrations == 0


def test_starting_step_from_the_cursor_reaches_run_api_and_environments(tmp_path):
    with TrajectoryApiProcess(tmp_path) as api:
        cfg = _cfg(tmp_path, api.url, group_size=2, groups_per_step=1)
        source = AtroposSource(cfg, SimpleNamespace(version=11), cursor={"kind": "atropos", "batches": 7, "step": 7})

        async def main():
            buffer = RolloutBuffer(capacity=4)
            env = ScoredGroupEnv(api.url, group_size=2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(source.fill, buffer, 1)
                registration = await env.register()
                await env.post(scored_group(1, group_size=2))
                await wait_until(lambda: len(buffer) == 1, 10, "the posted group", lambda: vars(source.stats))
            return registration, await buffer.take(1), await api_get(api.url, "/status")

        registration, [group], status = anyio.run(main)
    assert registration["starting_step"] == 7
    assert status["current_step"] == 8
    assert source.cursor() == {"kind": "atropos", "batches": 8, "step": 8}
    assert group.group_id == "atropos-8-0"
    assert group.policy_version == 11


def test_a_batch_size_kept_from_an_earlier_registration_is_reported(tmp_path):
    """run-api keeps the first registration's batch_size; a second trainer with another one is told."""
    with TrajectoryApiProcess(tmp_path) as api:
        first = AtroposSource(_cfg(tmp_path, api.url, group_size=2, groups_per_step=2), None, cursor=None)
        second = AtroposSource(_cfg(tmp_path, api.url, group_size=2, groups_per_step=4), None, cursor=None)

        async def main():
            async with anyio.create_task_group() as tg:
                for source in (first, second):
                    tg.start_soon(source.run, RolloutBuffer(capacity=8), _never_paused)
                    await wait_until(lambda s=source: s.stats.registrations == 1, 10, "registration")
                tg.cancel_scope.cancel()

        with capture_logs() as logs:
            anyio.run(main)
    assert first.stats.last_error is None and first.stats.api_batch_size == 4
    assert second.stats.api_batch_size == 4
    assert "keeps batch_size 4 from an earlier registration, not 8" in second.stats.last_error
    assert [e["event"] for e in logs].count("atropos_batch_size_mismatch") == 1


def test_a_batch_larger_than_the_buffer_room_stays_pending_in_the_cursor(tmp_path):
    """Four one-sequence groups make one batch of 4; a buffer with room for 2 takes half, the
    other half is recorded by `cursor()` until the trainer makes room."""
    with TrajectoryApiProcess(tmp_path) as api:
        cfg = _cfg(tmp_path, api.url, group_size=2, groups_per_step=2)
        source = AtroposSource(cfg, SimpleNamespace(version=0), cursor=None)
        posted = [scored_group(seed, group_size=1) for seed in range(4)]

        async def main():
            buffer = RolloutBuffer(capacity=2)
            env = ScoredGroupEnv(api.url, group_size=1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(source.run, buffer, _never_paused)
                await env.register()
                await env.post_many(posted)
                await wait_until(lambda: source.stats.pending_groups == 2, 10, "2 pending groups", lambda: vars(source.stats))
                cursor = source.cursor()
                first = await buffer.take(2)
                await wait_until(lambda: len(buffer) == 2, 10, "the pending groups to be delivered")
                second = await buffer.take(2)
                tg.cancel_scope.cancel()
            return cursor, first + second

        cursor, delivered = anyio.run(main)
    assert cursor["batches"] == 1 and len(cursor["pending"]) == 2
    assert [RolloutGroup.from_json(g) for g in cursor["pending"]] == delivered[2:]
    assert sorted(g.tokens[0] for g in delivered) == sorted(p["tokens"][0] for p in posted)
    assert "pending" not in source.cursor()


def test_errors_timeouts_and_garbage_are_waited_out(tmp_path):
    """A scripted API answers /batch with a 500, then never answers in time, then non-JSON, then
    a wrong shape, then "Trainer not registered", then an empty batch, then one good group."""
    good = scored_group(3, group_size=4)
    script = [
        web.Response(status=500, text="Internal Server Error"),
        "hang",
        web.Response(text="<html>proxy error</html>"),
        web.json_response({"batch": "oops"}),
        web.json_response({"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}),
        web.json_response({"batch": None}),
        web.json_response({"batch": [good, {"tokens": "not a list"}]}),
    ]
    seen: list[str] = []

    async def batch(request):
        seen.append("batch")
        answer = script.pop(0) if script else web.json_response({"batch": None})
        if answer == "hang":
            await anyio.sleep(1)
            return web.json_response({"batch": None})
        return answer

    async def register(request):
        seen.append("register")
        body = await request.json()
        assert body["batch_size"] == 8
        return web.json_response({"uuid": len(seen)})

    async def info(request):
        return web.json_response({"batch_size": 8, "max_token_len": 256})

    async def status(request):
        return web.json_response({"current_step": 0, "queue_size": 0})

    app = web.Application()
    app.add_routes([web.get("/batch", batch), web.post("/register", register), web.get("/info", info), web.get("/status", status)])
    port = free_port()
    source = AtroposSource(
        _cfg(tmp_path, f"http://127.0.0.1:{port}", group_size=4, groups_per_step=2),
        SimpleNamespace(version=2),
        cursor=None,
        request_timeout_s=0.3,
    )

    async def main():
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        buffer = RolloutBuffer(capacity=8)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(source.run, buffer, _never_paused)
                await wait_until(lambda: len(buffer) == 1, 20, "the good group", lambda: vars(source.stats))
                tg.cancel_scope.cancel()
        finally:
            await runner.cleanup()
        return await buffer.take(1)

    with capture_logs() as logs:
        [group] = anyio.run(main)
    assert group.tokens == good["tokens"]
    stats = source.stats
    assert stats.api_errors == 4
    assert source.rejections.as_dict() == {"bad_type": 1}
    assert stats.accepted_groups == 1 and stats.batches == 1 and stats.empty_polls >= 1
    # One registration at start, one after each of the 4 failures, one after "not registered".
    assert stats.registrations == 6 == seen.count("register")
    assert "HTTP 500" in [e for e in logs if e["event"] == "atropos_api_unavailable"][0]["error"]
    states = [(e["from"], e["to"]) for e in logs if e["event"] == "atropos_state"]
    assert states[:4] == [
        ("starting", "registering"),
        ("registering", "polling"),
        ("polling", "waiting_for_api"),
        ("waiting_for_api", "registering"),
    ]
    errors = [e["error"] for e in logs if e["event"] == "atropos_state" and e["to"] == "waiting_for_api"]
    assert len(errors) == 4
    assert "HTTP 500" in errors[0]
    assert "no answer within 0.3s" in errors[1]
    assert "not JSON" in errors[2]
    assert "'batch' to be a list or null" in errors[3]
    assert any(e["event"] == "atropos_trainer_forgotten" for e in logs)


def test_a_persistent_api_failure_raises_the_source_alarm_and_recovery_clears_it(tmp_path):
    """Issue #16 hole 5: requests that keep failing are one unbroken run of failures in the
    source's stats (re-registering does not end it, an answered `/batch` does); the alarm rises
    after `error_alarm_s`, `fail_after_s` gives the reason to end the run, and a run-api that
    answers again clears it. (A NaN score, the reported trigger, makes atroposlib 0.4.0's run-api
    fail one `/batch` and drop that batch; a run-api that is down fails every request.)"""
    import time

    from grpod.daemon.alarms import SourceErrorAlarm

    with TrajectoryApiProcess(tmp_path) as api:
        source = AtroposSource(_cfg(tmp_path, api.url, group_size=2, groups_per_step=1), SimpleNamespace(version=0))
        alarm = SourceErrorAlarm(alarm_after_s=0.5, fail_after_s=2.0)

        async def until(condition, what):
            with anyio.fail_after(30):
                while not condition():
                    await anyio.sleep(0.1)
            return True

        async def main():
            buffer = RolloutBuffer(capacity=8)
            env = ScoredGroupEnv(api.url, group_size=2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(source.run, buffer, _never_paused)
                await env.register()
                await env.post(scored_group(1, group_size=2))
                await wait_until(lambda: len(buffer) == 1, 10, "the good group", lambda: vars(source.stats))
                assert alarm.check(source.stats, time.time()) is None and not alarm.active
                api.stop()
                reasons = []
                await until(lambda: reasons.append(alarm.check(source.stats, time.time())) or reasons[-1], "fail reason")
                failed = dict(alarm.describe(), reason=reasons[-1], errors=source.stats.consecutive_errors)
                api.start()
                await until(lambda: alarm.check(source.stats, time.time()) is None and not alarm.active, "alarm cleared")
                tg.cancel_scope.cancel()
            return failed

        failed = anyio.run(main)
    assert failed["active"] and failed["failing_s"] >= 2.0 and failed["errors"] >= 2
    assert "source.fail_after_s = 2" in failed["reason"] and "errors in a row" in failed["reason"]
    assert "Atropos API" in failed["last_error"]
    assert alarm.raised == 1 and not alarm.active
    assert source.stats.consecutive_errors == 0 and source.stats.failing_since is None


def test_the_source_alarm_clears_when_the_source_delivers_again():
    from grpod.daemon.alarms import SourceErrorAlarm

    stats = SimpleNamespace(failing_since=None, consecutive_errors=0, last_error=None)
    alarm = SourceErrorAlarm(alarm_after_s=10.0, fail_after_s=None)
    assert alarm.check(stats, 100.0) is None and not alarm.active
    stats.failing_since, stats.consecutive_errors, stats.last_error = 100.0, 3, "HTTP 500"
    assert alarm.check(stats, 105.0) is None and not alarm.active, "5 s of failures is below error_alarm_s"
    assert alarm.check(stats, 111.0) is None and alarm.active, "no fail_after_s: never ends the run"
    stats.failing_since, stats.consecutive_errors = None, 0
    alarm.check(stats, 112.0)
    assert not alarm.active and alarm.raised == 1


def test_the_console_says_registered_and_still_waiting_for_batches(tmp_path, monkeypatch, capsys):
    """Issue #16 item 9: an operator watching the console sees that grpod registered and is waiting."""
    from grpod.rollouts import atropos

    monkeypatch.setattr(atropos, "WAITING_LINE_S", 0.3)
    with TrajectoryApiProcess(tmp_path) as api:
        source = AtroposSource(
            _cfg(tmp_path, api.url, group_size=2, groups_per_step=2, run={"dir": str(tmp_path / "run"), "progress": True}),
            SimpleNamespace(version=0),
        )

        async def main():
            buffer = RolloutBuffer(capacity=8)
            with anyio.move_on_after(1.5):
                await source.run(buffer, _never_paused)

        anyio.run(main)
    err = capsys.readouterr().err
    assert f"registered with run-api at {api.url} (batch of 4 sequences" in err, err
    waiting = [line for line in err.splitlines() if "waiting for Atropos batches for" in line]
    assert waiting and "0 groups queued" in waiting[0], err


def test_groups_without_a_temperature_get_source_temperature_counted_or_are_refused(tmp_path, capsys):
    """Issue #12 (F5): not silently T = 1.0. The config's temperature, recorded and counted (and
    said on the console once), or with atropos_undeclared_temperature = "refuse" a rejection."""
    from grpod.rollouts.validation import RejectionCounter

    results = {}
    for policy in ("config", "refuse"):
        (tmp_path / policy).mkdir()
        with TrajectoryApiProcess(tmp_path / policy) as api:
            cfg = _cfg(
                tmp_path, api.url, group_size=2, groups_per_step=1,
                run={"dir": str(tmp_path / "run"), "progress": True},
            )
            cfg.source.temperature = 0.6
            cfg.source.atropos_undeclared_temperature = policy
            rejections = RejectionCounter()
            source = AtroposSource(cfg, SimpleNamespace(version=0), rejections=rejections)

            async def main():
                buffer = RolloutBuffer(capacity=8)
                env = ScoredGroupEnv(api.url, group_size=2)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(source.run, buffer, _never_paused)
                    await env.register()
                    await env.post(scored_group(1, group_size=2))  # no generation_params
                    await env.post(scored_group(2, group_size=2, temperature=0.9))
                    await wait_until(lambda: source.stats.batches == 2, 10, "two batches", lambda: vars(source.stats))
                    tg.cancel_scope.cancel()
                return [await buffer.take(1) for _ in range(len(buffer))]

            results[policy] = ([g.temperature for [g] in anyio.run(main)], source.stats, rejections.as_dict())
    temps, stats, rejected = results["config"]
    assert sorted(temps) == [0.6, 0.9] and stats.undeclared_temperature_groups == 1 and rejected == {}
    assert "trained at source.temperature = 0.6" in capsys.readouterr().err
    temps, stats, rejected = results["refuse"]
    assert temps == [0.9] and rejected == {"undeclared_temperature": 1}
