"""Trainer ranks under torchrun: the policy sharded with FSDP2, rank 0 leading, ranks > 0 following.

    torchrun --standalone --nproc-per-node K -m grpod start --config grpod.toml

Rank 0 is the daemon (control socket, source, step loop, bridge, checkpoints) and holds a
`DistributedTrainer`, which has the phases of `Trainer` (plan, parts, prepare, apply, finish) and
its other calls (score, save_weights, full_state_dict, set_learning_rate, state I/O), so the step
loop and the bridges drive it unchanged. Ranks > 0 run `follow`: they build the same trainer when
rank 0 does and then execute, in order, every call rank 0 makes:

    rank 0 (in the step loop's worker thread)         ranks > 0 (follow)
    plan(groups)    -> send ("plan", groups, train)   receive -> plan(groups) with rank 0's live [train]
    prepare(plan,p) -> send ("prepare", p)            receive -> prepare(its plan, p)
    apply(prepared) -> send ("apply",)                receive -> apply(its prepared)
    ...                                               ...
    (the daemon ends) -> send ("stop",)               receive -> return

A command is two broadcasts (its size, its pickle) over a gloo group of its own, sent and then
executed under one lock, so calls from different threads of rank 0 reach every rank in one order.
Between commands the followers wait without a deadline (`FOLLOWER_WAIT`): rank 0 may wait minutes
for vLLM or sit paused for hours. That wait ends at once when rank 0's process exits (its sockets
close), and torchrun ends every rank of the job when any rank exits. Rank 0's sending of a
command, and every collective inside one, is bounded by `train.collective_timeout_s`: a frozen
follower (SIGSTOP, a hung driver) makes the ranks out of step, as a dead one does.

Equal to one process. Each part of a batch (one optimizer update) is split across the ranks by
whole sequences (longest first, to the rank with the fewest tokens); every rank micro-batches its
share as `Trainer` does and runs as many forward/backward rounds as the rank with the most
micro-batches (an idle round is a backward of zero through the whole model, so that FSDP's
collectives pair up). The loss normalisers are the whole part's (`StepNormalizer` over all its
sequences), and gradients are reduce-scattered as a sum (divide factor 1), so the gradient is the
one process's sum of the same terms in another order: measured equal to a relative ~1e-7. The
gradient norm is the global one (DTensor), clipping and the optimizer act on each rank's shard.
Loss statistics and token counts are gathered to every rank, so rank 0's metrics are the batch's.
This needs dropout off (`train.disable_dropout`, the default): dropout masks would differ.

Sharding: `fully_shard` on every decoder layer (the classes the HF model lists in
`_no_split_modules`) and on the root (embeddings, final norm, output head; a tied head stays one
parameter). Every rank loads the whole model from `model_path` before sharding it (at start, one
whole model per rank in memory). The frozen reference of `kl_reference = "model"` is kept whole
on every rank.

State. Rank 0 gathers full tensors (`get_model_state_dict(full_state_dict, cpu_offload)`) for the
HF export (`save_weights`: what the bridges and users load) and for a bridge's copy
(`full_state_dict`). A checkpoint adds `save_sharded`: model and optimizer shards written by every
rank with `torch.distributed.checkpoint` (DCP) into the checkpoint's directory, which therefore
must be on a filesystem every rank sees. DCP reshards on load, so a run resumes exactly (the same
weights, optimizer moments and schedule) at another world size, single process (`Trainer`)
included; the steps after it equal the old world size's to reduction-order rounding. A single
process's checkpoint (`trainer_state.pt` with the whole optimizer) resumes under torchrun too:
rank 0 reads it and the shards are broadcast (`broadcast_from_rank0`). Not kept: the RNG streams of
ranks > 0 (with dropout off nothing on them draws random numbers).

Failures. A call that raises on rank 0 (a rank died: gloo reports "Connection reset by peer" at
once; a collective ran past its timeout) leaves the ranks out of step: `TrainerWorld.broken` says
since when, no call is sent any more (each raises `TrainerRanksBroken`), so the daemon fails its
run at once instead of waiting on a dead rank, and the followers are not released: rank 0's exit
ends the job, which torchrun restarts with `--max-restarts` (rank 0 then resumes from the newest
checkpoint, tests/faults/test_trainer_rank_kill.py).

Not supported (refused at start, naming the key): LoRA (`train.lora`), the bridge modes that
read the trainer's memory or adapters (`shared`, `lora_only`, `lora_restart`), and optimizers
other than AdamW (`train.optimizer`: adafactor's factored state spans whole matrices). Written for GPU
(NCCL for FSDP, gloo beside it) but run on CPU/gloo only.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_optimizer_state_dict,
)

from grpod.config import ConfigError, GrpodConfig, ModelConfig, TrainConfig
from grpod.rollouts.group import RolloutGroup
from grpod.training.batching import MicroBatchPlan, TrainingSequence, plan_micro_batches
from grpod.training.loss import LossStats, StepNormalizer
from grpod.training.sharded import by_parameter_name, load_sharded_state, save_sharded_state
from grpod.training.trainer import BatchPlan, PreparedUpdate, Trainer, write_tokenizer_files

log = structlog.get_logger(__name__)

# How long a follower waits for rank 0's next command: unbounded in practice (rank 0 may be
# paused for days); rank 0's exit ends the wait at once (see the module docstring).
FOLLOWER_WAIT = timedelta(days=365)

# The calls a follower executes, by name; anything else from rank 0 is a protocol error.
FOLLOWED = (
    "plan", "prepare", "apply", "finish", "score", "save_weights", "full_state_dict", "set_learning_rate",
    "save_sharded", "load_sharded", "load_state_dict",
)

# Bridge modes that need the whole model in this process: its memory (shared) or a peft adapter.
SINGLE_PROCESS_MODES = ("shared", "lora_only", "lora_restart")


class FollowerProtocolError(RuntimeError):
    """A follower got a command it cannot execute (a grpod version mismatch between ranks?)."""


class TrainerRanksBroken(RuntimeError):
    """A call failed on rank 0 earlier: the ranks cannot be kept in step any more."""


@dataclass
class TrainerWorld:
    """This process's place among the trainer ranks: its rank, their number, and the two gloo
    groups besides FSDP's: `commands` (rank 0's calls, no deadline) and `objects` (small
    Python objects gathered inside a call, bounded like every collective)."""

    rank: int
    size: int
    commands: Any
    objects: Any
    restarts: int = 0
    timeout_s: float = 600.0  # train.collective_timeout_s: rank 0's wait for the followers to take a call
    # Why the ranks are out of step (a call failed on rank 0: a rank died, a collective timed
    # out); no call is sent any more, and the job must be restarted (torchrun --max-restarts).
    broken: str | None = None

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        """What `ctl status` shows of the trainer ranks (rank 0's view)."""
        return {"world_size": self.size, "restarts": self.restarts, "backend": dist.get_backend(),
                "out_of_step": self.broken}

    def send(self, name: str, *args: Any) -> None:
        """Rank 0: announce a call to every follower, each part within `timeout_s` (a frozen
        follower does not take it: rank 0 would wait with the commands group's no-deadline)."""
        if self.broken is not None:
            raise self.out_of_step(name)
        payload = pickle.dumps((name, args))
        parts = (torch.tensor([len(payload)], dtype=torch.int64), torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        for part in parts:
            try:
                dist.broadcast(part, src=0, group=self.commands, async_op=True).wait(timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise TrainerRanksBroken(
                    f"{name}: a follower rank did not take the call (it died, or froze past "
                    f"train.collective_timeout_s = {self.timeout_s:g} s): {str(exc).splitlines()[0][:200]}"
                ) from None

    def out_of_step(self, name: str) -> TrainerRanksBroken:
        """What call `name` raises on rank 0 once the ranks are out of step (`broken` says since when)."""
        return TrainerRanksBroken(
            f"{name}: the trainer ranks are out of step since {self.broken} (a rank died, froze, or ran past "
            f"train.collective_timeout_s = {self.timeout_s:g} s); restart the job (torchrun --max-restarts "
            "restarts every rank, rank 0 resumes from the last checkpoint)"
        )

    def receive(self) -> tuple[str, tuple]:
        """Ranks > 0: the next call rank 0 announces (waits as long as rank 0 lives)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.commands)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.commands)
        return pickle.loads(payload.numpy().tobytes())  # noqa: S301 — rank 0 of this job, as broadcast_object_list

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.objects)
        return values


_WORLD: TrainerWorld | None = None


def _attempt_store(timeout: timedelta) -> dict[str, Any]:
    """`init_process_group`'s store: under torchrun's agent store, the keys of this attempt only.

    The agent's store outlives a restart of the ranks (`--max-restarts`), and the process groups
    of every attempt publish their addresses under the same names: a rank of the new attempt that
    arrives before rank 0 reads the dead attempt's address and fails to connect. A prefix per
    attempt (TORCHELASTIC_RESTART_COUNT) keeps the attempts apart. Elsewhere: torch's env://."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=False, timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"grpod/attempt-{attempt}", client),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def join_trainer_world(cfg: GrpodConfig) -> TrainerWorld:
    """Form the trainer ranks' process groups from torchrun's environment (once per process).

    CPU: gloo. GPU (`train.device` cuda): NCCL for FSDP, each rank on the GPU of its LOCAL_RANK,
    with gloo beside it for the commands and object gathers.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    check_supported(cfg, int(os.environ["WORLD_SIZE"]))
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    store = _attempt_store(timeout)
    if torch.device(cfg.train.device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", timeout=timeout, **store)
        objects = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout, **store)
        objects = dist.group.WORLD
    commands = dist.new_group(backend="gloo", timeout=FOLLOWER_WAIT)
    _WORLD = TrainerWorld(
        rank=dist.get_rank(), size=dist.get_world_size(), commands=commands, objects=objects,
        restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), timeout_s=cfg.train.collective_timeout_s,
    )
    log.info("trainer_rank_joined", rank=_WORLD.rank, world_size=_WORLD.size, restarts=_WORLD.restarts,
             backend=dist.get_backend(), agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    return _WORLD


def current_world() -> TrainerWorld | None:
    """The trainer ranks this process joined, or None (a single-process daemon)."""
    return _WORLD


def leave_trainer_world() -> None:
    """Release the process groups; not when the ranks are out of step: destroying a group waits
    out an operation stuck on a dead rank (gloo's timeout), and the process is about to exit."""
    global _WORLD
    if _WORLD is not None and _WORLD.broken is None and dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None


def check_supported(cfg: GrpodConfig, world_size: int) -> None:
    """Refuse (ConfigError naming the key) what trainer ranks cannot do."""
    if cfg.train.lora:
        raise ConfigError(
            f"train.lora = true: LoRA is not supported with trainer ranks under torchrun (world size "
            f"{world_size}); train LoRA in a single process (`grpod start` without torchrun)"
        )
    if cfg.bridge.mode in SINGLE_PROCESS_MODES:
        raise ConfigError(
            f"bridge.mode = {cfg.bridge.mode!r} needs the whole trainer in one process; with trainer "
            f"ranks under torchrun use bridge.mode = 'broadcast' or 'none'"
        )
    if cfg.train.optimizer != "adamw":
        raise ConfigError(
            f"train.optimizer = {cfg.train.optimizer!r}: trainer ranks under torchrun support 'adamw' only "
            "(its state is per parameter element, so each rank's shard updates as one process would; "
            "adafactor factors its state over whole matrices, adamw_8bit quantizes blocks)"
        )
    if not cfg.train.disable_dropout:
        log.warning("distributed_dropout", detail="train.disable_dropout = false: ranks draw their own "
                    "dropout masks, so K ranks no longer compute one process's step")


# ---- sharding -----------------------------------------------------------------------------


def shard_model(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`fully_shard` every decoder layer (the classes HF marks `_no_split_modules`) and the root;
    gradients are reduced as a sum (divide factor 1: the loss is already normalised globally).
    Returns the sharded modules, root last."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in layer_classes]
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        # A plain SUM (gloo has no pre-multiplied sum; NCCL gets the same op), nothing divided.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return sharded


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another name of an earlier parameter (a tied output head)."""
    first: dict[int, str] = {}
    aliases = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases.add(name)
        else:
            first[id(parameter)] = name
    return aliases


def share_sequences(lengths: list[int], ranks: int) -> list[list[int]]:
    """Sequence indices per rank: longest first, each to the rank with the fewest tokens so far
    (ties to the lowest rank). Deterministic: every rank computes every rank's share."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(share) for share in shares]


@dataclass(frozen=True)
class RankRounds:
    """Sequences over the ranks: each rank's share (`share_sequences`) cut into micro-batches as
    `Trainer` cuts them, run in lockstep rounds; a rank out of micro-batches runs idle rounds
    until the busiest one is done."""

    shares: list[list[int]]
    plans: list[MicroBatchPlan]
    rank: int

    @classmethod
    def of(cls, lengths: list[int], world: TrainerWorld, cfg: TrainConfig) -> RankRounds:
        shares = share_sequences(lengths, world.size)
        plans = [
            plan_micro_batches(
                [lengths[i] for i in share], cfg.micro_batch_tokens, cfg.micro_batch_min_efficiency, cfg.pad_to_multiple
            )
            for share in shares
        ]
        return cls(shares, plans, world.rank)

    @property
    def rounds(self) -> int:
        return max(len(plan.batches) for plan in self.plans)

    @property
    def idle(self) -> int:
        """Rounds the ranks spent idle, all ranks together."""
        return sum(self.rounds - len(plan.batches) for plan in self.plans)

    def mine(self) -> Iterator[list[int] | None]:
        """This rank's micro-batch of each round (indices into `lengths`), or None: idle."""
        share, plan = self.shares[self.rank], self.plans[self.rank]
        for round_ in range(self.rounds):
            yield [share[i] for i in plan.batches[round_]] if round_ < len(plan.batches) else None


# ---- the trainer ----------------------------------------------------------------------------


@dataclass
class _Followed:
    """What a follower keeps between rank 0's calls: the batch in flight and its last update."""

    plan: BatchPlan | None = None
    prepared: PreparedUpdate | None = None


class DistributedTrainer(Trainer):
    """One rank's `Trainer` over an FSDP2-sharded model. On rank 0 every call is first sent to
    the followers (module docstring); on ranks > 0 `follow` makes the same calls."""

    sharded = True

    def __init__(
        self,
        world: TrainerWorld,
        train: TrainConfig,
        model: ModelConfig,
        *,
        model_path: Path | None = None,
        seed: int = 0,
        completion_budget: int,
    ) -> None:
        self.world = world
        self._lock = threading.RLock()
        self._depth = 0
        self._followed = _Followed()
        if world.leads:
            world.send("build", {"train": train, "model": model, "model_path": model_path, "seed": seed,
                                 "completion_budget": completion_budget})
        super().__init__(train, model, model_path=model_path, seed=seed, completion_budget=completion_budget)
        self.fsdp_modules = shard_model(self.model)
        # The parameters are DTensors now: the optimizer and schedule are built again on them.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        from grpod.training.optim import build_optimizer, build_scheduler

        self.optimizer = build_optimizer(self.trainable, train)
        self.scheduler = build_scheduler(self.optimizer, train)
        log.info("trainer_sharded", rank=world.rank, world_size=world.size, fsdp_modules=len(self.fsdp_modules))

    # ---- the command protocol ------------------------------------------------------------
    @contextmanager
    def _call(self, name: str, *args: Any) -> Iterator[None]:
        """One call on every rank: rank 0 sends it first, the lock keeps one order. A call made
        inside another (the base class's `load_state_dict` setting the learning rate) is part of
        the outer one, which every rank runs: it is not sent again."""
        with self._lock:
            outer = self._depth == 0
            self._depth += 1
            try:
                if outer and self.world.leads:
                    self.world.send(name, *args)  # a dead rank may show here first (gloo reads ahead)
                yield
            except BaseException as exc:
                if outer and self.world.leads and self.world.broken is None:
                    self.world.broken = f"{name} failed ({type(exc).__name__}: {str(exc)[:200]})"
                    log.error("trainer_ranks_broken", call=name, error=str(exc)[:300])
                    if isinstance(exc, Exception) and not isinstance(exc, TrainerRanksBroken):
                        raise self.world.out_of_step(name) from exc
                raise
            finally:
                self._depth -= 1

    def follow(self) -> None:
        """Ranks > 0: execute rank 0's calls in order until it sends stop."""
        followed = self._followed
        while True:
            name, args = self.world.receive()
            if name == "stop":
                return
            if name not in FOLLOWED:
                raise FollowerProtocolError(f"rank {self.world.rank}: unknown command {name!r} from rank 0")
            if name == "plan":
                groups, self.train_cfg = args  # rank 0's [train], live changes included
                followed.plan = self.plan(groups)
            elif name == "prepare":
                assert followed.plan is not None, "prepare before plan"
                followed.prepared = self.prepare(followed.plan, *args)
            elif name == "apply":
                assert followed.prepared is not None, "apply before prepare"
                self.apply(followed.prepared)
            elif name == "finish":
                assert followed.plan is not None, "finish before plan"
                self.finish(followed.plan)
                followed.plan = followed.prepared = None
            elif name == "load_state_dict":
                # rank 0's [train] too: a resumed run's `ctl set` values (train.lr) are in it only.
                rest, whole_optimizer, self.train_cfg = args
                self._load_state(rest, None, whole_optimizer)
            else:
                getattr(self, name)(*args)

    # ---- the phases -----------------------------------------------------------------------
    def plan(self, groups: list[RolloutGroup]) -> BatchPlan:
        with self._call("plan", groups, self.train_cfg):
            return super().plan(groups)

    def prepare(self, plan: BatchPlan, part: list[int]) -> PreparedUpdate:
        with self._call("prepare", part):
            return super().prepare(plan, part)

    def apply(self, prepared: PreparedUpdate) -> None:
        with self._call("apply"):
            super().apply(prepared)

    def finish(self, plan: BatchPlan) -> dict[str, float]:
        with self._call("finish"):
            return super().finish(plan)

    def _backward(self, plan: BatchPlan, part: list[int], normalizer: StepNormalizer) -> None:
        """This rank's share of `part`, in rounds with the other ranks' (the normalisers are the
        whole part's); then every rank's statistics and token counts, merged in rank order."""
        rounds = RankRounds.of([len(plan.sequences[i].tokens) for i in part], self.world, self.train_cfg)
        stats = LossStats()
        for mine in rounds.mine():
            if mine is None:
                self._idle_round(backward=True)
            else:
                stats.merge(self._micro_batch_backward(plan, [part[i] for i in mine], normalizer))
        for rank_stats in self.world.gather(stats):  # the same order on every rank
            plan.stats.merge(rank_stats)
        plan.real_tokens += sum(p.real_tokens for p in rounds.plans)
        plan.processed_tokens += sum(p.processed_tokens for p in rounds.plans)
        plan.micro_batches += sum(len(p.batches) for p in rounds.plans)
        plan.metrics["idle_rounds"] = plan.metrics.get("idle_rounds", 0.0) + rounds.idle

    def _idle_round(self, *, backward: bool) -> None:
        """A round this rank has no micro-batch for: FSDP's all-gathers (and reduce-scatters)
        still need it, so a forward of one pad token (and a backward of zero: no gradient)."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits
        if backward:
            (logits.sum() * 0.0).backward()

    def _clip_gradients(self, max_norm: float) -> float:
        """clip_grad_norm_ over the sharded gradients: the norm of the whole gradient."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.trainable if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(self.trainable, max_norm, total)
        return float(total)

    @torch.no_grad()
    def _old_logprobs(self, sequences: list[TrainingSequence]) -> list[torch.Tensor]:
        """pi_old's logprobs, each rank its share of the sequences, then gathered to every rank."""
        rounds = RankRounds.of([len(s.tokens) for s in sequences], self.world, self.train_cfg)
        found: dict[int, torch.Tensor] = {}
        for mine in rounds.mine():
            if mine is None:
                self._idle_round(backward=False)
            else:
                found.update({i: t.cpu() for i, t in self._micro_batch_logprobs(sequences, mine).items()})
        old: list[torch.Tensor | None] = [None] * len(sequences)
        for rank_found in self.world.gather(found):
            for i, tensor in rank_found.items():
                old[i] = tensor.to(self.device)
        return old

    # ---- what else the daemon and the bridges call ---------------------------------------
    def score(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        with self._call("score", token_ids, temperature):
            return super().score(token_ids, temperature)

    def set_learning_rate(self, lr: float) -> None:
        with self._call("set_learning_rate", lr):
            super().set_learning_rate(lr)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors on rank 0's CPU (gathered; an empty dict on the others)."""
        with self._call("full_state_dict"):
            return self._gather_full()

    def _gather_full(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_weights(self, out: Path) -> None:
        """Rank 0 writes the HF export of the whole model (gathered from every rank)."""
        with self._call("save_weights", str(out)):
            state = self._gather_full()
            if self.world.leads:
                self._write_hf(Path(out), state)

    def _write_hf(self, out: Path, state: dict[str, torch.Tensor]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        # Gathered, a tied head is a tensor of its own: leave it out as HF's save of the whole model
        # does (one parameter under its first name), so that both exports are the same files.
        state = {name: tensor for name, tensor in state.items() if name not in tied_aliases(self.model)}
        self.model.save_pretrained(out, state_dict=state, safe_serialization=True)
        write_tokenizer_files(self.tokenizer_files, out)
        log.info("weights_saved", out=str(out), step=self.step, gathered_from=self.world.size)

    def state_dict(self) -> dict[str, Any]:
        """Schedule and step counters (the same on every rank); the optimizer's shards are in
        the sharded state (`save_sharded`)."""
        return {"scheduler": self.scheduler.state_dict(), "step": self.step, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Schedule and counters; and a single process's whole optimizer state when `state`
        holds one (its checkpoint resumed under torchrun: rank 0 has it, the shards are
        broadcast from it)."""
        rest = {k: v for k, v in state.items() if k != "optimizer"}
        self._load_state(rest, state.get("optimizer"), "optimizer" in state)

    def _load_state(self, rest: dict[str, Any], whole: dict[str, Any] | None, whole_optimizer: bool) -> None:
        with self._call("load_state_dict", rest, whole_optimizer, self.train_cfg):
            if whole_optimizer:
                set_optimizer_state_dict(
                    self.model, self.optimizer, by_parameter_name(self.model, whole) if whole is not None else {},
                    options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
                )
            super().load_state_dict(rest)

    def save_sharded(self, path: Path) -> None:
        with self._call("save_sharded", str(path)):
            save_sharded_state(self.model, self.optimizer, Path(path))

    def load_sharded(self, path: Path, with_optimizer: bool = True) -> None:
        with self._call("load_sharded", str(path), with_optimizer):
            load_sharded_state(self.model, self.optimizer if with_optimizer else None, Path(path))


def build_distributed_trainer(
    cfg: GrpodConfig, model_path: Path | None = None, *, adapter_path: Path | None = None, world: TrainerWorld
) -> DistributedTrainer:
    """Rank 0's trainer (`build_trainer`'s counterpart): the followers build theirs with it."""
    if adapter_path is not None:
        raise ValueError(f"adapter_path {adapter_path}: LoRA is not supported with trainer ranks")
    return DistributedTrainer(
        world, cfg.train, cfg.model, model_path=model_path, seed=cfg.run.seed, completion_budget=cfg.completion_budget,
    )


def follow(world: TrainerWorld) -> None:
    """Ranks > 0: build the trainer when rank 0 builds its own, follow its calls, until stop."""
    while True:
        name, args = world.receive()
        if name == "stop":
            return
        if name != "build":
            raise FollowerProtocolError(f"rank {world.rank}: {name!r} from rank 0 before the trainer was built")
        (kwargs,) = args
        trainer = DistributedTrainer(world, kwargs.pop("train"), kwargs.pop("model"), **kwargs)
        trainer.follow()
        return


def stop_followers(world: TrainerWorld) -> None:
    """Rank 0, at the daemon's end: release every follower (unless the ranks are out of step:
    then rank 0's exit ends them, through torchrun)."""
    if world.broken is None:
        try:
            world.send("stop")
        except Exception as exc:  # noqa: BLE001 — the end of the process either way
            log.warning("followers_not_released", error=str(exc)[:300])
