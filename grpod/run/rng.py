"""Capture and restore every random stream training draws from, so a resumed run continues them.

Covers python `random`, numpy's global generator and torch (CPU, and every CUDA device when CUDA
is available). The captured state is plain JSON (ints, strings, lists), so it goes into a
checkpoint with `checkpoint.save_json` and needs no pickle to come back. torch is imported where it
is used: the run store (and the supervisor importing it) starts without it, so the engines launch
while the trainer thread imports torch.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

RNG_FORMAT = 1


class RngStateError(ValueError):
    """A saved RNG state that cannot be restored (wrong format or damaged)."""


def _bytes_to_text(state) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _text_to_bytes(text: str):
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """The current state of every random stream, as JSON-serialisable data."""
    import torch

    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    cuda = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {
        "format": RNG_FORMAT,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_cpu": _bytes_to_text(torch.get_rng_state()),
        "torch_cuda": cuda,
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what `capture_rng` returned. CUDA streams are restored only when the device count
    matches; otherwise a warning says they were left as they are."""
    import torch

    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RngStateError(f"RNG state format {found!r} is not {RNG_FORMAT}; it was not written by capture_rng")
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
        npy = state["numpy"]
        keys = np.asarray(npy["keys"], dtype=np.uint32)
        np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
        torch.set_rng_state(_text_to_bytes(state["torch_cpu"]))
        cuda = [_text_to_bytes(text) for text in state.get("torch_cuda", [])]
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise RngStateError(f"saved RNG state is damaged and cannot be restored: {exc!r}") from None
    if not cuda:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available != len(cuda):
        log.warning("cuda_rng_not_restored", saved_devices=len(cuda), available_devices=available)
        return
    torch.cuda.set_rng_state_all(cuda)
