"""The one status model: every `ctl status` field, how it is read from the run, and how it shows.

`STATUS_FIELDS` is a table: each `StatusField` names its key in the reply, reads its value from
the `Reporter` (what the run's objects say now), and says which rows of the operator's table it
gives (`rows(value, status)`, none for a field only machines read). `build_status` makes the
reply from it — the fields, and the `table` rows rendered from those same fields — so `grpod ctl
status` prints the rows it is given, `--json` shows the fields they came from, and the Prometheus
exporter (`grpod.daemon.exporter`) reads the same reply. A new status field is one entry here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Bump when a field changes meaning or leaves (clients read `schema`).
SCHEMA = 1

Rows = list[tuple[str | None, Any]]  # (label, text); a None label is a line of its own


def _none(value: Any, status: dict) -> Rows:
    return []


def _row(label: str, text: Callable[[Any], Any] = lambda v: v) -> Callable[[Any, dict], Rows]:
    """One row `label` whose text is `text(value)`."""
    def rows(value: Any, status: dict) -> Rows:
        return [(label, text(value))]
    return rows


@dataclass(frozen=True)
class StatusField:
    key: str
    read: Callable[[Any], Any]  # the Reporter -> the field's value (JSON)
    rows: Callable[[Any, dict], Rows] = _none  # (value, the whole reply) -> the table's rows


# ---- how fields show ------------------------------------------------------------------------


def _step_rows(step: int, status: dict) -> Rows:
    """"12/100"; "?/100" while a start has not read its resume point (a resumed run's step is
    not known yet: the reply's `step` is 0 until then, and `startup` has no `resume_point_s`)."""
    known = status.get("state") != "starting" or "resume_point_s" in (status.get("startup") or {})
    return [("step", f"{step}/{status.get('steps')}" if known else f"?/{status.get('steps')} (resume point not read yet)")]


def _bridge_rows(bridge: dict | None, status: dict) -> Rows:
    bridge = bridge or {}
    vllm = bridge.get("vllm") or {}
    return [
        ("bridge", f"{bridge.get('mode')} {bridge.get('state')}" + (f" ({bridge['error']})" if bridge.get("error") else "")),
        ("syncs / vLLM restarts", f"{bridge.get('syncs')} / {bridge.get('restarts')}"),
        ("trainer ranks", _ranks(status.get("trainer_ranks"))),
        ("vLLM", f"pid {vllm.get('pid')} running={vllm.get('running')} available={vllm.get('available')}"),
        *_engine_lines(bridge),
    ]


def _ranks(ranks: dict | None) -> str:
    """"2 (FSDP2 over gloo, torchrun restart 1)", or one process."""
    if not ranks:
        return "1 process"
    row = f"{ranks['world_size']} (FSDP2 over {ranks['backend']}, torchrun restart {ranks['restarts']})"
    if ranks.get("out_of_step"):
        row += f"; OUT OF STEP since {ranks['out_of_step'][:200]}"
    return row


def _endpoint(endpoint: dict | None) -> str | None:
    if not endpoint:
        return None
    return f"{endpoint['base_url']} (models: {', '.join(endpoint['model_names'])})"


def _rates(rates: dict | None) -> str | None:
    """Steps/s and tokens/s over this process's training time."""
    if not rates or rates.get("steps_per_s") is None:
        return None
    return (
        f"{rates['steps_per_s']:.2f} steps/s, {rates['tokens_per_s']:.0f} trained tok/s, "
        f"{rates['generated_tokens_per_s']:.0f} generated tok/s"
    )


def _startup(startup: dict | None) -> str | None:
    """Each start-up phase's seconds, in the order they were recorded."""
    if not startup:
        return None
    return ", ".join(f"{name.removesuffix('_s')} {seconds:.1f}" for name, seconds in startup.items())


def _source_rows(source: dict | None, status: dict) -> Rows:
    """"dataset: 40 generated, 3 dropped {'reward_error': 3}", and a dataset's reward workers."""
    if not source:
        return [("source", None)]
    counts = [
        f"{source[key]} {label}"
        for key, label in (("generated", "generated"), ("replayed", "replayed"), ("accepted_groups", "accepted"),
                           ("dropped", "dropped"))
        if key in source
    ]
    line = f"{source.get('kind')}: " + ", ".join(counts)
    rows: Rows = [("source", line + (f" {source['drop_reasons']}" if source.get("drop_reasons") else ""))]
    environment = source.get("environment")
    if environment:
        rows.append(("environment", ", ".join(f"{k} {v}" for k, v in environment.items())))
    curriculum = source.get("curriculum")
    if curriculum:
        window = curriculum.get("window_pass_rate")
        draws = ", ".join(f"{level}: {count}" for level, count in (curriculum.get("draws") or {}).items())
        rows.append(("curriculum", (
            f"level {curriculum.get('level')} of {curriculum.get('levels')}, window pass rate "
            f"{'-' if window is None else window} ({curriculum.get('window_groups')} groups), "
            f"{curriculum.get('moves_up')} up, {curriculum.get('moves_down')} down, draws {{{draws}}}")))
    pool = source.get("reward_pool")
    if pool:
        workers = (f"{pool['workers']}/{pool['size']} up, {pool['calls']} calls ({pool.get('mean_call_ms')} ms mean), "
                   f"{pool['replaced']} replaced")
        rows.append(("reward workers", workers + (f", failed {pool['failed']}" if pool.get("failed") else "")))
    return rows


def _alarm_rows(alarms: dict | None, status: dict) -> Rows:
    alarms = alarms or {}
    source = alarms.get("source")
    text = None
    if source and not source.get("active"):
        text = f"off (raised {source.get('raised', 0)} times)"
    elif source:
        text = (f"ACTIVE: failing for {source.get('failing_s')} s, {source.get('consecutive_errors')} errors in a row; "
                f"last error: {(source.get('last_error') or '-')[:200]}")
    rows: Rows = [("logprob gap alarm", alarms.get("logprob_gap")), ("source alarm", text)]
    for name in ("checkpoint", "sync"):
        alarm = alarms.get(name)
        if alarm and alarm.get("active"):
            rows.append((f"{name} alarm", f"ACTIVE since step {alarm.get('since_step')}: {(alarm.get('last_error') or '-')[:200]}"))
    return rows


def _heartbeat_rows(heartbeat: dict | None, status: dict) -> Rows:
    heartbeat = heartbeat or {}
    return [("last step age (s)", heartbeat.get("last_progress_age_s")),
            ("last heartbeat age (s)", heartbeat.get("last_heartbeat_age_s"))]


def _evaluation_rows(running: dict | None, status: dict) -> Rows:
    last = status.get("last_eval")
    if running:
        where = "beside training" if running.get("beside_training") else "in line"
        return [("evaluation", f"running {running['running_s']} s ({running['when']}, step {running['step']}, {where})")]
    if last:
        return [("evaluation", f"last: accuracy {last.get('eval_accuracy', float('nan')):.3f} at step {last.get('step')} "
                               f"({last.get('eval_s', '-')} s)")]
    return [("evaluation", None)]


def _core_loan(loan: dict | None) -> str | None:
    if not loan:
        return None
    if not loan.get("enabled"):
        return f"{loan.get('engine_threads')} (no loan: {loan.get('reason')})"
    now = loan["borrowed_threads"] if loan.get("lent") else loan["engine_threads"]
    return (f"{now} now; {loan['engine_threads']}, or {loan['borrowed_threads']} while the trainer waits "
            f"({loan.get('loans')} loans, {loan.get('lent_s')} s)")


def _core_loan_rows(loan: dict | None, status: dict) -> Rows:
    return [(label, text) for label, text in (("engine threads", _core_loan(loan)), ("trainer threads", _trainer_loan(loan)))
            if text is not None]


def _trainer_loan(loan: dict | None) -> str | None:
    trainer = (loan or {}).get("trainer")
    if not trainer:
        return None
    if not trainer.get("enabled"):
        return f"{trainer.get('threads')} (no loan: {trainer.get('reason')})"
    return (f"{trainer['threads']}, or {trainer['borrowed_threads']} while generation is parked and the engine idle "
            f"({trainer.get('micro_batches')} micro-batches)")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f} MiB"


def _change(n: int | None) -> str:
    return "" if n is None else f" ({'+' if n >= 0 else '-'}{abs(n) / (1 << 20):.0f})"


def _memory_rows(memory: dict | None, status: dict) -> Rows:
    """"daemon 1210 MiB (+12), engine-0 2900 MiB (+3), children 310 MiB; over 3600 s"."""
    if not memory:
        return [("memory (RSS)", None)]
    parts = [f"daemon {_mib(memory['daemon_rss'])}{_change(memory['daemon_rss_change'])}"]
    for name, held in memory["engines"].items():
        gpu = f", GPU {_mib(held['gpu'])}" if held.get("gpu") is not None else ""
        parts.append(f"{name} {_mib(held['rss'])}{_change(held['rss_change'])}{gpu}")
    parts.append(f"children {_mib(memory['children_rss'])}")
    return [("memory (RSS)", ", ".join(parts) + f"; change over {memory['since_s']:.0f} s")]


# The last step's metrics shown, in this order; a dataset's reward/<function> follow.
METRIC_ROWS = ("reward_mean", "loss", "grad_norm", "entropy", "clipped_fraction", "mismatch_kl", "tis_weight_mean",
               "tis_masked_fraction", "sync_s")


def _metric_rows(metrics: dict | None, status: dict) -> Rows:
    metrics = metrics or {}
    rows: Rows = [(key, metrics[key]) for key in METRIC_ROWS if key in metrics]
    return rows + [(key, value) for key, value in sorted(metrics.items()) if key.startswith("reward/")]


def _engine_lines(bridge: dict) -> Rows:
    """One line per engine (node, URL, state, version, restarts), one per agent of remote ones,
    the phases of the last sync, and the bridge's last transitions."""
    engines, last_sync = bridge.get("engines") or [], bridge.get("last_sync")
    lines: list[str] = []
    if engines:
        lines.append("engines:")
        agents: dict[str, list[dict]] = {}
        for e in engines:
            lines.append(
                f"  {e['name']}  node {e.get('node', 'local')}  {e.get('base_url') or '-'}  {e.get('state', '?')}  "
                f"v{e.get('version')}  restarts {e.get('restarts')}  launches {e.get('launches', '-')}  pid {e.get('pid')}"
            )
            if e.get("agent"):
                agents.setdefault(e["agent"]["url"], []).append(e["agent"])
        for url, seen in agents.items():
            last = seen[-1]
            reach = {True: "reachable", None: "not asked yet"}.get(
                last["reachable"], f"UNREACHABLE ({(last.get('error') or '')[:120]})"
            )
            lines.append(f"agent {url}: {len(seen)} engines, {reach}, last answer {last.get('last_answer_age_s')} s ago")
        if last_sync:
            phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in last_sync.get("phases", {}).items())
            lines.append(f"last sync v{last_sync.get('version')} (s): {phases}")
    if bridge.get("recent"):  # what the bridge did lately (its whole table is in --json, `transitions`)
        lines.append("recent bridge transitions:")
        lines.extend(f"  {t['from']} --{t['event']}--> {t['to']}  ({t['elapsed_s']} s in {t['from']})" for t in bridge["recent"])
    return [(None, line) for line in lines]


def _config_change_rows(changes: list[dict[str, Any]], status: dict) -> Rows:
    """The live settings changed in this run (`ctl set`, SIGHUP, a resume), newest last."""
    return [(None, "config changes:"), *((None, f"  #{c['version']} step {c['step']}: {c['key']} {c['old']!r} -> {c['new']!r} "
                                                f"({c['origin']})") for c in changes)] if changes else []


def _source_status(source) -> dict[str, Any] | None:
    if source is None:
        return None
    stats = {k: v for k, v in vars(source.stats).items() if not k.startswith("_")}
    return {"kind": source.kind, "cursor": source.cursor(), **stats}


# ---- the fields -------------------------------------------------------------------------------
# Read from the Reporter `r`; in the order the table shows them.
STATUS_FIELDS: tuple[StatusField, ...] = (
    StatusField("schema", lambda r: SCHEMA),
    StatusField("state", lambda r: r.progress.phase.value, _row("state")),
    StatusField("step", lambda r: r.progress.step, _step_rows),
    StatusField("steps", lambda r: r.progress.steps),
    StatusField("trained_steps", lambda r: r.progress.trained_steps,
                lambda v, s: [("trained / skipped", f"{v} / {s.get('skipped_batches')}")]),
    StatusField("skipped_batches", lambda r: r.progress.skipped_batches),
    StatusField("paused", lambda r: r.desk.paused if r.desk else False,
                lambda v, s: [("paused / draining", f"{v} / {s.get('draining')}")]),
    StatusField("draining", lambda r: r.desk.draining if r.desk else False),
    StatusField("policy_version", lambda r: r.bridge.policy.version if r.bridge else None, _row("policy version")),
    StatusField("bridge", lambda r: r.bridge.describe() if r.bridge else None, _bridge_rows),
    # None: the trainer is this one process (no torchrun).
    StatusField("trainer_ranks", lambda r: r.world.describe() if r.world is not None else None),
    StatusField("inference", lambda r: r.inference_endpoint(), _row("vLLM URL", _endpoint)),
    StatusField("rates", lambda r: {k: None if v is None else round(v, 3) for k, v in r.progress.rates().items()},
                _row("rates", _rates)),
    StatusField("startup", lambda r: r.progress.startup, _row("start-up (s)", _startup)),
    StatusField("queue_depth", lambda r: len(r.buffer), _row("queue depth")),
    StatusField("accepted_groups", lambda r: r.buffer.accepted),
    StatusField("rejected", lambda r: r.rejections.as_dict(), _row("rejected groups")),
    StatusField("source", lambda r: _source_status(r.source), _source_rows),
    StatusField("alarms", lambda r: {"logprob_gap": r.logprob_gap.describe(), "source": r.source_alarm.describe(),
                                     "checkpoint": r.checkpoint_alarm.describe(), "sync": r.sync_alarm.describe()},
                _alarm_rows),
    StatusField("staleness", lambda r: r.admission.staleness.as_dict() if r.admission else None),
    StatusField("heartbeat", lambda r: r.heartbeat.describe(), _heartbeat_rows),
    StatusField("last_checkpoint", lambda r: r.progress.last_checkpoint,
                _row("last checkpoint", lambda v: (v or {}).get("path"))),
    StatusField("last_eval", lambda r: r.progress.last_eval),
    # The evaluation running now (its step, seconds so far, beside training or not), or None.
    StatusField("evaluation", lambda r: r.evaluations.describe() if r.evaluations is not None else None,
                _evaluation_rows),
    # The trainer's cores lent to a CPU engine while the loop waits for rollouts.
    StatusField("core_loan", lambda r: r.cores.describe() if r.cores is not None else None,
                _core_loan_rows),
    # This node's processes: the last reading of the MemoryWatch, and the change since its first.
    StatusField("memory", lambda r: r.memory.describe() if r.memory is not None else None, _memory_rows),
    StatusField("last_metrics", lambda r: r.progress.last_metrics, _metric_rows),
    StatusField("config_changes", lambda r: r.desk.config_changes[-10:] if r.desk else [], _config_change_rows),
    StatusField("run_dir", lambda r: str(r.run_dir)),
    StatusField("pid", lambda r: os.getpid()),
    StatusField("uptime_s", lambda r: round(time.time() - r.progress.started_at, 1)),
    StatusField("stop_reason", lambda r: r.progress.stop_reason),
)


def status_table(status: dict[str, Any]) -> list[list[Any]]:
    """The operator's table of a status reply (or of any part of one): [label, text] rows, a None
    label for a line of its own."""
    rows: Rows = []
    for field in STATUS_FIELDS:
        rows.extend(field.rows(status.get(field.key), status))
    return [[label, text] for label, text in rows]


def build_status(reporter) -> dict[str, Any]:
    """The `ctl status` reply: every field of STATUS_FIELDS, and the table rows they show as."""
    status = {field.key: field.read(reporter) for field in STATUS_FIELDS}
    status["table"] = status_table(status)
    return status


def render_table(rows: list[list[Any]]) -> str:
    """The rows as aligned text (what `grpod ctl status` prints)."""
    labelled = [label for label, _ in rows if label is not None]
    width = max((len(label) for label in labelled), default=0)
    return "\n".join(str(text) if label is None else f"{label:<{width}}  {text}" for label, text in rows)
