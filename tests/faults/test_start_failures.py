"""Cases 5 and 6: a vLLM that never becomes healthy, and a port that is taken at launch.

Each runs `grpod start` to its end with stderr captured apart. Expected every time: exit status
non-zero, an error on stderr that says what failed and names the value (path, timeout, port),
and no process left of any vLLM process group the daemon launched.
"""

from __future__ import annotations

import socket

import pytest

from tests.faults.injection import (
    alive,
    first_line_matching,
    launched_pgids,
    run_to_exit,
)
from tests.harness import base_settings, write_config

pytestmark = pytest.mark.faults


def _start(tmp_path, model_dir, **overrides):
    run_dir = tmp_path / "run"
    settings = base_settings(run_dir, model_dir) | {"inference.start_timeout_s": 300.0} | overrides
    return run_dir, run_to_exit(write_config(tmp_path / "grpod.toml", settings), timeout_s=400)


def _check_nothing_left(run_dir, row, finished) -> None:
    pgids = launched_pgids(run_dir)
    left = alive(pgids)
    row.data_lost = "none"
    row.notes = f"exit {finished.code} after {finished.seconds:.1f} s; vLLM launches {len(pgids)}, left {len(left)}"
    assert finished.code != 0, finished.stderr[-3000:]
    assert left == [], f"processes of vLLM groups {pgids} left behind: {left}"
    assert not (run_dir / "grpod.sock").exists(), "the control socket is removed on the way out"


@pytest.mark.timeout(300)
def test_model_path_without_a_model(tmp_path, fault_model_dir, fault_case):
    row = fault_case("5a model.path holds no model (init_if_missing = false)")
    empty = tmp_path / "no-model"
    empty.mkdir()
    run_dir, finished = _start(tmp_path, empty)
    _check_nothing_left(run_dir, row, finished)
    line = first_line_matching(finished.stderr, "no HF model")
    assert line and str(empty) in line and "model.init_if_missing" in line, finished.stderr[-3000:]
    row.notes += f"; stderr: {line[line.index('model.path'):][:90]}"


@pytest.mark.timeout(300)
def test_vllm_exits_during_start_up(tmp_path, fault_model_dir, fault_case):
    row = fault_case("5b vLLM exits during start-up (bad extra_args)")
    flag = "--no-such-vllm-flag"
    run_dir, finished = _start(tmp_path, fault_model_dir, **{"inference.extra_args": [flag]})
    _check_nothing_left(run_dir, row, finished)
    assert len(launched_pgids(run_dir)) == 1, "vLLM was launched once (no restart loop at start-up)"
    # vLLM's argument parser refused it: the operator's input, exit 2 (systemd does not retry it), the key named.
    assert finished.code == 2, finished.stderr[-3000:]
    assert "grpod: inference.extra_args: vLLM refused its command line" in finished.stderr, finished.stderr[-3000:]
    line = first_line_matching(finished.stderr, "vLLM exited with code")
    assert line and "before becoming healthy" in line, finished.stderr[-3000:]
    assert flag in finished.stderr, "the error carries the tail of vLLM's log, which names the bad flag"
    row.notes += f"; stderr: {line[line.index('vLLM exited'):][:90]}"


@pytest.mark.timeout(300)
def test_vllm_not_healthy_within_start_timeout(tmp_path, fault_model_dir, fault_case):
    row = fault_case("5c inference.start_timeout_s = 3 (too short)")
    run_dir, finished = _start(tmp_path, fault_model_dir, **{"inference.start_timeout_s": 3.0})
    _check_nothing_left(run_dir, row, finished)
    assert len(launched_pgids(run_dir)) == 1
    line = first_line_matching(finished.stderr, "start_timeout_s")
    assert line and "did not answer /health within inference.start_timeout_s = 3 s" in line, finished.stderr[-3000:]
    row.notes += f"; stderr: {line[line.index('vLLM did not'):][:90]}"


@pytest.mark.timeout(300)
def test_inference_port_taken(tmp_path, fault_model_dir, fault_case):
    row = fault_case("6 inference.port held by another process")
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        run_dir, finished = _start(tmp_path, fault_model_dir, **{"inference.port": port})
        _check_nothing_left(run_dir, row, finished)
        assert launched_pgids(run_dir) == set(), "nothing is launched on a taken port"
        # Found by the start's host checks, before anything starts: the operator's input (exit 2).
        assert finished.code == 2, finished.stderr[-3000:]
        line = first_line_matching(finished.stderr, f"inference.port: 127.0.0.1:{port}")
        assert line and "is taken by another process (engine 0 would fail to start)" in line, finished.stderr[-3000:]
        row.notes += f"; stderr: {line[line.index('inference.port'):][:90]}"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the holder still listens: grpod did not touch it
    finally:
        holder.close()
