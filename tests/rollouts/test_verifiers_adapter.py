"""`VerifiersAdapter` with its real worker in the real verifiers venv (`make verifiers`), playing
the example environment `etc/examples/agent-envs/vf_calculator` and a slow, hanging and blocking one
written here."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from grpod.config import EnvironmentConfig
from grpod.rollouts.environments import EnvironmentFailure
from grpod.rollouts.verifiers_adapter import CANCEL_GRACE_S, VerifiersAdapter, worker_python

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "etc" / "examples" / "agent-envs"

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not (REPO / ".venv-verifiers" / "bin" / "python").exists(),
                       reason="no .venv-verifiers: run `make verifiers`"),
]

# Task 0 sleeps 2 s (awaiting) before its next turn, task 1 awaits forever, task 2 blocks the
# worker's event loop, task 3 answers with a 270 MB tool output, task 4 allocates 2 GiB.
SLOW_ENV = '''
import asyncio
import time
import verifiers.v1 as vf

HELD = []

class SlowTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        for kind in ("slow", "hang", "block", "big", "hog"):
            yield vf.Task(vf.TaskData(prompt=kind))


class SlowEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class SlowEnv(vf.Env[SlowEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            await interaction.turn()
            if task.data.prompt == "hang":
                await asyncio.sleep(3600)
            elif task.data.prompt == "block":
                time.sleep(3600)
            elif task.data.prompt == "big":
                await interaction.turn("x" * 270_000_000)  # over the 256 MiB a frame may carry
            elif task.data.prompt == "hog":
                HELD.append(bytearray(2048 << 20))
            else:
                await asyncio.sleep(2.0)
            await interaction.turn("slept")


__all__ = ["SlowEnv", "SlowTaskset"]
'''
SLOW, HANG, BLOCK, BIG, HOG = 0, 1, 2, 3, 4


@pytest.fixture
def anyio_backend():
    return "asyncio"


def calculator(**overrides) -> EnvironmentConfig:
    fields = {"adapter": "verifiers", "name": "vf_calculator", "path": [EXAMPLES],
              "python": REPO / ".venv-verifiers" / "bin" / "python"}
    return EnvironmentConfig(**{**fields, **overrides})


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_openings_are_deterministic_per_index(tmp_path):
    async with VerifiersAdapter(calculator(args={"seed": 3}), run_dir=tmp_path) as adapter:
        first, episode = await adapter.open(5, "train")
        await episode.aclose()
        again, episode = await adapter.open(5, "train")
        await episode.aclose()
        other = await adapter.task(6, "train")
    assert first == again
    # The system prompt, the worked exchange of the task's template, the task's question.
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert other != first


async def test_a_scripted_episode_gets_the_tool_output_and_the_reward(tmp_path):
    async with VerifiersAdapter(calculator(), run_dir=tmp_path) as adapter:
        opening, episode = await adapter.open(0, "train")
        assert "Dana had 96 coins and gave away 3 coins to each of 6 friends" in opening[-1]["content"]
        reply = await episode.respond("Let me compute. <tool>96 - 3 * 6</tool>")
        assert reply == [{"role": "user", "content": "<result>78</result>"}]
        assert await episode.respond("<answer>78</answer>") is None
        assert await episode.reward() == pytest.approx(1.1)  # correct (1.0) + format (0.1)
        await episode.aclose()
        # An episode grpod cuts short (its max_turns) still gets its reward: a terminated turn ends it.
        _, episode = await adapter.open(1, "train")
        assert await episode.respond("<tool>2 + 2</tool>") == [{"role": "user", "content": "<result>4</result>"}]
        assert await episode.reward() == 0.0
        await episode.aclose()


async def test_a_killed_worker_fails_its_episode_and_the_next_open_works(tmp_path):
    async with VerifiersAdapter(calculator(), run_dir=tmp_path) as adapter:
        _, episode = await adapter.open(0, "train")
        os.kill(adapter.worker.pid, signal.SIGKILL)
        with pytest.raises(EnvironmentFailure) as caught:
            await episode.respond("<tool>1 + 1</tool>")
        assert caught.value.reason == "environment_crash"
        assert "SIGKILL" in str(caught.value)
        await episode.aclose()
        opening, fresh = await adapter.open(0, "train")
        assert opening[-1]["role"] == "user"
        await fresh.aclose()
        assert adapter.health()["restarts"] == 1
        with pytest.raises(EnvironmentFailure) as caught:  # the old episode died with the old worker
            await episode.reward()
        assert caught.value.reason == "environment_crash"


def slow_env(tmp_path: Path, timeout_s: float, **overrides) -> EnvironmentConfig:
    (tmp_path / "vf_slow.py").write_text(textwrap.dedent(SLOW_ENV))
    return calculator(name="vf_slow", path=[tmp_path], timeout_s=timeout_s, **overrides)


async def test_episodes_play_concurrently_in_one_worker(tmp_path):
    async with VerifiersAdapter(slow_env(tmp_path, timeout_s=30.0), run_dir=tmp_path) as adapter:
        episodes = [(await adapter.open(SLOW, "train"))[1] for _ in range(3)]
        replies = []

        async def turn(episode) -> None:
            replies.append(await episode.respond("hello"))

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for episode in episodes:
                tg.start_soon(turn, episode)
        elapsed = time.monotonic() - started
        for episode in episodes:
            await episode.aclose()
    assert replies == [[{"role": "user", "content": "slept"}]] * 3
    # Each turn sleeps 2 s in the env: one at a time would take 6 s.
    assert elapsed < 4.0, elapsed


async def _respond_together(**episodes) -> dict:
    """Each episode's reply to "hello", its turns played at once; a failure is its outcome."""
    outcome = {}

    async def turn(name, episode) -> None:
        try:
            outcome[name] = await episode.respond("hello")
        except EnvironmentFailure as failure:
            outcome[name] = failure

    async with anyio.create_task_group() as tg:
        for name, episode in episodes.items():
            tg.start_soon(turn, name, episode)
    return outcome


async def test_a_call_past_its_timeout_is_cancelled_and_the_worker_goes_on(tmp_path):
    async with VerifiersAdapter(slow_env(tmp_path, timeout_s=3.0), run_dir=tmp_path) as adapter:
        pid = adapter.worker.pid
        _, stuck = await adapter.open(HANG, "train")
        _, sibling = await adapter.open(SLOW, "train")
        started = time.monotonic()
        outcome = await _respond_together(stuck=stuck, sibling=sibling)
        assert outcome["sibling"] == [{"role": "user", "content": "slept"}]
        failure = outcome["stuck"]
        assert isinstance(failure, EnvironmentFailure) and failure.reason == "environment_timeout"
        assert "cancelled in the worker, which goes on" in str(failure)
        assert time.monotonic() - started < 3.0 + 3.0
        assert adapter.worker.pid == pid and not _gone(pid)
        assert adapter.health()["restarts"] == 0 and adapter.health()["cancelled"] == 1
        # The cancelled call's episode was closed in the worker; the sibling plays on.
        with pytest.raises(EnvironmentFailure, match="no open episode"):
            await stuck.reward()
        assert await sibling.reward() == 0.0
        await sibling.aclose()


async def test_a_reply_too_large_to_send_fails_its_call_and_nothing_else(tmp_path):
    """A tool output over the frame limit is that call's environment_error, saying so; the worker
    and the episode beside it go on (it was read as a broken channel: the worker killed, every
    episode on it dropped as a crash, the cause nowhere)."""
    async with VerifiersAdapter(slow_env(tmp_path, timeout_s=60.0), run_dir=tmp_path) as adapter:
        pid = adapter.worker.pid
        _, big = await adapter.open(BIG, "train")
        _, sibling = await adapter.open(SLOW, "train")
        outcome = await _respond_together(big=big, sibling=sibling)
        failure = outcome["big"]
        assert isinstance(failure, EnvironmentFailure) and failure.reason == "environment_error", failure
        assert "cannot be sent to grpod" in str(failure) and "over the 256 MiB a frame may carry" in str(failure)
        assert outcome["sibling"] == [{"role": "user", "content": "slept"}]
        assert adapter.worker.pid == pid and adapter.health()["restarts"] == 0
        await big.aclose()
        await sibling.aclose()


async def test_an_environment_past_its_memory_cap_fails_that_call_and_the_worker_goes_on(tmp_path):
    """source.environment.memory_mb caps the worker: an episode that allocates 2 GiB under a 1 GiB
    cap fails as environment_error (MemoryError), and the worker plays on; uncapped, it grows
    until the OOM killer picks a process, perhaps the daemon."""
    async with VerifiersAdapter(slow_env(tmp_path, timeout_s=60.0, memory_mb=1024), run_dir=tmp_path) as adapter:
        pid = adapter.worker.pid
        _, hog = await adapter.open(HOG, "train")
        with pytest.raises(EnvironmentFailure) as failure:
            await hog.respond("hello")
        assert failure.value.reason == "environment_error" and "MemoryError" in str(failure.value), failure.value
        await hog.aclose()
        _, slow = await adapter.open(SLOW, "train")
        assert await slow.respond("hello") == [{"role": "user", "content": "slept"}]
        await slow.aclose()
        assert adapter.worker.pid == pid


async def test_a_cancel_that_reaches_an_answered_open_closes_its_episode(tmp_path):
    # The open answers in the instant its timeout fires: the daemon drops the reply and cancels a
    # call the worker has finished. The episode it opened is held by nobody, so it is closed.
    async with VerifiersAdapter(calculator(), run_dir=tmp_path) as adapter:
        _, other = await adapter.open(0, "train")
        channel = adapter.channel
        opening = channel.next_id()
        status, (key, _) = await channel.call(opening, "open", 0, "train")
        assert status == "ok"
        assert await channel.call(channel.next_id(), "cancel", opening) == ("ok", None)
        reply = await channel.call(channel.next_id(), "reward", key)
        assert reply[0] == "error" and "no open episode" in reply[2], reply
        # Only that episode: the other plays on.
        assert await other.respond("<answer>78</answer>") is None
        assert await other.reward() == pytest.approx(1.1)
        await other.aclose()


async def test_a_blocked_event_loop_gets_the_worker_replaced(tmp_path):
    async with VerifiersAdapter(slow_env(tmp_path, timeout_s=2.0), run_dir=tmp_path) as adapter:
        _, episode = await adapter.open(BLOCK, "train")
        pid = adapter.worker.pid
        started = time.monotonic()
        with pytest.raises(EnvironmentFailure) as caught:
            await episode.respond("anything")
        assert caught.value.reason == "environment_timeout"
        assert "event loop is blocked" in str(caught.value)
        assert time.monotonic() - started < 2.0 + CANCEL_GRACE_S + 5.0
        assert _gone(pid)
        _, episode = await adapter.open(SLOW, "train")
        assert adapter.health()["restarts"] == 1
        await episode.aclose()


# An infinite taskset of tiny tasks: task i's prompt is "i".
ENDLESS_ENV = '''
import verifiers.v1 as vf


class EndlessTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        i = 0
        while True:
            yield vf.Task(vf.TaskData(prompt=str(i)))
            i += 1


__all__ = ["EndlessTaskset"]
'''


async def test_a_fresh_worker_reaches_a_far_index_of_an_infinite_taskset(tmp_path):
    """A resumed run's first open, in a fresh worker, walks the taskset to its index (some
    seconds). The walk yields to the worker's event loop: a call past timeout_s is cancelled in
    the worker (not killed as blocked), the walk keeps its place, and a later open gets there
    (the whole walk blocked the loop: the worker was killed and began again at task 0, every time)."""
    (tmp_path / "vf_endless.py").write_text(textwrap.dedent(ENDLESS_ENV))
    far = 300_000
    async with VerifiersAdapter(calculator(name="vf_endless", path=[tmp_path], timeout_s=1.0), run_dir=tmp_path) as adapter:
        for _ in range(100):
            try:
                opening, episode = await adapter.open(far, "train")
                break
            except EnvironmentFailure as failure:
                assert failure.reason == "environment_timeout", failure
                assert "cancelled in the worker, which goes on" in str(failure)
        else:
            pytest.fail(f"open({far}) never answered within timeout_s")
        await episode.aclose()
        assert opening[-1] == {"role": "user", "content": str(far)}
        assert adapter.health()["restarts"] == 0
        assert await adapter.task(far + 1, "train") == [{"role": "user", "content": str(far + 1)}]


async def test_exit_leaves_no_process_on_every_path(tmp_path):
    adapter = VerifiersAdapter(calculator(), run_dir=tmp_path)
    with anyio.CancelScope() as scope:
        async with adapter:
            pid = adapter.worker.pid
            _, episode = await adapter.open(0, "train")
            scope.cancel()
            await anyio.sleep(10)
    assert _gone(pid)
    with pytest.raises(RuntimeError):
        async with VerifiersAdapter(calculator(), run_dir=tmp_path) as adapter:
            pid = adapter.worker.pid
            raise RuntimeError("the source failed")
    assert _gone(pid)


async def test_an_environment_that_does_not_load_says_why(tmp_path):
    with pytest.raises(EnvironmentFailure, match="no_such_env"):
        async with VerifiersAdapter(calculator(name="no_such_env"), run_dir=tmp_path):
            pass
    with pytest.raises(EnvironmentFailure, match="make verifiers"):
        worker_python(calculator(python=tmp_path / "missing" / "python"))
