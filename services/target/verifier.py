"""The target worker's job: score k+1 positions per sequence in one forward and decide what is accepted.

Per call and sequence: drop KV past `cached_len`, run `delta` (committed tokens not yet in KV — normally only the
last one) followed by the draft's proposals d_1..d_k, take the target's distribution p at the k+1 positions that
decide d_1..d_k and the token after, and run the lossless rejection sampler with the draft's exact sparse q.
KV of rejected proposals is dropped at once, so afterwards the KV holds every committed token but the newest.
A prefill is the same operation with the prompt as delta and no proposals: it samples the first token.
"""

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from specsplit.kernels.counter_rng import STREAM_ACCEPT, STREAM_SAMPLE
from specsplit.kernels.dispatch import counter_uniform, rejection_sample
from specsplit.services.errors import InvalidArgument
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
from specsplit.services.runtime.worker_sequences import WorkerSampling, WorkerSequences
from specsplit.services.runtime.host_transfer import to_device, to_host
from specsplit.services.sampling.batch_sampling import sampling_flags, sampling_tensors
from specsplit.services.sampling.logits_processing import processed_probs
from specsplit.services.sampling.logprobs import TokenLogprob, token_logprobs
from specsplit.services.target.acceptance_method import TYPICAL, AcceptancePolicy
from specsplit.services.target.typical_batch import accept_typical, merge_typical
from specsplit.services.target.synthetic_acceptance import check_alpha, synthetic_accept, warn_enabled


@dataclass
class TargetPrefill:
    handle: str
    token_ids: list[int]
    sampling: WorkerSampling
    logprobs: int | None = None


@dataclass
class VerifyItem:
    handle: str
    cached_len: int
    delta: list[int]
    draft_token_ids: list[int] = field(default_factory=list)
    q_token_ids: torch.Tensor | None = None  # [k, K] int64
    q_probs: torch.Tensor | None = None      # [k, K] float32
    logprobs: int | None = None


@dataclass
class Verdict:
    num_accepted: int
    token_ids: list[int]               # accepted proposals + the recovered or bonus token
    logprobs: list[TokenLogprob] | None
    num_cached: int                    # tokens now in the target's KV
    acceptance_method: str = ""        # prefill only: the method the sequence got (acceptance_method.py)


class TargetVerifier:
    def __init__(self, runner: ModelRunner, max_speculative_tokens: int = 16, synthetic_acceptance: float | None = None,
                 acceptance: AcceptancePolicy | None = None):
        """`synthetic_acceptance`: BENCHMARK ONLY, not lossless (see synthetic_acceptance.py); None in serving.
        `acceptance`: rejection sampling (lossless) unless it enables typical acceptance (NOT lossless)."""
        self.runner = runner
        self.sequences = WorkerSequences(runner)
        self.max_speculative_tokens = max_speculative_tokens
        self.acceptance = acceptance or AcceptancePolicy()
        self.acceptance.warn_if_lossy("the target verifier")
        self.synthetic_acceptance = None
        if synthetic_acceptance is not None:
            self.synthetic_acceptance = check_alpha(synthetic_acceptance)
            warn_enabled(self.synthetic_acceptance, "the target verifier")

    def prefill(self, items: list[TargetPrefill]) -> list[Verdict | Exception]:
        """Create sequences, run their prompts, and sample each one's first token."""
        results: list = [None] * len(items)
        verify_items, index = [], []
        for i, item in enumerate(items):
            try:
                sampling = self.acceptance.resolve(item.sampling)
                _, cached = self.sequences.start(item.handle, sampling, item.token_ids, "target")
                verify_items.append(VerifyItem(item.handle, cached, list(item.token_ids[cached:]), logprobs=item.logprobs))
                index.append(i)
            except Exception as error:
                results[i] = error
        for i, verdict in zip(index, self.verify(verify_items)):
            results[i] = verdict
            if isinstance(verdict, Exception):
                self.sequences.release(items[i].handle)
            else:
                sequence = self.sequences.get(items[i].handle)
                self.sequences.prompt_written(sequence, items[i].token_ids)
                verdict.acceptance_method = sequence.sampling.acceptance_method
        return results

    def verify(self, items: list[VerifyItem]) -> list[Verdict | Exception]:
        results: list = [None] * len(items)
        live: list[tuple[int, ForwardItem]] = []
        for i, item in enumerate(items):
            try:
                k = len(item.draft_token_ids)
                self._check(item, k)
                sequence = self.sequences.get(item.handle)
                self.sequences.rewind(sequence, item.cached_len)
                live.append((i, ForwardItem(sequence.table, list(item.delta) + list(item.draft_token_ids), k + 1)))
            except Exception as error:
                results[i] = error
        errors = self.runner.reserve([fi for _, fi in live])
        runnable = []
        for (i, fi), error in zip(live, errors):
            if error is not None:
                results[i] = error
            else:
                runnable.append((i, fi))
        if not runnable:
            return results
        logits = self.runner.forward_flat([fi for _, fi in runnable])
        for (i, _), verdict in zip(runnable, self._decide([items[i] for i, _ in runnable], [fi for _, fi in runnable], logits)):
            results[i] = verdict
        return results

    def release(self, handles: list[str]) -> int:
        return sum(self.sequences.release(h) for h in handles)

    def _check(self, item: VerifyItem, k: int) -> None:
        if not item.delta:
            raise InvalidArgument("delta must hold at least the last committed token")
        if k > self.max_speculative_tokens:
            raise InvalidArgument(f"at most {self.max_speculative_tokens} proposals per sequence, got {k}")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in item.delta) or any(not 0 <= t < vocab for t in item.draft_token_ids):
            raise InvalidArgument(f"token ids must be in [0, {vocab})")
        if k:
            if item.q_token_ids is None or item.q_probs is None:
                raise InvalidArgument("proposals need their draft distribution q")
            if item.q_token_ids.shape != item.q_probs.shape or item.q_token_ids.shape[0] != k:
                raise InvalidArgument(f"q must have one row per proposal ({k}), got {tuple(item.q_token_ids.shape)}")
            if bool(((item.q_token_ids < 0) | (item.q_token_ids >= vocab)).any()):
                raise InvalidArgument(f"q token ids must be in [0, {vocab})")
            if bool((item.q_probs < 0).any()) or not bool(torch.isfinite(item.q_probs).all()):
                raise InvalidArgument("q probabilities must be finite and non-negative")
        if item.cached_len + len(item.delta) + k > self.runner.max_model_len:
            raise InvalidArgument(f"sequence would exceed the target's context of {self.runner.max_model_len}")

    def _decide(self, items: list[VerifyItem], forward: list[ForwardItem], all_logits: torch.Tensor) -> list[Verdict]:
        """all_logits: [sum(k + 1), vocab], the items' rows in order. One device-to-host wait for the whole batch."""
        device = all_logits.device
        sequences = [self.sequences.get(item.handle) for item in items]
        num_draft = [len(item.draft_token_ids) for item in items]
        # Absolute position decided by each target row: committed length + row index.
        committed_lens = [fi.table.num_tokens - k for fi, k in zip(forward, num_draft)]
        row_params = [s.sampling for s, k in zip(sequences, num_draft) for _ in range(k + 1)]
        temperature, top_k, top_p, seeds = sampling_tensors(row_params, device)
        probs = processed_probs(all_logits, temperature, top_k, top_p, sampling_flags(row_params, self.runner.vocab_size))
        row_positions = to_device(
            [length + j for length, k in zip(committed_lens, num_draft) for j in range(k + 1)], torch.int64, device
        )
        sample_u = counter_uniform(seeds, row_positions, STREAM_SAMPLE)
        # Target rows that decide a proposal: sequence b's rows are [start_b, start_b + k_b]; all but the last.
        starts = [0] + list(accumulate(k + 1 for k in num_draft))
        draft_rows = to_device([start + j for start, k in zip(starts, num_draft) for j in range(k)], torch.int64, device)
        draft_ids = to_device([t for item in items for t in item.draft_token_ids], torch.int64, device)

        typical = [s.sampling.acceptance_method == TYPICAL for s in sequences]
        if self.synthetic_acceptance is not None:  # benchmark only: the accept decision is a biased coin
            output, num_accepted = synthetic_accept(self.synthetic_acceptance, probs, draft_ids, num_draft,
                                                    seeds[draft_rows], row_positions[draft_rows], sample_u)
        elif all(typical):  # NOT lossless, opted in (acceptance_method.py, typical_batch.py)
            output, num_accepted = accept_typical(probs, draft_ids, num_draft, [s.sampling for s in sequences], sample_u)
        else:
            accept_u = counter_uniform(seeds[draft_rows], row_positions[draft_rows], STREAM_ACCEPT)
            support = max([item.q_token_ids.shape[1] for item in items if item.draft_token_ids] or [1])
            # q arrives on the host (from the wire or the proposer): pad and stack there, then one copy.
            q_ids = torch.cat([_pad(item.q_token_ids, k, support, torch.int64) for item, k in zip(items, num_draft)])
            q_probs = torch.cat([_pad(item.q_probs, k, support, torch.float32) for item, k in zip(items, num_draft)])
            q_ids, q_probs = _on(q_ids, device), _on(q_probs, device)
            cu = to_device([0] + list(accumulate(num_draft)), torch.int64, device)
            output, num_accepted = rejection_sample(probs, draft_ids, q_ids, q_probs, cu, accept_u, sample_u,
                                                    max_num_draft=max(num_draft, default=0))
            if any(typical):  # a mixed batch: typical verdicts for the sequences that opted in
                output, num_accepted = merge_typical(typical, accept_typical(
                    probs, draft_ids, num_draft, [s.sampling for s in sequences], sample_u), (output, num_accepted))
        output, num_accepted = to_host(output, num_accepted)
        output, num_accepted = output.tolist(), num_accepted.tolist()

        verdicts = []
        row = 0
        for b, (item, sequence, length, k) in enumerate(zip(items, sequences, committed_lens, num_draft)):
            n_acc = num_accepted[b]
            emitted = output[b][: n_acc + 1]
            # Rejected proposals leave the KV: it now holds every committed token but the newest.
            self.runner.block_manager.truncate(sequence.table, length + n_acc)
            lp = None
            if item.logprobs is not None:
                lp = token_logprobs(all_logits[row : row + n_acc + 1], emitted, item.logprobs)
            verdicts.append(Verdict(n_acc, emitted, lp, sequence.table.num_tokens))
            row += k + 1
        return verdicts


def _pad(tensor, rows, width, dtype):
    if rows == 0:
        return torch.zeros(0, width, dtype=dtype)
    tensor = tensor.to(device="cpu", dtype=dtype)
    if tensor.shape[1] == width:
        return tensor
    return torch.cat([tensor, torch.zeros(rows, width - tensor.shape[1], dtype=dtype)], dim=1)


def _on(tensor: torch.Tensor, device) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)

