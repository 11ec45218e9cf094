"""Decoding ahead: the target runs a plain decode's next step before the coordinator asks for it.

A sequence without proposals decodes one token a round: the coordinator commits the token the target sampled and
sends it straight back as the next call's delta. Between the two calls the GPU waits for the reply's hop, the
coordinator's commit and the next call's hop: through the services 0.4-0.9 ms of a 5 ms step at batch 8. When the
coordinator marks every sequence of a plain decode call as decoding again next round (VerifyItem.decode_ahead: it
has no draft to propose, nothing new joins the batch), the verifier launches that next step at once, its input the
token just sampled, and answers the next call that asks exactly for it (the same KV length kept, that token as the
delta, no proposals, the same logprobs) from the step's result instead of running one.

Tokens do not change: the step is the one the call would run (the same rows and inputs, the same counter
randomness of the decided position). A call that asks for something else runs its own step, after the one ahead
has ended; its rewind drops the KV the step ahead wrote. On a GPU the step runs while the host answers and waits
(`auto`: on where the target is on a GPU); on the CPU it runs before the reply, so it gains nothing there (`on`
runs it anyway: the tests check the bookkeeping on the CPU).
"""

from dataclasses import dataclass

import numpy as np

from specsplit.services.runtime.pending_step import PendingStep
from specsplit.services.runtime.worker_sequences import WorkerSequence

DECODE_AHEAD_MODES = ("auto", "on", "off")


def decode_ahead_enabled(mode: str, device) -> bool:
    """`auto`: where the step can run while the host goes on (a GPU)."""
    if mode not in DECODE_AHEAD_MODES:
        raise ValueError(f"decode ahead must be one of {', '.join(DECODE_AHEAD_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and getattr(device, "type", str(device)) == "cuda")


@dataclass
class AheadRow:
    sequence: WorkerSequence
    cached_len: int          # the tokens in KV before the step: what the call it answers keeps
    token: int               # the token the step ran: that call's delta
    logprobs: int | None     # the logprobs it computed
    step: PendingStep
    row: int                 # this sequence's row of the step's packed result


class DecodeAhead:
    """The rows of the steps launched ahead, by handle, until a call takes them or asks for something else."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.rows: dict[str, AheadRow] = {}
        self.launched = 0   # rows run ahead
        self.taken = 0      # rows a call took
        self.missed = 0     # rows a call asked something else of

    def claim(self, handles: list[str]) -> dict[str, AheadRow]:
        """The rows of a call's sequences, each taken out: a row answers one call or none."""
        return {handle: row for handle in handles if (row := self.rows.pop(handle, None)) is not None}

    def answer(self, row: AheadRow | None, sequence: WorkerSequence, cached_len: int, delta: list[int],
               num_draft: int, logprobs: int | None) -> np.ndarray | None:
        """The packed result row that answers this call of the sequence, or None where the step ahead ran something
        else (the call then runs its own step)."""
        if row is None:
            return None
        if (row.sequence is sequence and cached_len == row.cached_len and len(delta) == 1 and delta[0] == row.token
                and num_draft == 0 and logprobs == row.logprobs):
            self.taken += 1
            return row.step.result()[row.row]
        self.missed += 1
        return None

    def add(self, rows: list[tuple[WorkerSequence, int, int, int | None]], step: PendingStep) -> None:
        """Rows (sequence, cached length, token, logprobs) of a step just launched, in its row order."""
        for index, (sequence, cached_len, token, logprobs) in enumerate(rows):
            self.rows[sequence.handle] = AheadRow(sequence, cached_len, token, logprobs, step, index)
        self.launched += len(rows)

    def forget(self, handles: list[str]) -> None:
        for handle in handles:
            self.rows.pop(handle, None)

    def prune(self, held) -> None:
        """Drop rows of sequences the worker no longer holds (released, expired, prefilled again)."""
        for handle in [h for h, row in self.rows.items() if held(h) is not row.sequence]:
            del self.rows[handle]
