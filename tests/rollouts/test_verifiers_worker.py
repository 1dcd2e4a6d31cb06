"""`TaskStream`, the verifiers worker's tasks of one split read by index, over plain iterables (it
needs no verifiers: the worker module imports only the standard library at the top)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from grpod.rollouts.verifiers_worker import TaskStream, UserCodeError


class Endless:
    """An infinite taskset of tiny tasks (task i is i) that counts its iterations and tasks made."""

    def __init__(self) -> None:
        self.iterations = 0
        self.made = 0

    def __iter__(self):
        self.iterations += 1
        for index in itertools.count():
            self.made += 1
            yield index


class Finite(Endless):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def __iter__(self):
        self.iterations += 1
        for index in range(self.length):
            self.made += 1
            yield index


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_far_index_of_an_infinite_taskset_holds_a_bounded_number_of_tasks():
    taskset = Endless()
    stream = TaskStream(taskset, "endless")

    async def walk():
        assert await stream.task(200_000) == 200_000
        assert stream.held() <= TaskStream.FIRST + TaskStream.WINDOW
        assert await stream.task(200_001) == 200_001  # onwards from where it was
        assert await stream.task(199_000) == 199_000  # in the window of recent tasks
        assert await stream.task(7) == 7  # among the first tasks (evaluation reads them)

    run(walk())
    assert stream.held() <= TaskStream.FIRST + TaskStream.WINDOW
    assert taskset.iterations == 1 and taskset.made == 200_002


def test_the_walk_lets_the_event_loop_run():
    stream = TaskStream(Endless(), "endless")
    ticks = 0

    async def tick(done: asyncio.Event) -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def walk():
        done = asyncio.Event()
        ticker = asyncio.get_running_loop().create_task(tick(done))
        await stream.task(50_000)
        done.set()
        await ticker

    run(walk())
    assert ticks >= 50_000 // TaskStream.YIELD_EVERY - 1, ticks


def test_a_cancelled_walk_keeps_its_position_for_the_next_call():
    taskset = Endless()
    stream = TaskStream(taskset, "endless")

    async def walk():
        far = asyncio.get_running_loop().create_task(stream.task(10**9))
        while stream.position < 5 * TaskStream.YIELD_EVERY:
            await asyncio.sleep(0)
        far.cancel()  # the daemon's timeout: confirmed at the walk's next yield
        with pytest.raises(asyncio.CancelledError):
            await far
        reached = stream.position
        assert 0 < reached < 10**9 and taskset.made == reached
        assert await stream.task(reached + 10) == reached + 10
        return reached

    reached = run(walk())
    assert taskset.iterations == 1 and taskset.made == reached + 11  # went on; did not start again


def test_a_finite_taskset_wraps_modulo_its_length():
    small = Finite(5)
    stream = TaskStream(small, "small")
    assert run(stream.task(7)) == 2
    assert run(stream.task(5)) == 0 and run(stream.task(4)) == 4
    assert stream.length == 5 and small.iterations == 1

    # Longer than the tasks held: an index that wraps behind them iterates it again.
    large = Finite(5000)
    stream = TaskStream(large, "large")
    assert run(stream.task(4999)) == 4999
    assert run(stream.task(5000 + 4000)) == 4000  # in the window of recent tasks
    assert run(stream.task(2 * 5000 + 3)) == 3  # among the first
    assert large.iterations == 1
    assert run(stream.task(5000 + 2000)) == 2000
    assert large.iterations == 2 and stream.held() <= TaskStream.FIRST + TaskStream.WINDOW


def test_an_index_behind_the_tasks_held_iterates_the_taskset_again():
    taskset = Endless()
    stream = TaskStream(taskset, "endless")
    assert run(stream.task(10_000)) == 10_000
    assert run(stream.task(3_000)) == 3_000
    assert taskset.iterations == 2
    assert run(stream.task(3_001)) == 3_001 and run(stream.task(500)) == 500
    assert taskset.iterations == 2


def test_a_one_shot_iterator_says_it_cannot_go_back_and_an_empty_taskset_says_so():
    stream = TaskStream(iter(range(10_000)), "one_shot")
    assert run(stream.task(9_000)) == 9_000
    assert run(stream.task(100)) == 100  # among the first: held
    with pytest.raises(UserCodeError, match="one-shot iterator"):
        run(stream.task(4_000))
    with pytest.raises(UserCodeError, match="'empty' has no tasks"):
        run(TaskStream([], "empty").task(0))


def test_a_taskset_that_raises_starts_again_at_the_next_call():
    class Flaky(Endless):
        def __iter__(self):
            self.iterations += 1
            for index in itertools.count():
                if index == 3000 and self.iterations == 1:
                    raise RuntimeError("the dataset server hung up")
                yield index

    taskset = Flaky()
    stream = TaskStream(taskset, "flaky")
    with pytest.raises(RuntimeError, match="hung up"):
        run(stream.task(4000))
    assert run(stream.task(4000)) == 4000 and taskset.iterations == 2
    assert run(stream.task(10)) == 10 and len(stream.first) == TaskStream.FIRST  # not appended twice
