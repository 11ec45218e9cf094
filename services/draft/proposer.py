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

        # Each step samples on the device and feeds its samples straight into the next forward; tokens and q come
        # back to the host once, after the last step (no wait inside the k-step loop).
        live = [(i, fi) for i, fi in forward if results[i] is None]
        stepping = [i for i, _ in live if items[i].k > 0]
        rows = torch.cat([logits[i][-1:] for i in stepping]) if stepping else None  # one row per stepping sequence
        steps = []  # per step: (sequence indices, sampled [n], support ids [n, K], support probs [n, K])
        while stepping:
            sequences = [self.sequences.get(items[i].handle) for i in stepping]
            params = [s.sampling for s in sequences]
            temperature, top_k, top_p, seeds = sampling_tensors(params, rows.device)
            probs = processed_probs(rows, temperature, top_k, top_p, sampling_flags(params, self.runner.vocab_size))
            support_ids, support_probs = sparse_draft_distribution(probs, self.support_size)
            positions = to_device([s.table.num_tokens for s in sequences], torch.int64, rows.device)
            sampled = sample_sparse(support_ids, support_probs, counter_uniform(seeds, positions, STREAM_DRAFT))
            steps.append((stepping, sampled, support_ids, support_probs))
            step = len(steps)
            next_rows, next_forward = [], []
            for row, (i, sequence) in enumerate(zip(stepping, sequences)):
                if step < items[i].k:
                    next_rows.append(row)
                    next_forward.append((i, ForwardItem(sequence.table, [0], 1)))  # the token comes from `sampled`
            stepping = []
            if next_forward:
                errors = self.runner.reserve([fi for _, fi in next_forward])
                # A sequence that runs out of KV mid-way simply proposes fewer tokens.
                runnable = [(row, i, fi) for row, (i, fi), err in zip(next_rows, next_forward, errors) if err is None]
                if runnable:
                    picked = [row for row, _, _ in runnable]
                    feed = sampled if picked == list(range(len(sampled))) else sampled[to_device(picked, torch.int64, rows.device)]
                    rows = self.runner.forward_flat([fi for _, _, fi in runnable], input_ids=feed)
                    stepping = [i for _, i, _ in runnable]

        tokens = {i: [] for i, _ in live}
        q_ids = {i: [] for i, _ in live}
        q_probs = {i: [] for i, _ in live}
        # Greedy sequences send q as the one-hot it is: one support entry.
        support = {i: 1 if self.sequences.get(items[i].handle).sampling.greedy else self.support_size for i, _ in live}
        host = to_host(*(t for step in steps for t in step[1:]))
        for s, (indices, _, _, _) in enumerate(steps):
            sampled, support_ids, support_probs = host[3 * s : 3 * s + 3]
            for row, (i, token) in enumerate(zip(indices, sampled.tolist())):
                tokens[i].append(token)
                q_ids[i].append(support_ids[row, : support[i]])
                q_probs[i].append(support_probs[row, : support[i]])
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
