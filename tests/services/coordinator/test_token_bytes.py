"""Logprobs' token strings and bytes: whole characters, each token's own bytes, for a byte-level vocabulary (the tiny
models' tokenizer, as Qwen2's) and a SentencePiece-style one with byte fallback; and the OpenAI response writer
built on them, whole and streamed."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specsplit.services.coordinator.generation import GenerationResult, SpeculationStats, TokenEvent
from specsplit.services.coordinator.openai_messages import ResponseWriter, parse_request
from specsplit.services.coordinator.token_bytes import TokenBytes, TokenTexts
from specsplit.services.sampling.token_logprob import TokenLogprob
from tiny_models import byte_tokenizer

TEXT = "a→é你好!"  # 1, 3, 2, 3, 3 and 1 bytes


def _byte_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: every multi-byte character is split
    return ids


def test_byte_level_tokens_give_their_bytes_and_whole_characters():
    tokenizer = byte_tokenizer()
    ids = _byte_ids(tokenizer, TEXT)
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(t) for t in ids) == TEXT.encode("utf-8")
    texts = TokenTexts(token_bytes)
    strings = [texts.chosen(t)[0] for t in ids]
    assert "".join(strings) == TEXT and "\ufffd" not in "".join(strings)
    assert strings[:4] == ["a", "", "", "→"]  # the arrow's first two bytes complete nothing; the third completes it
    assert tokenizer.decode([ids[1]]) == "\ufffd"  # what decoding the token alone would have said


def test_an_alternative_is_read_where_the_chosen_token_stands():
    tokenizer = byte_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    arrow = _byte_ids(tokenizer, "→")
    texts = TokenTexts(token_bytes)
    texts.chosen(arrow[0])
    texts.chosen(arrow[1])
    assert texts.alternative(arrow[2]) == ("→", bytes([0x92]))  # it would complete the arrow
    assert texts.alternative(arrow[2]) == ("→", bytes([0x92]))  # and asking does not move the state
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert texts.alternative(letter) == ("\ufffdx", b"x")  # the broken character shows as the text would show it
    assert texts.chosen(arrow[2])[0] == "→"


def test_byte_fallback_and_metaspace_pieces():
    vocab = {"<unk>": 0, "\u2581hi": 1, "<0xE4>": 2, "<0xBD>": 3, "<0xA0>": 4, "!": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes(1) == b" hi"  # the leading space kept (decoding the piece alone would strip it)
    assert [token_bytes(t) for t in (2, 3, 4)] == [b"\xe4", b"\xbd", b"\xa0"]
    texts = TokenTexts(token_bytes)
    assert [texts.chosen(t)[0] for t in (1, 2, 3, 4, 5)] == [" hi", "", "", "你", "!"]


def _result(token_ids, logprobs) -> GenerationResult:
    return GenerationResult("r", token_ids, "", "length", 3, SpeculationStats(), 0.0, 0.0, logprobs=logprobs)


def test_response_writer_chat_and_completions_logprobs():
    tokenizer = byte_tokenizer()
    ids = _byte_ids(tokenizer, TEXT)
    alternative = tokenizer.encode("z", add_special_tokens=False)[0]
    logprobs = [TokenLogprob(t, -0.5, [(t, -0.5), (alternative, -1.5)]) for t in ids]

    chat = ResponseWriter(parse_request({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                         "top_logprobs": 2}, chat=True), "m", tokenizer)
    content = chat.whole(_result(ids, logprobs))["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == TEXT
    assert bytes(b for e in content for b in e["bytes"]) == TEXT.encode("utf-8")
    assert all("\ufffd" not in e["token"] for e in content)
    assert content[3]["top_logprobs"][0] == {"token": "→", "logprob": -0.5, "bytes": [0x92]}

    # Streamed in pieces that cut characters apart: the same strings as whole.
    streamed = ResponseWriter(parse_request({"prompt": "x", "logprobs": 2, "stream": True}, chat=False), "m", tokenizer)
    tokens, keys, offsets = [], [], []
    for start in range(0, len(ids), 2):
        event = TokenEvent(ids[start:start + 2], "", logprobs[start:start + 2])
        (chunk,) = streamed.chunks(event)
        part = chunk["choices"][0]["logprobs"]
        tokens += part["tokens"]
        keys += part["top_logprobs"]
        offsets += part["text_offset"]
    assert "".join(tokens) == TEXT
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert set(keys[1]) == {"bytes:\\xe2", "z"}  # a token completing no character keeps its bytes as its key


def test_sentencepiece_strings_are_the_text_its_decoder_gives():
    """Llama 2's tokenizer (Metaspace, byte fallback, a decoder that strips the text's first space): the strings are
    what each token adds to the response text, not the pieces with their visible spaces made spaces."""
    vocab = {"<unk>": 0, "\u2581hi": 1, "\u2581there": 2, "!": 3, "<0xE4>": 4, "<0xBD>": 5, "<0xA0>": 6}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = [1, 2, 3, 4, 5, 6]
    text = tokenizer.decode(ids)
    assert text == "hi there!你"
    texts = TokenTexts(TokenBytes(tokenizer))
    assert texts.alternative(2) == ("there", b" there")  # first, its space is the one the decoder strips
    strings = [texts.chosen(t)[0] for t in ids[:3]]
    assert texts.alternative(1) == (" hi", b" hi")  # later, it keeps it
    strings += [texts.chosen(t)[0] for t in ids[3:]]
    assert strings == ["hi", " there", "!", "", "", "你"] and "".join(strings) == text

    writer = ResponseWriter(parse_request({"prompt": "x", "logprobs": 0}, chat=False), "m", tokenizer)
    logprobs = writer.whole(_result(ids, [TokenLogprob(t, -0.5, []) for t in ids]))["choices"][0]["logprobs"]
    assert logprobs["tokens"] == strings and logprobs["text_offset"] == [0, 2, 8, 9, 9, 9]
