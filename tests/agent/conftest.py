"""An agent served in the test's own event loop over stand-in engines.

Each engine is the real `SupervisedInference` over the real `InferenceProcess` lifecycle (own
process group, launch token, pidfd, release waits), launching the stub server of
tests/inference/stub_server.py instead of vLLM: it starts in a fraction of a second, answers
`/health` and the weight-version routes with the launch token, and dies when killed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from grpod.agent.server import Agent
from grpod.inference.release import free_port, wait_group_gone
from grpod.inference.supervised import SupervisedInference
from tests.inference.test_process import StubProcess

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def stub_engines(tmp_path: Path, count: int = 1, **cfg) -> list[SupervisedInference]:
    """`count` stand-in engines, each in a directory of its own (log, launch record)."""
    engines = []
    for index in range(count):
        process = StubProcess(tmp_path / f"engine-{index}", **cfg)
        engines.append(SupervisedInference(process, process.cfg, name=f"engine-{index}"))
    return engines


@asynccontextmanager
async def serving(engines: list[SupervisedInference], port: int | None = None) -> AsyncIterator[tuple[Agent, str]]:
    """The agent over `engines` on `port` (a free loopback one by default), its base URL; stopped
    (engines too) at exit."""
    agent = Agent(engines, token=TOKEN, host="127.0.0.1", port=port or free_port("127.0.0.1"))
    async with anyio.create_task_group() as tg:
        await tg.start(agent.serve)
        try:
            yield agent, f"http://127.0.0.1:{agent.port}"
        finally:
            tg.cancel_scope.cancel()


async def crash(engine: SupervisedInference) -> None:
    """Kill a stand-in engine as a crash would (SIGKILL to the group its launch created) and wait
    until the group is gone: the test launched it through the agent, and stops only that group."""
    pgid = engine.process.pgid
    assert pgid is not None
    os.killpg(pgid, signal.SIGKILL)
    await wait_group_gone(pgid, 10)


@pytest.fixture
def weights(tmp_path) -> Path:
    """A directory standing in for a model (the agent checks that the weights are a directory)."""
    path = tmp_path / "weights"
    path.mkdir()
    return path
