"""Logprobs' token strings as whole characters, and each token's own bytes.

A token of a byte-level vocabulary (Qwen2, Llama 3, GPT-2) or a SentencePiece byte-fallback token may hold part of
a multi-byte UTF-8 character; decoded alone it gives U+FFFD. The OpenAI API answers that with each token's `bytes`
(its UTF-8 bytes, which the client joins across tokens). Here a token's string is the text it adds to the response,
read from the same incremental detokenizer the response text comes from (incremental_detokenizer.py: whole
characters, and the tokenizer's own decoder, so a SentencePiece tokenizer's leading-space strip or merges come out
as in the text); `bytes` is the token's own bytes. A special token is not part of the text: its string is its own.
An alternative (top logprobs) is read at the same point: what it would have added in place of the chosen one.
"""

import re
import weakref
from functools import lru_cache

from specsplit.services.coordinator.incremental_detokenizer import IncrementalDetokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's piece for one raw byte
_METASPACE = "\u2581"  # SentencePiece's visible space


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters of a byte-level vocabulary back to the bytes they stand for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, shifted = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenBytes:
    """token id -> its UTF-8 bytes, for any Hugging Face tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        if backend is not None:
            self.special |= set(backend.get_added_tokens_decoder())
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return str(token_id).encode()
        if token_id in self.special:  # added tokens are text, whatever the vocabulary's encoding
            return self.tokenizer.decode([token_id]).encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return self.tokenizer.decode([token_id]).encode("utf-8")
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if _METASPACE in piece:  # decoding one piece alone would drop its leading space
            return piece.replace(_METASPACE, " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")


class TokenTexts:
    """One response's token strings: the text each token adds, in order (streamed or not)."""

    def __init__(self, token_bytes: TokenBytes):
        self.token_bytes = token_bytes
        self._detokenizer = _PeekingDetokenizer(token_bytes.tokenizer)

    def alternative(self, token_id: int) -> tuple[str, bytes]:
        """(string, bytes) of a token that could have come next; the state does not move."""
        raw = self.token_bytes(token_id)
        return self._special_or(token_id, raw) or self._detokenizer.peek(token_id), raw

    def chosen(self, token_id: int) -> tuple[str, bytes]:
        """(string, bytes) of the token that came next; its bytes join those of the tokens before it."""
        raw = self.token_bytes(token_id)
        before = len(self._detokenizer.text)
        self._detokenizer.add([token_id])
        return self._special_or(token_id, raw) or self._detokenizer.text[before:], raw

    def _special_or(self, token_id: int, raw: bytes) -> str:
        """A special token's own text, or the text of a token without a tokenizer (its id); else ""."""
        if self.token_bytes.tokenizer is None or token_id in self.token_bytes.special:
            return raw.decode("utf-8", errors="replace")
        return ""


class _PeekingDetokenizer(IncrementalDetokenizer):
    def peek(self, token_id: int) -> str:
        """The text `add([token_id])` would add, without adding it."""
        if self._decode is None:
            return ""
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        window = self._decode(self.tokens[self._prefix :] + [token_id])[len(prefix_text) :]
        return window.rstrip("\ufffd")[self._taken :]


_by_tokenizer: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_bytes_of(tokenizer) -> TokenBytes:
    """The one TokenBytes of a tokenizer (its cache outlives each response)."""
    if tokenizer is None:
        return TokenBytes(None)
    found = _by_tokenizer.get(tokenizer)
    if found is None:
        found = _by_tokenizer[tokenizer] = TokenBytes(tokenizer)
    return found
