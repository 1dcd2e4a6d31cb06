"""Bridge mode `shared` without vLLM: what it refuses before launching, its run-scoped /dev/shm
directory, and its transition table (the fenced sync path; the lifecycle rows are common)."""

from __future__ import annotations

import pytest

from grpod.bridges import shared
from grpod.bridges.machine import StateMachine
from grpod.config import GrpodConfig


def cfg(**sections) -> GrpodConfig:
    return GrpodConfig.model_validate({"bridge": {"mode": "shared"}, **sections})


def test_a_supported_cpu_configuration_passes():
    c = cfg()
    shared.check_supported(c.model, c.inference.enforce_eager, "cpu", False, 1)


def test_more_than_one_engine_is_refused():
    c = cfg()
    with pytest.raises(shared.SharedModeUnsupported, match="inference.engines = 1"):
        shared.check_supported(c.model, c.inference.enforce_eager, "cpu", False, 2)


@pytest.mark.parametrize(
    ("config", "device", "gpu", "message"),
    [
        (cfg(model={"dtype": "bfloat16"}), "cpu", False, r"model\.dtype = 'float32'.*not 'bfloat16'"),
        (cfg(inference={"enforce_eager": False}), "cpu", False, r"inference\.enforce_eager = true"),
        (cfg(), "cuda:0", False, r"same device: train\.device = 'cuda:0' but vLLM runs on the CPU"),
        (cfg(), "cpu", True, r"same device: train\.device = 'cpu' but vLLM runs on a GPU"),
    ],
)
def test_unsupported_configurations_are_refused_naming_the_key(config, device, gpu, message):
    with pytest.raises(shared.SharedModeUnsupported, match=message):
        shared.check_supported(config.model, config.inference.enforce_eager, device, gpu, 1)


def test_the_shm_directory_is_scoped_to_the_run(tmp_path):
    first = shared.shared_dir(tmp_path / "run")
    assert first.parent == shared.SHM_ROOT and first.name.startswith("grpod-shared-")
    assert shared.shared_dir(tmp_path / "run" / ".." / "run") == first
    assert shared.shared_dir(tmp_path / "other") != first


def test_the_fenced_sync_path_and_the_docstring_table():
    m = StateMachine("shared", shared.TABLE, shared.State.IDLE)
    for event in ("START", "READY", "PROBE_OK", "SYNC", "SAVED"):
        m.fire(shared.Event[event])
    assert m.state is shared.State.FENCED
    m.fire(shared.Event.FAIL, error="pause failed")
    assert m.state is shared.State.FAILED
    m.fire(shared.Event.SYNC)  # an operator's retry
    assert m.state is shared.State.SAVING
    for row in ("SAVING      --SAVED------>  FENCED", "FENCED      --APPLIED---->  PROBING"):
        assert row in shared.__doc__
    for (source, event), target in shared.TABLE.items():
        if event.name not in ("FAIL", "STOP", "STOPPED"):
            assert f"{source.name:<11} --{event.name:-<11}>  {target.name}" in shared.__doc__, (source, event)
