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
