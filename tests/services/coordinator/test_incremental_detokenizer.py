"""Incremental detokenization gives exactly the whole-list decode, token by token and in chunks, on the byte-level
test tokenizer (multi-byte characters split across tokens) and on the real Qwen2.5 tokenizer (merges, special
tokens, code and non-Latin text)."""

import random

import pytest

from specsplit.services.coordinator.incremental_detokenizer import IncrementalDetokenizer
from tiny_models import EOS_ID, byte_tokenizer


def _check_against_whole_decode(tokenizer, tokens, chunk_sizes):
    detokenizer = IncrementalDetokenizer(tokenizer)
    i = 0
    for size in chunk_sizes:
        detokenizer.add(tokens[i : i + size])
        i += size
        whole = tokenizer.decode(tokens[:i], skip_special_tokens=True)
        # Everything up to the last complete character is there, and nothing beyond.
        assert detokenizer.text == whole.rstrip("\ufffd")
    assert detokenizer.finish() == tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(5))
def test_byte_tokens_with_split_characters(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " ", "é", "日本", "🙂", "\n", "x=1;"]) for _ in range(60))
    tokenizer = byte_tokenizer()
    tokens = tokenizer.encode(text)
    tokens[rng.randrange(len(tokens))] = EOS_ID  # a special token, skipped in the text
    chunks = [rng.randint(1, 6) for _ in range(len(tokens))]
    _check_against_whole_decode(tokenizer, tokens, chunks)


def test_a_cut_inside_a_character_is_held_then_given_at_the_end():
    tokenizer = byte_tokenizer()
    tokens = tokenizer.encode("ok 🙂")[:-2]  # the emoji's last two bytes are missing
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.add(tokens)
    assert detokenizer.text == "ok "
    assert detokenizer.finish() == tokenizer.decode(tokens) and detokenizer.finish().endswith("\ufffd")


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    from specsplit.services.models.prepare import resolve_model
    from specsplit.services.service_commands import DEFAULT_TARGET

    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_TARGET))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_the_real_tokenizer(qwen_tokenizer, seed):
    rng = random.Random(seed)
    text = "def f(x):\n    return x ** 2  # quadrat\u00e9 \u65e5\u672c\u8a9e \U0001f642\n<|im_end|>\n" * 3
    tokens = qwen_tokenizer.encode(text)
    tokens += [rng.randrange(qwen_tokenizer.vocab_size) for _ in range(40)]  # arbitrary tokens, as a model may emit
    _check_against_whole_decode(qwen_tokenizer, tokens, [rng.randint(1, 5) for _ in range(len(tokens))])
