"""The gloo weight transfer with real vLLM (CPU build): one engine, two engines in one group, and a
trainer that dies mid-update.

Engines are launched on first use and shared by the module (a launch costs 25-120 s here), so a
case run alone starts only the engines it needs. No case depends on what another left in an
engine: each sends a complete update of its own weights (checked to differ from what the engine
served before) and forms and shuts down its own group.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from grpod.bridges.probe import probe_sequences
from grpod.config import InferenceConfig, ModelConfig
from grpod.inference.client import InferenceRequestError
from grpod.inference.process import InferenceProcess
from grpod.models.tiny import build_model, save_model
from grpod.weights.transfer import (
    ENGINE_EXTENSION,
    EngineWeightClient,
    TransferConfig,
    engine_launch_args,
    iter_state,
    open_weight_group,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
# Small chunks, so the tiny model (1.8 MB) travels in many and a sender can die between two.
CHUNK_BYTES = 128 * 1024
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def portal():
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        yield portal


class EnginePool:
    """vLLM engines with the gloo backend on the tiny model, launched on first use."""

    def __init__(self, portal, model_dir: Path, root: Path) -> None:
        self.portal = portal
        self.model_dir = model_dir
        self.root = root
        self.engines: dict[int, InferenceProcess] = {}

    def get(self, *indices: int) -> list[InferenceProcess]:
        missing = [i for i in indices if i not in self.engines]
        for i in missing:
            self.engines[i] = InferenceProcess(
                InferenceConfig(start_timeout_s=400.0, request_timeout_s=60.0, extra_args=engine_launch_args("gloo")),
                ModelConfig(path=self.model_dir),
                self.root / f"engine-{i}",
            )

        async def start_missing() -> None:
            async with anyio.create_task_group() as group:
                for i in missing:
                    group.start_soon(lambda p=self.engines[i]: p.start(self.model_dir, worker_extension=ENGINE_EXTENSION))

        self.portal.call(start_missing)
        return [self.engines[i] for i in indices]

    def stop_all(self) -> None:
        for process in self.engines.values():
            self.portal.call(process.stop)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model with tied embeddings: on CPU, vLLM's output head then computes from a copy
    of the embedding packed at load time, which the layerwise reload alone leaves stale
    (`grpod.weights.reload_ext`); an untied model would not show it."""
    out = tmp_path_factory.mktemp("tiny-tied")
    model, tokenizer = build_model(seed=0, tie_word_embeddings=True)
    save_model(model, tokenizer, out)
    return out


@pytest.fixture(scope="module")
def engines(portal, model_dir, tmp_path_factory):
    pool = EnginePool(portal, model_dir, tmp_path_factory.mktemp("gloo-engines"))
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="module")
def probe_ids(model_dir) -> list[list[int]]:
    return probe_sequences(AutoTokenizer.from_pretrained(model_dir))


def perturbed_model(model_dir: Path, seed: int) -> Qwen2ForCausalLM:
    """The tiny model with every weight moved by N(0, 0.05): a trainer's weights after training."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


@torch.no_grad()
def hf_scores(model, sequences: list[list[int]]) -> list[list[float]]:
    """fp32 logprob of token t given tokens[:t], t >= 1: what vLLM's prompt_logprobs report."""
    out = []
    for ids in sequences:
        x = torch.tensor([ids])
        logprobs = model(input_ids=x).logits[0, :-1].float().log_softmax(-1)
        out.append(logprobs.gather(-1, x[0, 1:, None])[:, 0].tolist())
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


async def served_scores(process: InferenceProcess, sequences) -> list[list[float]]:
    async with process.client() as client:
        await client.reset_prefix_cache()  # vLLM's weight-transfer routes leave it as it was
        return await client.score_many(sequences)


async def status(process: InferenceProcess) -> dict:
    async with process.client() as client:
        (state,) = await client.collective_rpc("grpod_weight_transfer_status")
    return state


def sync_and_check(portal, processes, model, probe_ids, version: str) -> None:
    """Sync `model` to `processes` over one new gloo group; every engine must then score the probe
    as the trainer does, to TOLERANCE (and must not have before)."""
    want = hf_scores(model, probe_ids)
    for process in processes:
        before = portal.call(served_scores, process, probe_ids)
        assert max_diff(before, want) > 1e-2, "the engine already served these weights: the check has no teeth"

    async def sync():
        clients = [EngineWeightClient.for_process(p) for p in processes]
        cfg = TransferConfig(chunk_bytes=CHUNK_BYTES, timeout_s=TIMEOUT_S)
        async with open_weight_group(clients, cfg) as group:
            assert group.rank_offsets == list(range(1, len(processes) + 1))
            timings = await group.sync(list(iter_state(model)), weight_version=version)
            assert timings.broadcast.chunks > 1
            async with processes[0].client() as client:
                assert await client.weight_version() == version

    portal.call(sync)
    for process in processes:
        got = portal.call(served_scores, process, probe_ids)
        assert max_diff(got, want) <= TOLERANCE, f"{process.base_url}: max |vLLM - trainer| {max_diff(got, want):.2e}"
        state = portal.call(status, process)
        assert state["last_update"]["ok"] and state["meta_tensors"] == [], state
        assert state["group"] is None, "the group's exit must shut the engine's side down"


def test_one_engine(portal, engines, model_dir, probe_ids):
    (engine,) = engines.get(0)
    sync_and_check(portal, [engine], perturbed_model(model_dir, seed=1), probe_ids, version="one-1")


def test_two_engines_one_group(portal, engines, model_dir, probe_ids):
    pair = engines.get(0, 1)
    sync_and_check(portal, pair, perturbed_model(model_dir, seed=2), probe_ids, version="two-1")


def test_sender_killed_mid_update_engine_survives(portal, engines, model_dir, probe_ids, tmp_path):
    (engine,) = engines.get(0)
    dying = perturbed_model(model_dir, seed=3)
    tensors = tmp_path / "tensors.pt"
    torch.save([(n, t.clone()) for n, t in iter_state(dying)], tensors)
    send_chunks = 3
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("dying_sender.py")), str(tensors), "127.0.0.1", "2",
         str(CHUNK_BYTES), str(send_chunks), str(TIMEOUT_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip

    def message() -> dict:
        while True:
            line = child.stdout.readline()
            assert line, f"the sender exited early with code {child.wait()}"
            if line.startswith("@@ "):
                return json.loads(line[3:])

    try:
        first = message()

        async def update_until_killed() -> BaseException | None:
            async with EngineWeightClient.for_process(engine) as client:
                async with anyio.create_task_group() as group:
                    group.start_soon(lambda: client.init_weight_transfer_engine(first["init_info"], timeout_s=TIMEOUT_S + 30))
                    assert (await anyio.to_thread.run_sync(message)) == {"joined": True}
                await client.start_weight_update()
                outcome: list[BaseException] = []

                async def update() -> None:
                    try:
                        await client.update_weights(first["update_info"], timeout_s=TIMEOUT_S * 3)
                    except Exception as exc:
                        outcome.append(exc)

                async with anyio.create_task_group() as group:
                    group.start_soon(update)
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    assert (await anyio.to_thread.run_sync(message)) == {"sent_chunks": send_chunks}
                    os.kill(child.pid, signal.SIGKILL)
                return outcome[0] if outcome else None

        error = portal.call(update_until_killed)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        child.stdin.close()
    assert error is not None, "/update_weights succeeded although the sender died mid-update"
    assert "Connection closed by peer" in str(error) or "failed" in str(error), error

    # The engine survived: healthy, generating, no tensor left on the meta device.
    async def alive() -> None:
        async with engine.client() as client:
            assert await client.health()
            (completion,) = await client.generate([3, 4, 5, 6], n=1, max_tokens=8, temperature=1.0, seed=0)
            assert completion.token_ids

    portal.call(alive)
    state = portal.call(status, engine)
    assert state["meta_tensors"] == [], state
    last = state["last_update"]
    assert not last["ok"] and 1 <= last["chunks_loaded"] <= send_chunks < last["chunks_total"], last
    assert state["group"] is None, "a failed update closes the engine's side of the group"
    # It serves a mix of weights, finite everywhere, and not the dying trainer's.
    mixed = portal.call(served_scores, engine, probe_ids)
    assert all(math.isfinite(x) for row in mixed for x in row)
    assert max_diff(mixed, hf_scores(dying, probe_ids)) > 1e-3
    print(f"after the failed update: partial layers restored {last['partial_layers_restored']}, error {last['error']}")

    # A new trainer re-forms the group and a complete update makes the engine right again.
    sync_and_check(portal, [engine], perturbed_model(model_dir, seed=4), probe_ids, version="after-death")


def test_update_without_group_is_refused_and_harmless(portal, engines, model_dir, probe_ids):
    """A /start_weight_update before any init is refused by the engine and changes nothing."""
    (engine,) = engines.get(0)
    before = portal.call(served_scores, engine, probe_ids)

    async def start_without_group() -> None:
        async with EngineWeightClient.for_process(engine) as client:
            await client.shutdown_weight_transfer_engine()
            with pytest.raises(InferenceRequestError) as info:
                await client.start_weight_update()
            assert info.value.status == 500, info.value

    portal.call(start_without_group)
    assert max_diff(portal.call(served_scores, engine, probe_ids), before) == 0.0


def test_one_extension_also_serves_the_in_place_reload(portal, engines, model_dir, probe_ids):
    """`GlooTransferExtension` is grpod's `ReloadExtension` too: the `none` bridge's reload from
    disk works on the same engines (here: back to the checkpoint's weights, tied head included)."""
    (engine,) = engines.get(0)
    original = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    want = hf_scores(original, probe_ids)
    if max_diff(portal.call(served_scores, engine, probe_ids), want) <= 1e-2:
        # Run alone, the engine still serves the checkpoint: move it away first.
        sync_and_check(portal, [engine], perturbed_model(model_dir, seed=5), probe_ids, version="away")

    async def reload() -> None:
        async with engine.client() as client:
            (repacked,) = await client.collective_rpc("grpod_reload_weights", kwargs={"weights_path": str(model_dir)})
        assert int(repacked) >= 1  # vLLM's /collective_rpc stringifies scalar results

    portal.call(reload)
    assert max_diff(portal.call(served_scores, engine, probe_ids), want) <= TOLERANCE
