"""Optional Prometheus text endpoint (`metrics.prometheus_port`), bound to 127.0.0.1 by default.

The numbers come from the daemon's own state at scrape time (a custom prometheus_client
collector), so there is one source of truth: what `ctl status` shows is what Prometheus scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

log = structlog.get_logger(__name__)

def _histogram(name: str, doc: str, counted: dict[float, int], buckets: tuple[float, ...]) -> HistogramMetricFamily:
    """A histogram family from `counted` ({value: how many}): work by distinct value, not by
    observation (a days-long run has trained millions of groups)."""
    counts = [(str(bound), sum(n for value, n in counted.items() if value <= bound)) for bound in buckets]
    counts.append(("+Inf", sum(counted.values())))
    return HistogramMetricFamily(name, doc, buckets=counts, sum_value=float(sum(value * n for value, n in counted.items())))


Status = Callable[[], dict[str, Any]]


class DaemonCollector:
    """Prometheus families from one `ctl status` reply, taken at scrape time."""

    def __init__(self, status: Status) -> None:
        self.status = status

    def collect(self):
        status: dict[str, Any] = self.status()
        yield GaugeMetricFamily("grpod_step", "Batches taken in this run, skipped ones included (the run's step)", value=status["step"])
        yield GaugeMetricFamily("grpod_policy_version", "Policy version vLLM serves", value=status.get("policy_version") or 0)
        yield GaugeMetricFamily("grpod_queue_depth", "Rollout groups buffered, not yet trained", value=status.get("queue_depth", 0))
        state = GaugeMetricFamily("grpod_bridge_state", "1 for the bridge's current state", labels=["mode", "state"])
        bridge = status.get("bridge") or {}
        if bridge:
            state.add_metric([bridge["mode"], bridge["state"]], 1)
        yield state
        yield CounterMetricFamily("grpod_vllm_restarts", "vLLM crash recoveries", value=bridge.get("restarts", 0))
        yield CounterMetricFamily("grpod_syncs", "Weight syncs completed", value=bridge.get("syncs", 0))
        latency = bridge.get("sync_latency") or {"buckets": [], "count": 0, "sum": 0.0}
        yield HistogramMetricFamily(
            "grpod_sync_seconds", "Weight sync latency",
            buckets=[(str(bound), count) for bound, count in latency["buckets"]] + [("+Inf", latency["count"])],
            sum_value=float(latency["sum"]),
        )
        histogram = (status.get("staleness") or {}).get("histogram", {})
        ages = {float(age): count for age, count in histogram.items()}
        yield _histogram(
            "grpod_staleness_versions", "Policy versions a group lagged at training time", ages, (0, 1, 2, 3, 4, 6, 8, 16, 32)
        )
        rejected = CounterMetricFamily("grpod_rejected_groups", "Rollout groups rejected, by reason", labels=["reason"])
        for reason, count in (status.get("rejected") or {}).items():
            rejected.add_metric([reason], count)
        yield rejected
        age = None
        if status.get("last_checkpoint"):
            age = time.time() - status["last_checkpoint"]["time"]
        yield GaugeMetricFamily(
            "grpod_last_checkpoint_age_seconds", "Seconds since the last checkpoint (NaN: none yet)", value=age if age is not None else float("nan")
        )
        metrics = status.get("last_metrics") or {}
        tokens, seconds = metrics.get("tokens"), metrics.get("step_s")
        yield GaugeMetricFamily(
            "grpod_tokens_per_second", "Trained tokens per second over the last step",
            value=tokens / seconds if tokens and seconds else 0.0,
        )
        yield GaugeMetricFamily("grpod_reward_mean", "Mean reward of the last step", value=metrics.get("reward_mean") or 0.0)
        source = status.get("source") or {}
        per_function = GaugeMetricFamily(
            "grpod_reward_function_mean", "Each reward function's mean over the latest groups", labels=["function"]
        )
        for name, mean in (source.get("reward_means") or {}).items():
            per_function.add_metric([name], mean)
        yield per_function
        dropped = CounterMetricFamily("grpod_source_dropped_groups", "Groups the source dropped, by reason", labels=["reason"])
        for reason, count in (source.get("drop_reasons") or {}).items():
            dropped.add_metric([reason], count)
        yield dropped
        alarms = status.get("alarms") or {}
        active = GaugeMetricFamily("grpod_alarm", "1 while the named alarm is raised", labels=["alarm"])
        for name, alarm in alarms.items():
            active.add_metric([name], 1.0 if alarm.get("active") else 0.0)
        yield active
        source_alarm = alarms.get("source") or {}
        yield GaugeMetricFamily(
            "grpod_source_failing_seconds", "How long the source has failed with no success (0: it delivers)",
            value=source_alarm.get("failing_s") or 0.0,
        )
        yield GaugeMetricFamily(
            "grpod_source_consecutive_errors", "Source requests failed in a row",
            value=source_alarm.get("consecutive_errors") or 0,
        )
        memory = status.get("memory")
        if memory:
            rss = GaugeMetricFamily("grpod_memory_rss_bytes", "Resident bytes of this node's run processes, last reading",
                                    labels=["process"])
            rss.add_metric(["daemon"], memory["daemon_rss"])
            rss.add_metric(["children"], memory["children_rss"])
            gpu = GaugeMetricFamily("grpod_engine_gpu_memory_bytes", "GPU bytes each engine holds (NVML)", labels=["engine"])
            for name, held in memory["engines"].items():
                rss.add_metric([name], held["rss"])
                if held.get("gpu") is not None:
                    gpu.add_metric([name], held["gpu"])
            yield rss
            yield gpu
        if status.get("last_eval"):
            yield GaugeMetricFamily("grpod_eval_accuracy", "Last held-out accuracy", value=status["last_eval"]["eval_accuracy"])


async def serve_metrics(status: Status, host: str, port: int, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Serve `/metrics` on host:port until cancelled; `status` is the daemon's `ctl status`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(status))

    async def handle(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("metrics_listening", host=host, port=port)
    task_status.started()
    try:
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
