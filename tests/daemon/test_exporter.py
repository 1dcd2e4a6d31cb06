import socket
import urllib.request

import anyio
from prometheus_client import CollectorRegistry, generate_latest

from grpod.config import load_config
from grpod.daemon.exporter import DaemonCollector, serve_metrics
from grpod.daemon.supervisor import Supervisor
from grpod.rollouts.admission import BatchAdmission
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.staleness import apply_staleness
from grpod.rollouts.validation import Rejection


def _daemon(tmp_path):
    cfg = load_config(None, [f"run.dir={str(tmp_path)!r}"])
    daemon = Supervisor(cfg)
    daemon.progress.step = 7
    daemon.rejections.add(Rejection(reason="length_mismatch", detail="x"))
    daemon.rejections.add(Rejection(reason="length_mismatch", detail="y"))
    admission = BatchAdmission(cfg.train, vocab_size=10, max_seq_len=10, rejections=daemon.rejections)
    groups = [RolloutGroup([[1]], [[1]], [0.0], policy_version=v) for v in (5, 4, 1)]
    apply_staleness(groups, 5, 2, "drop", admission.staleness)
    daemon.reporter.attach(admission=admission)
    daemon.progress.last_metrics = {"reward_mean": 0.25, "tokens": 100, "step_s": 0.5}
    return daemon


def _scrape(status) -> str:
    """The text one scrape of a collector over `status` (a `ctl status` reply's callable) serves."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(status))
    return generate_latest(registry).decode()


def test_collector_exposes_the_daemon_state(tmp_path):
    text = _scrape(_daemon(tmp_path).status)
    assert "grpod_step 7.0" in text
    assert 'grpod_rejected_groups_total{reason="length_mismatch"} 2.0' in text
    assert 'grpod_staleness_versions_bucket{le="0"} 1.0' in text
    assert "grpod_staleness_versions_count 3.0" in text
    assert "grpod_tokens_per_second 200.0" in text
    assert "grpod_reward_mean 0.25" in text


def test_endpoint_serves_text_on_loopback(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = _daemon(tmp_path)

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(serve_metrics, daemon.status, "127.0.0.1", port)
            body = await anyio.to_thread.run_sync(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            )
            tg.cancel_scope.cancel()
        return body

    body = anyio.run(main)
    assert "grpod_step 7.0" in body and "# TYPE grpod_sync_seconds histogram" in body


def test_the_staleness_histogram_is_built_from_its_counts_not_one_entry_per_group():
    """A days-long run trains millions of groups; a scrape reads the status's counts as they are
    (one entry per group blocked the event loop for seconds at 5 million)."""
    status = {"step": 1, "staleness": {"histogram": {"0": 3_000_000_000, "2": 2_000_000_000, "40": 7}}}
    text = _scrape(lambda: status)
    assert 'grpod_staleness_versions_bucket{le="0"} 3e+09' in text
    assert 'grpod_staleness_versions_bucket{le="2"} 5e+09' in text
    assert 'grpod_staleness_versions_bucket{le="32"} 5e+09' in text
    assert "grpod_staleness_versions_count 5.000000007e+09" in text
    assert "grpod_staleness_versions_sum 4.00000028e+09" in text
