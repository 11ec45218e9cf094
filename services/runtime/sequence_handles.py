"""The sequence handles a worker holds: lookup that keeps each handle alive, release, and expiry of handles nobody
has touched for a while (their coordinator is gone). A model worker's sequences (worker_sequences.py) also own KV
blocks, freed on release; the n-gram proposer's (draft/ngram_proposer.py) only their context."""

import time

from specsplit.services.errors import UnknownSequence


class SequenceHandles:
    """Sequences by handle; each has a `handle` and a `last_used` (time.monotonic())."""

    def __init__(self):
        self._by_handle: dict = {}
        self.created_total = 0

    def __len__(self) -> int:
        return len(self._by_handle)

    def __contains__(self, handle: str) -> bool:
        return handle in self._by_handle

    def handles(self) -> list[str]:
        return list(self._by_handle)

    def add(self, sequence) -> None:
        self._by_handle[sequence.handle] = sequence
        self.created_total += 1

    def get(self, handle: str):
        sequence = self._by_handle.get(handle)
        if sequence is None:
            raise UnknownSequence(f"unknown sequence handle '{handle}' (released, expired or never prefilled)")
        sequence.last_used = time.monotonic()
        return sequence

    def release(self, handle: str) -> bool:
        sequence = self._by_handle.pop(handle, None)
        if sequence is None:
            return False
        self.released(sequence)
        return True

    def released(self, sequence) -> None:
        """What a released sequence gives back besides its handle (nothing here)."""

    def release_idle(self, max_idle_seconds: float) -> list[str]:
        now = time.monotonic()
        stale = [h for h, s in self._by_handle.items() if now - s.last_used > max_idle_seconds]
        for handle in stale:
            self.release(handle)
        return stale
