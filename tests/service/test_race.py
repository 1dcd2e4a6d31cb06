"""`first_of`: the first wait to return wins, the others are cancelled; an error is the caller's."""

import anyio
import pytest

from grpod.service.race import first_of

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_the_first_to_return_wins_and_the_others_are_cancelled():
    cancelled = []

    async def slow():
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            cancelled.append("slow")
            raise

    async def quick():
        await anyio.sleep(0.01)
        return "quick"

    with anyio.fail_after(5):
        assert await first_of(slow, quick) == (1, "quick")
    assert cancelled == ["slow"]


async def test_an_error_in_a_wait_reaches_the_caller():
    async def broken():
        raise ValueError("no")

    with pytest.raises(ExceptionGroup) as err, anyio.fail_after(5):
        await first_of(broken, anyio.sleep_forever)
    assert err.group_contains(ValueError)


async def test_nothing_to_wait_for_is_an_error():
    with pytest.raises(ValueError):
        await first_of()
