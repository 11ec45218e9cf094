"""The text of a growing list of generated tokens, at a cost per token that does not grow with the list.

Decoding every generated token again each round costs O(length) per round (and transformers' decode adds Python
work per token): at batch 64 that was most of a round's host time. Here each step decodes a short window instead
(the method vLLM uses): the text the newest tokens add is decode(tokens[prefix:]) minus decode(tokens[prefix:read]),
where `read` is where the settled text ends and `prefix` a few tokens before it, so merges, byte-level pieces and
tokenizers that treat a leading space specially decode as they would in the whole text. While the window ends
inside a multi-byte character (a trailing U+FFFD) the window stays open and only the complete characters before
that one are taken.
"""


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0
        self._taken = 0  # characters of the open window's text already in `text`
        self._decode = _fast_decoder(tokenizer)

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; `text` then holds the text of every token up to the last complete character."""
        self.tokens.extend(token_ids)
        if self._decode is None or len(self.tokens) == self._read:
            return
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        window = self._decode(self.tokens[self._prefix :])[len(prefix_text) :]
        complete = window.rstrip("\ufffd")
        if len(complete) > self._taken:
            self.text += complete[self._taken :]
            self._taken = len(complete)
        if window and complete == window:  # the window ends on a whole character: settle it
            self._prefix, self._read, self._taken = self._read, len(self.tokens), 0

    def finish(self) -> str:
        """All of the text, an unfinished character at the end included (as a whole-list decode gives it)."""
        if self._decode is not None and len(self.tokens) > self._read:
            prefix_text = self._decode(self.tokens[self._prefix : self._read])
            self.text += self._decode(self.tokens[self._prefix :])[len(prefix_text) + self._taken :]
            self._prefix = self._read = len(self.tokens)
            self._taken = 0
        return self.text


def _fast_decoder(tokenizer):
    """decode(ids) without special tokens: the `tokenizers` backend directly when transformers would add nothing to
    it (no clean-up of spaces), which is several times faster for short windows."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
