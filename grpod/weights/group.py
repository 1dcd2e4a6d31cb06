"""`GlooGroup`: one stateless gloo process group between a trainer (rank 0) and vLLM workers.

Both sides of the gloo weight transfer hold one: the trainer as rank 0, each engine worker at its
own rank. The group is vLLM's `stateless_init_torch_distributed_process_group`, so it never
touches torch's global process group (a trainer under torchrun keeps its own).

Guarantees:
- Forming the group and every collective are bounded by `timeout_s` (gloo's own per-operation
  timeout, fixed when the group is formed); a wait that runs out raises `WeightTransferTimeout`
  naming the group, the rank and what was being waited for. Any other collective failure raises
  `WeightTransferError` with the same context. Measured: a receiver whose sender died sees
  "Connection closed by peer" at once; a sender whose receiver died sometimes sees it at once,
  sometimes only at the timeout ("Timed out waiting ... for send operation to complete").
- Rank 0 always forms the group on a socket it bound and listens on itself (`listen_socket=`).
  Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) torch's rendezvous would otherwise make
  rank 0 a store *client* of a store nobody serves, and the group would hang until its timeout
  (measured: 300 s). Binding first also removes the race between picking a free port and using it.
- Collectives are the ProcessGroup's own `broadcast` with group ranks: the stateless group is
  not registered with torch.distributed, so `torch.distributed.broadcast(group=...)` (which maps
  global ranks) cannot be used on it.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch


class WeightTransferError(RuntimeError):
    """A weight-transfer group could not be formed, or a collective on it failed."""


class WeightTransferTimeout(WeightTransferError):
    """A wait on the weight-transfer group ran past its timeout."""


class WeightTransferCancelled(WeightTransferError):
    """A wait was given up because its caller asked (`cancel` set): another party of the transfer
    already failed."""


# A wait polls in slices this long, so that a cancel is noticed: gloo gives no other way to
# interrupt a pending collective (pg.abort() and pg.shutdown() do not), and a wait whose slice
# runs out leaves its work running (a later wait on it still completes it). Measured on torch
# 2.13, one exception: a send to a receiver that died can block a slice's wait until gloo's own
# timeout (the group's `timeout_s`), so a cancel is not always noticed within a slice; callers
# that must not wait that long abandon the waiting thread (`WeightGroup` does).
WAIT_SLICE_S = 0.2


def listen_on(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


class GlooGroup:
    """A formed gloo group; `close()` it (idempotent) when done."""

    def __init__(self, pg, *, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self._pg = pg
        self.host = host
        self.port = port
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        listen_socket: socket.socket | None = None,
    ) -> GlooGroup:
        """Form (rank 0, on `listen_socket`, which the group's store takes over) or join (ranks
        > 0) the group at `host:port`. Blocks until every rank arrived, or `timeout_s`."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if (rank == 0) != (listen_socket is not None):
            raise ValueError("rank 0, and only rank 0, forms the group on its own listening socket")
        where = f"gloo group tcp://{host}:{port} (rank {rank} of {world_size})"
        try:
            pg = stateless_init_torch_distributed_process_group(
                host,
                port,
                rank,
                world_size,
                "gloo",
                listen_socket=listen_socket,
                timeout=timedelta(seconds=timeout_s),
            )
        except Exception as exc:
            raise _error(f"{where}: forming the group", timeout_s, exc) from exc
        return cls(pg, host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s)

    def __repr__(self) -> str:
        return f"GlooGroup(tcp://{self.host}:{self.port}, rank {self.rank} of {self.world_size})"

    def broadcast(self, tensor: torch.Tensor) -> torch.distributed.Work:
        """Start broadcasting `tensor` from rank 0 (rank 0 sends it, the others receive into it);
        `wait` on the returned work. Works complete in the order they were started."""
        if self._pg is None:
            raise WeightTransferError(f"{self!r} is closed")
        return self._pg.broadcast(tensor, 0)

    def wait(self, work: torch.distributed.Work, what: str, cancel: threading.Event | None = None) -> None:
        """Wait for `work` at most `timeout_s`, or until `cancel` is set; `what` names it in the
        error."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if cancel is not None and cancel.is_set():
                raise WeightTransferCancelled(f"{self!r}: {what}: given up, another party of the transfer failed")
            left = deadline - time.monotonic()
            try:
                work.wait(timedelta(seconds=max(0.001, min(WAIT_SLICE_S, left))))
                return
            except Exception as exc:
                if work.is_completed() or left <= WAIT_SLICE_S:
                    # Failed (a dead peer), or the whole timeout ran out.
                    raise _error(f"{self!r}: {what}", self.timeout_s, exc) from exc

    def close(self) -> None:
        """Drop this end of the group without blocking the caller. Peers still waiting on it are
        not told: they fail by their timeout, or at once when this process exits.

        Measured on torch 2.13: `abort()` makes this side's pending waits fail at once, but
        neither `abort()` nor `shutdown()` ends an operation stuck on a silent or dead peer, and
        the group's destructor (and `shutdown()`) wait for it until gloo's timeout. So the last
        reference goes to a short-lived thread, which ends by that timeout at the latest: a
        caller on an event loop never waits on it. Not a daemon thread: a process that exits
        meanwhile waits for it (at most `timeout_s`), where a daemon thread inside the
        destructor would end the process with SIGABRT ("terminate called without an active
        exception", measured).
        """
        if self._pg is None:
            return
        holder, self._pg = [self._pg], None  # the only reference from here on
        holder[0].abort()
        threading.Thread(target=_release, args=(holder,), name=_releaser_name(self.port)).start()

    @property
    def closed(self) -> bool:
        return self._pg is None


def _releaser_name(port: int) -> str:
    """The name of the thread that releases a group closed on `port` (`releasing` looks it up)."""
    return f"grpod-gloo-release-{port}"


def releasing(port: int) -> bool:
    """Whether a group this process closed on `port` is still being released, and holds the port
    (the store's listening socket goes with the group's destructor): that destructor waits out an
    operation stuck on a dead or silent peer, gloo's timeout after that operation began at the
    latest (measured: the port is free within 10 ms of that)."""
    name = _releaser_name(port)
    return any(thread.name == name for thread in threading.enumerate())


def _release(holder: list) -> None:
    holder.clear()  # the group's destructor runs here, waiting out a stuck operation


def _error(what: str, timeout_s: float, exc: BaseException) -> WeightTransferError:
    """A typed error for a failure of torch/gloo, classified by its root cause.

    The cause can hide behind a later exception: when rank 0's store times out waiting for the
    engines, vLLM's `create_tcp_store` (vllm/distributed/utils.py) closes the listening fd that
    the failed TCPStore already closed, and raises `OSError: Bad file descriptor` in place of
    torch's "Timed out ... waiting for clients". So the whole chain is read.
    """
    texts = []
    seen: BaseException | None = exc
    while seen is not None and len(texts) < 8:
        text = str(seen).strip()
        texts.append(text.splitlines()[0] if text else type(seen).__name__)
        seen = seen.__cause__ or seen.__context__
    if any("timed out" in t.lower() or "timeout" in t.lower() for t in texts):
        root = next(t for t in texts if "timed out" in t.lower() or "timeout" in t.lower())
        return WeightTransferTimeout(f"{what} did not complete within {timeout_s:g} s ({root})")
    return WeightTransferError(f"{what} failed: {' <- '.join(texts)}")
