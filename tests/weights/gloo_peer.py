"""An engine worker's side of the gloo transfer without vLLM: the peer process of test_group.py.

    python gloo_peer.py MODE   (then one JSON line on stdin: {"init_info": ..., "update_info": ...})

It prints "@@ " + {"ready": true} once imported (so a test's short timeouts do not count the
import), then {"joined": true} once in the group.

Runs the real `GlooWeightTransferEngine` join and receive loop, with a stand-in for the model
that records what `load_weights` is given (the layerwise reload around it is vLLM's, tested e2e).
MODE:
- receive: join, receive the update, print "@@ " + JSON {name: [dtype, shape, sum of the values]}.
- die: join, receive, and exit hard (os._exit) inside the first `load_weights`.
- idle: join, then wait until stdin closes without receiving anything.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from grpod.weights.gloo_engine import GlooWeightTransferEngine, UpdateRecord
from grpod.weights.wire import GlooInitInfo, GlooUpdateInfo, dtype_name


class RecordingModel:
    def __init__(self, die: bool) -> None:
        self.die = die
        self.seen: dict[str, list] = {}

    def load_weights(self, weights) -> None:
        if self.die:
            os._exit(17)
        for name, tensor in weights:
            self.seen[name] = [dtype_name(tensor.dtype), list(tensor.shape), float(tensor.double().sum())]


def main() -> None:
    mode = sys.argv[1]
    message = json.loads(sys.stdin.readline())
    # The engine without vLLM's config: only what the join and the receive loop read.
    engine = object.__new__(GlooWeightTransferEngine)
    engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    engine.group = None
    engine.model = RecordingModel(die=mode == "die")
    print("@@ " + json.dumps({"ready": True}), flush=True)  # imports done: joins within the timeout
    engine.init_transfer_engine(GlooInitInfo(**message["init_info"]))
    print("@@ " + json.dumps({"joined": True}), flush=True)
    if mode == "idle":
        sys.stdin.read()
        return
    engine._receive_and_load(GlooUpdateInfo(**message["update_info"]), UpdateRecord())
    print("@@ " + json.dumps(engine.model.seen), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
