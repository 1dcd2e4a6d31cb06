"""`Reporter`: what a run tells the world — `ctl status`, metrics.jsonl, the console, systemd.

It reads the run's objects and writes nothing back into them: the progress counters, the desk,
the bridge and its policy, the buffer, the admission gates, the source, the alarms and the
heartbeat. Its outputs:
- `status()`: the `ctl status` reply (a stable schema, `"schema": 1`; Prometheus reads it too);
- `step_done` / `sync_done` / `eval_done`: one record each in metrics.jsonl (and W&B), the
  progress line and the systemd STATUS line;
- `announce_inference()`: where environments reach the policy; `summary()`: the last lines.

The parts are attached as the supervisor builds them (`attach`); until then `status()` says so.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from grpod.config import LORA_MODES, GrpodConfig
from grpod.daemon.alarms import CheckpointAlarm, LogprobGapAlarm, SourceErrorAlarm
from grpod.daemon.desk import OperatorDesk
from grpod.service.logs import MetricsLog
from grpod.service.notify import Heartbeat, SystemdNotifier
from grpod.daemon.progress import RunProgress
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
        self.run_dir = run_dir
        self.desk: OperatorDesk | None = None
        self.bridge = None
        self.source = None
        self.admission = None
        self.world = None  # grpod.training.distributed.TrainerWorld under torchrun
        self.evaluations = None  # grpod.daemon.evaluation.Evaluations, the step loop's
        self.cores = None  # grpod.inference.cores.CoreLoan, the step loop's

    def attach(
        self, *, desk: OperatorDesk | None = None, bridge=None, source=None, admission=None, world=None,
        evaluations=None, cores=None,
    ) -> None:
        self.desk = desk or self.desk
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

    def eval_done(self, result: dict[str, Any], when: str, *, step: int) -> None:
        """One `eval` line: `step` is the step whose policy was evaluated (an evaluation beside
        training ends some steps later, `finished_step`; W&B gets it at that later step)."""
        p = self.progress
        p.last_eval = {**result, "when": when, "step": step, "finished_step": p.step}
        self.metrics.write("eval", step, p.last_eval, log_step=p.step)
        log.info("eval", **p.last_eval)
        if self.cfg.run.progress:
            print(
                f"eval ({when}, step {step}): accuracy {result['eval_accuracy']:.3f}"
                + (f", mean@{result['eval_k']} {result['eval_mean_at_k']:.3f}" if "eval_mean_at_k" in result else "")
                + f" on {result['eval_size']} held-out problems",
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
        p, bridge = self.progress, self.bridge
        return {
            "schema": 1,
            "state": p.phase.value,
            "step": p.step,
            "steps": p.steps,
            "trained_steps": p.trained_steps,
            "skipped_batches": p.skipped_batches,
            "rates": {k: None if v is None else round(v, 3) for k, v in p.rates().items()},
            "startup": p.startup,
            "paused": self.desk.paused if self.desk else False,
            "draining": self.desk.draining if self.desk else False,
            "policy_version": bridge.policy.version if bridge else None,
            "bridge": bridge.describe() if bridge else None,
            # None: the trainer is this one process (no torchrun).
            "trainer_ranks": self.world.describe() if self.world is not None else None,
            "queue_depth": len(self.buffer),
            "accepted_groups": self.buffer.accepted,
            "rejected": self.rejections.as_dict(),
            "inference": self.inference_endpoint(),
            "alarms": {
                "logprob_gap": self.logprob_gap.describe(),
                "source": self.source_alarm.describe(),
                "checkpoint": self.checkpoint_alarm.describe(),
            },
            "staleness": self.admission.staleness.as_dict() if self.admission else None,
            "source": self._source_status(),
            "heartbeat": self.heartbeat.describe(),
            "last_metrics": p.last_metrics,
            "last_eval": p.last_eval,
            # The evaluation running now (its step, seconds so far, beside training or not), or None.
            "evaluation": self.evaluations.describe() if self.evaluations is not None else None,
            # The trainer's cores lent to a CPU engine while the loop waits for rollouts.
            "core_loan": self.cores.describe() if self.cores is not None else None,
            "last_checkpoint": p.last_checkpoint,
            "config_changes": self.desk.config_changes[-10:] if self.desk else [],
            "run_dir": str(self.run_dir),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - p.started_at, 1),
            "stop_reason": p.stop_reason,
        }

    def _source_status(self) -> dict[str, Any] | None:
        if self.source is None:
            return None
        stats = {k: v for k, v in vars(self.source.stats).items() if not k.startswith("_")}
        return {"kind": self.source.kind, "cursor": self.source.cursor(), **stats}

    def summary(self) -> None:
        """The run's last lines on the console: why it stopped, accuracy before/after, checkpoint."""
        if not self.cfg.run.progress:
            return
        p = self.progress
        evals = [r for r in self.metrics.read() if r["kind"] == "eval"]
        version = self.bridge.policy.version if self.bridge else "-"
        lines = [
            f"grpod: {p.stop_reason or 'stopped'} at step {p.step}/{p.steps} "
            f"({p.trained_steps} trained, {p.skipped_batches} skipped), "
            f"policy version {version}, run dir {self.run_dir}"
        ]
        if len(evals) >= 2:
            lines.append(
                f"held-out accuracy: {evals[0]['eval_accuracy']:.3f} (step {evals[0]['step']}) -> "
                f"{evals[-1]['eval_accuracy']:.3f} (step {evals[-1]['step']}) on {evals[-1]['eval_size']} problems"
            )
        if p.last_checkpoint:
            lines.append(f"last checkpoint: {p.last_checkpoint['path']}")
        print("\n".join(lines), file=sys.stderr, flush=True)
