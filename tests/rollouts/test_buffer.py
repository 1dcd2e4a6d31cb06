import anyio
import pytest

from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.group import RolloutGroup


def _g(i):
    return RolloutGroup(tokens=[[1, 2]], loss_mask=[[0, 1]], scores=[float(i)], group_id=str(i))


def test_fifo_and_backpressure():
    async def main():
        buf = RolloutBuffer(capacity=2)
        await buf.put(_g(0))
        await buf.put(_g(1))
        with pytest.raises(TimeoutError):
            await buf.put(_g(2), timeout_s=0.1)
        taken = await buf.take(2)
        assert [g.group_id for g in taken] == ["0", "1"]
        with pytest.raises(TimeoutError):
            await buf.take(1, timeout_s=0.1)

    anyio.run(main)


def test_snapshot_restore_keeps_order():
    async def main():
        buf = RolloutBuffer(capacity=8)
        for i in range(3):
            await buf.put(_g(i))
        snap = buf.snapshot()
        other = RolloutBuffer(capacity=8)
        other.restore([RolloutGroup.from_json(g.to_json()) for g in snap])
        await other.put(_g(9))
        assert [g.group_id for g in await other.take(4)] == ["0", "1", "2", "9"]

    anyio.run(main)
