"""Trainer ranks (`grpod.training.distributed`): the command protocol, and 2 FSDP ranks on gloo.

The fast tests drive a follower's dispatch and the sequence split in this process. The others
start `tests/training/fsdp_ranks.py` under torchrun (2 ranks, gloo, no vLLM) on replayed groups
of the tiny model with tied embeddings, two PPO minibatches per batch (pi_old computed across the
ranks), a KL penalty to a frozen reference model (whole on every rank), gradient checkpointing
and micro-batches small enough that the ranks' counts differ (idle rounds):

- 2 ranks train as one process does on the same groups: losses and gradient norms to a relative
  1e-5, the weights to 1e-5 absolute (1e-6 relative in norm): FSDP sums the same terms in another
  order, and Adam's normalised step turns that rounding into up to ~lr/100 where a gradient is
  near 0 (measured after 4 steps: 3e-6 max, 1.3e-7 relative in norm);
- the sharded checkpoint (DCP) of 2 ranks resumes bit for bit at 2 ranks; in one process without
  torchrun (DCP reshards: the same tensors); and that process's own checkpoint resumes at 2 ranks
  bit for bit again (2 -> 1 -> 2 loses nothing).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpod.config import ConfigError, parse_config
from grpod.training import distributed
from grpod.training.distributed import (
    DistributedTrainer,
    FollowerProtocolError,
    TrainerRanksBroken,
    TrainerWorld,
    check_supported,
    share_sequences,
    stop_followers,
)
from grpod.training.sharded import by_parameter_name
from tests.faults.injection import write_replay_rollouts
from tests.harness import ROOT, base_settings, write_config

STEPS = 4
CHECKPOINT_AT = 2
RANKS_SCRIPT = Path(__file__).with_name("fsdp_ranks.py")
LAUNCH_TIMEOUT_S = 600


# ---- in this process: the follower's dispatch, the split, the refusals ------------------------
class ScriptedWorld:
    """Rank 1 of 2, receiving a fixed list of commands."""

    rank, size, leads, broken = 1, 2, False, None

    def __init__(self, commands):
        self.commands = list(commands)

    def receive(self):
        return self.commands.pop(0)


class RecordingTrainer(DistributedTrainer):
    """A follower whose phases record their calls instead of computing."""

    def __init__(self, world):  # no model: only the protocol
        import threading

        from grpod.training.distributed import _Followed

        self.world, self._lock, self._depth, self._followed = world, threading.RLock(), 0, _Followed()
        self.train_cfg, self.calls = None, []

    def plan(self, groups):
        with self._call("plan", groups, self.train_cfg):
            self.calls.append(("plan", groups, self.train_cfg))
            return f"plan of {groups}"

    def prepare(self, plan, part):
        with self._call("prepare", part):
            self.calls.append(("prepare", plan, part))
            return f"prepared {part}"

    def apply(self, prepared):
        with self._call("apply"):
            self.calls.append(("apply", prepared))

    def finish(self, plan):
        with self._call("finish"):
            self.calls.append(("finish", plan))

    def score(self, token_ids, temperature=1.0):
        with self._call("score", token_ids, temperature):
            self.calls.append(("score", token_ids, temperature))

    def _load_state(self, rest, whole, whole_optimizer):
        self.calls.append(("load_state_dict", rest, whole_optimizer, self.train_cfg))


def test_a_follower_makes_rank_0s_calls_in_order_with_its_own_plan():
    train = parse_config({}).train
    world = ScriptedWorld([
        ("plan", (["g1", "g2"], train)), ("prepare", ([0, 2],)), ("apply", ()), ("prepare", ([1, 3],)),
        ("apply", ()), ("finish", ()), ("score", ([5, 6, 7], 1.0)), ("stop", ()),
    ])
    follower = RecordingTrainer(world)
    follower.follow()
    assert follower.calls == [
        ("plan", ["g1", "g2"], train),  # rank 0's live [train] arrives with the batch
        ("prepare", "plan of ['g1', 'g2']", [0, 2]),
        ("apply", "prepared [0, 2]"),
        ("prepare", "plan of ['g1', 'g2']", [1, 3]),
        ("apply", "prepared [1, 3]"),
        ("finish", "plan of ['g1', 'g2']"),
        ("score", [5, 6, 7], 1.0),
    ]
    assert world.commands == []


def test_a_follower_loads_a_checkpoint_under_rank_0s_train_config():
    """A resumed run's `ctl set` values are in rank 0's config only (the followers read the file):
    the schedule a follower loads is judged against rank 0's train.lr, as rank 0's is."""
    operator = parse_config({"train": {"lr": 2e-5}}).train
    world = ScriptedWorld([("load_state_dict", ({"step": 7}, False, operator)), ("stop", ())])
    follower = RecordingTrainer(world)
    follower.train_cfg = parse_config({"train": {"lr": 1e-4}}).train  # its own file's
    follower.follow()
    assert follower.calls == [("load_state_dict", {"step": 7}, False, operator)]
    assert follower.train_cfg.lr == 2e-5


def test_a_follower_refuses_a_command_it_does_not_know():
    follower = RecordingTrainer(ScriptedWorld([("rm_rf", ("/",)), ("stop", ())]))
    with pytest.raises(FollowerProtocolError, match="unknown command 'rm_rf'"):
        follower.follow()


def test_rank_0_sends_each_call_once_even_when_a_call_makes_another():
    sent = []

    class Leader(ScriptedWorld):
        rank, leads = 0, True

        def send(self, name, *args):
            sent.append(name)

    trainer = RecordingTrainer(Leader([]))
    with trainer._call("load_state_dict", {}, False):
        trainer.score([1, 2])  # e.g. the base class setting the learning rate inside
    trainer.score([3, 4])
    assert sent == ["load_state_dict", "score"]


class _Sent:
    """`dist.broadcast` on rank 0: records each call's name (the pickled part) or fails its wait."""

    def __init__(self, wait_error: str | None = None) -> None:
        self.names: list[str] = []
        self.wait_error = wait_error

    def __call__(self, tensor, src, group, async_op):
        assert src == 0 and async_op, "rank 0 never waits on a send without its deadline"
        if tensor.dtype == torch.uint8:
            self.names.append(pickle.loads(tensor.numpy().tobytes())[0])
        sent = self

        class Work:
            def wait(self, timeout):
                assert timeout.total_seconds() == 600.0, "train.collective_timeout_s bounds every part"
                if sent.wait_error:
                    raise RuntimeError(sent.wait_error)

        return Work()


def test_a_call_that_fails_on_rank_0_puts_the_ranks_out_of_step(monkeypatch):
    sent = _Sent()
    monkeypatch.setattr(distributed.dist, "broadcast", sent)
    world = TrainerWorld(rank=0, size=2, commands=None, objects=None)
    trainer = RecordingTrainer(world)
    with pytest.raises(TrainerRanksBroken, match="prepare: the trainer ranks are out of step.*closed by peer"), \
            trainer._call("prepare", [0]):
        raise RuntimeError("Connection closed by peer")  # what gloo says when a rank died
    assert world.broken.startswith("prepare failed")
    sent = sent.names
    with pytest.raises(TrainerRanksBroken, match="restart the job") as later:
        trainer.score([1, 2])
    # A later call's error (the one a run may fail with) says since when and why, as the first's does.
    assert "out of step since prepare failed" in str(later.value) and "collective_timeout_s = 600 s" in str(later.value)
    stop_followers(world)  # nothing to release: rank 0's exit ends the others
    assert sent == ["prepare"]


def test_a_call_whose_announcement_fails_puts_the_ranks_out_of_step_too(monkeypatch):
    def dead_rank(tensor, src, group, async_op):
        raise RuntimeError("Read error [127.0.0.1]:17074: Connection reset by peer")  # measured

    monkeypatch.setattr(distributed.dist, "broadcast", dead_rank)
    world = TrainerWorld(rank=0, size=2, commands=None, objects=None)
    with pytest.raises(TrainerRanksBroken, match="did not take the call.*reset by peer"):
        RecordingTrainer(world).score([1, 2])
    assert world.broken.startswith("score failed")
    stop_followers(world)  # sends nothing, raises nothing


def test_a_frozen_follower_is_given_up_after_the_collective_timeout(monkeypatch):
    """Rank 0 waits for a follower to take a call at most train.collective_timeout_s (the commands
    group itself has no deadline: followers wait for rank 0 as long as it lives)."""
    monkeypatch.setattr(distributed.dist, "broadcast", _Sent("Timed out waiting 600000ms for send operation to complete"))
    world = TrainerWorld(rank=0, size=2, commands=None, objects=None)
    with pytest.raises(TrainerRanksBroken, match="froze past train.collective_timeout_s = 600 s"):
        RecordingTrainer(world).score([1, 2])
    assert world.broken.startswith("score failed")


def test_sequences_are_shared_by_tokens_longest_first_the_same_on_every_rank():
    lengths = [30, 10, 50, 20, 40, 5]
    shares = share_sequences(lengths, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(lengths), loads
    assert shares == share_sequences(lengths, 2)
    assert share_sequences([7], 3) == [[0], [], []], "a rank may get nothing: it runs idle rounds"


def test_what_trainer_ranks_cannot_do_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="train.lora"):
        check_supported(parse_config({"train": {"lora": True}, "bridge": {"mode": "lora_only"}}), 2)
    with pytest.raises(ConfigError, match="bridge.mode = 'shared'"):
        check_supported(parse_config({"bridge": {"mode": "shared"}}), 2)
    with pytest.raises(ConfigError, match="train.optimizer = 'adafactor'"):
        check_supported(parse_config({"train": {"optimizer": "adafactor"}}), 2)
    check_supported(parse_config({"bridge": {"mode": "broadcast"}}), 2)


def test_a_single_process_optimizer_state_is_renamed_by_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    named = by_parameter_name(model, optimizer.state_dict())
    assert list(named["state"]) == ["0.weight", "1.weight", "1.bias"]
    assert named["param_groups"][0]["params"] == ["0.weight", "1.weight", "1.bias"]
    assert torch.equal(named["state"]["1.bias"]["exp_avg"], optimizer.state[model[1].bias]["exp_avg"])


# ---- 2 ranks under torchrun ----------------------------------------------------------------
@dataclass
class Run:
    out: Path
    result: dict
    weights: dict[str, torch.Tensor]

    @classmethod
    def read(cls, out: Path) -> Run:
        return cls(out, json.loads((out / "result.json").read_text()), load_file(out / "final" / "model.safetensors"))

    def checkpoint(self, step: int) -> Path:
        return self.out / "run" / "checkpoints" / f"step-{step:06d}"


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """The tiny model (tied embeddings) and replayed groups for STEPS steps."""
    from grpod.models.tiny import build_model, save_model

    root = tmp_path_factory.mktemp("fsdp-workload")
    save_model(*build_model(seed=0, tie_word_embeddings=True), root / "model")
    write_replay_rollouts(root / "rollouts.jsonl", root / "model", groups=STEPS * 2, completion_len=40)
    return root


def _config(workload: Path, out: Path, resume: str = "never", **more) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    settings = base_settings(out / "run", workload / "model") | more | {
        "run.resume": resume,
        "source.kind": "replay",
        "source.replay_path": str(workload / "rollouts.jsonl"),
        "train.steps": STEPS,
        "train.minibatches": 2,
        "train.micro_batch_tokens": 96,
        "train.collective_timeout_s": more.get("train.collective_timeout_s", 120.0),
        "model.gradient_checkpointing": True,
        # a frozen reference model on every rank (kept whole), in the loss
        "train.loss.kl_coef": 0.05,
        "train.loss.kl_reference": "model",
    }
    return write_config(out / "grpod.toml", settings)


def _torchrun(config: Path, out: Path, *extra: str, ranks: int = 2) -> Run:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(RANKS_SCRIPT), str(config), str(out), "--steps", str(STEPS), *extra],
        check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return Run.read(out)


def _in_process(config: Path, out: Path, *extra: str) -> Run:
    from tests.training.fsdp_ranks import main

    threads = torch.get_num_threads()
    argv = sys.argv
    try:
        sys.argv = ["fsdp_ranks.py", str(config), str(out), "--steps", str(STEPS), *extra]
        assert main() == 0
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    return Run.read(out)


def _resumed_from(checkpoint: Path, workload: Path, out: Path, **more) -> Path:
    """A config for a run of its own resuming a copy of `checkpoint`."""
    copy = out / "resumed-from" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return _config(workload, out, resume=str(copy), **more)


@pytest.fixture(scope="module")
def two_ranks(workload, tmp_path_factory) -> Run:
    """2 ranks, steps 1..STEPS, a checkpoint after CHECKPOINT_AT."""
    out = tmp_path_factory.mktemp("two-ranks")
    return _torchrun(_config(workload, out), out, "--checkpoint-at", str(CHECKPOINT_AT))


@pytest.fixture(scope="module")
def one_process(workload, tmp_path_factory) -> Run:
    """The same run in one process (`Trainer`), no torchrun."""
    out = tmp_path_factory.mktemp("one-process")
    return _in_process(_config(workload, out), out)


def _max_abs(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _bitwise(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in b if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(900)
def test_two_ranks_train_as_one_process_does(two_ranks, one_process):
    ours, theirs = two_ranks.result, one_process.result
    assert ours["backend"] == "gloo"
    for step, reference in theirs["steps"].items():
        mine = ours["steps"][step]
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-7), step
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), step
    assert any(s["idle_rounds"] > 0 for s in ours["steps"].values()), "no step had ranks with different micro-batch counts"
    assert ours["score"] == pytest.approx(theirs["score"], abs=1e-5)
    assert ours["gathered"] == theirs["gathered"], "rank 0 gathers every tensor, tied head included"
    assert ours["lr_after_set"] == pytest.approx(theirs["lr_after_set"])
    assert _max_abs(two_ranks.weights, one_process.weights) <= 1e-5
    norm = lambda d: torch.sqrt(sum((t.double() ** 2).sum() for t in d.values()))
    diff = {k: two_ranks.weights[k] - one_process.weights[k] for k in one_process.weights}
    assert norm(diff) / norm(one_process.weights) <= 1e-6
    exported = sorted(p.name for p in (two_ranks.out / "final").iterdir())
    assert exported == sorted(p.name for p in (one_process.out / "final").iterdir())
    sharded = two_ranks.checkpoint(CHECKPOINT_AT) / "sharded"
    assert {p.name for p in sharded.iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}, "each rank wrote its shards"


@pytest.mark.timeout(900)
def test_the_sharded_checkpoint_resumes_bit_for_bit_at_two_ranks(two_ranks, workload, tmp_path):
    # Rank 0 also makes no call for longer than any collective may wait: the follower's wait
    # for the next call has no such bound (a paused daemon, an engine launching).
    config = _resumed_from(two_ranks.checkpoint(CHECKPOINT_AT), workload, tmp_path, **{"train.collective_timeout_s": 8.0})
    resumed = _torchrun(config, tmp_path, "--idle-s", "12")
    assert resumed.result["resumed_from"] == CHECKPOINT_AT
    assert _bitwise(resumed.weights, two_ranks.weights) == []
    for step in range(CHECKPOINT_AT + 1, STEPS + 1):
        assert resumed.result["steps"][str(step)]["loss"] == two_ranks.result["steps"][str(step)]["loss"]


@pytest.mark.timeout(900)
def test_the_sharded_checkpoint_resumes_in_one_process_and_back_at_two_ranks_bit_for_bit(
    two_ranks, workload, tmp_path
):
    # 2 ranks -> 1 process (no torchrun): DCP gathers the shards; the process checkpoints the
    # state it resumed at once, in its own format (the whole optimizer in trainer_state.pt).
    single = _in_process(
        _resumed_from(two_ranks.checkpoint(CHECKPOINT_AT), workload, tmp_path / "one"), tmp_path / "one",
        "--checkpoint-at", str(CHECKPOINT_AT),
    )
    assert single.result["resumed_from"] == CHECKPOINT_AT
    converted = single.checkpoint(CHECKPOINT_AT)
    assert not (converted / "sharded").exists()
    assert "optimizer" in torch.load(converted / "trainer_state.pt", weights_only=True)
    assert _bitwise(load_file(converted / "model" / "model.safetensors"),
                    load_file(two_ranks.checkpoint(CHECKPOINT_AT) / "model" / "model.safetensors")) == []
    assert _max_abs(single.weights, two_ranks.weights) <= 1e-5, "1 process continues the 2 ranks' run"
    # ... and back: 1 process -> 2 ranks (rank 0 reads the whole optimizer, the shards are
    # broadcast). Nothing was lost on the way: the 2 ranks end where the straight 2 ranks ended.
    back = _torchrun(_resumed_from(converted, workload, tmp_path / "two"), tmp_path / "two")
    assert back.result["resumed_from"] == CHECKPOINT_AT
    assert _bitwise(back.weights, two_ranks.weights) == []
