"""The grpod supervisor: one anyio task group that owns everything a run does.

    Supervisor.run
    └── task group
        ├── control socket server     (OperatorDesk's commands; answers while a step runs)
        ├── Prometheus exporter       (optional)
        ├── signals                   (SIGTERM/SIGINT → stop, SIGHUP → reload live settings)
        ├── start-up                  (trainer load ∥ engine launch, then the first probe;
        │                              cancelled at once by a stop)
        ├── systemd watchdog          (WATCHDOG=1 only while steps progress)
        ├── engine health watches     (bridge.watch: a lost engine is relaunched and probed)
        ├── source alarm              (a source failing for source.error_alarm_s)
        └── step loop (this task)     (StepLoop.run, with its fetch task and pipelined syncs)

Every way a run ends (steps done, `ctl stop`, `ctl drain`, SIGTERM, a failed bridge, a failed
start) goes through `_shutdown`: the running step finishes (its thread is never abandoned),
final checkpoint, final evaluation, engines stopped and released, STOPPING=1. The components are
built by `grpod.daemon.components`; the supervisor only starts, watches and stops them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import structlog

from grpod.agent.remote import RemoteInference, agents_memory
from grpod.bridges.base import BridgeFailed
from grpod.config import ConfigError, GrpodConfig
from grpod.errors import first_error
from grpod.daemon.alarms import LogprobGapAlarm, SourceErrorAlarm
from grpod.daemon.control import ControlServer
from grpod.daemon.desk import OperatorDesk
from grpod.daemon.memory import MemoryWatch
from grpod.service.logs import LogLimit, MetricsLog, WandbSink, configure_logging
from grpod.service.notify import Heartbeat, SystemdNotifier, watchdog_interval_s
from grpod.daemon.progress import RunPhase, RunProgress
from grpod.inference.process import InferenceStartError
from grpod.daemon.reporting import Reporter
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.validation import RejectionCounter
from grpod.run.checkpoint import ResumeError
from grpod.run.lock import RunDirInUse, RunDirLock
from grpod.service.race import first_of

log = structlog.get_logger(__name__)

# How often the source alarm looks at the source, and refreshes the systemd STATUS line while up.
SOURCE_CHECK_S = 1.0
SOURCE_STATUS_S = 10.0


class RunDirError(Exception):
    """The run directory is unusable or unsafe."""


def prepare_run_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise RunDirError(f"run directory {path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


class Supervisor:
    def __init__(self, cfg: GrpodConfig, *, config_path: Path | None = None, overrides: list[str] = ()) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run.dir
        self.progress = RunProgress(cfg.train.steps)
        self.buffer = RolloutBuffer(max(cfg.source.prefetch_groups, cfg.train.groups_per_step))
        self.rejections = RejectionCounter()
        self.heartbeat = Heartbeat(cfg.notify.stall_after_s)
        self.notifier = SystemdNotifier()
        self.logprob_gap = LogprobGapAlarm(cfg.train.logprob_gap_alarm)
        self.source_alarm = SourceErrorAlarm(cfg.source.error_alarm_s, cfg.source.fail_after_s)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.memory = MemoryWatch(cfg.metrics.memory_every_s, self.metrics, lambda: self.progress.step,
                                  self._local_engines, self._remote_memory)
        self.logs = LogLimit(self.run_dir, cfg.run.log_max_bytes)
        self.reporter = Reporter(
            cfg, progress=self.progress, buffer=self.buffer, rejections=self.rejections,
            heartbeat=self.heartbeat, notifier=self.notifier, metrics=self.metrics,
            logprob_gap=self.logprob_gap, source_alarm=self.source_alarm, run_dir=self.run_dir,
        )
        self.desk = OperatorDesk(cfg, self.progress, config_path=config_path, overrides=overrides,
                                 status=self.reporter.status)
        self.reporter.attach(desk=self.desk, memory=self.memory)
        self.parts = None  # grpod.daemon.components.RunParts once started

    def status(self) -> dict:
        return self.reporter.status()

    def _engines_in_service(self) -> list:
        """The run's engines while it trains; none once it stops: an engine group read while it
        is being stopped is half gone (a 1000-step run's last reading: 618 of 1758 MiB)."""
        bridge = self.parts.bridge if self.parts is not None else None
        stopping = self.progress.phase in (RunPhase.STOPPING, RunPhase.STOPPED)
        return [e for e in bridge.engines if e.process.running] if bridge is not None and not stopping else []

    def _local_engines(self) -> dict[str, int]:
        """The process group of each engine this node runs (what `MemoryWatch` reads)."""
        return {e.name: e.process.pgid for e in self._engines_in_service() if e.node == "local"}

    async def _remote_memory(self) -> dict[str, dict[str, int | None]]:
        """What each running engine of an agent holds, as its agent reads it (`MemoryWatch`)."""
        return await agents_memory([e for e in self._engines_in_service() if isinstance(e, RemoteInference)])

    # ---- the run ----------------------------------------------------------------------------
    async def run(self) -> int:
        """The run, holding the run directory's lock (`RunDirLock`) from before its first write to
        its end; a run directory another daemon holds, or one that cannot be made, is refused with
        exit status 2."""
        lock = RunDirLock(self.run_dir)
        refused = None
        try:
            prepare_run_dir(self.run_dir)
            lock.acquire()
        except (RunDirInUse, RunDirError) as exc:
            refused = str(exc)
        except OSError as exc:  # not a directory, not creatable: what preflight missed, or a race
            refused = f"run.dir {self.run_dir}: {exc.strerror or exc}"
        if refused is not None:
            print(f"grpod: {refused}", file=sys.stderr, flush=True)
            self.progress.phase = RunPhase.STOPPED
            self.progress.exit_code, self.progress.stop_reason = 2, refused
            return 2
        try:
            return await self._run_locked()
        finally:
            lock.release()

    async def _run_locked(self) -> int:
        configure_logging(self.run_dir, self.cfg.run.log_level)
        log.info("daemon_starting", run_dir=str(self.run_dir), mode=self.cfg.bridge.mode, pid=os.getpid())
        control = ControlServer(self.cfg.socket_path, self.desk.handlers(), self.cfg.control.request_timeout_s)
        try:
            async with AsyncExitStack() as self.resources, anyio.create_task_group() as tg:
                if self.cfg.metrics.wandb_project:
                    m = self.cfg.metrics
                    self.metrics.wandb = await anyio.to_thread.run_sync(
                        lambda: WandbSink(m.wandb_project, m.wandb_entity, m.wandb_mode, self.run_dir, self.cfg.model_dump(mode="json"))
                    )
                await tg.start(control.serve)
                if self.cfg.metrics.prometheus_port is not None:
                    from grpod.daemon.exporter import serve_metrics

                    await tg.start(serve_metrics, self.status, self.cfg.metrics.prometheus_host, self.cfg.metrics.prometheus_port)
                tg.start_soon(self._signals)
                tg.start_soon(self.logs.run)  # from the start: an engine or environment may print while it starts
                if await self._start():
                    await self._train(tg)
                else:
                    self.progress.stop_reason = f"{self.progress.stop_reason} during start-up"
                    log.info("start_cancelled", reason=self.progress.stop_reason)
                await self._shutdown()
                tg.cancel_scope.cancel()
        except BaseException as exc:
            failure = first_error(exc)
            if failure is None:
                raise
            self._fail(f"{type(failure).__name__}: {failure}")
            refused = (isinstance(failure, InferenceStartError) and failure.exit_code == 2
                       and self.progress.phase is RunPhase.STARTING)
            if isinstance(failure, INPUT_ERRORS) or refused:
                self.progress.exit_code = 2  # what to resume from is the operator's to fix
                if refused:  # argparse's exit status: the command line grpod built from the config
                    print("grpod: inference.extra_args: vLLM refused its command line (exit 2, its argument "
                          "parser's; its words below)", file=sys.stderr, flush=True)
                print(f"grpod: {failure}", file=sys.stderr, flush=True)  # once, as written (check-config's words)
            await self._stop_inference()
        finally:
            self.notifier.close()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.metrics.close)
        self.progress.phase = RunPhase.STOPPED
        log.info("daemon_stopped", step=self.progress.step, exit_code=self.progress.exit_code, reason=self.progress.stop_reason)
        return self.progress.exit_code

    async def _start(self) -> bool:
        """Build and start the components; a stop request cancels the start-up at once (a
        loading trainer finishes its thread, the tiny model's build stops at its next warm-up
        step, a launching engine is stopped, none is launched after it). True once started."""
        from grpod.daemon.components import (
            start_parts,  # the trainer stack imports torch
        )

        async def start() -> None:
            self.parts = await start_parts(
                self.cfg, self.run_dir, progress=self.progress, buffer=self.buffer,
                rejections=self.rejections, desk=self.desk, heartbeat=self.heartbeat, reporter=self.reporter,
                resources=self.resources,
            )
            self.heartbeat.progress()

        self.heartbeat.busy()
        started, _ = await first_of(start, self.desk.stopping.wait)
        return started == 0 and self.parts is not None and not self.desk.stop_requested

    async def _train(self, tg) -> None:
        tg.start_soon(self._watchdog)
        tg.start_soon(self._watch_bridge)
        tg.start_soon(self._watch_source)
        tg.start_soon(self.memory.run)
        self.reporter.announce_inference()
        self.notifier.ready(f"step {self.progress.step}/{self.cfg.train.steps}, vLLM ready")
        self.progress.phase = RunPhase.RUNNING
        try:
            await self.parts.loop.run()  # the start evaluation is its first act
        except* BridgeFailed as failed:  # anyio task groups always raise ExceptionGroups
            self._fail(f"bridge failed: {failed.exceptions[0]}")

    def _fail(self, reason: str) -> None:
        log.error("run_failed", reason=reason, step=self.progress.step)
        self.progress.fail(reason)
        self.desk.request_stop(reason)

    async def _shutdown(self) -> None:
        """The one way a started (or cancelled) run ends."""
        self.progress.phase = RunPhase.STOPPING
        self.notifier.stopping(f"stopping at step {self.progress.step}: {self.progress.stop_reason}")
        self.desk.close(self.progress.stop_reason or "shutdown")  # no boundary comes any more
        parts = self.parts
        # The checkpoint first: a stop's grace period may end during the evaluation after it. A
        # checkpoint of this very state exists: nothing trained, no group accepted, no sync and
        # no `ctl set` since (a stop after `ctl checkpoint`, `ctl sync`, `ctl set` lost the set).
        last = self.progress.last_checkpoint
        already = parts is not None and last is not None and last["state"] == parts.loop.checkpoint_state()
        if parts is not None and self.cfg.checkpoint.at_shutdown and self.progress.step > 0 and not already:
            with anyio.CancelScope(shield=True):
                await parts.loop.checkpoint()
        if parts is not None and parts.bridge.available and self.progress.exit_code == 0:
            # In line: the run's last one, of what the engines serve (the last result again if
            # it measured these weights). A run that ends by itself synced its last steps first.
            await parts.loop.evaluations.run("end", None, step=parts.loop.served_step, version=parts.bridge.policy.version)
        await self._stop_inference()
        self.reporter.summary()

    async def _stop_inference(self) -> None:
        bridge = self.parts.bridge if self.parts is not None else None
        if bridge is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await bridge.stop()
            except Exception as exc:  # noqa: BLE001 — reported; the exit code says it
                log.error("inference_stop_failed", error=str(exc))
                self.progress.exit_code = self.progress.exit_code or 1

    # ---- the watchers -------------------------------------------------------------------------
    async def _signals(self) -> None:
        """A stop at once; a reload in a task of its own (its read is a worker thread's), so that a
        SIGTERM after a SIGHUP never waits for the file."""
        async with anyio.create_task_group() as reloads:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        reloads.start_soon(self.desk.reload_file)
                    else:
                        self.desk.request_stop(signal.Signals(signum).name)

    async def _watchdog(self) -> None:
        """WATCHDOG=1 at half systemd's interval (the protocol is periodic), while healthy."""
        interval = watchdog_interval_s() if self.cfg.notify.watchdog else None
        if interval is None:
            return
        while True:
            if self.heartbeat.healthy():
                self.notifier.watchdog()
                self.heartbeat.last_ping = time.monotonic()
            else:
                log.warning("watchdog_withheld", **self.heartbeat.describe())
            await anyio.sleep(interval)

    async def _watch_bridge(self) -> None:
        """The engines' health watches. What ends them stops the run the one way a run stops, its
        checkpoint first: a BridgeFailed, or anything else a recovery raised (not out of the task
        group, which would end the run with no checkpoint)."""
        try:
            await self.parts.bridge.watch()
        except BridgeFailed as exc:
            self._fail(f"bridge failed: {exc}")
        except Exception as exc:  # noqa: BLE001 — said as the run's failure; the shutdown checkpoints
            log.exception("bridge_watch_failed")
            self._fail(f"bridge failed: {type(exc).__name__}: {exc}"[:500])

    async def _watch_source(self) -> None:
        """Raise and clear the source alarm; end the run after `source.fail_after_s` of failures.
        The alarm is a matter of elapsed time, so it is checked each SOURCE_CHECK_S; while it is
        up the systemd STATUS line says so (refreshed each SOURCE_STATUS_S)."""
        last_status = 0.0
        source = self.parts.source
        while True:
            await anyio.sleep(SOURCE_CHECK_S)
            was_active = self.source_alarm.active
            reason = self.source_alarm.check(source.stats, time.time())
            if reason is not None:
                self._fail(reason)
                return
            now = time.monotonic()
            step = f"step {self.progress.step}/{self.cfg.train.steps}"
            if self.source_alarm.active and (not was_active or now - last_status >= SOURCE_STATUS_S):
                self.notifier.status(f"ALARM {step}: {self.source_alarm.summary()[:200]}")
                last_status = now
            elif was_active and not self.source_alarm.active:
                self.notifier.status(f"{step}, source delivering again")


# Failures that are the operator's input, not the run's: exit status 2, as for a bad config.
INPUT_ERRORS = (ResumeError, ConfigError)  # ConfigError: a dataset row, a reward function


def run_daemon(cfg: GrpodConfig, config_path: Path | None = None, overrides: list[str] = ()) -> int:
    """`grpod start`: `cfg` as loaded from `config_path` with the `--set` `overrides` (what a
    reload re-applies)."""
    return anyio.run(Supervisor(cfg, config_path=config_path, overrides=overrides).run)
