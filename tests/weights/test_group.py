"""Rank 0's `GlooWeightSender` against the engine's receive loop in a peer process (no vLLM server):
every tensor arrives intact, and each way a transfer can go wrong ends in a typed error, not a hang.

The peer (`gloo_peer.py`) runs `GlooWeightTransferEngine`'s own join and receive loop with a
recording stand-in for the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from grpod.inference.release import port_is_free
from grpod.weights.group import WeightTransferCancelled, WeightTransferError, WeightTransferTimeout, listen_on, releasing
from grpod.weights.transfer import GlooWeightSender, tensor_metadata, wait_port_released
from grpod.weights.wire import dtype_name

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("gloo_peer.py")


class Peer:
    """The peer process, rank 1 of a group of two."""

    def __init__(self, mode: str, sender: GlooWeightSender, update_info: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        )
        self.proc.stdin.write(json.dumps({"init_info": sender.engine_init_info(1), "update_info": update_info}) + "\n")
        self.proc.stdin.flush()

    def message(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, f"the peer exited with code {self.proc.wait()}"
            if line.startswith("@@ "):
                return json.loads(line[3:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its PID
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def joined(mode: str, sender: GlooWeightSender, update_info: dict) -> Peer:
    peer = Peer(mode, sender, update_info)
    try:
        assert peer.message() == {"ready": True}
        sender.join()
        assert peer.message() == {"joined": True}
    except BaseException:
        peer.close()
        raise
    return peer


def model_like_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(50, 64, generator=gen)),
        ("layer.0.q.weight", torch.randn(64, 64, generator=gen)),
        ("layer.0.q.bias", torch.randn(64, generator=gen)),
        ("layer.0.mlp.weight", torch.randn(64, 256, generator=gen).t()),  # not contiguous
        ("layer.0.norm.weight", torch.randn(64, generator=gen).to(torch.bfloat16)),
        ("head.weight", torch.randn(200, 64, generator=gen)),  # larger than a chunk
    ]


def test_every_tensor_arrives_intact_in_planned_chunks(monkeypatch):
    # Rank 0 under torchrun: torch's rendezvous would make it a store client of a store nobody
    # serves (measured: both ranks time out); the sender's own listening socket avoids that.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    tensors = model_like_tensors()
    with_sender = GlooWeightSender("127.0.0.1", 2, chunk_bytes=20_000, timeout_s=60, inflight_chunks=2)
    update_info = with_sender.update_info(tensor_metadata(tensors))
    assert len(update_info["chunk_counts"]) > 2
    peer = joined("receive", with_sender, update_info)
    try:
        stats = with_sender.broadcast(tensors, update_info)
        received = peer.message()
    finally:
        peer.close()
        with_sender.close()
    assert stats.chunks == len(update_info["chunk_counts"]) and stats.tensors == len(tensors)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    for name, tensor in tensors:
        dtype, shape, total = received[name]
        assert (dtype, shape) == (dtype_name(tensor.dtype), list(tensor.shape))
        assert total == pytest.approx(float(tensor.double().sum()), rel=1e-12, abs=1e-9)


def test_tensors_that_differ_from_the_announced_update_are_refused_before_sending():
    tensors = model_like_tensors()
    sender = GlooWeightSender("127.0.0.1", 2, chunk_bytes=20_000, timeout_s=5)
    try:
        update_info = sender.update_info(tensor_metadata(tensors))
        sender.group = object()  # never reached: the check comes first
        swapped = [tensors[1], tensors[0], *tensors[2:]]
        with pytest.raises(ValueError, match="tensor 0 is 'layer.0.q.weight'"):
            sender.broadcast(swapped, update_info)
        with pytest.raises(ValueError, match="5 tensors to send"):
            sender.broadcast(tensors[:5], update_info)
    finally:
        sender.group = None
        sender.close()


def test_peer_dying_mid_update_fails_the_broadcast():
    """Measured: gloo's sending side notices a receiver that died sometimes at once, sometimes
    only at its timeout (waiting "for send operation to complete"); a receiver whose sender died
    always at once. `WeightGroup` does not wait for it: the dead engine's HTTP call fails first."""
    # 8 tensors of 8 MiB: more than the socket buffers hold, so rank 0 is still sending when the
    # peer dies in its first load.
    tensors = [(f"t{i}", torch.full((8 << 20,), i, dtype=torch.uint8)) for i in range(8)]
    sender = GlooWeightSender("127.0.0.1", 2, chunk_bytes=8 << 20, timeout_s=5)
    update_info = sender.update_info(tensor_metadata(tensors))
    peer = joined("die", sender, update_info)
    try:
        # At once ("Connection reset") or by the timeout, depending on where gloo's send was.
        with pytest.raises(WeightTransferError, match=r"sending chunk \d+/4"):
            sender.broadcast(tensors, update_info)
        assert peer.proc.wait() == 17
    finally:
        peer.close()
        sender.close()


@contextmanager
def never_received(timeout_s: float):
    """A sender joined by a peer that never receives, the tensors of a send that cannot complete
    (larger than the socket buffers), and a cancel event set 0.5 s from now."""
    tensors = [("big", torch.zeros(64 << 20, dtype=torch.uint8))]
    sender = GlooWeightSender("127.0.0.1", 2, chunk_bytes=1 << 20, timeout_s=timeout_s)
    update_info = sender.update_info(tensor_metadata(tensors))
    peer = joined("idle", sender, update_info)
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    try:
        yield sender, tensors, update_info, cancel
    finally:
        timer.cancel()
        peer.close()
        sender.close()


def test_a_peer_that_never_receives_cancel_then_timeout():
    """A broadcast the peer never receives: given up on `cancel` (set by the fan-out when the
    engines' side failed) long before its timeout; without `cancel`, a timeout naming the wait."""
    with never_received(timeout_s=3) as (sender, tensors, update_info, cancel):
        with pytest.raises(WeightTransferCancelled, match="another party of the transfer failed"):
            sender.broadcast(tensors, update_info, cancel)
        with pytest.raises(WeightTransferTimeout, match=r"rank 0 of 2\): sending chunk 1/1 .* within 3 s"):
            sender.broadcast(tensors, update_info)


def test_rank_zero_join_times_out_when_no_engine_comes():
    sender = GlooWeightSender("127.0.0.1", 2, timeout_s=2)
    try:
        with pytest.raises(WeightTransferTimeout, match=r"rank 0 of 2\): forming the group .*waiting for clients"):
            sender.join()
    finally:
        sender.close()


@pytest.mark.anyio
async def test_a_fixed_port_is_waited_for_until_the_last_groups_stuck_send_runs_out():
    """A group closed while its send is stuck on a member that died (CI, case 13: an engine killed
    mid-sync) keeps its port until that send runs out, gloo's timeout after it began; the next
    group on the fixed port waits for exactly that release, where a wait of `timeout_s` counted
    from the retry lost the race and ended the run (EADDRINUSE, "still held after 60 s")."""
    with never_received(timeout_s=3) as (sender, tensors, update_info, cancel):
        began = time.monotonic()
        with pytest.raises(WeightTransferCancelled):
            sender.broadcast(tensors, update_info, cancel)
        sender.close()
        port = sender.port
        assert releasing(port) and not port_is_free("127.0.0.1", port)
        # Another holder's wait (the rest of timeout_s) would not cover it: the release is waited for.
        await wait_port_released("127.0.0.1", port, 0.5)
        released_s = time.monotonic() - began
        assert not releasing(port) and port_is_free("127.0.0.1", port)
        assert 2.5 < released_s < 3 + 2, released_s  # the stuck send's 3 s timeout, not before


@pytest.mark.anyio
async def test_a_fixed_port_held_by_another_process_is_named():
    with listen_on("127.0.0.1") as other:  # another holder: not a group this process released
        port = other.getsockname()[1]
        assert not releasing(port)
        with pytest.raises(WeightTransferError, match=rf"bridge.port: port {port} on 127.0.0.1 .* still held after 0.3 s"):
            await wait_port_released("127.0.0.1", port, 0.3)


@pytest.mark.anyio
async def test_a_kept_broadcast_error_does_not_keep_the_group_or_its_port():
    """The daemon keeps a failed sync's error (its cause chain holds rank 0's): its traceback held
    the send's pending works, they the closed group and its store, and the store a fixed
    `bridge.port` for as long as the error lived (CI, fault case 13: "still held after 60 s")."""
    tensors = [("big", torch.zeros(64 << 20, dtype=torch.uint8))]
    sender = GlooWeightSender("127.0.0.1", 2, chunk_bytes=1 << 20, timeout_s=5)
    update_info = sender.update_info(tensor_metadata(tensors))
    peer = joined("idle", sender, update_info)
    killer = threading.Timer(0.3, peer.proc.kill)  # our own child, by its PID
    killer.start()
    try:
        with pytest.raises(WeightTransferError) as failure:
            sender.broadcast(tensors, update_info)
        sender.close()
        await wait_port_released("127.0.0.1", sender.port, 2)
        assert port_is_free("127.0.0.1", sender.port) and failure.value.__traceback__ is not None
    finally:
        killer.cancel()
        peer.close()
        sender.close()
