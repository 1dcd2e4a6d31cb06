"""The trainer's side without vLLM: payloads (gloo and NCCL), rank offsets, and `WeightGroup` over
stand-in engines that speak vLLM's weight-transfer routes.

A stand-in engine (`StubEngine`) is a small aiohttp server running the real
`GlooWeightTransferEngine` join and receive loop in this process (rank 1 next to rank 0), with a
recording stand-in for the model; it can be told to refuse a route. Real vLLM: the e2e module.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from types import SimpleNamespace

import anyio
import pytest
import torch
from aiohttp import web

from grpod.inference.release import free_port
from grpod.weights.gloo_engine import GlooWeightTransferEngine, UpdateRecord
from grpod.weights.transfer import (
    EngineFanoutError,
    EngineWeightClient,
    GlooWeightSender,
    NcclWeightSender,
    TransferConfig,
    TransportUnavailable,
    WeightTransferError,
    engine_launch_args,
    iter_state,
    make_sender,
    open_weight_group,
    rank_offsets,
    tensor_metadata,
)
from grpod.weights.wire import GlooInitInfo, GlooUpdateInfo


def test_rank_offsets_follow_each_engines_workers():
    assert rank_offsets([1]) == [1]
    assert rank_offsets([1, 1]) == [1, 2]
    assert rank_offsets([2, 4, 1]) == [1, 3, 7]  # an engine with TP 2, one with TP 2 x DP 2, one plain
    with pytest.raises(ValueError):
        rank_offsets([1, 0])


def test_launch_args_and_config():
    assert engine_launch_args() == ["--weight-transfer-config", '{"backend": "gloo"}']
    assert engine_launch_args("nccl")[1] == '{"backend": "nccl"}'
    with pytest.raises(ValueError, match="chunk_byte"):
        TransferConfig(chunk_byte=1)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_gloo_sender_binds_at_construction_and_builds_engine_payloads():
    sender = GlooWeightSender("127.0.0.1", 3, chunk_bytes=1000, timeout_s=7, inflight_chunks=3)
    try:
        assert listening(sender.port), "rank 0 listens before any engine is told the port"
        info = GlooInitInfo(**sender.engine_init_info(2))
        assert (info.master_address, info.master_port, info.rank_offset, info.world_size) == ("127.0.0.1", sender.port, 2, 3)
        assert (info.timeout_s, info.inflight_chunks) == (7, 3)
        update = GlooUpdateInfo(**sender.update_info([("a", torch.float32, (10, 30)), ("b", torch.bfloat16, (4,))]))
        assert update.chunk_counts == [1, 1] and update.dtype_names == ["float32", "bfloat16"]
    finally:
        sender.close()
    assert not listening(sender.port)


def test_nccl_sender_builds_vllm_nccl_payloads():
    """The `nccl` transport's argument building, checked against vLLM's own NCCL dataclasses. Its
    group and broadcast need CUDA and have not run here."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    sender = make_sender(TransferConfig(transport="nccl", chunk_bytes=1 << 20, inflight_chunks=2, timeout_s=30), world_size=3)
    try:
        assert isinstance(sender, NcclWeightSender) and listening(sender.port)
        payload = sender.engine_init_info(rank_offset=2)
        assert "nccl_unique_id_b64" not in payload  # the TCP rendezvous, not a pre-shared id
        info = NCCLWeightTransferInitInfo(**payload)  # what the engine's parse_init_info does
        assert (info.master_address, info.master_port, info.rank_offset, info.world_size) == ("127.0.0.1", sender.port, 2, 3)
        assert (info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) == (True, 1 << 20, 2)
        update = NCCLWeightTransferUpdateInfo(**sender.update_info([("w", torch.bfloat16, (2, 3))]))
        assert (update.names, update.dtype_names, update.shapes) == (["w"], ["bfloat16"], [[2, 3]])
        if not torch.cuda.is_available():
            with pytest.raises(TransportUnavailable, match="needs CUDA"):
                sender.join()
    finally:
        sender.close()


def test_a_failed_nccl_broadcasts_error_holds_nothing_of_the_producer(monkeypatch):
    """A failed NCCL broadcast raises an error that keeps none of the producer's frames, which
    hold its communicator (and with it the group's store and port), for as long as the daemon
    keeps the error: the fix of a failed gloo broadcast's kept error (test_group), applied to NCCL.
    NCCL itself needs CUDA: only its producer's failure is stood in for here."""
    import gc
    import weakref

    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    class Communicator:
        def destroy(self) -> None:
            pass

    def failing_producer(*, group, **_):
        raise RuntimeError(f"NCCL error: remote process exited ({type(group).__name__})")

    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", failing_producer)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    sender = NcclWeightSender("127.0.0.1", 2, timeout_s=5)
    try:
        sender.communicator = Communicator()
        communicator = weakref.ref(sender.communicator)
        with pytest.raises(WeightTransferError, match="broadcast failed: .*NCCL error: remote process exited") as failure:
            sender.broadcast([("w", torch.zeros(4))], {})
        kept = failure.value
        assert kept.__cause__ is None and kept.__context__ is None
        sender.communicator = None  # what closing the sender does
        gc.collect()
        assert communicator() is None, "the kept error still holds the communicator"
    finally:
        sender.close()


def test_iter_state_leaves_out_a_tied_head():
    from grpod.models.tiny import build_model

    untied, _ = build_model(seed=0)
    tied, _ = build_model(seed=0, tie_word_embeddings=True)
    assert "lm_head.weight" in dict(iter_state(untied))
    names = [name for name, _ in iter_state(tied)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


# -- WeightGroup over stand-in engines ---------------------------------------------------------

class StubEngine:
    """vLLM's weight-transfer routes over the real gloo engine's join and receive loop, with the
    update-session rules of vLLM's worker (`vllm/v1/worker/gpu_worker.py`): no start while a
    session is open, no update or finish without one, no release during one; a failed update
    closes it. `refuse` answers that route with an error; `fail_after_receive` makes the update
    receive everything and then fail (an engine that dies after the broadcast reached it)."""

    def __init__(self, refuse: str | None = None, fail_after_receive: bool = False) -> None:
        self.refuse = refuse
        self.fail_after_receive = fail_after_receive
        self.session = False
        self.one_at_a_time = anyio.Lock()
        self.calls: list[str] = []
        self.versions: list[str | None] = []
        self.received: dict[str, torch.Tensor] = {}
        engine = object.__new__(GlooWeightTransferEngine)
        engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        engine.group = None
        engine.model = SimpleNamespace(load_weights=lambda weights: self.received.update((n, t.clone()) for n, t in weights))
        self.engine = engine

    async def handle(self, request: web.Request) -> web.Response:
        # One call at a time, in arrival order, as vLLM's EngineCore runs its workers' calls.
        async with self.one_at_a_time:
            return await self._handle(request)

    async def _handle(self, request: web.Request) -> web.Response:
        route = request.path
        self.calls.append(route)
        if route == self.refuse:
            if route == "/update_weights":
                self.session = False  # as vLLM's worker does when an update fails
                self.engine.shutdown()  # as the gloo engine does
            return web.json_response({"error": f"refused {route}"}, status=500)
        body = await request.json() if request.can_read_body else {}
        if route == "/get_world_size":
            return web.json_response({"world_size": 1})
        refused = {
            "/start_weight_update": self.session and "a weight update is already active",
            "/update_weights": not self.session and "start_weight_update must be called before update_weights",
            "/finish_weight_update": not self.session and "finish_weight_update called without a matching start",
            "/shutdown_weight_transfer_engine": self.session and "cannot release during a weight update",
        }.get(route)
        if refused:
            return web.json_response({"error": refused}, status=500)
        if route == "/init_weight_transfer_engine":
            await anyio.to_thread.run_sync(self.engine.init_transfer_engine, GlooInitInfo(**body["init_info"]))
        elif route == "/start_weight_update":
            self.engine.start_weight_update()
            self.session = True
        elif route == "/update_weights":
            info = GlooUpdateInfo(**body["update_info"])
            try:
                await anyio.to_thread.run_sync(self.engine._receive_and_load, info, UpdateRecord())
            except BaseException:
                self.session = False
                raise
            if self.fail_after_receive:
                self.session = False
                self.engine.shutdown()
                return web.json_response({"error": "died after receiving"}, status=500)
        elif route == "/finish_weight_update":
            self.session = False
            self.versions.append(body.get("weight_version"))
        elif route == "/shutdown_weight_transfer_engine":
            self.engine.shutdown()
        return web.json_response({"message": "ok"})

    async def serve(self, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        app = web.Application()
        app.router.add_route("*", "/{route:.*}", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port("127.0.0.1")
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            task_status.started(f"http://127.0.0.1:{port}")
            await anyio.sleep_forever()
        finally:
            self.engine.shutdown()
            await runner.cleanup()


def tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [("a.weight", torch.randn(300, 100, generator=gen)), ("b.bias", torch.randn(7, generator=gen))]


@asynccontextmanager
async def serving(stubs: list[StubEngine]) -> AsyncIterator[list[EngineWeightClient]]:
    """The stand-ins served on free ports, with a client for each."""
    async with anyio.create_task_group() as group:
        urls = [await group.start(stub.serve) for stub in stubs]
        try:
            yield [EngineWeightClient(url, 30.0) for url in urls]
        finally:
            group.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_weight_group_syncs_every_engine_and_releases_them():
    stubs = [StubEngine(), StubEngine()]
    sent = tensors()

    async def body(weights) -> None:
        assert weights.rank_offsets == [1, 2] and weights.sender.world_size == 3
        timings = await weights.sync(sent, weight_version="7")
        assert timings.broadcast.chunks == 2 and timings.broadcast.bytes == sum(t.numel() * 4 for _, t in sent)

    async with serving(stubs) as clients, open_weight_group(clients, TransferConfig(chunk_bytes=1000, timeout_s=30)) as weights:
        await body(weights)
    for stub in stubs:
        assert stub.versions == ["7"]
        assert stub.calls[-1] == "/shutdown_weight_transfer_engine"
        for name, tensor in sent:
            assert torch.equal(stub.received[name], tensor)


@pytest.mark.anyio
@pytest.mark.timeout(15)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_engine_refusing_the_group_fails_formation_without_waiting_for_rank_zero():
    """Rank 0's join and the other engine's (20 s timeouts) are not waited for once an engine's
    init failed, nor is that engine's release, queued behind its blocked join (the stand-ins run
    one call at a time, as vLLM's EngineCore does): the test's own 15 s limit would end it first.
    (They end by their timeout in threads of this process, which its exit waits for.)"""
    stubs = [StubEngine(), StubEngine(refuse="/init_weight_transfer_engine")]

    async with serving(stubs) as clients:
        with pytest.raises(WeightTransferError, match="forming the weight-transfer group failed; engines: /init_weight_transfer_engine failed on 1 of 2 engines: http://127.0.0.1:\\d+: .*refused") as info:
            async with open_weight_group(clients, TransferConfig(timeout_s=20)):
                raise AssertionError("formed a group with an engine that refused it")
    assert isinstance(info.value.__cause__, EngineFanoutError)


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_engine_failing_its_update_stops_rank_zero_and_breaks_the_group():
    """The refusing engine never receives: rank 0's broadcast (300 s timeout) is given up at once
    (the test's own 60 s limit would end it first)."""
    stubs = [StubEngine(refuse="/update_weights")]
    big = [("big", torch.zeros(64 << 20, dtype=torch.uint8))]  # more than socket buffers hold

    async def body(weights) -> None:
        with pytest.raises(WeightTransferError, match="weight update to version 3 failed; engines: /update_weights failed on 1 of 1"):
            await weights.sync(big, weight_version="3")
        assert weights.broken
        with pytest.raises(WeightTransferError, match="broken"):
            await weights.sync(big, weight_version="4")

    async with serving(stubs) as clients, open_weight_group(clients, TransferConfig(timeout_s=300)) as weights:
        await body(weights)
    assert stubs[0].versions == []


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_engine_that_received_a_failed_sync_is_released_and_syncs_in_the_next_group():
    """Engine B fails its update after receiving it; A completed its own, so its update session is
    still open when the sync fails. The broken group's release finishes that session, so A lets
    itself be released and a new group over A alone (the bridge's retry without B) syncs."""
    a, b = StubEngine(), StubEngine(fail_after_receive=True)
    sent = tensors()
    async with serving([a, b]) as clients:
        with pytest.raises(WeightTransferError, match="weight update to version 1 failed; engines: /update_weights failed on 1 of 2"):
            async with open_weight_group(clients, TransferConfig(timeout_s=30)) as weights:
                await weights.sync(sent, weight_version="1")
        assert not a.session and a.calls[-2:] == ["/finish_weight_update", "/shutdown_weight_transfer_engine"]
        assert a.engine.group is None  # released, not only finished
        async with open_weight_group(clients[:1], TransferConfig(timeout_s=30)) as weights:
            await weights.sync(sent, weight_version="1")
    assert a.versions == [None, "1"]
    for name, tensor in sent:
        assert torch.equal(a.received[name], tensor)


def test_metadata_is_what_the_update_info_describes():
    sent = tensors()
    assert tensor_metadata(sent) == [("a.weight", torch.float32, (300, 100)), ("b.bias", torch.float32, (7,))]
    assert asdict(GlooUpdateInfo.plan(tensor_metadata(sent), 10))["chunk_counts"] == [1, 1]
