import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory) -> Path:
    """The tiny built-in model after its supervised warm-up (built once per test session).

    GRPOD_TEST_WARM_MODEL may name an already built one (a developer's shortcut; CI builds it).
    """
    prebuilt = os.environ.get("GRPOD_TEST_WARM_MODEL")
    if prebuilt:
        return Path(prebuilt)
    from grpod.models.tiny import init_model

    out = tmp_path_factory.mktemp("warm-model") / "tiny-arith"
    init_model(out, seed=0)
    return out
