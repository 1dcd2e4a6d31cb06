"""The warmed-up tiny model, as `init_model` saves it, is served by stock vLLM and agrees with HF.

This starts vLLM's own OpenAI server (not grpod's entry) on the saved directory, so it proves the
model format itself: config, safetensors, tokenizer with its added role tokens, chat template.
The server runs in a process group of its own, stopped by that group in a `finally`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpod.inference.release import (
    free_port,
    group_members,
    remove_shm_segments,
    vllm_shm_segments,
)
from grpod.models.warmup import greedy_answers
from grpod.rollouts.arithmetic import (
    ArithmeticTask,
    answer_ids,
    completion_answer,
    prompt_ids,
)

pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 60.0
# Measured: vLLM CPU (fp32, eager) and HF fp32 log-softmax agree to ~1e-5 on this model.
LOGPROB_TOLERANCE = 2e-3
# A greedy disagreement is accepted only where HF's top two logits are this close (a near-tie
# that fp32 summation order may flip); anywhere else it is a failure.
NEAR_TIE = 1e-3


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        return json.loads(reply.read())


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def stock_vllm(warm_model_dir: Path, tmp_path_factory) -> str:
    """Base URL of `python -m vllm.entrypoints.openai.api_server` serving the warm model."""
    scratch = tmp_path_factory.mktemp("stock-vllm")
    log_path = scratch / "vllm.log"
    port = free_port(HOST)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(warm_model_dir),
        "--host", HOST, "--port", str(port),
        "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", "64M", "--max-model-len", "256",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    # vLLM leaves its rendezvous files in TMPDIR: keep them in this test's scratch directory.
    env = {**os.environ, "TMPDIR": str(scratch)}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    pgid = process.pid
    base = f"http://{HOST}:{port}"
    segments: set[Path] = set()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM exited with code {process.returncode} before /health; log tail:\n{_log_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM /health not 200 after {START_TIMEOUT_S:g} s; log tail:\n{_log_tail(log_path)}")
            time.sleep(0.5)
        segments = vllm_shm_segments(group_members(pgid))
        yield base
    finally:
        segments |= vllm_shm_segments(group_members(pgid))
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not _wait_group_gone(pgid, 10.0):
            os.killpg(pgid, signal.SIGKILL)
            assert _wait_group_gone(pgid, 10.0), f"vLLM process group {pgid} still alive 10 s after SIGKILL"
        process.wait(timeout=10)
        remove_shm_segments(segments)


@pytest.fixture(scope="module")
def hf_policy(warm_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(warm_model_dir, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(warm_model_dir)


def test_prompt_logprobs_match_hf(stock_vllm, hf_policy, warm_model_dir):
    model, tokenizer = hf_policy
    problems = ArithmeticTask(seed=0).eval_set(6)
    worst = 0.0
    for problem in problems:
        ids = prompt_ids(tokenizer, problem) + answer_ids(tokenizer, problem)
        reply = _post(
            f"{stock_vllm}/v1/completions",
            {"model": str(warm_model_dir), "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        )
        entries = reply["choices"][0]["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        served = torch.tensor([entries[t][str(ids[t])]["logprob"] for t in range(1, len(ids))], dtype=torch.float64)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        gap = (served - reference.double()).abs().max().item()
        worst = max(worst, gap)
        assert gap <= LOGPROB_TOLERANCE, f"{problem.question}: vLLM vs HF prompt logprob gap {gap:.2e}"
    print(f"max |vLLM - HF| prompt logprob over {len(problems)} sequences: {worst:.2e}")


def test_greedy_answers_match_hf(stock_vllm, hf_policy, warm_model_dir):
    model, tokenizer = hf_policy
    problems = ArithmeticTask(seed=0).eval_set(24)
    hf_texts = greedy_answers(model, tokenizer, problems, max_new_tokens=8)
    mismatches = []
    for problem, hf_text in zip(problems, hf_texts, strict=True):
        ids = prompt_ids(tokenizer, problem)
        reply = _post(
            f"{stock_vllm}/v1/completions",
            {"model": str(warm_model_dir), "prompt": ids, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True},
        )
        choice = reply["choices"][0]
        served_ids = [t for t in choice["token_ids"] if t != tokenizer.eos_token_id]
        hf_ids = tokenizer.encode(completion_answer(hf_text), add_special_tokens=False)
        if served_ids == hf_ids:
            assert completion_answer(choice["text"]) == completion_answer(hf_text)
            continue
        # Where the two first differ, HF's top-two margin tells a near-tie from a real disagreement.
        common = next(i for i, (a, b) in enumerate(zip(served_ids + [-1], hf_ids + [-2])) if a != b)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + hf_ids[:common]])).logits[0, -1].float()
        top2 = logits.topk(2).values
        mismatches.append((problem.question, choice["text"], hf_text, (top2[0] - top2[1]).item()))
    print(f"vLLM greedy == HF greedy on {len(problems) - len(mismatches)}/{len(problems)} problems")
    real = [m for m in mismatches if m[3] > NEAR_TIE]
    assert not real, f"vLLM greedy differs from HF greedy (question, vLLM, HF, HF top-2 margin): {real}"
    assert len(mismatches) <= 1, f"too many near-tie disagreements: {mismatches}"
