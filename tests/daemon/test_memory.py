"""The memory watch on real processes: an engine's whole process group counted as the engine, the
daemon's other children apart, one `memory` record per reading, and `ctl status` / Prometheus
showing the last reading with its change since the first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from grpod.config import load_config
from grpod.daemon.exporter import DaemonCollector
from grpod.daemon.memory import MemoryWatch
from grpod.inference.memory import MIB
from grpod.daemon.supervisor import Supervisor
from grpod.service.logs import MetricsLog, read_metrics
from tests.harness import ROOT

# A process that holds `mib` MiB resident and, with `children` = 1, starts a child holding as much:
# a stand-in for vLLM's API server and its engine core, in a process group of its own when
# started in a new session.
HOLDER = textwrap.dedent("""
    import subprocess, sys, time
    mib, children, source = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    held = bytearray(mib << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    if children:
        kid = subprocess.Popen([sys.executable, "-c", source, str(mib), "0", source], stdout=subprocess.PIPE, text=True)
        assert kid.stdout.readline().strip() == "ready"
    print("ready", flush=True)
    time.sleep(120)
""")


def holder(mib: int, *, children: int, own_group: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(mib), str(children), HOLDER],
                            stdout=subprocess.PIPE, text=True, start_new_session=own_group)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def processes():
    """What a test started, stopped after it: a process group it created by that group."""
    started: list[tuple[subprocess.Popen, bool]] = []
    yield started
    for proc, own_group in started:
        if own_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(timeout=30)


# A daemon of its own, whose only children are a stand-in engine (leader + child in a new session,
# 150 MiB each) and a stand-in reward worker (60 MiB, in its own process group): the test process
# itself has other children in the suite (shared vLLM servers).
READER = textwrap.dedent("""
    import json, os, signal, subprocess, sys
    from grpod.inference.memory import read_memory

    def start(mib, children, own_group):
        proc = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(mib), str(children), sys.argv[1]],
                                stdout=subprocess.PIPE, text=True, start_new_session=own_group)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    engine = start(150, 1, True)
    worker = start(60, 0, False)
    try:
        reading = read_memory({"engine-0": engine.pid}, gpu=False)
        print(json.dumps({"daemon": reading.daemon_rss, "children": reading.children_rss,
                          "engine": reading.engines["engine-0"]}))
    finally:
        os.killpg(engine.pid, signal.SIGKILL)
        worker.kill()
        engine.wait()
        worker.wait()
""")


def test_an_engines_process_group_is_the_engine_and_other_children_are_apart():
    out = subprocess.run([sys.executable, "-c", READER, HOLDER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reading = json.loads(out.stdout)
    assert 290 * MIB < reading["engine"]["rss"] < 400 * MIB, "both processes of the group, nothing else"
    assert reading["engine"]["gpu"] is None
    assert 55 * MIB < reading["children"] < 120 * MIB, "the worker alone"
    assert reading["daemon"] > 10 * MIB


def run_until_records(watch: MemoryWatch, n: int) -> None:
    """Run `watch` until its metrics file holds `n` records (30 s at most)."""

    async def readings() -> None:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch.run)
                while not watch.metrics.path.exists() or len(read_metrics(watch.metrics.path)) < n:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()

    anyio.run(readings)


def test_each_reading_is_a_record_and_status_shows_the_change_since_the_first(tmp_path, processes):
    engine = holder(40, children=0, own_group=True)
    processes.append((engine, True))
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    step = iter(range(100))
    groups = [{"engine-0": engine.pid}]
    watch = MemoryWatch(0.05, metrics, lambda: next(step), lambda: groups[0])

    run_until_records(watch, 2)
    growing = holder(80, children=0, own_group=True)  # the engine relaunched, larger
    processes.append((growing, True))
    groups[0] = {"engine-0": growing.pid}
    run_until_records(watch, 4)
    records = read_metrics(tmp_path)
    assert [r["kind"] for r in records] == ["memory"] * len(records) and len(records) >= 4
    assert [r["step"] for r in records] == list(range(len(records)))
    assert records[0]["engine_rss_mib/engine-0"] < 60 < records[-1]["engine_rss_mib/engine-0"]
    assert "engine_gpu_mib/engine-0" not in records[0], "no GPU figure where NVML reads none"
    assert records[-1]["daemon_rss_mib"] > 20, records[-1]
    described = watch.describe()
    assert 30 * MIB < described["engines"]["engine-0"]["rss_change"] < 60 * MIB
    assert described["since_s"] >= 0.05 and described["age_s"] >= 0

    cfg = load_config(None, [f"run.dir={str(tmp_path / 'run')!r}"])
    daemon = Supervisor(cfg)
    daemon.reporter.attach(memory=watch)
    status = daemon.status()
    assert status["memory"] == watch.describe() | {"age_s": status["memory"]["age_s"]}
    (row,) = [text for label, text in status["table"] if label == "memory (RSS)"]
    assert "engine-0 " in row and "MiB (+" in row and "children" in row, row
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon.status))
    exported = {
        sample.labels["process"]: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name == "grpod_memory_rss_bytes"
        for sample in family.samples
    }
    memory = status["memory"]
    assert exported == {"daemon": memory["daemon_rss"], "children": memory["children_rss"],
                        "engine-0": memory["engines"]["engine-0"]["rss"]}


def test_a_run_that_has_read_nothing_yet_says_so(tmp_path):
    daemon = Supervisor(load_config(None, [f"run.dir={str(tmp_path)!r}"]))
    status = daemon.status()
    assert status["memory"] is None
    assert ["memory (RSS)", None] in status["table"]


def test_engines_on_other_nodes_join_each_reading_as_their_agents_read_them(tmp_path):
    """`remote`: asked at each reading (the supervisor asks each agent's `/status`); what it answers
    joins the local engines, in the record and in `ctl status`; an agent that answered nothing
    leaves its engines out of that reading."""
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    answers = [{"node-b:7900/engine-0": {"rss": 300 * MIB, "gpu": 2048 * MIB}}, {}]
    asked = []

    async def remote() -> dict:
        asked.append(len(asked))
        return answers[min(len(asked) - 1, 1)]

    watch = MemoryWatch(0.01, metrics, lambda: len(asked), dict, remote)

    run_until_records(watch, 2)
    first, second = read_metrics(tmp_path)[:2]
    assert first["engine_rss_mib/node-b:7900/engine-0"] == 300.0 and first["engine_gpu_mib/node-b:7900/engine-0"] == 2048.0
    assert not any(key.startswith("engine_") for key in second), "the silent agent's engine is left out"
    assert watch.first.engines == answers[0] and watch.last.engines == {}


def test_engines_are_read_while_the_run_trains_and_not_once_it_stops(tmp_path):
    """A stopping run's engines are being stopped: a group read then is half gone (the last reading
    of a 1000-step run read 618 MiB of a 1758 MiB engine), so the watch reads none of them."""
    from types import SimpleNamespace

    from grpod.daemon.progress import RunPhase

    daemon = Supervisor(load_config(None, [f"run.dir={str(tmp_path)!r}"]))
    engine = SimpleNamespace(name="engine-0", node="local", process=SimpleNamespace(pgid=4242, running=True))
    stopped = SimpleNamespace(name="engine-1", node="local", process=SimpleNamespace(pgid=4343, running=False))
    daemon.parts = SimpleNamespace(bridge=SimpleNamespace(engines=[engine, stopped]))
    daemon.progress.phase = RunPhase.RUNNING
    assert daemon._local_engines() == {"engine-0": 4242}
    daemon.progress.phase = RunPhase.STOPPING
    assert daemon._local_engines() == {} and anyio.run(daemon._remote_memory) == {}
