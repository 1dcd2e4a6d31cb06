"""The chat template rendered one new message at a time: the delta after a model turn is exactly
what the template writes there, whether the model sampled its end-of-turn token or was cut off."""

from __future__ import annotations

import pytest

from grpod.models.tiny import build_tokenizer
from grpod.rollouts.chat_turns import ChatTemplateError, ChatTurns

TOOL = [{"role": "tool", "content": "7"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_the_delta_after_a_model_turn_is_the_templates_rendering_of_the_new_message(tokenizer):
    turns = ChatTurns(tokenizer)
    assert turns.closing == "<|im_end|>\n"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert turns.stop_token_ids == [end]
    prompt = turns.prompt([{"role": "user", "content": "what is 3+4"}])
    sampled = tokenizer.encode("use tool", add_special_tokens=False) + [end]
    following = turns.after_model_turn(sampled, TOOL)
    # The model sampled <|im_end|> itself: only the rest of the closing, then the tool turn.
    assert tokenizer.decode(following, skip_special_tokens=False) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    # Prompt + sampled + delta is the template's rendering of the whole conversation.
    conversation = [{"role": "user", "content": "what is 3+4"}, {"role": "assistant", "content": "use tool"}, *TOOL]
    whole = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompt + sampled + following, skip_special_tokens=False) == whole


def test_a_turn_cut_off_at_max_tokens_gets_the_whole_closing(tokenizer):
    turns = ChatTurns(tokenizer)
    following = turns.after_model_turn(tokenizer.encode("use to", add_special_tokens=False), TOOL)
    assert tokenizer.decode(following, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>tool\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    rewriting = build_tokenizer()
    # Earlier assistant turns lose their content once a later message exists (as reasoning
    # templates drop earlier thinking): no appended delta can reproduce that.
    rewriting.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' and not loop.last %}{% else %}{{ message['content'] }}{% endif %}"
        "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    turns = ChatTurns(rewriting)
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns"):
        turns.after_model_turn([2], TOOL)
