"""The Policy handle: requests go to the available engine with the fewest outstanding requests,
wait at the gates while none is open, and are tagged with the older version they could be of."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from grpod.config import InferenceConfig
from grpod.inference.policy import Policy
from grpod.inference.supervised import InferenceUnavailable, SupervisedInference

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def engine(name: str, version: int = 3) -> SupervisedInference:
    process = SimpleNamespace(running=True, pid=None, base_url=f"http://127.0.0.1/{name}", cfg=InferenceConfig(),
                              fixed_port=0, served_model_names=lambda lora=False: ["policy"])
    e = SupervisedInference(process, InferenceConfig(), name=name)
    e.client, e.version = SimpleNamespace(name=name), version
    return e


async def test_the_least_busy_open_engine_is_lent_and_a_closed_one_never():
    a, b, c = engine("a"), engine("b"), engine("c")
    a.open(), b.open()  # c stays closed (being relaunched, or its update failed)
    policy = Policy([a, b, c], version=3)
    async with policy.engine(1) as first:
        async with policy.engine(1) as second:
            assert {first.engine.name, second.engine.name} == {"a", "b"}, "spread over the open engines"
            async with policy.engine(1) as third:
                assert third.engine.name in ("a", "b") and third.engine is not c
            assert first.engine.outstanding == second.engine.outstanding == 1
    assert a.outstanding == b.outstanding == 0


async def test_requests_wait_at_the_gates_until_an_engine_opens():
    a, b = engine("a"), engine("b")
    policy = Policy([a, b], version=3)
    lent = []

    async def request():
        async with policy.engine(5) as lease:
            lent.append(lease.engine.name)

    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            await anyio.wait_all_tasks_blocked()
            assert lent == []
            b.open()
    assert lent == ["b"]
    with pytest.raises(InferenceUnavailable, match="no vLLM engine available for 0 s"):
        b.close()
        async with policy.engine(0.05):
            pass


async def test_a_result_is_tagged_with_the_older_of_the_versions_its_engine_served():
    a = engine("a", version=4)
    a.open()
    async with Policy([a], version=4).engine(1) as lease:
        a.version = 5  # a sync landed while the request ran
        assert lease.version == 4 and lease.sampled_version() == 4
    async with Policy([a], version=5).engine(1) as lease:
        assert lease.sampled_version() == 5
