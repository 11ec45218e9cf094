"""What a worker keeps per sequence handle: its KV block table, how to sample for it, and when it was last used.

The coordinator is the source of truth for committed tokens; a worker keeps only KV and sampling settings, so a
sequence can be dropped at any time (release, lease expiry) and rebuilt from the coordinator's tokens.
"""

import time
from dataclasses import dataclass, field

from specsplit.services.errors import InvalidArgument
from specsplit.services.kv.block_manager import BlockTable
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.runtime.sequence_handles import SequenceHandles


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


class WorkerSequences(SequenceHandles):
    """The handles a worker holds, each owning KV blocks of the runner's cache."""

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner

    def start(self, handle: str, sampling: WorkerSampling, prompt: list[int], role: str) -> tuple[WorkerSequence, int]:
        """A new sequence for `prompt`, on the KV of its longest cached prefix (kv/prefix_cache.py). Returns it and
        how many prompt tokens that KV already holds; the rest must run. The last prompt token always runs: its
        logits give the target's first token, and every prefill stays a forward of at least one token."""
        self.check_prompt(prompt, role)
        if not handle:
            raise InvalidArgument("sequence handle must be non-empty")
        if handle in self:  # a retried prefill starts over
            self.release(handle)
        sequence = WorkerSequence(handle, sampling)
        self.add(sequence)
        return sequence, self.runner.block_manager.reuse_prefix(sequence.table, prompt, len(prompt) - 1)

    def prompt_written(self, sequence: WorkerSequence, prompt: list[int]) -> None:
        """The prompt's KV is in the cache: offer its full blocks to later prompts."""
        self.runner.block_manager.remember_prefix(sequence.table, prompt)

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

    def released(self, sequence: WorkerSequence) -> None:
        self.runner.release(sequence.table)
