from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory) -> Path:
    """The tiny built-in model after its supervised warm-up (built once per test session)."""
    from grpod.models.tiny import init_model

    out = tmp_path_factory.mktemp("warm-model") / "tiny-arith"
    init_model(out, seed=0)
    return out
