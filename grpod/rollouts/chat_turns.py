"""`ChatTurns`: the model's chat template, rendered one new message at a time as token ids.

An episode (`grpod.rollouts.episode`) never re-renders its conversation: after a model turn it
appends only the ids of what comes next. `ChatTurns` asks the chat template what that is:

- `prompt(messages)`: the first prompt, the template's rendering of `messages` with the assistant
  turn opened (`add_generation_prompt`), tokenised once;
- `after_model_turn(sampled_ids, messages)`: the ids that follow the model's sampled ids when
  `messages` (tool results, user replies) are added: the rest of the model turn's closing as the
  template writes it, then the new messages and the next assistant opening.

How the delta is found, for any template. A fixed placeholder conversation (a user message and
an assistant reply) is rendered with and without the new messages; the template's rendering of
the new messages is what the longer text adds after the shorter one (a template that rewrites
earlier turns when a message is added, as some reasoning templates do with earlier thinking,
raises `ChatTemplateError`: no delta appended to the sampled ids can be faithful to it). The
closing of an assistant turn is what the template writes after the placeholder reply (ChatML:
`<|im_end|>\\n`); the model usually samples the start of it itself (its end-of-turn token stops
generation and is part of the sampled ids), so only the part it did not sample is appended. A turn
cut off at max_tokens gets the whole closing.

Text is tokenised without the tokeniser's own special-token additions (the template writes them),
and special tokens in the template's text are parsed as special tokens, as `apply_chat_template`
does.

Messages an environment sends are untrusted in size: `too_long` tells, without rendering or
tokenising them, that they cannot fit in the room left (tokenising an 8 MB tool output took 12 s
on the daemon's event loop, and gigabytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]

# Placeholder contents: plain words a template passes through unchanged.
_PLACEHOLDER_USER = {"role": "user", "content": "placeholder question"}
_PLACEHOLDER_REPLY = "placeholder reply"


def model_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer of the model at `path` (model.path's: the one every export of the run
    carries), or None while `path` holds no model yet (model.init_if_missing builds it after the
    start's checks). Blocking: run it in a worker thread."""
    if not (path / "config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class ChatTemplateError(ValueError):
    """The chat template cannot be rendered one turn at a time (it rewrites earlier turns)."""


class ChatTurns:
    """One tokenizer's chat template as per-turn token deltas (module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._base = [_PLACEHOLDER_USER, {"role": "assistant", "content": _PLACEHOLDER_REPLY}]
        self._base_text = self._render(self._base, opened=False)
        at = self._base_text.rfind(_PLACEHOLDER_REPLY)
        if at < 0:
            raise ChatTemplateError("the chat template does not write an assistant message's content as given")
        # What the template writes after an assistant message (ChatML: "<|im_end|>\n").
        self.closing = self._base_text[at + len(_PLACEHOLDER_REPLY) :]
        self.closing_ids = self.encode(self.closing)
        # No token stands for more characters than its vocabulary entry has (byte-level BPE writes a
        # byte as one character, SentencePiece a space as one); so a text of n characters needs at
        # least n / max_token_chars ids.
        self.max_token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1) or 1

    @property
    def stop_token_ids(self) -> list[int]:
        """The id that ends an assistant turn when the closing starts with a special token (ChatML's
        `<|im_end|>`): a model turn stops there, and the engine returns it among the sampled ids."""
        first = self.closing_ids[:1]
        return first if first and first[0] in self.tokenizer.all_special_ids else []

    def _render(self, messages: Sequence[Message], *, opened: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=opened, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The ids of `messages` with the assistant turn opened: an episode's first prompt."""
        return list(
            self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    def rendered(self, messages: Sequence[Message]) -> str:
        """The template's text for `messages` added after a finished assistant turn, up to and
        including the next assistant opening."""
        text = self._render([*self._base, *messages], opened=True)
        if not text.startswith(self._base_text):
            raise ChatTemplateError(
                "the chat template rewrites earlier turns when "
                f"{[m.get('role') for m in messages]} messages are added; an episode cannot append them as a "
                "token delta (use a template that renders each turn independently)"
            )
        return text[len(self._base_text) :]

    def unsampled_closing(self, sampled_ids: Sequence[int]) -> str:
        """The part of the assistant turn's closing the model did not sample itself: the longest
        start of `closing_ids` that ends `sampled_ids` is taken as sampled."""
        for k in range(min(len(self.closing_ids), len(sampled_ids)), 0, -1):
            if list(sampled_ids[-k:]) == self.closing_ids[:k]:
                written = self.tokenizer.decode(self.closing_ids[:k], skip_special_tokens=False)
                if self.closing.startswith(written):
                    return self.closing[len(written) :]
        return self.closing

    @staticmethod
    def chars(messages: Sequence[Message]) -> int:
        """The characters of `messages`' contents (what `too_long` weighs)."""
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else message
            total += len(content) if isinstance(content, str) else len(str(content))
        return total

    def too_long(self, messages: Sequence[Message], room: int) -> bool:
        """Whether `messages` certainly need more than `room` ids: there are more of them than
        `room` (each renders to one id at least: a reply of 100,000 empty messages passed and was
        rendered for 2.8 s on the event loop), or their text is longer than `room` of the
        vocabulary's longest tokens. (A tokenizer whose normaliser collapses runs of spaces could
        fit such a text; an environment's message that long is refused as too long anyway.)"""
        return len(messages) > room or self.chars(messages) > room * self.max_token_chars

    def after_model_turn(self, sampled_ids: Sequence[int], messages: Sequence[Message]) -> list[int]:
        """The ids to append after a model turn that sampled `sampled_ids` when `messages` follow
        it: the rest of its closing, the messages, the next assistant opening (module docstring)."""
        return self.encode(self.unsampled_closing(sampled_ids) + self.rendered(messages))
