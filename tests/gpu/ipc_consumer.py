"""A stand-in for vLLM's worker in bridge mode `shared`: it maps the trainer's weights through
grpod's CUDA IPC handle and reads them, nothing more. Imports torch and grpod's weight-sharing
module only (no vLLM, no transformers).

Protocol: one JSON request per stdin line, one JSON answer per stdout line; EOF on stdin ends it.
  {"op": "attach", "dir": D}        -> {"pid", "numel", "nbytes", "free_drop", "allocated", "same_device"}
  {"op": "read", "indices": [...]}  -> {"values": [...], "sum": float}
It writes {"ready": true} once its CUDA context exists and its kernels are loaded (so `attach`
measures the mapping alone).
"""

import json
import os
import sys

import torch

from grpod.weights.shared_layout import SharedLayout, device_uuid, open_shared_buffer


def main() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    torch.cuda.init()
    torch.cuda.mem_get_info()  # creates the context: its memory is not the mapping's
    # The kernels `attach` and `read` run are loaded on their first launch (CUDA loads modules
    # lazily), which takes device memory too (94 MiB on an H200): run them once here, on a
    # tensor of our own, so that `attach` measures the mapping alone. The allocator keeps the
    # freed block for the small results later.
    warm = torch.ones(1 << 23, device="cuda")
    warm.sum().item()
    warm.double().sum().item()
    warm[torch.tensor([0, 1], dtype=torch.long, device="cuda")].tolist()
    del warm
    torch.cuda.synchronize()
    answers.write(json.dumps({"ready": True}) + "\n")
    flat = None
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "attach":
            directory = request["dir"]
            layout = SharedLayout.load(directory)
            free_before = torch.cuda.mem_get_info()[0]
            flat = open_shared_buffer(directory, layout)
            flat.sum().item()  # touch every element
            torch.cuda.synchronize()
            answer = {
                "pid": os.getpid(),
                "numel": flat.numel(),
                "nbytes": flat.numel() * flat.element_size(),
                "free_drop": free_before - torch.cuda.mem_get_info()[0],
                "allocated": torch.cuda.memory_allocated(),
                "same_device": device_uuid(flat.device) == layout.device_uuid,
            }
        elif request["op"] == "read":
            index = torch.tensor(request["indices"], dtype=torch.long, device=flat.device)
            answer = {"values": flat[index].tolist(), "sum": flat.double().sum().item()}
        else:
            answer = {"error": f"unknown op {request['op']!r}"}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
