"""What a worker keeps per sequence handle: its KV block table, how to sample for it, and when it was last used.

The coordinator is the source of truth for committed tokens; a worker keeps only KV and sampling settings, so a
sequence can be dropped at any time (release, lease expiry) and rebuilt from the coordinator's tokens.
"""

import time
from dataclasses import dataclass, field

from specsplit.services.errors import InvalidArgument, UnknownSequence
from specsplit.services.kv.block_manager import BlockTable
from specsplit.services.runtime.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerSampling:
    temperature: float
    top_k: int
    top_p: float
    seed: int
    # Target only (services/target/acceptance_method.py): "" = the target's default, "rejection" (lossless) or
    # "typical" (NOT lossless) with its parameters (None = the target's); the target settles them at prefill.
    acceptance_method: str = ""
    posterior_threshold: float | None = None
    posterior_alpha: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class WorkerSequence:
    handle: str
    sampling: WorkerSampling
    table: BlockTable = field(default_factory=BlockTable)
    last_used: float = field(default_factory=time.monotonic)


class WorkerSequences:
    """The handles a worker holds, each owning KV blocks of the runner's cache."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._by_handle: dict[str, WorkerSequence] = {}
        self.created_total = 0

    def __len__(self) -> int:
        return len(self._by_handle)

    def __contains__(self, handle: str) -> bool:
        return handle in self._by_handle

    def handles(self) -> list[str]:
        return list(self._by_handle)

    def start(self, handle: str, sampling: WorkerSampling, prompt: list[int], role: str) -> tuple[WorkerSequence, int]:
        """A new sequence for `prompt`, on the KV of its longest cached prefix (kv/prefix_cache.py). Returns it and
        how many prompt tokens that KV already holds; the rest must run. The last prompt token always runs: its
        logits give the target's first token, and every prefill stays a forward of at least one token."""
        self.check_prompt(prompt, role)
        if not handle:
            raise InvalidArgument("sequence handle must be non-empty")
        if handle in self._by_handle:  # a retried prefill starts over
            self.release(handle)
        sequence = WorkerSequence(handle, sampling)
        self._by_handle[handle] = sequence
        self.created_total += 1
        return sequence, self.runner.block_manager.reuse_prefix(sequence.table, prompt, len(prompt) - 1)

    def prompt_written(self, sequence: WorkerSequence, prompt: list[int]) -> None:
        """The prompt's KV is in the cache: offer its full blocks to later prompts."""
        self.runner.block_manager.remember_prefix(sequence.table, prompt)

    def get(self, handle: str) -> WorkerSequence:
        sequence = self._by_handle.get(handle)
        if sequence is None:
            raise UnknownSequence(f"unknown sequence handle '{handle}' (released, expired or never prefilled)")
        sequence.last_used = time.monotonic()
        return sequence

    def check_prompt(self, token_ids: list[int], role: str) -> None:
        """A prompt a worker can take: non-empty, inside the vocabulary, shorter than the served context."""
        if not token_ids:
            raise InvalidArgument("prompt must not be empty")
        if len(token_ids) >= self.runner.max_model_len:
            raise InvalidArgument(
                f"prompt of {len(token_ids)} tokens does not fit the {role}'s context of {self.runner.max_model_len}"
            )
        if any(not 0 <= t < self.runner.vocab_size for t in token_ids):
            raise InvalidArgument(f"prompt token ids must be in [0, {self.runner.vocab_size})")

    def rewind(self, sequence: WorkerSequence, cached_len: int) -> None:
        """Drop KV past `cached_len` tokens: the coordinator says how many of the cached tokens are committed."""
        if cached_len > sequence.table.num_tokens or cached_len < 0:
            raise InvalidArgument(
                f"sequence '{sequence.handle}' holds {sequence.table.num_tokens} tokens, cannot keep {cached_len}"
            )
        self.runner.block_manager.truncate(sequence.table, cached_len)

    def release(self, handle: str) -> bool:
        sequence = self._by_handle.pop(handle, None)
        if sequence is None:
            return False
        self.runner.release(sequence.table)
        return True

    def release_idle(self, max_idle_seconds: float) -> list[str]:
        """Free sequences nobody has touched for a while (their coordinator is gone)."""
        now = time.monotonic()
        stale = [h for h, s in self._by_handle.items() if now - s.last_used > max_idle_seconds]
        for handle in stale:
            self.release(handle)
        return stale
