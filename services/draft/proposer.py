"""The draft worker's job: catch up on committed tokens, then propose `k` tokens with their exact distributions.

Per call and sequence: drop KV past `cached_len` (rejected proposals of the last round), run the `delta` of
committed tokens it has not seen (normally 1 token; 2 for a bonus-token sequence; more after target-only rounds),
then `k` autoregressive steps without returning to the caller. Step s samples proposal d_s from q_s, the top-K
truncation of the request's processed distribution, with the counter-based uniform of d_s's absolute position.
The last proposal's KV is never computed: if it is accepted the coordinator sends it back in the next delta.
"""

from dataclasses import dataclass

import torch

from specsplit.kernels.counter_rng import STREAM_DRAFT
from specsplit.kernels.dispatch import counter_uniform
from specsplit.services.errors import InvalidArgument
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
from specsplit.services.runtime.worker_sequences import WorkerSampling, WorkerSequences
from specsplit.services.runtime.host_transfer import to_device, to_host
from specsplit.services.sampling.batch_sampling import sampling_flags, sampling_tensors
from specsplit.services.sampling.draft_distribution import sample_sparse, sparse_draft_distribution
from specsplit.services.sampling.logits_processing import processed_probs


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
    q_token_ids: torch.Tensor  # [k', K] int64: support of each q_i
    q_probs: torch.Tensor      # [k', K] float32
    num_cached: int        # tokens now in the draft's KV (committed + d_1..d_{k'-1})


class DraftProposer:
    def __init__(self, runner: ModelRunner, support_size: int = 32, max_speculative_tokens: int = 16):
        self.runner = runner
        self.sequences = WorkerSequences(runner)
        self.support_size = support_size
        self.max_speculative_tokens = max_speculative_tokens

    def prefill(self, items: list[DraftPrefill]) -> list[int | Exception]:
        """Run prompts into KV. Returns per item the number of cached tokens, or the error for that item."""
        results: list[int | Exception] = [None] * len(items)
        forward: list[tuple[int, ForwardItem]] = []
        for i, item in enumerate(items):
            try:
                self.sequences.check_prompt(item.token_ids, "draft")
                sequence = self.sequences.create(item.handle, item.sampling)
                forward.append((i, ForwardItem(sequence.table, item.token_ids, 0)))
            except Exception as error:  # per-item failure; the rest of the batch goes on
                results[i] = error
        self._reserve_and_run(forward, results, items)
        for i, _ in forward:
            if results[i] is None:
                results[i] = self.sequences.get(items[i].handle).table.num_tokens
            else:  # a prompt that did not fit leaves nothing behind
                self.sequences.release(items[i].handle)
        return results

    def propose(self, items: list[ProposeItem]) -> list[Proposal | Exception]:
        results: list[Proposal | Exception] = [None] * len(items)
        forward: list[tuple[int, ForwardItem]] = []
        for i, item in enumerate(items):
            try:
                if not 0 <= item.k <= self.max_speculative_tokens:
                    raise InvalidArgument(f"k must be in [0, {self.max_speculative_tokens}], got {item.k}")
                if not item.delta:
                    raise InvalidArgument("delta must hold at least the last committed token")
                sequence = self.sequences.get(item.handle)
                self.sequences.rewind(sequence, item.cached_len)
                forward.append((i, ForwardItem(sequence.table, list(item.delta), 1 if item.k > 0 else 0)))
            except Exception as error:
                results[i] = error
        logits = self._reserve_and_run(forward, results, items)

        # Proposal state per live item: tokens and q rows so far.
        live = [(i, fi) for i, fi in forward if results[i] is None]
        tokens = {i: [] for i, _ in live}
        q_ids = {i: [] for i, _ in live}
        q_probs = {i: [] for i, _ in live}
        step_logits = {i: logits[i] for i, _ in live}
        stepping = [i for i, _ in live if items[i].k > 0]
        step, step_rows = 0, None  # step_rows: the last forward's logits, one row per stepping sequence
        while stepping:
            step += 1
            sequences = [self.sequences.get(items[i].handle) for i in stepping]
            rows = torch.cat([step_logits[i][-1:] for i in stepping]) if step == 1 else step_rows
            params = [s.sampling for s in sequences]
            temperature, top_k, top_p, seeds = sampling_tensors(params, rows.device)
            probs = processed_probs(rows, temperature, top_k, top_p, sampling_flags(params, self.runner.vocab_size))
            support_ids, support_probs = sparse_draft_distribution(probs, self.support_size)
            positions = to_device([s.table.num_tokens for s in sequences], torch.int64, rows.device)
            sampled = sample_sparse(support_ids, support_probs, counter_uniform(seeds, positions, STREAM_DRAFT))
            # The step's one wait: the sampled tokens (needed to feed the next step) and q, which leaves as host data.
            sampled, support_ids, support_probs = to_host(sampled, support_ids, support_probs)
            sampled = sampled.tolist()
            next_stepping, next_forward = [], []
            for row, (i, sequence) in enumerate(zip(stepping, sequences)):
                support = 1 if sequence.sampling.greedy else self.support_size
                tokens[i].append(sampled[row])
                q_ids[i].append(support_ids[row, :support])
                q_probs[i].append(support_probs[row, :support])
                if step < items[i].k:
                    next_forward.append((i, ForwardItem(sequence.table, [tokens[i][-1]], 1)))
            if next_forward:
                errors = self.runner.reserve([fi for _, fi in next_forward])
                runnable = [(i, fi) for (i, fi), err in zip(next_forward, errors) if err is None]
                # A sequence that runs out of KV mid-way simply proposes fewer tokens.
                if runnable:
                    step_rows = self.runner.forward_flat([fi for _, fi in runnable])  # one row per sequence
                    next_stepping = [i for i, _ in runnable]
            stepping = next_stepping

        for i, fi in live:
            k_done = len(tokens[i])
            results[i] = Proposal(
                token_ids=tokens[i],
                q_token_ids=torch.stack(q_ids[i]) if k_done else torch.empty(0, 1, dtype=torch.int64),
                q_probs=torch.stack(q_probs[i]) if k_done else torch.empty(0, 1),
                num_cached=fi.table.num_tokens,
            )
        return results

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
