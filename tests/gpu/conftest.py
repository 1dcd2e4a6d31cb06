"""The GPU suite (`-m gpu`): grpod's own CUDA code on one real device, without vLLM.

Every test here is marked `gpu` and, where torch sees no CUDA device, skipped with the reason
"no CUDA device": on a CPU machine the suite is reported as skipped, never as passed, and costs
nothing. On a GPU machine run it with `bash tests/gpu/run.sh` (it installs the wheels that travel
with the tree and needs no network).
"""

from __future__ import annotations

import select
import subprocess
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# A child process that does not answer within this long is a failure, never a hang.
ANSWER_TIMEOUT_S = 120.0


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="no CUDA device") if not torch.cuda.is_available() else None
    for item in items:
        if Path(item.path).is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)
            if no_cuda is not None:
                item.add_marker(no_cuda)


def read_line(proc: subprocess.Popen, timeout_s: float = ANSWER_TIMEOUT_S) -> str:
    """The next line `proc` writes on stdout, waiting at most `timeout_s` (then `proc` is killed)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait(timeout=30)
        raise TimeoutError(
            f"child pid {proc.pid} wrote no line within {timeout_s:g} s (exit code {proc.returncode}); "
            "its stderr is in the test's captured output"
        )
    return line


def stop_child(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """Close `proc`'s stdin (its signal to exit) and reap it; killed if it outlives `timeout_s`."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=timeout_s)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """grpod's tiny built-in model (random init, seed 0) saved as an HF directory: no download."""
    from grpod.models.tiny import build_model, save_model

    out = tmp_path_factory.mktemp("gpu-tiny") / "tiny"
    save_model(*build_model(seed=0), out)
    return out
