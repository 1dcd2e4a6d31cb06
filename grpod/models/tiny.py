"""The tiny built-in policy: a Qwen2-architecture causal LM and a character tokenizer, made locally.

Nothing is downloaded. The tokenizer is character level (digits, operators, lower-case letters and
the chat special tokens) plus one token per chat role name (`system`, `user`, `assistant`), which
keeps the ChatML text format while making a chat prompt ~13 tokens shorter (training time is
proportional to it); the model a 2-layer Qwen2 with head_dim 64 (the smallest head size the
vLLM CPU attention supports). Both are deterministic from the seed. The model is saved in HF
format (safetensors + tokenizer.json + chat template) so that `from_pretrained` and vLLM load it.

`init_model` makes the policy grpod starts from when none is configured: built, warmed up on the
arithmetic task (`grpod.models.warmup`), and saved atomically with a `grpod_model.json` that
records how it was made and how well it does.

Why the warm-up teaches a rejected answer style. A warm-up that stops while the model is still
learning the arithmetic (340 steps: greedy accuracy 0.33 on training problems, 0.22 held out)
leaves GRPO nothing it can move on held-out problems in minutes, because what it would have to
improve is problem-specific knowledge. Measured offline with the trainer and on-policy samples:
one step does raise P(correct) on its own groups (+0.03 at lr 1e-4), but 400 steps left held-out
greedy accuracy at 0.14 (lr 1e-4; lower at 3e-4 and 1e-3), and at 550 warm-up steps 0.42 -> 0.46
with dips to 0.33. So the warm-up runs long enough for the arithmetic to generalise (800 steps)
and writes 60 % of the non-negative answers as "+12", a form the verifier rejects
(`DEFAULT_PLUS_SIGN_SHARE`). The policy then knows most answers but greedy decoding often opens
with "+": seed 0 is right on 0.21 of the held-out problems greedily, on 0.31 of T=1 samples, and
81 % of problems get a group of 8 samples that mixes right and wrong answers. Dropping the "+" is
one behaviour shared by every problem, so what GRPO learns on training problems shows on held-out
ones: `make run` goes from 0.21 to 0.83 held-out greedy accuracy in 100 steps, most of it in the
first 40 (README has three seeds; bench/tiny_model.py measures the init). The evaluation is still
exact match: a "+12" counts as wrong at the start and at the end alike. The whole init takes
~60 s with one thread on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import structlog
import torch
from tokenizers import AddedToken, pre_tokenizers
from transformers import (
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
)

from grpod.models.warmup import check_stop, greedy_accuracy, sampled_group_stats, warmup
from grpod.rollouts.arithmetic import ArithmeticTask

log = structlog.get_logger(__name__)

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
CHARACTERS = list("0123456789+-*=?:.,()# \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
ROLE_WORDS = ["system", "user", "assistant"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer() -> Qwen2Tokenizer:
    """A character-level tokenizer: a byte-level BPE without merges, plus the chat role words.

    It is built as a `Qwen2Tokenizer` on purpose: transformers 5 reloads the tokenizer of any
    `model_type = qwen2` directory through that class (whatever tokenizer_config.json says), which
    rebuilds the BPE from the saved vocabulary with the Qwen split regex and byte-level spelling.
    A tokenizer of another shape encodes differently once reloaded (a word-level one lost every
    space and newline). Characters outside the alphabet are dropped when encoding.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    spelled = [byte_level.pre_tokenize_str(ch)[0][0] for ch in CHARACTERS]  # " " -> "Ġ", "\n" -> "Ċ"
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + spelled + ROLE_WORDS)}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=PAD,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
    )
    # Added (not special) tokens are matched whole before the per-character split and decode as text.
    tok.add_tokens([AddedToken(word, special=False, normalized=False) for word in ROLE_WORDS])
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 256
    return tok


def build_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    layers: int = 2,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
) -> Qwen2Config:
    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=hidden_size // 64,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.convert_tokens_to_ids(IM_START),
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(PAD),
        torch_dtype="float32",
        use_sliding_window=False,
    )
    if rope_scaling is not None:
        cfg.rope_scaling = rope_scaling
    return cfg


def build_model(seed: int = 0, **config_kwargs) -> tuple[Qwen2ForCausalLM, Qwen2Tokenizer]:
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(build_config(len(tok), **config_kwargs))
    return model, tok


def save_model(model: Qwen2ForCausalLM, tok: PreTrainedTokenizerBase, out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    gen = {"eos_token_id": tok.convert_tokens_to_ids(IM_END), "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


DEFAULT_WARMUP_STEPS = 800
DEFAULT_WARMUP_LR = 3e-3
DEFAULT_WARMUP_BATCH = 64
# Share of warm-up answers >= 0 written "+12" (rejected by the verifier); see the module docstring.
DEFAULT_PLUS_SIGN_SHARE = 0.6
MODEL_RECORD = "grpod_model.json"


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def outdated_recipe(path: Path) -> str | None:
    """Why the model at `path` is not what `init_model` builds today (None when it is, or when
    `path` has no record): a model from an older warm-up recipe makes the default run show
    something else than what the docs promise."""
    record_path = Path(path) / MODEL_RECORD
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    current = {"warmup_steps": DEFAULT_WARMUP_STEPS, "warmup_plus_sign_share": DEFAULT_PLUS_SIGN_SHARE}
    differ = {key: record.get(key, 0.0) for key, value in current.items() if record.get(key, 0.0) != value}
    if not differ:
        return None
    return f"built with {differ}, the current recipe is {current}"


def init_model(
    out: Path,
    seed: int = 0,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    *,
    lr: float = DEFAULT_WARMUP_LR,
    batch_size: int = DEFAULT_WARMUP_BATCH,
    eval_size: int | None = None,
    group_size: int = 8,
    threads: int | None = 1,
    plus_sign_share: float = DEFAULT_PLUS_SIGN_SHARE,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Build the tiny policy, warm it up on the arithmetic task, measure it, save it at `out`.

    Returns (and writes to `out/grpod_model.json`) seed, the warm-up settings (warmup_steps, lr,
    batch size, plus_sign_share), eval_accuracy (HF greedy on
    `eval_size` held-out problems, default all of them), eval_size, seconds, and the sampled-group
    figures (`sampled`: group_size completions per problem at temperature 1).

    Atomic: everything is written into a sibling `out.tmp-*` directory, fsynced, then renamed to
    `out`, so `out` either holds a complete model or does not exist. `out` must not exist (or be an
    empty directory); an existing model is never overwritten.

    `stop`: once set, the build ends at its next safe point (a warm-up step, a measurement, the
    save) with `ModelInitStopped`, having written nothing at `out`.

    Runs with `threads` torch threads (restored afterwards; None = leave the caller's setting):
    the weights are bitwise deterministic from `seed` for a given thread count, and one thread is
    the fast choice for a model this small (measured: with two threads on a busy 2-core machine a
    warm-up step took 10x longer than with one).
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"init_model: {out} already exists and is not an empty directory; "
            f"remove it or choose another path (an existing model is never overwritten)"
        )
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _init_model(out, seed, warmup_steps, lr, batch_size, eval_size, group_size, plus_sign_share, stop)
    finally:
        torch.set_num_threads(previous_threads)


def _init_model(
    out: Path, seed: int, warmup_steps: int, lr: float, batch_size: int, eval_size: int | None, group_size: int,
    plus_sign_share: float, stop: threading.Event | None,
) -> dict[str, Any]:
    started = time.perf_counter()
    model, tok = build_model(seed)
    task = ArithmeticTask(seed=seed)
    problems = task.eval_set(task.held_out_size if eval_size is None else eval_size)
    training = warmup(
        model, tok, task, warmup_steps, seed=seed, lr=lr, batch_size=batch_size, plus_sign_share=plus_sign_share,
        stop=stop,
    )
    check_stop(stop, "before measuring greedy accuracy")
    accuracy = greedy_accuracy(model, tok, problems)
    check_stop(stop, "before sampling groups")
    sampled = sampled_group_stats(model, tok, problems, group_size=group_size, temperature=1.0, seed=seed)
    check_stop(stop, "before saving")
    record = {
        "seed": seed,
        "warmup_steps": warmup_steps,
        "warmup_lr": lr,
        "warmup_batch_size": batch_size,
        "warmup_plus_sign_share": plus_sign_share,
        "warmup_final_loss": training["final_loss"],
        "task": task.name,
        "task_max_operand": task.max_operand,
        "eval_accuracy": accuracy,
        "eval_size": len(problems),
        "sampled": sampled,
        "torch_threads": torch.get_num_threads(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        save_model(model, tok, tmp)
        record["seconds"] = round(time.perf_counter() - started, 3)
        (tmp / MODEL_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _fsync_tree(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the model is meant to be readable like any file
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fields = {k: v for k, v in record.items() if k != "sampled"}
    log.info("model_initialised", path=str(out), mixed_share=sampled["mixed_share"], **fields)
    return record
