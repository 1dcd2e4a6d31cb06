"""A trainer rank 0 that dies mid-update: the child process of the dying-sender e2e case.

    python dying_sender.py TENSORS_PT HOST WORLD_SIZE CHUNK_BYTES SEND_CHUNKS TIMEOUT_S

Talks to its parent in lines on stdout that start with "@@ " (JSON) and lines on stdin:
1. binds rank 0's socket, prints {"init_info": ..., "update_info": ...} (update info of ALL the
   tensors in TENSORS_PT, a `torch.save`d list of (name, tensor));
2. forms the group (the parent inits the engine meanwhile), prints {"joined": true};
3. on a "go" line, broadcasts the first SEND_CHUNKS chunks of that update and prints
   {"sent_chunks": SEND_CHUNKS}; then waits on stdin for the SIGKILL the parent sends it.
"""

from __future__ import annotations

import json
import sys

import torch

from grpod.weights.transfer import GlooWeightSender, tensor_metadata


def say(**message) -> None:
    print("@@ " + json.dumps(message), flush=True)


def main() -> None:
    path, host, world_size, chunk_bytes, send_chunks, timeout_s = sys.argv[1:]
    named = torch.load(path)
    sender = GlooWeightSender(host, int(world_size), chunk_bytes=int(chunk_bytes), timeout_s=float(timeout_s))
    full = sender.update_info(tensor_metadata(named))
    counts = full["chunk_counts"]
    if int(send_chunks) >= len(counts):
        raise SystemExit(f"asked to send {send_chunks} chunks of {len(counts)}: that is no partial update")
    say(init_info=sender.engine_init_info(1), update_info=full)
    sender.join()
    say(joined=True)
    assert sys.stdin.readline().strip() == "go"
    first = named[: sum(counts[: int(send_chunks)])]
    part = sender.update_info(tensor_metadata(first))
    # The greedy chunking of a prefix cut at a chunk boundary is the prefix of the chunking.
    assert part["chunk_counts"] == counts[: int(send_chunks)], (part["chunk_counts"], counts)
    sender.broadcast(first, part)
    say(sent_chunks=int(send_chunks))
    sys.stdin.readline()  # killed here


if __name__ == "__main__":
    main()
