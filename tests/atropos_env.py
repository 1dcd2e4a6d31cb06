"""Test helpers for the Atropos source: the real `run-api` as a child process, and a minimal
environment that speaks the environment side of its protocol.

`TrajectoryApiProcess` starts atroposlib's own `run-api` entry point (`python -m
atroposlib.cli.run_api --host 127.0.0.1 --port N`) on a free loopback port, waits until it answers
`GET /`, and stops it by its PID (SIGTERM, then SIGKILL after a grace period). `restart` stops it
and starts a fresh one on the same port: the new server has lost every registration and queued
group, exactly as after a crash.

`ScoredGroupEnv` is what an Atropos environment does once it has scored a group: register with
`/register-env` (refused until the trainer's first `GET /batch`) and post the group to
`/scored_data`. `scored_group` builds a well-formed group over the tiny model's vocabulary.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio

TINY_VOCAB_SIZE = 52
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TrajectoryApiProcess:
    """The real Atropos `run-api`, bound to 127.0.0.1. Use as a context manager."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.starts = 0

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"run-api already running as pid {self.proc.pid}")
        self.starts += 1
        self._log = open(self.log_dir / f"run-api-{self.port}-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_answering()

    def _wait_answering(self) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"run-api exited with {self.proc.returncode} before answering:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        raise TimeoutError(f"run-api on {self.url} did not answer GET / within {START_TIMEOUT_S}s:\n{self.output()}")

    def stop(self) -> None:
        """Stop the server this object started (by its PID) and wait until it has exited."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=STOP_GRACE_S)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def output(self) -> str:
        if self._log is not None:
            self._log.flush()
        path = self.log_dir / f"run-api-{self.port}-{self.starts}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def __enter__(self) -> TrajectoryApiProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def scored_group(
    seed: int,
    *,
    group_size: int,
    prompt_len: int = 5,
    completion_len: int = 4,
    vocab_size: int = TINY_VOCAB_SIZE,
    temperature: float | None = None,
) -> dict[str, Any]:
    """One well-formed Atropos scored group: `group_size` completions of one prompt.

    Masks hold -100 at prompt positions and the token id elsewhere; inference logprobs hold 1.0
    at prompt positions (Atropos's placeholder) and a negative logprob per completion token; every
    optional field is null unless asked for.
    """
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
    tokens, masks, logprobs, scores = [], [], [], []
    for _ in range(group_size):
        completion = [rng.randrange(3, vocab_size) for _ in range(completion_len)]
        tokens.append(prompt + completion)
        masks.append([-100] * prompt_len + completion)
        logprobs.append([1.0] * prompt_len + [round(-rng.uniform(0.05, 4.0), 4) for _ in completion])
        scores.append(float(rng.random() < 0.5))
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": scores,
        "advantages": None,
        "ref_logprobs": None,
        "messages": None,
        "generation_params": None if temperature is None else {"temperature": temperature},
        "inference_logprobs": logprobs,
        "overrides": None,
        "group_overrides": None,
        "images": None,
    }


class EnvNotRegistered(RuntimeError):
    pass


class ScoredGroupEnv:
    """A minimal Atropos environment: registers, then posts scored groups."""

    def __init__(self, url: str, *, group_size: int, max_token_length: int = 256, name: str = "grpod-test-env") -> None:
        self.url = url
        self.group_size = group_size
        self.max_token_length = max_token_length
        self.name = name
        self.env_id: int | None = None
        self.registration: dict[str, Any] | None = None

    async def _post(self, route: str, body: Any) -> Any:
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + route, json=body, timeout=aiohttp.ClientTimeout(total=10)) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"POST {route}: HTTP {reply.status}: {(await reply.text())[:300]}")
                return await reply.json()

    async def try_register(self) -> dict[str, Any] | None:
        """The registration reply, or None while run-api says to wait for the trainer."""
        reply = await self._post(
            "/register-env",
            {
                "max_token_length": self.max_token_length,
                "desired_name": self.name,
                "weight": 1.0,
                "group_size": self.group_size,
            },
        )
        if reply.get("status") != "success":
            return None
        self.env_id = reply["env_id"]
        self.registration = reply
        return reply

    async def register(self, timeout_s: float = 15.0) -> dict[str, Any]:
        """Register, retrying while the trainer has not asked for a batch yet."""
        with anyio.move_on_after(timeout_s):
            while True:
                reply = await self.try_register()
                if reply is not None:
                    return reply
                await anyio.sleep(0.05)
        raise EnvNotRegistered(
            f"run-api at {self.url} refused /register-env for {timeout_s}s: the trainer never called GET /batch"
        )

    async def post(self, group: dict[str, Any]) -> dict[str, Any]:
        if self.env_id is None:
            raise EnvNotRegistered("post before register")
        return await self._post("/scored_data", {**group, "env_id": self.env_id})

    async def post_many(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        if self.env_id is None:
            raise EnvNotRegistered("post before register")
        return await self._post("/scored_data_list", [{**g, "env_id": self.env_id} for g in groups])


async def api_get(url: str, route: str) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + route, timeout=aiohttp.ClientTimeout(total=10)) as reply:
            return await reply.json()


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, describe: Callable[[], Any] = None) -> None:
    """Poll `condition` every 20 ms; TimeoutError naming `what` (and the state) if it never holds."""
    deadline = anyio.current_time() + timeout_s
    while not condition():
        if anyio.current_time() > deadline:
            state = f"; state: {describe()}" if describe is not None else ""
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}{state}")
        await anyio.sleep(0.02)
