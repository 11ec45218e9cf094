"""The prompt-lookup (n-gram) proposer: proposes what followed the latest earlier occurrence of the context's tail.

No weights and no device: per sequence it keeps the committed tokens (prompt + generated) and, for every n in
[min_n, max_n], an index from each n-gram to where its latest occurrence with a following token ends. A proposal:
for n from max_n down to min_n, look the last n tokens up; the first n that matches proposes the (up to) k tokens
that followed that occurrence, fewer when the context ends sooner, none when no n matches. The proposal is a
deterministic function of the context, so its q is one-hot (support 1, probability 1) at any temperature: the
target accepts d with probability p(d) and otherwise samples from the residual p without d, renormalised, which is
exact (kernels/rejection_sampling.py). Fewer or zero proposals leave a shorter round, or a target-only one.

It answers the calls the draft service and the coordinator make of a model draft (draft/proposer.py): prefill,
propose (with the same `cached_len`/`delta` protocol), release; `kind` tells the two apart in metrics and traces.
"""

import time
from dataclasses import dataclass, field

import numpy as np

from specsplit.services.draft.proposer import DraftPrefill, Proposal, ProposeItem
from specsplit.services.errors import InvalidArgument
from specsplit.services.runtime.sequence_handles import SequenceHandles

DEFAULT_NGRAM_MAX = 4
DEFAULT_NGRAM_MIN = 1
# Tokens one sequence may hold: the proposer has no model context of its own, so it takes what the target serves
# (the coordinator never sends more); this bounds a sequence's memory (its tokens and indexes) all the same.
MAX_CONTEXT = 1 << 20


def check_ngram_range(max_n: int, min_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise InvalidArgument(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
    if max_n > 64:
        raise InvalidArgument(f"the n-gram max must be at most 64, got {max_n}")


@dataclass
class NgramSequence:
    handle: str
    tokens: list[int] = field(default_factory=list)
    # n -> {n-gram: index of the token that followed its latest occurrence}; only occurrences with a follower
    follower: dict[int, dict[tuple, int]] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)


class NgramProposer:
    kind = "ngram"
    runner = None  # no model: nothing to load, warm up or keep KV for

    def __init__(self, max_n: int = DEFAULT_NGRAM_MAX, min_n: int = DEFAULT_NGRAM_MIN, max_speculative_tokens: int = 16,
                 max_context: int = MAX_CONTEXT):
        check_ngram_range(max_n, min_n)
        self.max_n, self.min_n = max_n, min_n
        self.max_speculative_tokens = max_speculative_tokens
        self.max_model_len = max_context
        self.vocab_size = 0  # any vocabulary: it proposes only tokens the sequence already holds
        self.sequences = SequenceHandles()

    def prefill(self, items: list[DraftPrefill]) -> list[int | Exception]:
        """Take each prompt as its sequence's context. Returns per item the tokens held, or that item's error."""
        results: list[int | Exception] = []
        for item in items:
            try:
                if not item.handle:
                    raise InvalidArgument("sequence handle must be non-empty")
                if not item.token_ids:
                    raise InvalidArgument("prompt must not be empty")
                if len(item.token_ids) >= self.max_model_len:
                    raise InvalidArgument(f"prompt of {len(item.token_ids)} tokens does not fit the n-gram proposer's "
                                          f"context of {self.max_model_len}")
                self.sequences.release(item.handle)  # a retried prefill starts over
                sequence = NgramSequence(item.handle)
                self._append(sequence, item.token_ids)
                self.sequences.add(sequence)
                results.append(len(sequence.tokens))
            except Exception as error:  # per-item failure; the rest of the batch goes on
                results.append(error)
        return results

    def propose(self, items: list[ProposeItem]) -> list[Proposal | Exception]:
        """Per item: keep `cached_len` tokens, append `delta`, propose up to `k` tokens (one-hot q each)."""
        results: list[Proposal | Exception] = []
        for item in items:
            try:
                if not 0 <= item.k <= self.max_speculative_tokens:
                    raise InvalidArgument(f"k must be in [0, {self.max_speculative_tokens}], got {item.k}")
                if not item.delta:
                    raise InvalidArgument("delta must hold at least the last committed token")
                sequence = self.sequences.get(item.handle)
                if not 0 <= item.cached_len <= len(sequence.tokens):
                    raise InvalidArgument(f"sequence '{item.handle}' holds {len(sequence.tokens)} tokens, "
                                          f"cannot keep {item.cached_len}")
                if item.cached_len + len(item.delta) >= self.max_model_len:
                    raise InvalidArgument(f"sequence would exceed the n-gram proposer's context of {self.max_model_len}")
                if item.cached_len < len(sequence.tokens):
                    self._rewind(sequence, item.cached_len)
                self._append(sequence, item.delta)
                tokens = self.lookup(sequence, item.k)
                ids = np.array(tokens, dtype=np.int64).reshape(len(tokens), 1)  # q is one-hot: support 1
                results.append(Proposal(tokens, ids, np.ones((len(tokens), 1), dtype=np.float32), len(sequence.tokens)))
            except Exception as error:
                results.append(error)
        return results

    def lookup(self, sequence: NgramSequence, k: int) -> list[int]:
        """The k tokens (or fewer, to the end of the context) after the latest earlier occurrence of the longest
        matching tail of n tokens, n from max_n down to min_n; [] when none matches."""
        tokens = sequence.tokens
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = sequence.follower[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def release(self, handles: list[str]) -> int:
        return sum(self.sequences.release(h) for h in handles)

    def warm_up(self, **_) -> int:
        return 0  # nothing to capture

    def _append(self, sequence: NgramSequence, new_tokens: list[int]) -> None:
        """Add tokens, indexing each n-gram that a token now follows (a later occurrence replaces an earlier one)."""
        tokens = sequence.tokens
        for token in new_tokens:
            end = len(tokens)  # the index `token` takes: it follows the n-grams ending just before it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                sequence.follower.setdefault(n, {})[tuple(tokens[end - n : end])] = end
            tokens.append(int(token))
        for n in range(self.min_n, self.max_n + 1):
            sequence.follower.setdefault(n, {})

    def _rewind(self, sequence: NgramSequence, keep: int) -> None:
        """Drop tokens past `keep` (the coordinator says which are committed): rebuild the indexes from the rest."""
        kept = sequence.tokens[:keep]
        sequence.tokens, sequence.follower = [], {}
        self._append(sequence, kept)
