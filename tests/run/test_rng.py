"""A captured RNG state, stored as JSON, brings back exactly the same random streams."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from grpod.run.checkpoint import load_json, save_json
from grpod.run.rng import RngStateError, capture_rng, restore_rng


def _draw() -> dict[str, list[float]]:
    return {
        "python": [random.random() for _ in range(5)] + [random.gauss(0, 1) for _ in range(3)],
        "numpy": np.random.rand(5).tolist() + np.random.randn(3).tolist(),
        "torch": torch.rand(5).tolist() + torch.randn(3).tolist() + torch.randint(0, 1000, (4,)).tolist(),
    }


def test_round_trip_through_json_reproduces_every_stream(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # Leave a cached gaussian in python's and numpy's generators: it is part of the state.
    random.gauss(0, 1)
    np.random.randn(1)

    save_json(tmp_path, "rng.json", capture_rng())
    expected = _draw()
    _draw()  # move every stream further on
    restore_rng(load_json(tmp_path, "rng.json"))

    assert _draw() == expected


def test_a_restored_state_differs_from_continuing(tmp_path: Path) -> None:
    state = capture_rng()
    first = _draw()
    second = _draw()
    assert first != second
    restore_rng(json.loads(json.dumps(state)))
    assert _draw() == first


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.update(format=99),
        lambda s: s.pop("numpy"),
        lambda s: s.update(torch_cpu="not base64!"),
        lambda s: s["python"].update(internal=[1, 2, 3]),
    ],
    ids=["format", "missing-numpy", "bad-torch-bytes", "short-python-state"],
)
def test_a_damaged_state_is_refused_with_a_clear_error(damage) -> None:
    state = capture_rng()
    damage(state)
    with pytest.raises(RngStateError):
        restore_rng(state)


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(RngStateError, match="not written by capture_rng"):
        restore_rng(["nope"])
