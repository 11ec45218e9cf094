"""OpenAI request bodies to the coordinator's types: defaults as OpenAI's, vLLM's extensions, and a 400 naming the
field for what this server does not do (never silently ignored)."""

import pytest

from specsplit.services.coordinator.openai_messages import InvalidField, parse_request


def test_defaults_are_openais():
    parsed = parse_request({"model": "m", "prompt": "hi"}, chat=False)
    p = parsed.params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.logprobs) == (1.0, 1.0, 0, None, None, None)
    assert parsed.prompt == "hi" and not parsed.stream and not parsed.include_usage


def test_fields_and_extensions_reach_the_sampling_params():
    body = {"prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 3,
            "stop": "x", "ignore_eos": True, "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
            "stop_token_ids": [5], "num_speculative_tokens": 0}
    parsed = parse_request(body, chat=False)
    p = parsed.params
    assert parsed.prompt == [1, 2, 3] and parsed.stream and parsed.include_usage
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos, p.logprobs) == \
        (7, 0.0, 0.5, 0, 3, ["x"], True, 2)
    assert p.stop_token_ids == [5] and p.num_speculative_tokens == 0


def test_chat_messages_roles_parts_and_logprobs():
    body = {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 9, "max_tokens": 100, "logprobs": True, "top_logprobs": 4}
    parsed = parse_request(body, chat=True)
    assert parsed.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert parsed.params.max_tokens == 9 and parsed.params.logprobs == 4  # max_completion_tokens wins
    assert parse_request({"messages": body["messages"], "logprobs": True}, chat=True).params.logprobs == 0


@pytest.mark.parametrize("body,chat,param,message", [
    ({"prompt": "hi", "n": 2}, False, "n", "n must be 1"),
    ({"prompt": "hi", "echo": True}, False, "echo", "not supported"),
    ({"prompt": "hi", "presence_penalty": 0.5}, False, "presence_penalty", "not supported"),
    ({"prompt": ["a", "b"]}, False, "prompt", "one prompt per request"),
    ({"prompt": ""}, False, "prompt", "must not be empty"),
    ({"prompt": "hi", "max_tokens": True}, False, "max_tokens", "integer"),
    ({"prompt": "hi", "max_tokens": 0}, False, "max_tokens", ">= 1"),
    ({"prompt": "hi", "temperature": "hot"}, False, "temperature", "number"),
    ({"prompt": "hi", "stop": [1]}, False, "stop", "strings"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, False, "stream_options", "stream: true"),
    ({"prompt": "hi", "logprobs": 21}, False, "logprobs", "[0, 20]"),
    ({"messages": []}, True, "messages", "non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages", "only text"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, "top_logprobs", "logprobs: true"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, True, "tools", "not supported"),
])
def test_bad_bodies_name_the_field(body, chat, param, message):
    with pytest.raises(InvalidField, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        parse_request(body, chat=chat)
    assert error.value.param == param
