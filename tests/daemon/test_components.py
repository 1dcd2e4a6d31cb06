"""The wiring: N engines of one node, each with its own port, log, launch record and cores."""

from grpod.config import load_config
from grpod.daemon.components import build_bridge, build_engines


def test_two_engines_get_their_own_port_log_record_and_core(tmp_path):
    cfg = load_config(None, [f"run.dir={str(tmp_path)!r}", "inference.engines=2", "inference.port=18000"])
    engines = build_engines(cfg, tmp_path)
    assert [e.name for e in engines] == ["engine-0", "engine-1"]
    first, second = (e.process for e in engines)
    assert (first.fixed_port, second.fixed_port) == (18000, 18001)
    assert (first.log_path.name, second.log_path.name) == ("vllm.log", "vllm-1.log")
    assert first._record.path.name == "vllm.launch.json" and second._record.path.name == "vllm-1.launch.json"
    assert first.build_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert second.build_env()["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "--port" in first.build_args(tmp_path) and str(18001) in second.build_args(tmp_path)


def test_one_engine_keeps_vllms_own_binding_and_listed_binds_win(tmp_path):
    one = build_engines(load_config(None, [f"run.dir={str(tmp_path)!r}"]), tmp_path)
    assert len(one) == 1 and "VLLM_CPU_OMP_THREADS_BIND" not in one[0].process.build_env()
    listed = load_config(None, [f"run.dir={str(tmp_path)!r}", "inference.engines=2", 'inference.cpu_binds=["0-1", "0-1"]'])
    assert [e.process.build_env()["VLLM_CPU_OMP_THREADS_BIND"] for e in build_engines(listed, tmp_path)] == ["0-1", "0-1"]


def test_the_bridge_and_its_policy_hold_every_engine(tmp_path):
    cfg = load_config(None, [f"run.dir={str(tmp_path)!r}", "inference.engines=3"])
    bridge = build_bridge(cfg, tmp_path, build_engines(cfg, tmp_path))
    assert len(bridge.engines) == 3 and bridge.policy.engines == bridge.engines
    assert [e["name"] for e in bridge.describe()["engines"]] == ["engine-0", "engine-1", "engine-2"]


def test_the_daemon_reaches_its_engine_launch_without_importing_the_trainer_stack(tmp_path):
    """Start-up launches the engines while the trainer's thread imports torch and transformers
    (~6 s here): nothing the supervisor runs before the launch may import them, or the launch
    waits for the imports. A fresh interpreter does what `grpod start` does up to the launch."""
    import subprocess
    import sys

    script = f"""
import sys
from pathlib import Path
from grpod.config import load_config
from grpod.daemon.components import build_bridge, build_engines, trainer_builder, trainer_world
from grpod.service.logs import configure_logging
from grpod.daemon.supervisor import Supervisor
from grpod.run.store import RunStore
cfg = load_config(None, ["run.dir={str(tmp_path)!r}"])
Supervisor(cfg)
configure_logging(Path({str(tmp_path)!r}), "warning")
store = RunStore(cfg, cfg.run.dir, build_trainer=trainer_builder(trainer_world()))
store.resume_point()
build_bridge(cfg, cfg.run.dir, build_engines(cfg, cfg.run.dir))
print(sorted(name for name in ("torch", "transformers", "peft", "vllm") if name in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
