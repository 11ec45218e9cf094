"""What a draft pool runs: a model, or the n-gram (prompt-lookup) proposer, as one string.

The rollout machinery (state.py: canary, promotion, status) compares and records what the draft and canary pools run
as strings; a model is its name, the n-gram proposer is `ngram:MAX:MIN`. Pods get the matching `specsplit draft`
flags, and an n-gram pod no GPU (it has no model).
"""

from __future__ import annotations

PROPOSERS = ("model", "ngram")
NGRAM_PREFIX = "ngram:"
DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN = 4, 1  # as `specsplit draft --proposer ngram`


def ngram_source(max_n: int, min_n: int) -> str:
    return f"{NGRAM_PREFIX}{max_n}:{min_n}"


def is_ngram(source: str) -> bool:
    return isinstance(source, str) and source.startswith(NGRAM_PREFIX)


def draft_flags(source: str) -> list[str]:
    """`specsplit draft` flags for what the pool runs."""
    if is_ngram(source):
        max_n, min_n = source.removeprefix(NGRAM_PREFIX).split(":")
        return ["--proposer", "ngram", "--ngram-max", max_n, "--ngram-min", min_n]
    return ["--model", source]
