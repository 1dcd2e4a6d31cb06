"""TRL's GRPOTrainer on the workload of a grpod config: one run, started by `compare.py`.

    python bench/peers/trl_runner.py --config etc/grpod.toml --set run.dir="runs/peers/trl" [--set K=V ...]
        [--threads 1]

It takes the same `--config` and `--set` arguments `grpod start` gets, so both trainers read one
effective config; `workload.py` turns it into TRL's dataset, reward and GRPOConfig (the mapping and
the differences left are in compare.py's docstring). Generation is HF `generate` in the training
process (`use_vllm=False`). The held-out evaluation is a callback: greedy HF `generate` on grpod's
held-out problems, scored by grpod's verifier, at step 0, every `eval.every` steps and after the
last step (as grpod: start, periodic, end).

`--threads N` sets torch's intra-op threads (and OMP_NUM_THREADS, which `compare.py` also sets in
the environment); 0 leaves torch's default (one per core).

Writes `<run.dir>/records.jsonl`, one JSON object per line, each with a wall-clock `time`:
`phase` (started, imported, model_loaded, trainer_ready, trained, done), `step` (step,
generated_tokens: completion tokens sampled for that step, EOS included; reward_mean), `eval`
(step, when, eval_accuracy, eval_size, eval_s) and `log` (what TRL logs each step).
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


class Records:
    """Append-only JSON lines, flushed at once (compare.py reads them after the run)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 — open for the process' lifetime

    def write(self, kind: str, **values) -> None:
        self.file.write(json.dumps({"kind": kind, "time": time.time(), **values}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    parser.add_argument("--eval-batch", type=int, default=64, help="prompts per greedy generate call")
    parser.add_argument("--save-at", type=float, nargs="*", default=[], metavar="EPOCH_S",
                        help="wall-clock times (Unix seconds): at the first step end at or after each, save the "
                        "weights to <run.dir>/weights-at-<i>; after the last, stop training")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workload import AGGREGATIONS, Workload, eos_token_ids, gradient_tokens, grpo_config_kwargs, load
    from workload import held_out_accuracy as shared_held_out_accuracy

    cfg = load(args.config, args.set)
    run_dir = Path(cfg.run.dir)
    records = Records(run_dir / "records.jsonl")
    records.write("phase", name="started", at=STARTED, threads=torch.get_num_threads())

    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    records.write("phase", name="imported", trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    workload = Workload(cfg, tokenizer)
    train = workload.train_examples(cfg.train.steps * cfg.train.groups_per_step)
    held_out = workload.eval_examples()
    workload.check_prompt_tokens(train[: 2 * cfg.train.groups_per_step] + held_out)
    records.write("phase", name="model_loaded", completion_tokens=workload.max_tokens, eval_max_tokens=workload.eval_max_tokens,
                  eval_size=len(held_out), train_prompts=len(train))

    dataset = datasets.Dataset.from_list([{"prompt": e.messages, **e.columns} for e in train])

    class StepTally:
        """What the reward function sees of a step's generations (TRL calls it once per step here)."""

        tokens = 0
        gradient = 0
        scores: list[float] = []

    eos_ids = set(eos_token_ids(model, tokenizer))

    def grpod_reward(prompts, completions, completion_ids, **kwargs):
        columns = [name for name in train[0].columns]
        rows = [{name: kwargs[name][i] for name in columns} for i in range(len(completions))]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = workload.scores(rows, texts, completion_ids)
        StepTally.tokens += sum(len(ids) for ids in completion_ids)
        StepTally.gradient += gradient_tokens(scores, completion_ids, cfg.source.group_size, workload.max_tokens,
                                              eos_ids, cfg.train.loss.mask_truncated)
        StepTally.scores.extend(scores)
        return scores

    def held_out_accuracy(model) -> tuple[float, int]:
        scored = shared_held_out_accuracy(model, tokenizer, workload, held_out, args.eval_batch)
        return scored.correct / max(scored.size, 1), scored.size

    class GrpodSchedule(TrainerCallback):
        """Steps and held-out evaluations recorded as grpod records them (metrics.jsonl)."""

        def _evaluate(self, model, step: int, when: str) -> None:
            began = time.perf_counter()
            accuracy, size = held_out_accuracy(model)
            records.write("eval", step=step, when=when, eval_accuracy=accuracy, eval_size=size,
                          eval_s=round(time.perf_counter() - began, 3))
            print(f"eval ({when}, step {step}): accuracy {accuracy:.3f} on {size} held-out problems", file=sys.stderr, flush=True)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if cfg.eval.size:
                self._evaluate(model, 0, "start")

        def on_step_end(self, args, state, control, model=None, **kwargs):
            scores = StepTally.scores
            records.write("step", step=state.global_step, generated_tokens=StepTally.tokens,
                          gradient_tokens=StepTally.gradient, reward_mean=sum(scores) / len(scores) if scores else None)
            StepTally.tokens, StepTally.gradient, StepTally.scores = 0, 0, []
            while marks and time.time() >= marks[0]:
                index = len(save_at) - len(marks)
                path = run_dir / f"weights-at-{index}"
                model.save_pretrained(path)
                tokenizer.save_pretrained(path)
                records.write("saved", mark=index, mark_time=marks.pop(0), step=state.global_step, path=str(path))
                if not marks:
                    control.should_training_stop = True
                    return
            if not cfg.eval.size:
                return
            # Before the trainer's checkpoint of this step, as grpod evaluates before its final checkpoint.
            if state.global_step >= state.max_steps:
                self._evaluate(model, state.global_step, "end")
            elif cfg.eval.every and state.global_step % cfg.eval.every == 0:
                self._evaluate(model, state.global_step, "periodic")

        def on_log(self, args, state, control, logs=None, **kwargs):
            records.write("log", step=state.global_step, **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    save_at = sorted(args.save_at)
    marks = list(save_at)
    reward_funcs, extra = [grpod_reward], {}
    own = workload.trl_reward_functions()
    if own is not None:
        # The user's functions themselves, called by TRL as grpod calls them; grpod_reward stays
        # (weight 0) to tally each step's tokens and combined reward for the records.
        functions, weights = own
        reward_funcs = [grpod_reward, *functions]
        extra = {"reward_weights": [0.0, *weights],
                 "multi_objective_aggregation": AGGREGATIONS[cfg.source.dataset.reward_aggregation]}
    grpo_args = GRPOConfig(output_dir=str(run_dir), **grpo_config_kwargs(cfg, workload.max_tokens), **extra)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=grpo_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[GrpodSchedule()],
    )
    records.write("phase", name="trainer_ready", optim=str(grpo_args.optim), loss_type=grpo_args.loss_type,
                  batch=grpo_args.per_device_train_batch_size, num_generations=grpo_args.num_generations,
                  eos_token_ids=list(trainer.eos_token_ids))
    trainer.train()
    records.write("phase", name="trained", steps=trainer.state.global_step)
    records.write("phase", name="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
