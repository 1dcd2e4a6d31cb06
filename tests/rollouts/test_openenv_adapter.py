"""`OpenEnvAdapter` against real OpenEnv servers: one grpod starts (the shipped guess-the-number
example, an environment whose step hangs) and one the test serves itself (`url`)."""

from __future__ import annotations

import os
import re
import signal
import socket
import textwrap
from functools import partial
from pathlib import Path

import anyio
import psutil
import pytest

from grpod.config import EnvironmentConfig
from grpod.rollouts.environment_source import _failure
from grpod.rollouts.environments import EnvironmentFailure
from grpod.rollouts.openenv_adapter import (
    ABANDON_CLOSE_S,
    STUCK_LIMIT,
    OpenEnvAdapter,
    action_observation_classes,
    task_seed,
)

pytestmark = pytest.mark.anyio

GUESS = str(Path(__file__).resolve().parents[2] / "etc/examples/agent-envs/guess_env.py") + ":GuessEnvironment"
# A server's start-up imports OpenEnv (seconds on a busy 2-core machine).
START_TIMEOUT_S = 60.0

STUCK_ENV = """
import time

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class Say(Action):
    message: str


class Heard(Observation):
    prompt: str


class StuckEnvironment(Environment[Say, Heard, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Heard(prompt=f"task {seed}")

    def step(self, action, timeout_s=None, **kwargs):
        time.sleep(60)
        return Heard(prompt="too late")

    @property
    def state(self):
        return State()
"""


@pytest.fixture
def anyio_backend():
    return "asyncio"  # OpenEnv's client is written for asyncio


def _cfg(**kw) -> EnvironmentConfig:
    return EnvironmentConfig(adapter="openenv", timeout_s=5.0, start_timeout_s=START_TIMEOUT_S, **kw)


def _range(prompt: str) -> tuple[int, int]:
    low, high = re.search(r"from (\d+) to (\d+)", prompt).groups()
    return int(low), int(high)


async def _play_binary_search(episode, opening: str) -> int:
    """Win a guessing game by bisection; the number of guesses it took."""
    low, high = _range(opening)
    for turn in range(1, 10):
        guess = (low + high) // 2
        reply = await episode.respond(f"My guess is {guess}")
        if reply is None:
            return turn
        assert reply[0]["role"] == "user"
        if reply[0]["content"].startswith("Higher"):
            low = guess + 1
        else:
            assert reply[0]["content"].startswith("Lower"), reply
            high = guess - 1
    raise AssertionError("the game never ended")


async def test_guess_episodes_through_a_server_grpod_starts(tmp_path):
    async with OpenEnvAdapter(_cfg(name=GUESS), run_dir=tmp_path) as adapter:
        health = adapter.health()
        assert health["restarts"] == 0 and health["server"].startswith("http://127.0.0.1:") and health["state"] == "up"
        first, won = await adapter.open(3, "train")
        again, lost = await adapter.open(3, "train")
        other, third = await adapter.open(4, "train")
        assert first == again and first != other
        assert [m["role"] for m in first] == ["user"] and "reply with one number" in first[0]["content"]
        assert (await adapter.open(3, "eval"))[0] != first

        turns = await _play_binary_search(won, first[0]["content"])
        assert await won.reward() == pytest.approx(1.0 - 0.1 * (turns - 1))

        low, high = _range(first[0]["content"])
        for left in ("4 guesses", "3 guesses", "2 guesses", "1 guess"):
            reply = await lost.respond("no idea")
            assert reply == [{"role": "user", "content": f"Reply with one number from {low} to {high}. {left} left."}]
        assert await lost.respond("still no idea") is None
        assert await lost.reward() == 0.0
        for episode in (won, lost, third):
            await episode.aclose()
        pid = health["pid"]
        assert psutil.pid_exists(pid)
    assert not psutil.pid_exists(pid)
    assert (tmp_path / "environment.log").read_text().startswith("=== grpod launch")


async def test_a_killed_server_fails_its_episode_and_is_restarted_for_the_next(tmp_path):
    cfg = _cfg(name=GUESS)
    async with OpenEnvAdapter(cfg, run_dir=tmp_path) as adapter:
        opening, episode = await adapter.open(0, "train")
        assert await episode.respond("0") is not None  # below every range: "Higher."
        pid = adapter.health()["pid"]
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(cfg.timeout_s + 5), pytest.raises(EnvironmentFailure) as failure:
            await episode.respond("0")
        assert failure.value.reason == "environment_crash"
        assert "(task 0 of train), turn 2: step" in str(failure.value)
        await episode.aclose()

        again, episode = await adapter.open(0, "train")
        assert again == opening
        health = adapter.health()
        assert health["restarts"] == 1 and health["pid"] != pid and not psutil.pid_exists(pid)
        assert await episode.respond("0") is not None
        await episode.aclose()
        pid = health["pid"]
    assert not psutil.pid_exists(pid)


def _stuck_cfg(tmp_path: Path, *, serving: str = "concurrent") -> EnvironmentConfig:
    """STUCK_ENV served `concurrent`ly, as `one session` at a time, or with concurrent sessions whose
    steps OpenEnv runs on `one thread`."""
    text = textwrap.dedent(STUCK_ENV)
    if serving == "one session":
        text = text.replace("    SUPPORTS_CONCURRENT_SESSIONS = True\n", "")
    elif serving == "one thread":
        text = text.replace("    SUPPORTS_CONCURRENT_SESSIONS = True\n",
                            "    SUPPORTS_CONCURRENT_SESSIONS = True\n    REQUIRES_SINGLE_THREAD_EXECUTOR = True\n")
    (tmp_path / "stuck_env.py").write_text(text)
    return EnvironmentConfig(adapter="openenv", name="stuck_env:StuckEnvironment", path=[tmp_path], timeout_s=1.0,
                             start_timeout_s=START_TIMEOUT_S)


async def _time_out(episode, index: int) -> None:
    with anyio.fail_after(15), pytest.raises(EnvironmentFailure) as failure:
        await episode.respond("hello")
    assert failure.value.reason == "environment_timeout"
    assert f"stuck_env:StuckEnvironment (task {index} of train), turn 1: step" in str(failure.value)
    with anyio.fail_after(ABANDON_CLOSE_S + 1):  # no polite close: the server reads nothing of that session
        await episode.aclose()


async def test_a_step_that_hangs_is_abandoned_and_the_server_killed_at_the_stuck_limit(tmp_path):
    async with OpenEnvAdapter(_stuck_cfg(tmp_path), run_dir=tmp_path / "run") as adapter:
        pid = adapter.health()["pid"]
        _, bystander = await adapter.open(99, "train")  # an episode that plays on through the stuck calls
        for stuck in range(1, STUCK_LIMIT):
            opening, episode = await adapter.open(stuck, "train")
            assert opening[0]["content"] == f"task {task_seed(adapter.cfg.task_seed, 'train', stuck)}"
            await _time_out(episode, stuck)
            health = adapter.health()
            assert (health["pid"], health["stuck"], health["restarts"]) == (pid, stuck, 0), "abandoned, not killed"
        assert (await bystander.call("reset", lambda: bystander.client.reset(seed=5))).observation["prompt"] == "task 5"
        await bystander.aclose()

        _, episode = await adapter.open(STUCK_LIMIT, "train")
        await _time_out(episode, STUCK_LIMIT)
        assert not psutil.pid_exists(pid), "the STUCK_LIMIT-th stuck call has the server killed"
        assert adapter.health()["pid"] is None  # and status names no PID until the next episode relaunches it
        await adapter.open(0, "train")
        assert (adapter.health()["restarts"], adapter.health()["stuck"]) == (1, 0)
        pid = adapter.health()["pid"]
    assert not psutil.pid_exists(pid)


@pytest.mark.parametrize("serving", ["one session", "one thread"])
async def test_a_step_that_hangs_on_a_server_of_one_step_at_a_time_has_it_killed_at_once(tmp_path, serving):
    async with OpenEnvAdapter(_stuck_cfg(tmp_path, serving=serving), run_dir=tmp_path / "run") as adapter:
        pid = adapter.health()["pid"]
        _, episode = await adapter.open(7, "train")
        await _time_out(episode, 7)
        assert not psutil.pid_exists(pid)  # that one stuck step would hold every episode's session
        assert adapter.health()["pid"] is None and adapter.health()["stuck"] == 1
    assert not psutil.pid_exists(pid)


async def test_a_group_whose_step_hangs_is_dropped_as_a_timeout_though_its_siblings_lose_their_connection(tmp_path):
    """Two episodes of a group on one server, the second asking a moment after the first: the first
    call times out at the stuck limit and has the server killed, which cuts the second's connection
    (a crash, often ended before the timeout is raised). The group's drop is the timeout, its cause."""
    async with OpenEnvAdapter(_stuck_cfg(tmp_path), run_dir=tmp_path / "run") as adapter:
        adapter.server.stuck = STUCK_LIMIT - 1  # as if earlier groups had left calls stuck on it
        episodes = [(await adapter.open(3, "train"))[1] for _ in range(2)]

        async def play(i: int) -> None:
            await anyio.sleep(0.5 * i)
            await episodes[i].respond("hello")

        with anyio.fail_after(20), pytest.raises(BaseExceptionGroup) as group:
            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(play, i)
        reasons = sorted(e.reason for e in group.value.exceptions if isinstance(e, EnvironmentFailure))
        assert reasons == ["environment_crash", "environment_timeout"], group.value.exceptions
        assert _failure(group.value).reason == "environment_timeout"
        for episode in episodes:
            await episode.aclose()


async def test_url_mode_uses_a_server_it_did_not_start(tmp_path):
    import uvicorn
    from openenv.core.env_server import create_fastapi_app

    from grpod.rollouts.rewards import import_function

    guess_cls = import_function(GUESS)
    app = create_fastapi_app(partial(guess_cls, span=10), *action_observation_classes(guess_cls), max_concurrent_envs=4)
    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [listener])
        async with OpenEnvAdapter(_cfg(url=url + "/"), run_dir=tmp_path) as adapter:
            assert adapter.health() == {"server": url}
            opening, episode = await adapter.open(5, "train")
            assert opening == (await adapter.open(5, "train"))[0]
            turns = await _play_binary_search(episode, opening[0]["content"])
            assert await episode.reward() == pytest.approx(1.0 - 0.1 * (turns - 1))
            await episode.aclose()
        server.should_exit = True
    listener.close()
    assert not list((tmp_path).iterdir())  # grpod started nothing, logged nothing here


async def test_url_mode_without_a_server_fails_at_entry(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    cfg = EnvironmentConfig(adapter="openenv", url=f"http://127.0.0.1:{port}", start_timeout_s=0.5)
    with pytest.raises(RuntimeError, match="no answer from .*/health within"):
        async with OpenEnvAdapter(cfg, run_dir=tmp_path):
            pass


async def _until_dead(adapter) -> None:
    """Until the adapter sees its SIGKILLed server dead (a leader shows as a zombie before its
    threads are gone and it can be waited for), so the next `open` relaunches it."""
    with anyio.fail_after(10):
        while adapter.health()["pid"] is not None:
            await anyio.sleep(0.05)


async def test_a_relaunch_outlives_the_cancelled_open_that_began_it(tmp_path):
    """A group is cancelled when one of its episodes lost the server; its sibling may be relaunching
    that server for everyone, and the relaunch must survive the cancellation."""
    async with OpenEnvAdapter(_cfg(name=GUESS), run_dir=tmp_path) as adapter:
        pid = adapter.health()["pid"]
        os.kill(pid, signal.SIGKILL)
        await _until_dead(adapter)
        with anyio.move_on_after(0.5) as opening:  # well inside the relaunch's start-up
            await adapter.open(0, "train")
        assert opening.cancelled_caught
        relaunched = adapter.health()
        assert relaunched["restarts"] == 1 and relaunched["pid"] not in {None, pid} and relaunched["state"] == "up"
        assert psutil.pid_exists(relaunched["pid"])
        _, episode = await adapter.open(0, "train")
        assert adapter.health() == relaunched
        await episode.aclose()
    assert not psutil.pid_exists(relaunched["pid"])


async def test_leaving_the_adapter_stops_a_relaunch_under_way(tmp_path):
    failures: list[BaseException] = []

    async def open_during_close(adapter) -> None:
        try:
            await adapter.open(0, "train")
        except EnvironmentFailure as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        async with OpenEnvAdapter(_cfg(name=GUESS), run_dir=tmp_path) as adapter:
            pid = adapter.health()["pid"]
            os.kill(pid, signal.SIGKILL)
            await _until_dead(adapter)
            tg.start_soon(open_during_close, adapter)
            with anyio.fail_after(10):
                while adapter.health()["pid"] in {None, pid}:
                    await anyio.sleep(0.02)
            assert adapter.health()["state"] == "starting"
            relaunched = adapter.health()["pid"]
            started = anyio.current_time()
        closed_after = anyio.current_time() - started
    assert not psutil.pid_exists(relaunched)
    assert closed_after < START_TIMEOUT_S / 4, closed_after  # the start-up was cut short, not waited out
    assert [f.reason for f in failures] == ["environment_crash"] and "stopped while it started" in str(failures[0])


class _Answers:
    """An OpenEnv client that answers each step with the next of `results` (or raises it)."""

    def __init__(self, results: list) -> None:
        self.results = list(results)

    async def step(self, action):
        result = self.results.pop(0)
        if isinstance(result, BaseException):
            raise result
        return result


def _step(reward=0.5, done=False, observation=None):
    from types import SimpleNamespace

    return SimpleNamespace(reward=reward, done=done,
                           observation={"prompt": "go on"} if observation is None else observation)


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (_step(reward="abc"), "its reward is 'abc', expected a finite number"),
        (_step(reward=[1]), "its reward is [1], expected a finite number"),
        (_step(reward=10**400), "expected a finite number"),
        (_step(reward=float("inf")), "its reward is inf"),
        (_step(reward=True), "its reward is True"),
        (_step(done="false"), "its `done` is 'false', expected true or false"),
        (_step(observation=[1]), "its observation is list [1], expected an object"),
        (_step(observation="text"), "its observation is str 'text', expected an object"),
        (_step(observation={"messages": [{"role": "assistant", "content": "I win"}]}), "has role 'assistant'"),
        (AttributeError("'list' object has no attribute 'get'"), "a malformed answer (AttributeError"),
        (TypeError("float() argument must be a string or a real number, not 'list'"), "a malformed answer (TypeError"),
    ],
)
async def test_a_malformed_step_answer_is_the_environments_error_naming_task_and_turn(result, expected):
    """Whatever shape a server's answer has, the episode fails as environment_error with the
    environment, the task and the turn named (a list answer was an AttributeError with no place,
    a reward of 10**400 an OverflowError, `"done": "false"` ended the episode and trained)."""
    from types import SimpleNamespace

    from grpod.rollouts.openenv_adapter import OpenEnvEpisode

    adapter = SimpleNamespace(cfg=SimpleNamespace(timeout_s=5.0), text_field="message", connection_errors=(OSError,))
    episode = OpenEnvEpisode(adapter, _Answers([_step(), result]), "openenv environment e (task 7 of train)", 0)
    assert await episode.respond("first") == [{"role": "user", "content": "go on"}]
    with pytest.raises(EnvironmentFailure) as failure:
        await episode.respond("second")
    assert failure.value.reason == "environment_error"
    assert str(failure.value).startswith("openenv environment e (task 7 of train), turn 2")
    assert expected in str(failure.value)


async def test_a_class_serving_one_session_is_refused_at_start_for_a_run_of_groups(tmp_path):
    """OpenEnv's default (no SUPPORTS_CONCURRENT_SESSIONS) holds one session: every other episode
    of a group was refused at capacity and the run trained nothing, forever. The start says so;
    the same class declaring concurrent sessions starts."""
    from contextlib import AsyncExitStack

    from grpod.config import ConfigError, parse_config
    from grpod.rollouts.environment_source import prepare_environment

    def source(serving: str):
        env = _stuck_cfg(tmp_path, serving=serving).model_dump(exclude_defaults=True)
        return parse_config({"source": {"kind": "environment", "group_size": 2, "concurrency": 3,
                                        "environment": env}}).source

    with pytest.raises(ConfigError, match=r"holds 1 episode\(s\) at once, and the run plays source.group_size x "
                                          r"source.concurrency = 6.*SUPPORTS_CONCURRENT_SESSIONS = True"):
        async with AsyncExitStack() as stack:
            await prepare_environment(source("one session"), tmp_path / "run", stack, max_seq_len=512,
                                      model_path=tmp_path / "no-model")
    async with AsyncExitStack() as stack:
        adapter = await prepare_environment(source("concurrent"), tmp_path / "run", stack, max_seq_len=512,
                                             model_path=tmp_path / "no-model")
        assert adapter.session_capacity == 1024


async def test_a_server_past_its_memory_cap_fails_that_step_and_serves_on(tmp_path):
    """source.environment.memory_mb: a step that allocates past it fails in the environment's code
    (environment_error naming the MemoryError) instead of growing the server until the OOM killer
    picks a process; the server lives on and the next episode plays (it reached 5 GB, uncapped)."""
    text = textwrap.dedent(STUCK_ENV).replace(
        "        time.sleep(60)\n        return Heard(prompt=\"too late\")",
        "        if action.message == 'hog':\n            HELD.append(bytearray(1500 << 20))\n"
        "        return Heard(prompt='fine')",
    ).replace("class Say(Action):", "HELD = []\n\n\nclass Say(Action):")
    (tmp_path / "hog_env.py").write_text(text)
    cfg = _cfg(name="hog_env:StuckEnvironment", path=[tmp_path], memory_mb=1024)
    async with OpenEnvAdapter(cfg, run_dir=tmp_path / "run") as adapter:
        pid = adapter.health()["pid"]
        _, episode = await adapter.open(1, "train")
        with pytest.raises(EnvironmentFailure) as failure:
            await episode.respond("hog")
        assert failure.value.reason == "environment_error" and "MemoryError" in str(failure.value), failure.value
        await episode.aclose()
        _, episode = await adapter.open(2, "train")
        assert await episode.respond("small") == [{"role": "user", "content": "fine"}]
        await episode.aclose()
        assert adapter.health()["pid"] == pid and psutil.Process(pid).memory_info().rss < 1024 << 20
