"""The two LoRA modes without vLLM: their state tables, docstrings, and what vLLM is launched with.

grpod/bridges/lora_only.py and grpod/bridges/lora_restart.py; the runs against a real vLLM are in
tests/e2e/test_lora_bridges.py.
"""

from __future__ import annotations

import re

import anyio
import pytest

from grpod.bridges import lora_only, lora_restart
from grpod.bridges.lora_only import LoraOnlyBridge
from grpod.bridges.lora_restart import LoraRestartBridge
from grpod.bridges.machine import IllegalTransition, StateMachine
from grpod.config import GrpodConfig
from grpod.daemon.components import build_bridge, build_engines
from grpod.models.tiny import build_model, save_model
from grpod.training.trainer import build_trainer

MODES = {"lora_only": (lora_only, "SWAPPING"), "lora_restart": (lora_restart, "RESTARTING")}
ROW = re.compile(r"^\s{4}([A-Z_]+)\s+--([A-Z_]+)-*>\s+([A-Z_]+)", re.MULTILINE)


@pytest.fixture(params=sorted(MODES))
def mode(request):
    module, apply_state = MODES[request.param]
    return request.param, module, apply_state


def config(root, mode_name: str, **bridge) -> GrpodConfig:
    return GrpodConfig.model_validate(
        {
            "run": {"dir": str(root / "run")},
            "model": {"path": str(root / "model"), "init_if_missing": False},
            "train": {"lora": True, "threads": 1, "lora_config": {"rank": 4}},
            "bridge": {"mode": mode_name, **bridge},
        }
    )


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bridge-unit")
    model, tokenizer = build_model(seed=0)
    save_model(model, tokenizer, root / "model")
    return root


def test_sync_path_and_lifecycle(mode):
    name, module, apply_state = mode
    m = StateMachine(name, module.TABLE, module.State.IDLE)
    for event in ("START", "READY", "PROBE_OK", "SYNC", "SAVED"):
        m.fire(module.Event[event])
    assert m.state.name == apply_state
    m.fire(module.Event.APPLIED)
    m.fire(module.Event.PROBE_OK)
    assert m.state is module.State.SERVING
    m.fire(module.Event.LOST)
    m.fire(module.Event.RECOVERED)
    m.fire(module.Event.PROBE_FAIL, error="mismatch")
    assert m.state is module.State.FAILED and m.error == "mismatch"
    m.fire(module.Event.SYNC)
    assert m.state is module.State.SAVING


def test_every_state_can_stop_and_stopping_ends_in_stopped(mode):
    _, module, _ = mode
    for state in module.State:
        if state in (module.State.STOPPING, module.State.STOPPED):
            assert (state, module.Event.STOP) not in module.TABLE
        else:
            assert module.TABLE[(state, module.Event.STOP)] is module.State.STOPPING
    assert module.TABLE[(module.State.STOPPING, module.Event.STOPPED)] is module.State.STOPPED
    assert not any(source is module.State.STOPPED for source, _ in module.TABLE), "STOPPED is final"


@pytest.mark.parametrize(
    ("state", "event"),
    [("IDLE", "SYNC"), ("SAVING", "SYNC"), ("SERVING", "APPLIED"), ("PROBING", "SAVED"), ("STOPPED", "START"),
     ("FAILED", "LOST"), ("LAUNCHING", "PROBE_OK")],
)  # fmt: skip
def test_illegal_transitions_are_refused(mode, state, event):
    name, module, _ = mode
    m = StateMachine(name, module.TABLE, module.State[state])
    with pytest.raises(IllegalTransition, match=f"event {event} is not allowed in state {state}"):
        m.fire(module.Event[event])
    assert m.state is module.State[state] and m.history == []


def test_the_docstring_prints_the_table(mode):
    """Each row the docstring shows is in the table, and each table row is shown (the `any` rows
    stand for FAIL and STOP from every state)."""
    _, module, _ = mode
    documented = {(s, e, t) for s, e, t in ROW.findall(module.__doc__)}
    table = {(s.name, e.name, t.name) for (s, e), t in module.TABLE.items()}
    assert documented <= table, documented - table
    generic = {row for row in table if row[1] in ("FAIL", "STOP") or row == ("STOPPING", "STOPPED", "STOPPED")}
    assert table - generic <= documented, (table - generic) - documented
    assert "any         --FAIL------->  FAILED" in module.__doc__
    assert "any         --STOP------->  STOPPING --STOPPED--> STOPPED" in module.__doc__


def _bridge(cfg, run_dir, trainer, policy_version):
    return build_bridge(cfg, run_dir, build_engines(cfg, run_dir), trainer=trainer, policy_version=policy_version)


def test_build_bridge_builds_the_configured_mode(tmp_path, model_root):
    trainer = build_trainer(config(model_root, "lora_only"))
    for name, cls in (("lora_only", LoraOnlyBridge), ("lora_restart", LoraRestartBridge)):
        bridge = _bridge(config(model_root, name), tmp_path / name, trainer, policy_version=3)
        assert type(bridge) is cls and bridge.mode == name and bridge.policy.version == 3
        assert bridge.state == "IDLE"


def test_vllm_launches_on_the_base_with_the_current_adapter_preloaded(tmp_path, model_root, mode):
    name, _, _ = mode
    cfg = config(model_root, name, keep_adapters=2)
    trainer = build_trainer(cfg)
    bridge = _bridge(cfg, tmp_path / "run", trainer, policy_version=5)
    with pytest.raises(RuntimeError, match="before start"):
        bridge._served_name()
    stale = bridge.adapters.path_for(6)
    stale.mkdir(parents=True)  # left by an earlier run that synced past its last checkpoint

    model_path = anyio.run(bridge._initial_weights, None)

    assert model_path == cfg.model.path == bridge.current_weights
    assert bridge.policy.served_name == "policy-v5"
    assert bridge.adapter.path == tmp_path / "run" / "adapters" / "v000005"
    assert (bridge.adapter.path / "adapter_model.safetensors").exists()
    assert not stale.exists()
    kwargs = bridge._launch_kwargs()
    assert kwargs == {
        "enable_lora": True,
        "max_lora_rank": 8,
        "lora_target_modules": list(cfg.train.lora_config.target_modules),
        "lora_modules": {"policy-v5": str(bridge.adapter.path)},
    }
    argv = bridge.engines[0].process.build_args(model_path, **kwargs)
    assert argv[argv.index("--model") + 1] == str(cfg.model.path)
    assert argv[argv.index("--lora-modules") + 1] == f"policy-v5={bridge.adapter.path}"
    assert argv[argv.index("--max-lora-rank") + 1] == "8"
    assert bridge.describe()["adapter"] == {"name": "policy-v5", "version": 5, "path": str(bridge.adapter.path)}


def test_a_resumed_run_serves_the_checkpoints_adapter_without_the_trainer(tmp_path, model_root, mode):
    """Resuming, the engines launch on the checkpoint's adapter (hard-linked in as the current
    version) while the trainer is still loading: no trainer is needed to start them."""
    name, _, _ = mode
    cfg = config(model_root, name)
    checkpoint_adapter = tmp_path / "checkpoint" / "model"
    build_trainer(cfg).save_weights(checkpoint_adapter)
    bridge = _bridge(cfg, tmp_path / "run", None, policy_version=4)
    assert anyio.run(bridge._initial_weights, checkpoint_adapter) == cfg.model.path
    assert bridge.adapter.path == tmp_path / "run" / "adapters" / "v000004"
    assert bridge.policy.served_name == "policy-v4" and bridge.trainer is None
    written = bridge.adapter.path / "adapter_model.safetensors"
    assert written.read_bytes() == (checkpoint_adapter / "adapter_model.safetensors").read_bytes()
