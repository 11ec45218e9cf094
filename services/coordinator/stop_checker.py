"""Incremental detokenization and stop conditions: EOS, stop token ids, stop strings, max tokens, context length.

Tokens accepted in a round past the point where the request stops are dropped: the stop is checked token by token.
Text is released only when it cannot change: a trailing incomplete UTF-8 character and any suffix that could still
grow into a stop string are held back until the next tokens (or the end) settle them. Detokenization is
incremental (incremental_detokenizer.py): a round costs the same whatever the length generated so far, and without
stop strings a round's tokens are decoded together.
"""

from specsplit.services.coordinator.incremental_detokenizer import IncrementalDetokenizer
from specsplit.services.sampling_params import SamplingParams


class StopChecker:
    def __init__(self, params: SamplingParams, tokenizer, eos_token_ids, max_total_len: int, prompt_len: int):
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_total_len = max_total_len
        # Unset max_tokens: until end of sequence, bounded by what the context leaves after the prompt.
        self.max_tokens = params.max_tokens if params.max_tokens is not None else max(1, max_total_len - prompt_len)
        self.prompt_len = prompt_len
        self.generated: list[int] = []
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.text = ""
        self.emitted_chars = 0
        self.finish_reason: str | None = None
        self._text_cut_at_stop: str | None = None
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def add(self, token_ids: list[int]) -> tuple[list[int], str]:
        """Commit tokens one by one until a stop; returns the tokens kept and the newly releasable text."""
        kept = []
        for token in token_ids:
            if self.finish_reason:
                break
            kept.append(token)
            self.generated.append(token)
            if self.params.stop:  # stop strings are matched token by token, so the text must be too
                self.detokenizer.add([token])
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif self.params.stop and self._find_stop_string():
                self.finish_reason = "stop"
            elif len(self.generated) >= self.max_tokens or self.prompt_len + len(self.generated) >= self.max_total_len:
                self.finish_reason = "length"
        if not self.params.stop:
            self.detokenizer.add(kept)
        return kept, self._release()

    def _find_stop_string(self) -> bool:
        text = self.detokenizer.text
        search_from = max(0, self.emitted_chars - self._hold)
        hits = [i for s in self.params.stop if (i := text.find(s, search_from)) >= 0]
        if hits:
            self._text_cut_at_stop = text[: min(hits)]  # the stop string itself is not returned
            return True
        return False

    def _release(self) -> str:
        if self._text_cut_at_stop is not None:
            self.text = self._text_cut_at_stop
        else:
            self.text = self.detokenizer.finish() if self.finish_reason else self.detokenizer.text
        releasable = len(self.text)
        if not self.finish_reason:
            if self.params.stop:
                releasable = min(releasable, len(self.text) - self._hold)
        releasable = max(releasable, self.emitted_chars)
        new = self.text[self.emitted_chars : releasable]
        self.emitted_chars = releasable
        return new
