"""Token-in/token-out conversations: appended turns equal the template's own rendering."""

import numpy as np
import pytest

from longhorizon.common.chat import ByteChatTokenizer, HFChatTokenizer, TokenConversation
from longhorizon.common.models import load_tokenizer


def _play_two_turns(tokenizer, reply_tokens, reply_text="a0"):
    conversation = TokenConversation.start(
        tokenizer, [{"role": "system", "content": "rules"}, {"role": "user", "content": "s1"}]
    )
    conversation.add_generation(reply_tokens, [-0.5] * len(reply_tokens), 7, reply_text)
    conversation.add_observation("s2", stopped_on_eos=True)
    return conversation


def test_tiny_template_matches_full_rendering(tiny_codebook_model):
    tokenizer = HFChatTokenizer(load_tokenizer(tiny_codebook_model))
    reply = tokenizer.encode("a0") + [tokenizer.eos_token_id]
    conversation = _play_two_turns(tokenizer, reply)
    assert conversation.token_ids == tokenizer.prompt_tokens(conversation.messages)
    arrays = conversation.arrays()
    generated = arrays["loss_mask"] == 1
    assert generated.sum() == len(reply)
    assert np.all(arrays["policy_versions"][generated] == 7)
    assert np.all(arrays["policy_versions"][~generated] == -1)
    assert np.allclose(arrays["behaviour_logprobs"][generated], -0.5)
    assert np.all(arrays["behaviour_logprobs"][~generated] == 0)


def test_a_prompt_seen_before_is_not_rendered_again(tiny_codebook_model, monkeypatch):
    tokenizer = HFChatTokenizer(load_tokenizer(tiny_codebook_model))
    rendered = []
    render = tokenizer.tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer.tokenizer, "apply_chat_template",
                        lambda messages, **options: rendered.append(messages) or render(messages, **options))
    prompt = [{"role": "system", "content": "rules"}, {"role": "user", "content": "s1"}]
    first = tokenizer.prompt_tokens(prompt)
    first.append(-1)  # the caller's list is its own
    assert tokenizer.prompt_tokens([dict(message) for message in prompt]) == first[:-1]
    assert len(rendered) == 1
    other = tokenizer.prompt_tokens([*prompt[:1], {"role": "user", "content": "s2"}])
    assert other != first[:-1] and len(rendered) == 2
    # Bounded: the oldest prompt goes first.
    monkeypatch.setattr(HFChatTokenizer, "PROMPT_MEMORY", 2)
    tokenizer.prompt_tokens([{"role": "user", "content": "s3"}])
    assert len(rendered) == 3
    tokenizer.prompt_tokens(prompt)
    assert len(rendered) == 4
    # A value JSON cannot spell is rendered each time, not refused.
    odd = [{"role": "user", "content": "s1", "extra": {1, 2}}]
    assert tokenizer.prompt_tokens(odd) == tokenizer.prompt_tokens(odd) and len(rendered) == 6


def test_generation_cut_at_max_tokens_gets_an_end_of_turn_token(tiny_codebook_model):
    tokenizer = HFChatTokenizer(load_tokenizer(tiny_codebook_model))
    reply = tokenizer.encode("a0")  # no end-of-turn token: max_new_tokens was hit
    conversation = TokenConversation.start(tokenizer, [{"role": "user", "content": "s1"}])
    conversation.add_generation(reply, [0.0], 0, "a0")
    conversation.add_observation("s2", stopped_on_eos=False)
    position = conversation.prompt_length + len(reply)
    assert conversation.token_ids[position] == tokenizer.eos_token_id
    assert conversation.loss_mask[position] == 0  # the closing token was not sampled: not trained on
    assert conversation.token_ids == tokenizer.prompt_tokens(conversation.messages)


@pytest.mark.slow
def test_default_model_template_matches_full_rendering(default_model_path):
    tokenizer = HFChatTokenizer(load_tokenizer(default_model_path))
    text = "Thought: go\n\nAction: get 1 oak log"
    conversation = _play_two_turns(tokenizer, tokenizer.encode(text) + [tokenizer.eos_token_id], text)
    assert conversation.token_ids == tokenizer.prompt_tokens(conversation.messages)


def test_byte_tokenizer_round_trip():
    tokenizer = ByteChatTokenizer()
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"
    conversation = _play_two_turns(tokenizer, tokenizer.encode("a0") + [tokenizer.eos_token_id])
    assert conversation.token_ids == tokenizer.prompt_tokens(conversation.messages)


def test_a_last_turns_view_is_the_first_prompt_and_the_exact_tokens_of_the_last_turns(tiny_codebook_model):
    tokenizer = HFChatTokenizer(load_tokenizer(tiny_codebook_model))
    conversation = TokenConversation.start(
        tokenizer, [{"role": "system", "content": "rules"}, {"role": "user", "content": "s1"}]
    )
    replies = [tokenizer.encode("a0") + [tokenizer.eos_token_id], tokenizer.encode("a1"),  # a1 hit max_new_tokens
               tokenizer.encode("a2") + [tokenizer.eos_token_id]]
    for turn, reply in enumerate(replies):
        conversation.add_generation(reply, [-0.1] * len(reply), turn, f"a{turn}")
        conversation.add_observation(f"s{turn + 2}", stopped_on_eos=reply[-1] == tokenizer.eos_token_id)
    assert conversation.turn_starts[0] == conversation.prompt_length and len(conversation.turn_starts) == 3

    last_two = conversation.last_turns_view(2)
    assert [m["content"] for m in last_two.messages] == ["rules", "s1", "a1", "s3", "a2", "s4"]
    # The kept replies are the sampled tokens themselves, the cut one with its added end-of-turn.
    start = conversation.turn_starts[1]
    assert last_two.token_ids == conversation.token_ids[: conversation.prompt_length] + conversation.token_ids[start:]
    assert last_two.token_ids == tokenizer.prompt_tokens(last_two.messages)  # what the template renders
    last_one = conversation.last_turns_view(1)
    assert [m["content"] for m in last_one.messages] == ["rules", "s1", "a2", "s4"]
    assert last_one.token_ids == tokenizer.prompt_tokens(last_one.messages)

    everything = conversation.last_turns_view(5)
    assert everything.token_ids == conversation.token_ids and everything.messages == conversation.messages
    # Where each view's turns begin: the whole history starts at the prompt's end.
    assert (last_two.window_start, last_one.window_start) == (start, conversation.turn_starts[2])
    assert everything.window_start == conversation.full_view().window_start == conversation.prompt_length
    with pytest.raises(ValueError, match="at least the last turn"):
        conversation.last_turns_view(0)
