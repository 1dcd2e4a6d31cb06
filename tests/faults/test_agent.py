"""`grpod agent` end to end, and its two fault cases: a leader and an agent as two nodes, the
agent's engine serving the leader's `grpod start` in bridge mode `broadcast`.

The two nodes are two network namespaces joined by a veth pair that the test creates and removes
(root and `ip netns` needed); without them, or with GRPOD_TEST_NO_NETNS=1, the test falls back to
two loopback ports on this machine (and says so on stdout). In the namespaces the agent's API and its vLLM listen on the
agent node's address only, so the vLLM needs its API key and the leader's trainer rank 0 listens
on the leader node's address (`bridge.host`) for the engine's workers: the weights cross the veth
pair. gloo picks its interface from the hostname, which resolves to 127.0.0.1 here, so both sides
name theirs (`GLOO_SOCKET_IFNAME`), as a multi-homed node would.

The run: the leader has no engine of its own (`inference.engines = 0`) and one on the agent.
It trains syncing after every step, every sync probed. After step `CRASH_AT` the
test pauses the run (`ctl pause`, then `ctl sync`, which answers once a whole sync is done, after
which the paused loop waits at the step boundary) and
SIGKILLs the engine's vLLM API server (a crash): the agent relaunches it on the weights it was
launched with, the leader hears the loss through the agent, takes over that launch (or asks for
one, whichever reaches the agent first: one vLLM start either way), brings it to the current
version with an update of its own and probes it; `ctl status` shows the engine's node and its
agent; the run resumes (fault case 15).

Then the agent stops answering for `UNREACHABLE_S` seconds (SIGSTOP by its PID: its port still
accepts, nothing answers — a hung or partitioned node as the leader sees it) while the engine it
supervises runs on: training goes on through the whole outage, syncing to that engine, `ctl
status` says the agent is unreachable and why, and no engine is declared lost or relaunched; once
the agent answers again (SIGCONT) the leader's watch picks up and the status says reachable
(fault case 16). `ctl stop` ends the run a few steps later: every step trained exactly once.
Two vLLM launches in all. At the end every process is stopped by PID (the leader by `ctl stop`,
the agent by SIGTERM) and no vLLM process group is left.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from grpod.inference.release import free_port
from tests.faults.injection import log_events, sigkill, vllm_api_server
from tests.harness import (
    ROOT,
    DaemonProcess,
    base_settings,
    group_processes,
    write_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(1500)]

STEPS = 100_000  # never reached: the test ends the run by `ctl stop`
CRASH_AT = 1
UNREACHABLE_S = 30.0  # how long the agent answers nothing (fault case 16)
API_KEY = "e2e-vllm-key-" + secrets.token_hex(8)
TOKEN = "e2e-agent-token-" + secrets.token_hex(8)


@dataclass
class Node:
    """One side of the test's two-node network: its address and how to run a command on it."""

    address: str
    prefix: list[str] = field(default_factory=list)  # `ip netns exec NAME`, or nothing
    interface: str | None = None  # gloo's GLOO_SOCKET_IFNAME (None: the hostname's)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes() -> Iterator[tuple[Node, Node]]:
    """(leader, agent): two network namespaces joined by a veth pair, removed at the end; else two
    loopback "nodes" on this machine."""
    tag = f"{os.getpid() % 100000}{secrets.token_hex(1)}"
    leader_ns, agent_ns = f"grpod-l{tag}", f"grpod-a{tag}"
    leader_if, agent_if = f"gl{tag}", f"ga{tag}"
    net = f"10.{200 + os.getpid() % 50}.{secrets.randbelow(250)}"
    created: list[str] = []
    try:
        if os.environ.get("GRPOD_TEST_NO_NETNS"):
            raise OSError("GRPOD_TEST_NO_NETNS is set")
        for ns in (leader_ns, agent_ns):
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", leader_if, "netns", leader_ns, "type", "veth", "peer", "name", agent_if, "netns", agent_ns)
        for ns, interface, host in ((leader_ns, leader_if, 1), (agent_ns, agent_if, 2)):
            _ip("-n", ns, "addr", "add", f"{net}.{host}/30", "dev", interface)
            _ip("-n", ns, "link", "set", interface, "up")
    except (OSError, subprocess.SubprocessError) as exc:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)
        print(f"two_nodes: no network namespaces here ({exc}); falling back to loopback ports on one machine")
        yield Node("127.0.0.1"), Node("127.0.0.1")
        return
    print(f"two_nodes: namespaces {leader_ns} ({net}.1) and {agent_ns} ({net}.2) joined by {leader_if}/{agent_if}")
    try:
        yield (Node(f"{net}.1", ["ip", "netns", "exec", leader_ns], leader_if),
               Node(f"{net}.2", ["ip", "netns", "exec", agent_ns], agent_if))
    finally:
        for ns in created:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)


class AgentProcess:
    """`grpod agent` started on a node; ready once systemd's READY=1 arrives on our socket."""

    def __init__(self, config: Path, run_dir: Path, node: Node, notify: Path) -> None:
        self.run_dir = run_dir
        self.output = config.parent / "agent.out"
        self._out = open(self.output, "ab")  # noqa: SIM115 — closed by close()
        self.proc = subprocess.Popen(
            [*node.prefix, sys.executable, "-m", "grpod", "agent", "--config", str(config)], cwd=ROOT,
            stdout=self._out, stderr=subprocess.STDOUT, env={**os.environ, "NOTIFY_SOCKET": str(notify)},
        )  # fmt: skip

    def tail(self, n: int = 40) -> str:
        self._out.flush()
        return "\n".join(self.output.read_text(errors="replace").splitlines()[-n:])

    def launched_pgids(self) -> list[int]:
        return [int(e["pid"]) for e in log_events(self.run_dir, "inference_launched")]

    def close(self) -> int | None:
        """SIGTERM (the agent stops its engines), SIGKILL if it is still alive after a minute."""
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()
        return code


def test_an_agents_engine_serves_the_leaders_broadcast_run_through_a_crash_and_an_unreachable_agent(
    tmp_path, warm_model_dir, two_nodes, fault_case
):
    crash_row = fault_case("15 SIGKILL the agent's engine (the agent relaunches, the leader takes it over)")
    silent_row = fault_case(f"16 agent unreachable for {UNREACHABLE_S:.0f} s (SIGSTOP; its engine runs on)")
    leader_node, agent_node = two_nodes
    began = time.monotonic()
    token_file = tmp_path / "agent.token"
    token_file.write_text(TOKEN + "\n")
    agent_port = free_port("127.0.0.1") if agent_node.address == "127.0.0.1" else 7900
    agent_url = f"http://{agent_node.address}:{agent_port}"
    engine_env = {"inference.env.GLOO_SOCKET_IFNAME": agent_node.interface} if agent_node.interface else {}
    agent_settings = {
        "run.dir": str(tmp_path / "agent-node"),
        "model.path": str(warm_model_dir),
        "model.init_if_missing": False,
        "inference.host": agent_node.address,
        "inference.api_key": API_KEY,
        "inference.start_timeout_s": 400.0,
        "inference.stop_grace_s": 2.0,
        "inference.max_restarts": 2,
        "agent.host": agent_node.address,
        "agent.port": agent_port,
        "agent.token_file": str(token_file),
    } | engine_env
    run_dir = tmp_path / "leader"
    leader_settings = base_settings(run_dir, warm_model_dir) | {
        "train.steps": STEPS,
        "bridge.mode": "broadcast",
        "bridge.sync_every": 1,
        "bridge.host": leader_node.address,
        # Groups queued before the pause are older than the default bound after it: this test is
        # about the crash, not about staleness (which would skip a batch).
        "train.max_staleness": 1000,
        "inference.engines": 0,
        "inference.api_key": API_KEY,
        "inference.start_timeout_s": 400.0,
        "inference.max_restarts": 2,
        "cluster.agents": [agent_url],
        "cluster.token_file": str(token_file),
        "cluster.request_timeout_s": 3.0,
        "cluster.watch_poll_s": 5.0,  # an agent silent for 8 s is reported unreachable
        "run.record_rollouts": True,
        "metrics.memory_every_s": 2.0,  # the agent's engine read on its node, through the agent
    }
    leader_env = {"GLOO_SOCKET_IFNAME": leader_node.interface} if leader_node.interface else {}

    notify = tmp_path / "agent-notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ready:
        ready.bind(str(notify))
        ready.settimeout(120)
        agent = AgentProcess(write_config(tmp_path / "agent.toml", agent_settings), tmp_path / "agent-node" / "agent",
                             agent_node, notify)
        daemon = None
        try:
            assert "READY=1" in ready.recv(4096).decode(), agent.tail()
            daemon = DaemonProcess(write_config(tmp_path / "leader.toml", leader_settings), run_dir, env=leader_env,
                                   prefix=leader_node.prefix)
            daemon.wait_for(lambda s: (s.get("step") or 0) >= CRASH_AT, 700, f"step {CRASH_AT} served by the agent's engine")
            # Hold the loop at a step boundary with no sync in flight (`ctl sync` answers once a whole
            # sync is done, the step's own or one at the boundary; the paused loop then waits), so
            # that the crash is met between syncs, by the watch through the agent.
            assert daemon.ctl("pause")["ok"]
            assert daemon.ctl("sync")["ok"]
            status = daemon.ctl("status")["result"]
            crashed_at = status["step"]
            # The version the crashed engine served: the operator's sync's, which is the paused step's
            # own sync when the request met that step still training (then forced), else one more.
            crashed_version = status["policy_version"]
            [engine] = status["bridge"]["engines"]
            assert engine["node"] == agent_url and engine["base_url"].startswith(f"http://{agent_node.address}:")
            assert engine["agent"]["reachable"] and engine["launches"] == 1 and engine["state"] == "serving"
            # The leader's memory watch has the agent's engine, as its agent read it on its node.
            held = status["memory"]["engines"][engine["name"]]
            assert held["rss"] > 100 * 2**20 and held["gpu"] is None, status["memory"]
            crashed_pid = engine["pid"]
            killed_at = time.monotonic()
            sigkill(vllm_api_server(crashed_pid))

            daemon.wait_for(lambda s: s["bridge"]["engines"][0]["launches"] == 2 and s["bridge"]["state"] == "SERVING"
                            and s["bridge"]["engines"][0]["state"] == "serving", 600, "the engine relaunched and serving")
            text = subprocess.run([sys.executable, "-m", "grpod", "ctl", "status", "--socket", str(daemon.socket)],
                                  check=False, cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
            crash_row.recovery_s = time.monotonic() - killed_at
            assert f"node {agent_url}" in text and f"agent {agent_url}: 1 engines, reachable" in text, text
            assert daemon.ctl("resume")["ok"]

            # Fault 16: the agent answers nothing for UNREACHABLE_S; its engine serves on.
            before = daemon.wait_for(lambda s: s["step"] >= crashed_at + 3, 300, "steps after the relaunch")
            agent.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                silent = daemon.wait_for(lambda s: s["bridge"]["engines"][0]["agent"]["reachable"] is False,
                                         UNREACHABLE_S, "the agent reported unreachable")
                silent_text = subprocess.run(
                    [sys.executable, "-m", "grpod", "ctl", "status", "--socket", str(daemon.socket)],
                    check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
                ).stdout
                reported_after = time.monotonic() - stopped_at
                end = daemon.wait_for(lambda s: time.monotonic() - stopped_at >= UNREACHABLE_S, UNREACHABLE_S + 60,
                                      "the end of the outage")
            finally:
                agent.proc.send_signal(signal.SIGCONT)
            resumed_at = time.monotonic()
            back = daemon.wait_for(lambda s: s["bridge"]["engines"][0]["agent"]["reachable"] is True, 120,
                                   "the agent answering again")
            silent_row.recovery_s = time.monotonic() - resumed_at
            last = daemon.wait_for(lambda s: s["step"] >= back["step"] + 3, 300, "steps after the outage")
            assert daemon.ctl("stop", timeout_s=120)["ok"]
            assert daemon.wait_exit(600) == 0, daemon.tail()
        finally:
            if daemon is not None:
                daemon.close(stop_vllm=False)  # its engines are the agent's: stopped by the agent below
            agent_exit = agent.close()
    elapsed = time.monotonic() - began
    print(f"e2e agent run: {elapsed:.0f} s ({'netns' if agent_node.prefix else 'loopback'})")

    assert agent_exit == 0, agent.tail()
    pgids = agent.launched_pgids()
    assert len(pgids) == 2 and crashed_pid == pgids[0], f"two vLLM launches, the first one crashed: {pgids}"
    for pgid in pgids:
        assert group_processes(pgid) == [], f"vLLM process group {pgid} left behind"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["kind"] == "step"]
    syncs = [r for r in records if r["kind"] == "sync"]
    # The agent's engine in the leader's memory records, as the agent read it: not while it is
    # relaunched, nor while the agent is silent, nor once the run stops (a fast host trains
    # between these in seconds, so one reading may be all there is).
    key = f"engine_rss_mib/{engine['name']}"
    read = [r[key] for r in records if r["kind"] == "memory" and key in r]
    assert read and min(read) > 100, read
    # Every step recorded, in order. A step may be skipped only because admission refused all its
    # groups as repeats: the tiny model, once it has learnt a problem, answers it the same way each
    # time the stream draws it again ("duplicate"). How many grows with how far the run got (it
    # trains through a 30 s outage: 500 steps on a fast host, 12 skipped in one run), so the bound
    # is a share of the steps, there to catch a run that trains nothing; nothing else is refused.
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= last["step"]
    skipped = [s for s in steps if s.get("skipped")]
    assert all(s["rejected"] == s["groups"] for s in skipped), skipped
    assert set(last["rejected"]) <= {"duplicate"}, last["rejected"]
    assert len(skipped) <= max(2, len(steps) // 4), f"{len(skipped)} of {len(steps)} steps skipped"
    crash_row.data_lost = silent_row.data_lost = "none"

    # Fault 16: trained and synced to the agent's engine all through the outage; reported, not lost.
    silent_engine = silent["bridge"]["engines"][0]
    # (open or closed for a sync in flight, never out of the pool)
    assert not silent_engine["recovering"] and silent_engine["launches"] == 2, silent_engine
    assert silent_engine["agent"]["error"], "the status says why the agent is unreachable"
    assert f"agent {agent_url}: 1 engines, UNREACHABLE" in silent_text, silent_text
    trained_silent = end["step"] - before["step"]
    synced_silent = [s for s in syncs if before["policy_version"] < s["version"] <= end["policy_version"]]
    assert trained_silent >= 3 and len(synced_silent) >= 3, (before["step"], end["step"], len(synced_silent))
    assert back["bridge"]["engines"][0]["launches"] == 2, "no engine was relaunched for the outage"
    silent_row.notes = (f"reported unreachable after {reported_after:.1f} s; {trained_silent} steps and "
                        f"{len(synced_silent)} syncs during the outage; no engine lost")
    # Every sync probed, versions in order, one of them the operator's (`ctl sync`).
    assert [s["version"] for s in syncs] == list(range(1, len(syncs) + 1)), syncs
    assert [s["forced"] for s in syncs].count(True) == 1
    assert all(s["probe"]["ok"] and "broadcast" in s["phases"] for s in syncs), syncs
    lost = log_events(run_dir, "inference_lost")
    recovered = log_events(run_dir, "inference_recovered")
    assert len(lost) == 1 and "exited" in lost[0]["error"] and len(recovered) == 1, (lost, recovered)
    launched = log_events(run_dir, "remote_engine_launched")
    assert len(launched) == 2 and launched[0]["url"] != "" and not launched[0]["adopted"]
    caught_up = log_events(run_dir, "engine_caught_up")
    assert len(caught_up) == 1 and caught_up[0]["version"] == crashed_version, (caught_up, crashed_version)
    assert len([s for s in syncs if s["version"] > caught_up[0]["version"]]) >= 3, "syncs to the relaunched engine"
    agent_events = [e["event"] for e in log_events(tmp_path / "agent-node" / "agent")
                    if e["event"] in ("engine_lost", "engine_relaunched", "engine_handed_over")]
    # Whoever reached the agent first relaunched the engine: the agent's own watch (then handed over), or the leader.
    expected = ["engine_lost", "engine_relaunched", "engine_handed_over"] if launched[1]["adopted"] else []
    assert agent_events == expected, agent_events
    probed = [e for e in log_events(run_dir, "engine_probed") if e["version"] == caught_up[0]["version"]]
    assert probed, "the relaunched engine was probed at the version it was caught up to"
    # The weights crossed from the leader's node to the agent's: rank 0 listened on bridge.host.
    epochs = log_events(run_dir, "weight_group_epoch")
    assert len(epochs) == 2, epochs  # the first launch's group, then the relaunched engine's
    print(f"relaunch taken over from the agent: {launched[1]['adopted']}; agent phases {launched[1]['agent_phases']}")
