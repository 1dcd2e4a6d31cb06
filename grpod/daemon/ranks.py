"""`grpod start` as one of several trainer ranks under torchrun.

    torchrun --standalone --nproc-per-node K [--max-restarts N] -m grpod start --config grpod.toml

Every rank reads the same config and joins the trainer ranks' process groups
(`grpod.training.distributed.join_trainer_world`). Rank 0 then runs the daemon as `grpod start`
does alone (`run_daemon`), with a `DistributedTrainer` built by the components; when the daemon
ends, however it ends, rank 0 releases the followers. Ranks > 0 run `follow` until then.

Why torchrun starts grpod, not the other way round: torchrun already owns what a group of ranks
needs — one process per rank, the rendezvous (one node or many: `--nnodes`, `--rdzv-endpoint`),
restarting the whole group when one rank fails (`--max-restarts`) — and grpod owns what it owns
now (the engines' process groups, the control socket, checkpoints). A rank that fails ends the
group; the restarted rank 0 resumes from the newest checkpoint like any restarted daemon.

Signals: torchrun passes SIGTERM/SIGINT to every rank. Rank 0 treats them as always (a stop:
the final checkpoint, then the engines). Ranks > 0 ignore them: rank 0's final checkpoint needs
them, and they end when rank 0 releases them or exits. torchrun kills what is still running
`--shutdown-timeout` seconds (default 30) after its SIGTERM: give the daemon time for its final
checkpoint and its engines' stop (e.g. `--shutdown-timeout 120`). A rank that froze (SIGSTOP, a
hung driver) is given up after `train.collective_timeout_s`: rank 0 ends its run, stops its
engines and exits non-zero, and torchrun ends the job. A torchrun that is itself
killed (SIGKILL, the OOM killer) sends nothing: rank 0 watches it and stops as on its SIGTERM
(torchrun starts each rank in a session of its own, so nothing else would).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

import structlog

from grpod.config import GrpodConfig
from grpod.service.children import watch_parent

log = structlog.get_logger(__name__)


def run_rank(cfg: GrpodConfig, config_path: Path | None = None, overrides: list[str] = ()) -> int:
    """This process's part of the run: the daemon on rank 0, a follower elsewhere. Exit status
    as `grpod start`'s (a follower: 0 once released)."""
    from grpod.training.distributed import (
        follow,
        join_trainer_world,
        leave_trainer_world,
        stop_followers,
    )

    world = join_trainer_world(cfg)
    try:
        if world.leads:
            from grpod.daemon.supervisor import run_daemon

            launcher = os.getppid()
            if launcher != 1:  # torchrun SIGKILLed or OOM-killed: stop as on its SIGTERM
                watch_parent(launcher, lambda: os.kill(os.getpid(), signal.SIGTERM))
            code = 1
            try:
                code = run_daemon(cfg, config_path=config_path, overrides=overrides)
                return code
            finally:
                stop_followers(world)
                if world.broken is not None:
                    _exit_past_stuck_collectives(code, world.broken)
        from grpod.service.logs import configure_logging

        configure_logging(None, cfg.run.log_level)
        structlog.contextvars.bind_contextvars(rank=world.rank)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        follow(world)
        log.info("follower_released", rank=world.rank)
        return 0
    finally:
        leave_trainer_world()


def _exit_past_stuck_collectives(code: int, why: str) -> None:
    """Rank 0 with its ranks out of step, the daemon ended (engines stopped, logs written): exit
    now. A call sent to a frozen rank leaves gloo work pending on the commands group, whose
    deadline is the followers' (`FOLLOWER_WAIT`), and the process's exit would wait for it."""
    log.warning("rank_0_exits_past_stuck_collectives", exit_code=code, out_of_step=why)
    if sys.exc_info()[1] is not None:  # the daemon raised: say what, as the interpreter would have
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
