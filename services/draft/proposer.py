"""The draft worker's job: catch up on committed tokens, then propose `k` tokens with their exact distributions.

Per call and sequence: drop KV past `cached_len` (rejected proposals of the last round), run the `delta` of
committed tokens it has not seen (normally 1 token; 2 for a bonus-token sequence; more after target-only rounds),
then `k` autoregressive steps without returning to the caller. Step s samples proposal d_s from q_s, the top-K
truncation of the request's processed distribution, with the counter-based uniform of d_s's absolute position.
The last proposal's KV is never computed: if it is accepted the coordinator sends it back in the next delta.

`propose` reads top to bottom: check and rewind each sequence, reserve the KV the whole call will write, gather
the batch's fields, run the step program (draft_steps.py: one graph replay on a GPU), unpack one result per
sequence. With graphs, a catch-up longer than the proposing graphs take runs first through catch-up-only graphs.
"""

from dataclasses import dataclass

import numpy as np
import torch

from specsplit.services.draft.draft_steps import DraftShape, DraftSteps
from specsplit.services.runtime.cuda_graphs import BATCH_BUCKETS
from specsplit.services.errors import InvalidArgument, KVCacheFull
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
from specsplit.services.runtime.worker_sequences import WorkerSampling, WorkerSequence, WorkerSequences
from specsplit.services.sampling.batch_sampling import sampling_flags, sampling_fields
from specsplit.services.sampling.logits_processing import SamplingFlags

# Catch-up widths a step program takes per sequence (a delta is padded to the next one). Proposing graphs take 2 (the
# normal catch-up: one token, two after a bonus round); longer catch-ups (after rounds the speculation policy ran
# without the draft) go through catch-up-only graphs first, up to 64 tokens a sequence per call.
CATCH_UP_SIZES = (2, 4, 8, 16, 32, 64)
MAX_CATCH_UP = CATCH_UP_SIZES[-1]
CATCH_UP_FLAGS = SamplingFlags(top_k=False, top_p=False, greedy=True)  # a catch-up samples nothing: one shape


@dataclass
class DraftPrefill:
    handle: str
    token_ids: list[int]
    sampling: WorkerSampling


@dataclass
class ProposeItem:
    handle: str
    cached_len: int        # committed tokens of the draft's KV to keep
    delta: list[int]       # committed tokens the draft has not yet run
    k: int                 # proposals wanted (0 = just catch up)


@dataclass
class Proposal:
    token_ids: list[int]   # d_1..d_k' (k' < k only if KV ran out mid-way)
    q_token_ids: np.ndarray    # [k', K] int64: support of each q_i
    q_probs: np.ndarray        # [k', K] float32
    num_cached: int        # tokens now in the draft's KV (committed + d_1..d_{k'-1})


class DraftProposer:
    kind = "model"  # the proposer kind metrics and traces name (the n-gram proposer is "ngram")

    def __init__(self, runner: ModelRunner, support_size: int = 32, max_speculative_tokens: int = 16):
        self.runner = runner
        self.sequences = WorkerSequences(runner)
        self.support_size = support_size
        self.max_speculative_tokens = max_speculative_tokens

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def prefill(self, items: list[DraftPrefill]) -> list[int | Exception]:
        """Run prompts into KV. Returns per item the number of cached tokens, or the error for that item."""
        results: list[int | Exception] = [None] * len(items)
        forward: list[tuple[int, ForwardItem]] = []
        for i, item in enumerate(items):
            try:
                sequence, cached = self.sequences.start(item.handle, item.sampling, item.token_ids, "draft")
                forward.append((i, ForwardItem(sequence.table, item.token_ids[cached:], 0)))
            except Exception as error:  # per-item failure; the rest of the batch goes on
                results[i] = error
        self._reserve_and_run(forward, results, items)
        for i, _ in forward:
            if results[i] is None:
                sequence = self.sequences.get(items[i].handle)
                self.sequences.prompt_written(sequence, items[i].token_ids)
                results[i] = sequence.table.num_tokens
            else:  # a prompt that did not fit leaves nothing behind
                self.sequences.release(items[i].handle)
        return results

    def propose(self, items: list[ProposeItem]) -> list[Proposal | Exception]:
        results: list[Proposal | Exception] = [None] * len(items)
        batch: list[tuple[int, WorkerSequence, int, list[int]]] = []  # (item index, sequence, k, delta)
        for i, item in enumerate(items):
            try:
                if not 0 <= item.k <= self.max_speculative_tokens:
                    raise InvalidArgument(f"k must be in [0, {self.max_speculative_tokens}], got {item.k}")
                if not item.delta:
                    raise InvalidArgument("delta must hold at least the last committed token")
                if min(item.delta) < 0 or max(item.delta) >= self.runner.vocab_size:
                    raise InvalidArgument(f"token ids must be in [0, {self.runner.vocab_size})")
                sequence = self.sequences.get(item.handle)
                self.sequences.rewind(sequence, item.cached_len)
                k = self._reserve(sequence, len(item.delta), item.k)
                batch.append((i, sequence, k, list(item.delta)))
            except Exception as error:  # per-item failure; the rest of the batch goes on
                results[i] = error
        self._catch_up_long_deltas(batch)
        if not batch:
            return results

        steps = max(max(k for _, _, k, _ in batch), 1)
        greedy = all(sequence.sampling.greedy for _, sequence, _, _ in batch)
        support = 1 if greedy else min(self.support_size, self.runner.vocab_size)
        catch_up = self.runner.shape_size(max(len(delta) for _, _, _, delta in batch), CATCH_UP_SIZES)
        starts = np.array([sequence.table.num_tokens - len(delta) - max(k - 1, 0) for _, sequence, k, delta in batch])
        deltas = np.zeros((len(batch), catch_up), dtype=np.int64)
        for b, (_, _, _, delta) in enumerate(batch):
            deltas[b, : len(delta)] = delta
        params = [sequence.sampling for _, sequence, _, _ in batch]
        flags = sampling_flags(params, self.runner.vocab_size, fewer_shapes=self.runner.graphs is not None)
        shape = DraftShape(catch_up, steps, support, flags,
                           self.runner.context_bound(int(starts.max()) + catch_up + steps))
        packed = self.runner.run_step(DraftSteps, shape, {
            "start": starts, "n_delta": [len(delta) for _, _, _, delta in batch], "delta": deltas,
            "k": [k for _, _, k, _ in batch], **sampling_fields(params),
        }, [sequence.table for _, sequence, _, _ in batch])

        out = packed.reshape(-1, steps, 1 + 2 * support)[: len(batch)]
        tokens = out[:, :, 0].tolist()
        # The whole batch's q as two arrays; each sequence gets views of its rows (numpy, as the wire carries them:
        # no torch call per sequence on the way out).
        q_ids = out[:, :, 1 : 1 + support].astype(np.int64)
        q_probs = np.ascontiguousarray(out[:, :, 1 + support :]).view(np.float32)
        for b, (i, sequence, k, _) in enumerate(batch):
            width = 1 if sequence.sampling.greedy else support  # greedy: q is the one-hot it is, one entry
            results[i] = Proposal(tokens[b][:k], q_ids[b, :k, :width], q_probs[b, :k, :width],
                                  sequence.table.num_tokens)
        return results

    def _reserve(self, sequence: WorkerSequence, delta: int, k: int) -> int:
        """Claim KV for the call: the delta and every proposal but the last. A sequence whose KV runs out proposes
        one token (which needs no KV of its own) rather than none. Returns the k it will propose."""
        try:
            self.runner.reserve_tokens(sequence.table, delta + max(k - 1, 0))
            return k
        except KVCacheFull:
            if k <= 1:
                raise
        self.runner.reserve_tokens(sequence.table, delta)
        return 1

    def _catch_up_long_deltas(self, batch) -> None:
        """Deltas longer than the proposing program's catch-up (after rounds the speculation policy ran without the
        draft): with graphs, run their heads first through catch-up-only graphs (k = 0, no sampling) of up to
        MAX_CATCH_UP tokens a sequence, so proposing always runs the few shapes captured before serving; eager, the
        proposing program takes any length (its shapes cost nothing)."""
        if self.runner.graphs is None:
            return
        keep = CATCH_UP_SIZES[0]
        while True:
            long = [b for b, (_, _, _, delta) in enumerate(batch) if len(delta) > keep]
            if not long:
                return
            pieces, tables, starts = [], [], []
            for b in long:
                i, sequence, k, delta = batch[b]
                piece = delta[: min(len(delta) - keep, MAX_CATCH_UP)]
                pieces.append(piece)
                tables.append(sequence.table)
                # The call's slots were reserved for the whole delta: this piece takes the first of them.
                starts.append(sequence.table.num_tokens - len(delta) - max(k - 1, 0))
                batch[b] = (i, sequence, k, delta[len(piece) :])
            width = self.runner.shape_size(max(len(p) for p in pieces), CATCH_UP_SIZES)
            deltas = np.zeros((len(pieces), width), dtype=np.int64)
            for row, piece in enumerate(pieces):
                deltas[row, : len(piece)] = piece
            shape = DraftShape(width, 0, 1, CATCH_UP_FLAGS, self.runner.context_bound(max(starts) + width))
            self.runner.run_step(DraftSteps, shape, {
                "start": starts, "n_delta": [len(p) for p in pieces], "delta": deltas, "k": [0] * len(pieces),
                **sampling_fields([batch[b][1].sampling for b in long]),
            }, tables)

    @staticmethod
    def warm_up_bound(max_k: int) -> int:
        """The proposals per call to capture graphs for, for rounds of up to `max_k`: one more, since an overlapped
        round's propose call also samples the bonus guess (coordinator._guesses)."""
        return max_k + 1 if max_k > 0 else 0

    def warm_up(self, max_batch: int = 64, max_k: int = 4, sampled: bool = True) -> int:
        """Capture the step programs a round is likely to run (every batch bucket up to `max_batch`, every k up to
        `max_k`, greedy and plain-temperature sampling, and the catch-up-only graphs) before serving, so no request
        waits for a capture. A no-op without graphs. Returns the graphs captured."""
        graphs = self.runner.graphs
        if graphs is None:
            return 0
        before = len(graphs.steps)
        settings = [WorkerSampling(0.0, 0, 1.0, 0)] + ([WorkerSampling(1.0, 0, 1.0, 0)] if sampled else [])
        for bucket in (b for b in BATCH_BUCKETS if b <= max_batch):
            for sampling in settings:
                handles = [f"warm-up-{i}" for i in range(bucket)]
                if self.runner.block_manager.num_free_blocks < 2 * bucket + 2:
                    break  # a cache this small serves few sequences: capture the rest when they come
                self.prefill([DraftPrefill(h, [0, 0], sampling) for h in handles])
                for k in range(1, max_k + 1):
                    self.propose([ProposeItem(h, 2, [0, 0], k) for h in handles])
                if sampling.greedy:  # catch-ups sample nothing: one set of graphs serves every setting
                    for size in CATCH_UP_SIZES[1:]:
                        if self.runner.block_manager.num_free_blocks >= bucket * (size // 16 + 2):
                            self.propose([ProposeItem(h, 2, [0] * (size + 2), 1) for h in handles])
                self.release(handles)
        return len(graphs.steps) - before

    def release(self, handles: list[str]) -> int:
        return sum(self.sequences.release(h) for h in handles)

    def _reserve_and_run(self, forward, results, items) -> dict[int, torch.Tensor]:
        errors = self.runner.reserve([fi for _, fi in forward])
        runnable = []
        for (i, fi), error in zip(forward, errors):
            if error is not None:
                results[i] = error
            else:
                runnable.append((i, fi))
        out = self.runner.forward([fi for _, fi in runnable]) if runnable else []
        return {i: rows for (i, _), rows in zip(runnable, out)}
