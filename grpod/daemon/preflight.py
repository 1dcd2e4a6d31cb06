"""What this machine says about a config, checked by `grpod check-config` and by `grpod start`
before anything is launched: the run directory, the control socket, the model directory, the
trainer's device, a replay file, a fixed `bridge.port`. Parsing (`grpod.config`) checks what a
config means anywhere; these are the facts of one host, each refused as a ConfigError naming the
key, the path and why, where they used to surface as a traceback or an `OSError` after vLLM had
started.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from grpod.config import ConfigError, GrpodConfig
from grpod.daemon.control import socket_alive
from grpod.inference.release import port_is_free
from grpod.run.store import model_dir_problem


def check_host(cfg: GrpodConfig) -> None:
    """ConfigError with every problem found (one line each); nothing when the host can run `cfg`."""
    problems = [*_run_dir(cfg.run.dir), *_socket(cfg), *_device(cfg.train.device), *_fixed_ports(cfg)]
    if model := model_dir_problem(cfg.model):
        problems.append(model)
    problems += _builtin_eval_size(cfg)
    replay = getattr(cfg.source, "replay_path", None)
    if replay is not None and not Path(replay).is_file():
        problems.append(f"source.replay_path: {replay} is not a file (an earlier run's rollouts.jsonl)")
    if problems:
        raise ConfigError("\n".join(problems))


def _builtin_eval_size(cfg: GrpodConfig) -> list[str]:
    """The builtin task holds out a fixed set (its problems decide it, not this host): asking for
    more failed every evaluation of the run, each one a warning, and the run ended with exit 0."""
    if cfg.source.kind != "builtin" or cfg.eval.size <= 0:
        return []
    from grpod.rollouts.arithmetic import ArithmeticTask

    held_out = ArithmeticTask(seed=cfg.source.task_seed).held_out_size
    if cfg.eval.size > held_out:
        return [f"eval.size = {cfg.eval.size}: the builtin task holds out {held_out} problems; ask for at most {held_out}"]
    return []


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _run_dir(path: Path) -> list[str]:
    if path.exists() and not path.is_dir():
        return [f"run.dir: {path} exists and is not a directory"]
    parent = _nearest_existing(path)
    if not path.exists() and not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        return [f"run.dir: {path} cannot be created ({parent} is not a directory this user may write in)"]
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        return [f"run.dir: {path} is not writable by this user"]
    return []


def _socket(cfg: GrpodConfig) -> list[str]:
    path = cfg.socket_path
    if path.is_dir():
        return [f"{cfg.socket_key}: {path} is a directory"]
    # In the run directory, the run directory's lock names the daemon holding it (exit 2 at start).
    if cfg.control.socket is not None and (path.exists() or path.is_symlink()) and socket_alive(path):
        return [f"{cfg.socket_key}: {path} is in use by another running grpod"]
    return []


def _device(device: str) -> list[str]:
    if device == "cpu":
        return []
    import torch

    try:
        wanted = torch.device(device)
    except RuntimeError as exc:
        return [f"train.device: {device!r} is not a torch device ({exc})"]
    if wanted.type == "cuda" and not torch.cuda.is_available():
        return [f"train.device: {device!r}, but torch finds no CUDA device on this host"]
    if wanted.type == "cuda" and wanted.index is not None and wanted.index >= torch.cuda.device_count():
        return [f"train.device: {device!r}, but this host has {torch.cuda.device_count()} CUDA devices"]
    return []


def _fixed_ports(cfg: GrpodConfig) -> list[str]:
    """Every fixed port grpod binds on this machine, checked before anything starts: a taken one
    failed the start later with exit 1 (the Prometheus endpoint with a bare OSError, vLLM after
    its launch), and `bridge.port` only at the first sync, minutes into a run."""
    wanted = []  # (host key, host, port key, port, what fails without it)
    bridge = cfg.bridge
    if bridge.mode == "broadcast" and bridge.port:
        wanted.append(("bridge.host", bridge.host, "bridge.port", bridge.port,
                       "the first sync would fail to form the weight group"))
    metrics = cfg.metrics
    if metrics.prometheus_port:
        wanted.append(("metrics.prometheus_host", metrics.prometheus_host, "metrics.prometheus_port",
                       metrics.prometheus_port, "the start would fail to serve the metrics"))
    inference = cfg.inference
    if inference.port:
        for index in range(inference.engines):  # this machine's engines: inference.port + index
            wanted.append(("inference.host", inference.host, "inference.port", inference.port + index,
                           f"engine {index} would fail to start"))
    problems = []
    for host_key, host, port_key, port, fails in wanted:
        try:
            if port_is_free(host, port):
                continue
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                problems.append(f"{host_key}: {host} is not an address of this machine")
            else:
                problems.append(f"{port_key}: cannot listen on {host}:{port} ({exc.strerror or exc})")
            continue
        problems.append(f"{port_key}: {host}:{port} is taken by another process ({fails}); free it, pick another, "
                        "or 0 for a free one")
    return problems
