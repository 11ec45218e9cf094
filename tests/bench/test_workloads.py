"""Workloads of `specsplit bench`: random token-id prompts, JSONL files of prompts and conversations, and errors
that name the file and line."""

import json

import pytest

from specsplit.bench.workloads import WorkloadError, jsonl_requests, load_workload, ordinary_token_ids
from tiny_models import byte_tokenizer


def test_random_prompts_are_ordinary_token_ids_of_the_asked_length():
    tokenizer = byte_tokenizer()
    requests = load_workload("random", 5, input_len=12, output_len=7, seed=3, tokenizer=tokenizer)
    assert len(requests) == 5 and all(len(r.prompt) == 12 and r.output_len == 7 for r in requests)
    ordinary = set(ordinary_token_ids(tokenizer))
    assert tokenizer.eos_token_id not in ordinary and len(ordinary) == 256
    assert all(t in ordinary for r in requests for t in r.prompt)
    assert [r.prompt for r in requests] == [r.prompt for r in load_workload("random", 5, 12, 7, 3, tokenizer)]
    with pytest.raises(WorkloadError, match="--tokenizer"):
        load_workload("random", 1, 4, 4)


def test_jsonl_prompts_messages_and_sharegpt_conversations(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "def f():"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 3},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "the recorded answer"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    first, second, third = jsonl_requests(path, output_len=9)
    assert (first.prompt, first.output_len, first.messages) == ("def f():", 9, None)
    assert second.prompt is None and second.output_len == 3 and second.messages[1] == {"role": "user", "content": "hi"}
    assert third.messages == [{"role": "user", "content": "q"}]  # the answer is what the server is asked for
    assert load_workload(str(path), 5, 0, 9) == [first, second, third, first, second]  # cycled in file order


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "x"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "x"}', '"prompt", "messages" or "conversations"'),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "role"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be a positive integer"),
])
def test_a_malformed_line_is_named(tmp_path, bad, message):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + bad + "\n")
    with pytest.raises(WorkloadError, match=message) as error:
        jsonl_requests(path, 8)
    assert str(error.value).startswith(f"{path}:3: ")


def test_unknown_workload_and_empty_file(tmp_path):
    with pytest.raises(WorkloadError, match="nor a JSONL file"):
        load_workload("no-such-thing", 1, 1, 1)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_workload(str(tmp_path / "empty.jsonl"), 1, 1, 1)
