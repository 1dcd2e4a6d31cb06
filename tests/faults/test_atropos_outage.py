"""Case 4: the Atropos trajectory API (real `run-api`) goes down for 30 s in the middle of a run.

Also the daemon-level Atropos end-to-end run (issue 5): a minimal environment generates its
groups the way Atropos environments do — arithmetic prompts sent to the `POST /generate` route of
the daemon's own vLLM, completions with their inference logprobs, scored by the arithmetic
verifier — and keeps a few of them queued in run-api. The daemon registers, trains from `/batch`;
the first step's trainer-vs-inference logprob gap shows the logprobs are vLLM's, aligned token for
token.

Once the daemon has trained two steps, run-api is stopped by its PID; 30 s later a fresh one
starts on the same port (it has forgotten the trainer and the environment, as after a crash).
Meanwhile `ctl status` shows the source `waiting_for_api`; afterwards the daemon registers again,
training continues, the run finishes with exit 0, and every group the daemon received was
trained (or is in the final checkpoint's buffer) exactly once.
"""

from __future__ import annotations

import random
import threading
import time

import aiohttp
import anyio
import pytest
from transformers import AutoTokenizer

from grpod.rollouts.arithmetic import ArithmeticTask, prompt_ids
from tests.atropos_env import ScoredGroupEnv, TrajectoryApiProcess, api_get
from tests.faults.injection import (
    checkpoint_steps,
    failure_reason,
    follow_to_exit,
    log_events,
    run_state,
    status_until,
    step_records,
)
from tests.harness import DaemonProcess, base_settings, write_config

pytestmark = pytest.mark.faults

STEPS = 8
GROUP_SIZE = 4
DOWN_S = 30.0
QUEUED_GROUPS = 4


class Environment(threading.Thread):
    """Keeps `QUEUED_GROUPS` scored groups queued in run-api, each generated through the daemon's
    vLLM `/generate`; survives run-api restarts by registering again. Runs its own event loop in
    a thread; `stop()` ends it."""

    def __init__(self, url: str, daemon: DaemonProcess, model_dir) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.daemon_process = daemon
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.task = ArithmeticTask(seed=3)
        self.rng = random.Random(3)
        self.posted = 0
        self.registrations = 0
        self.errors = 0
        self.scores: list[float] = []
        self._stopping = threading.Event()

    def _generate_url(self) -> str | None:
        try:
            status = self.daemon_process.ctl("status", timeout_s=10)["result"]
        except Exception:  # noqa: BLE001 — the daemon is still starting
            return None
        vllm = (status.get("bridge") or {}).get("vllm") or {}
        return vllm.get("base_url")

    async def _generated_group(self, base_url: str) -> dict:
        """One scored group the way an Atropos environment makes it, from grpod's `/generate`."""
        problem = self.task.sample(self.rng)
        prompt = prompt_ids(self.tokenizer, problem)
        body = {"prompt": {"prompt_token_ids": prompt}, "n": GROUP_SIZE, "max_tokens": 6, "temperature": 1.0, "logprobs": 0}
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=60)) as reply:
                assert reply.status == 200, await reply.text()
                answer = await reply.json()
        tokens, masks, logprobs, scores = [], [], [], []
        for ids, per_token, finish in zip(answer["token_ids"], answer["logprobs"], answer["finish_reasons"], strict=True):
            tokens.append(prompt + ids)
            masks.append([-100] * len(prompt) + ids)
            logprobs.append([1.0] * len(prompt) + [next(iter(entry[0].values())) for entry in per_token])
            # The verifier, plus half a point for ending the turn (the random model rarely does).
            exact = self.task.score(problem, self.tokenizer.decode(ids))
            scores.append(exact if exact else 0.5 * (finish == "stop"))
        return {
            "tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": logprobs,
            "generation_params": {"temperature": 1.0}, "advantages": None, "ref_logprobs": None,
            "messages": None, "overrides": None, "group_overrides": None, "images": None,
        }  # fmt: skip

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=30)

    def run(self) -> None:
        anyio.run(self._feed)

    async def _feed(self) -> None:
        env = ScoredGroupEnv(self.url, group_size=GROUP_SIZE)
        base_url = None
        while not self._stopping.is_set():
            if base_url is None:
                base_url = await anyio.to_thread.run_sync(self._generate_url)
                if base_url is None:
                    await anyio.sleep(0.5)
                    continue
            try:
                if env.env_id is None:
                    if await env.try_register() is None:
                        await anyio.sleep(0.1)
                        continue
                    self.registrations += 1
                status = await api_get(self.url, "/status")
                if status.get("queue_size", 0) < QUEUED_GROUPS:
                    group = await self._generated_group(base_url)
                    await env.post(group)
                    self.posted += 1
                    self.scores.extend(group["scores"])
                    continue
            except Exception:  # noqa: BLE001 — run-api is down: register again once it is back
                self.errors += 1
                env.env_id = None
            await anyio.sleep(0.1)


@pytest.mark.timeout(600)
def test_run_api_down_30_s_daemon_waits_and_finishes(tmp_path, fault_model_dir, fault_case):
    row = fault_case("4 Atropos run-api down 30 s")
    run_dir = tmp_path / "run"
    with TrajectoryApiProcess(tmp_path) as api:
        settings = base_settings(run_dir, fault_model_dir) | {
            "train.steps": STEPS,
            "source.kind": "atropos",
            "source.atropos_url": api.url,
            "source.group_size": GROUP_SIZE,
            "source.atropos_poll_s": 0.2,
            "inference.start_timeout_s": 300.0,
        }
        daemon = DaemonProcess(write_config(tmp_path / "grpod.toml", settings), run_dir)
        env = Environment(api.url, daemon, fault_model_dir)
        env.start()
        try:
            status_until(daemon, lambda s: s["step"] >= 2, 400, "two steps trained from run-api")
            api.stop()
            down_at = time.monotonic()
            waiting = status_until(
                daemon, lambda s: s["source"]["api_state"] == "waiting_for_api", DOWN_S, "the source waiting for run-api"
            )
            step_down = waiting["step"]
            time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at)))
            still = daemon.ctl("status")["result"]
            assert still["step"] < STEPS, "the run ended during the outage: raise STEPS"
            api.start()
            up_at = time.monotonic()
            status_until(daemon, lambda s: s["step"] > still["step"], 300, "a step trained after run-api came back")
            row.recovery_s = time.monotonic() - up_at
            code, last = follow_to_exit(daemon, 300)
        finally:
            env.stop()
            daemon.close()

    records = step_records(run_dir)
    trained = [gid for r in records for gid in r["group_ids"]]
    received = {
        f"atropos-{e['batch']}-{i}" for e in log_events(run_dir, "atropos_batch_received") for i in range(e["accepted"])
    }
    final = run_state(run_dir, checkpoint_steps(run_dir)[-1])
    kept = [g["group_id"] for g in final["buffered"]] + [g["group_id"] for g in final["source_cursor"].get("pending", [])]
    missing = received - set(trained) - set(kept)
    twice = len(trained) - len(set(trained))
    row.data_lost = "none" if not missing and not twice else f"{len(missing)} received but lost, {twice} trained twice"
    row.notes = (
        f"waiting_for_api at step {step_down}, step {still['step']} after {DOWN_S:.0f} s down; "
        f"source registrations {last['source']['registrations']}, api errors {last['source']['api_errors']}"
    )

    assert code == 0, f"exit {code}: {failure_reason(run_dir)}\n{daemon.tail()}"
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step trained exactly once"
    assert still["source"]["api_state"] == "waiting_for_api", "still waiting at the end of the outage"
    assert still["source"]["last_error"] and "no response" in still["source"]["last_error"]
    assert last["source"]["registrations"] >= 2, "registered again with the restarted run-api"
    assert log_events(run_dir, "atropos_api_back"), "the source logged the API's return"
    assert not missing and not twice
    assert env.registrations >= 2
    # The groups came from vLLM: at step 1 (weights = the ones that sampled them) the trainer's
    # logprobs of the completion tokens equal the inference logprobs Atropos carried.
    assert env.posted >= STEPS * 2 and len(env.scores) == env.posted * GROUP_SIZE
    assert records[0]["logprob_diff_abs_mean"] < 0.01, records[0]["logprob_diff_abs_mean"]
    assert any(r["loss"] != 0.0 for r in records), "the generated groups carried a learning signal"
