"""`Reporter`: what a run tells the world — `ctl status`, metrics.jsonl, the console, systemd.

It reads the run's objects and writes nothing back into them: the progress counters, the desk,
the bridge and its policy, the buffer, the admission gates, the source, the alarms and the
heartbeat. Its outputs:
- `status()`: the `ctl status` reply, built from `grpod.daemon.status` (a stable schema,
  `"schema": 1`; its `table` is what `grpod ctl status` prints; Prometheus reads it too);
- `step_done` / `sync_done` / `eval_done`: one record each in metrics.jsonl (and W&B), the
  progress line and the systemd STATUS line;
- `announce_inference()`: where environments reach the policy; `summary()`: the last lines.

The parts are attached as the supervisor builds them (`attach`); until then `status()` says so.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import structlog

from grpod.config import LORA_MODES, GrpodConfig
from grpod.daemon.alarms import CheckpointAlarm, LogprobGapAlarm, SourceErrorAlarm, SyncAlarm
from grpod.daemon.desk import OperatorDesk
from grpod.service.logs import MetricsLog
from grpod.service.notify import Heartbeat, SystemdNotifier
from grpod.daemon.progress import RunProgress
from grpod.daemon.status import build_status
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.validation import RejectionCounter

log = structlog.get_logger(__name__)


class Reporter:
    def __init__(
        self,
        cfg: GrpodConfig,
        *,
        progress: RunProgress,
        buffer: RolloutBuffer,
        rejections: RejectionCounter,
        heartbeat: Heartbeat,
        notifier: SystemdNotifier,
        metrics: MetricsLog,
        logprob_gap: LogprobGapAlarm,
        source_alarm: SourceErrorAlarm,
        run_dir: Path,
    ) -> None:
        self.cfg = cfg
        self.progress = progress
        self.buffer = buffer
        self.rejections = rejections
        self.heartbeat = heartbeat
        self.notifier = notifier
        self.metrics = metrics
        self.logprob_gap = logprob_gap
        self.source_alarm = source_alarm
        self.checkpoint_alarm = CheckpointAlarm()
        self.sync_alarm = SyncAlarm()
        self.run_dir = run_dir
        self.desk: OperatorDesk | None = None
        self.bridge = None
        self.source = None
        self.admission = None
        self.world = None  # grpod.training.distributed.TrainerWorld under torchrun
        self.evaluations = None  # grpod.daemon.evaluation.Evaluations, the step loop's
        self.cores = None  # grpod.inference.cores.CoreLoan, the step loop's
        self.memory = None  # grpod.daemon.memory.MemoryWatch, the supervisor's

    def attach(
        self, *, desk: OperatorDesk | None = None, bridge=None, source=None, admission=None, world=None,
        evaluations=None, cores=None, memory=None,
    ) -> None:
        self.desk = desk or self.desk
        self.memory = memory or self.memory
        self.evaluations = evaluations or self.evaluations
        self.cores = cores or self.cores
        self.world = world or self.world
        self.bridge = bridge or self.bridge
        self.source = source or self.source
        self.admission = admission or self.admission

    # ---- records --------------------------------------------------------------------------
    def step_done(self, record: dict[str, Any]) -> None:
        p = self.progress
        p.last_metrics = {k: v for k, v in record.items() if isinstance(v, (int, float, type(None)))}
        self.metrics.write("step", p.step, record)
        self.logprob_gap.observe(p.step, record)
        self._progress_line(record)
        self.notifier.status(f"step {p.step}/{p.steps} reward {record.get('reward_mean', 0):.3f}")

    def sync_done(self, sync, weights_step: int) -> None:
        """One `sync` line per sync, written at the current step (W&B needs steps in order);
        `weights_step` is the step whose weights it carries."""
        self.metrics.write("sync", self.progress.step, {**sync.as_dict(), "weights_step": weights_step})
        self.sync_alarm.written(weights_step)

    def resumed(self, checkpoint: Path, step: int, policy_version: int, buffered: int) -> None:
        """A start that resumes a checkpoint: the log, and a console line saying which."""
        log.info("resumed", checkpoint=str(checkpoint), step=step, policy_version=policy_version, buffered_groups=buffered)
        if self.cfg.run.progress:
            print(f"grpod: resuming {checkpoint} at step {step}/{self.progress.steps} (policy version "
                  f"{policy_version}, {buffered} groups buffered)", file=sys.stderr, flush=True)

    def eval_done(self, result: dict[str, Any], when: str, *, step: int) -> None:
        """One `eval` line: `step` is the step whose policy was evaluated (an evaluation beside
        training ends some steps later, `finished_step`; W&B gets it at that later step)."""
        p = self.progress
        p.last_eval = {**result, "when": when, "step": step, "finished_step": p.step}
        self.metrics.write("eval", step, p.last_eval, log_step=p.step)
        log.info("eval", **p.last_eval)
        if self.cfg.run.progress and _none_scored(result):
            print(f"eval ({when}, step {step}): no accuracy: none of the {result['eval_size']} held-out problems was "
                  "scored (every reward call failed, see the log)", file=sys.stderr, flush=True)
        elif self.cfg.run.progress:
            print(
                f"eval ({when}, step {step}): accuracy {result['eval_accuracy']:.3f}"
                + (f", mean@{result['eval_k']} {result['eval_mean_at_k']:.3f}" if "eval_mean_at_k" in result else "")
                + f" on {result['eval_size']} held-out problems"
                # A row whose reward call failed counts as wrong: say how many were never scored.
                + (f" ({result['eval_reward_failures']} not scored: reward failures, see the log)"
                   if result.get("eval_reward_failures") else ""),
                file=sys.stderr,
                flush=True,
            )

    def _progress_line(self, record: dict[str, Any]) -> None:
        if not self.cfg.run.progress:
            return
        p, rates = self.progress, self.progress.rates()
        loss = "skipped" if record.get("skipped") else f"{record.get('loss', float('nan')):+.4f}"
        line = (
            f"step {p.step:>4}/{p.steps}  reward {record.get('reward_mean', float('nan')):6.3f}  "
            f"loss {loss}  {rates['steps_per_s'] or 0.0:5.2f} steps/s  "
            f"{rates['generated_tokens_per_s'] or 0.0:7.1f} gen tok/s"
        )
        if self.bridge is not None:
            line += f"  v{self.bridge.policy.version} {self.bridge.state}"
        if record.get("sync_s") is not None:
            line += f"  sync {record['sync_s'] * 1000:.0f} ms"
        print(line, file=sys.stderr, flush=True)

    # ---- where environments find the policy -------------------------------------------------
    def inference_endpoint(self) -> dict[str, Any] | None:
        """vLLM's OpenAI base URL and the model names it serves (None while none runs)."""
        return self.bridge.policy.endpoint() if self.bridge is not None else None

    def announce_inference(self) -> None:
        endpoint = self.inference_endpoint()
        if endpoint is None:
            return
        log.info("inference_endpoint", **endpoint)
        if not self.cfg.run.progress:
            return
        names = ", ".join(endpoint["model_names"])
        lines = [f"grpod: vLLM serves the policy at {endpoint['base_url']} (model names: {names})"]
        if self.cfg.bridge.mode in LORA_MODES:
            lines.append(
                f"grpod: LoRA mode: environments should call {endpoint['generate_url']} (Atropos server_type = vllm), "
                "which samples from the current adapter"
            )
        if not endpoint["fixed_port"]:
            lines.append("grpod: the port was picked at random; set inference.port for a URL environments can keep")
        print("\n".join(lines), file=sys.stderr, flush=True)

    # ---- ctl status -------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The `ctl status` reply (`grpod.daemon.status`: its fields and how each shows)."""
        return build_status(self)

    def summary(self) -> None:
        """The run's last lines on the console: why it stopped, accuracy before/after, the groups
        the source dropped and why, checkpoint. The drops are also logged (`source_drops`): the
        failures' own warnings are rate-limited, so the log alone would undercount them."""
        stats = self.source.stats if self.source is not None else None
        if stats is not None and stats.dropped:
            log.info("source_drops", dropped=stats.dropped, drop_reasons=dict(stats.drop_reasons))
        if not self.cfg.run.progress:
            return
        p = self.progress
        try:
            evals = [r for r in self.metrics.read() if r.get("kind") == "eval"]
        except (OSError, ValueError) as exc:  # a damaged metrics.jsonl costs these lines, not the exit status
            log.warning("summary_without_metrics", error=f"{type(exc).__name__}: {exc}")
            evals = []
        version = self.bridge.policy.version if self.bridge else "-"
        lines = [
            f"grpod: {p.stop_reason or 'stopped'} at step {p.step}/{p.steps} "
            f"({p.trained_steps} trained, {p.skipped_batches} skipped), "
            f"policy version {version}, run dir {self.run_dir}"
        ]
        if len(evals) >= 2:
            def accuracy(e: dict) -> str:
                return "none scored" if _none_scored(e) else f"{e['eval_accuracy']:.3f}"

            lines.append(
                f"held-out accuracy: {accuracy(evals[0])} (step {evals[0]['step']}) -> "
                f"{accuracy(evals[-1])} (step {evals[-1]['step']}) on {evals[-1]['eval_size']} problems"
            )
        if stats is not None and stats.dropped:
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(stats.drop_reasons.items()))
            lines.append(f"groups dropped by the source: {stats.dropped} ({reasons})")
        if p.last_checkpoint:
            lines.append(f"last checkpoint: {p.last_checkpoint['path']}")
        print("\n".join(lines), file=sys.stderr, flush=True)


def _none_scored(result: dict[str, Any]) -> bool:
    """An evaluation whose every row's reward call failed: its accuracy of 0 measured nothing."""
    return bool(result.get("eval_size")) and result.get("eval_reward_failures") == result["eval_size"]
