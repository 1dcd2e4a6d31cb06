"""Guess the number: a small multi-turn OpenEnv environment, written with OpenEnv's own API
(`openenv.core.env_server`: `Environment`, `Action`, `Observation`, `State`), for grpod's
`source.environment.adapter = "openenv"`:

    [source.environment]
    adapter = "openenv"
    name = "etc/examples/agent-envs/guess_env.py:GuessEnvironment"
    args = { span = 10, max_guesses = 5 }
    max_turns = 5

The game. Each task is a range of `span` whole numbers (its low end drawn from the reset seed, so
tasks differ in their prompt) and a secret in it (drawn from the same seed). The model answers
with a number; the environment says "Higher." or "Lower." until the number is found or
`max_guesses` guesses are spent. Binary search finds any secret of a 10-number range in at most
4 guesses, so a model that learns the rule and the feedback wins every game, with a guess to spare.

Reward (OpenEnv gives one per step; grpod's episode reward is their sum): 1.0 on the step that
finds the secret, less 0.1 for each guess before it (1.0 first try, 0.6 on the fifth); 0.0 on
every other step, so a lost game scores 0.0. An answer without a number costs a guess and is
told the answer format again.

How grpod reads it (`grpod.rollouts.openenv_adapter`): the model's turn goes into the action's
`message` field; every observation carries its text in `prompt`, which becomes one user message
(the reset observation's is the episode's opening, the others reply to the model's turns).
`SUPPORTS_CONCURRENT_SESSIONS = True`: each episode has an instance of its own, so grpod's
server runs many at once.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

_INTEGER = re.compile(r"-?\d+")


class GuessAction(Action):
    message: str = Field(..., description="The player's turn: its guess, a whole number.")


class GuessObservation(Observation):
    prompt: str = Field(..., description="What the game says: the rules at reset, then the feedback.")


class GuessState(State):
    low: int = 1
    high: int = 10
    secret: int = 1
    guesses: int = 0


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    """One game per reset (module docstring). `span`: how many numbers the range holds;
    `max_guesses`: guesses before the game is lost."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, span: int = 10, max_guesses: int = 5) -> None:
        super().__init__()
        if span < 2 or max_guesses < 1:
            raise ValueError(f"GuessEnvironment needs span >= 2 and max_guesses >= 1, not {span} and {max_guesses}")
        self.span = span
        self.max_guesses = max_guesses
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        rng = random.Random(seed)
        low = rng.randint(1, 50)
        high = low + self.span - 1
        self._state = GuessState(episode_id=episode_id, low=low, high=high, secret=rng.randint(low, high))
        prompt = (
            f"Let's play a game. I am thinking of a whole number from {low} to {high}. "
            f"Guess it: reply with one number only. After each guess I say \"Higher.\" if my number is "
            f"higher, \"Lower.\" if it is lower. You have {self.max_guesses} guesses."
        )
        return GuessObservation(prompt=prompt)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        state = self._state
        state.step_count += 1
        state.guesses += 1
        left = self.max_guesses - state.guesses
        numbers = _INTEGER.findall(action.message)
        guess = int(numbers[-1]) if numbers else None
        if guess == state.secret:
            return GuessObservation(prompt="Correct!", done=True, reward=round(1.0 - 0.1 * (state.guesses - 1), 6))
        if left <= 0:
            return GuessObservation(prompt=f"Out of guesses: it was {state.secret}.", done=True, reward=0.0)
        if guess is None:
            feedback = f"Reply with one number from {state.low} to {state.high}."
        else:
            feedback = "Higher." if state.secret > guess else "Lower."
        return GuessObservation(prompt=f"{feedback} {left} guess{'es' if left > 1 else ''} left.", reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state
