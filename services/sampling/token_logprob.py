"""One emitted token's log-probability and its top alternatives (plain data: clients use it without torch)."""

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
