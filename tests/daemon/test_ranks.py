"""`grpod start` under torchrun (`grpod.daemon.ranks`): which processes are trainer ranks, and a
config trainer ranks cannot run refused before anything starts, naming the key (exit status 2)."""

from __future__ import annotations

import subprocess

from grpod.daemon.torchrun import under_torchrun
from tests.harness import ROOT, torchrun, write_config


def test_a_process_is_a_trainer_rank_when_torchrun_set_its_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not under_torchrun()
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    assert not under_torchrun(), "all four are torchrun's"
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert under_torchrun()


def test_every_rank_refuses_a_config_trainer_ranks_cannot_run_naming_the_key(tmp_path):
    config = write_config(tmp_path / "grpod.toml", {"run.dir": str(tmp_path / "run"), "train.optimizer": "adafactor"})
    proc = subprocess.run(
        [*torchrun(2), "-m", "grpod", "start", "--config", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Each rank checks the config before anything starts; the first to refuse ends the job (torchrun
    # then stops the other, which, on a loaded machine, may not have reached its own check yet).
    assert said.count("train.optimizer = 'adafactor'") >= 1, said[-3000:]
    assert "exitcode  : 2" in said, "a rank exits as `grpod start` does on a config error"
    assert not (tmp_path / "run").exists(), "refused before anything started"
