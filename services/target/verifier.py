"""The target worker's job: score k+1 positions per sequence in one forward and decide what is accepted.

Per call and sequence: drop KV past `cached_len`, run `delta` (committed tokens not yet in KV — normally only the
last one) followed by the draft's proposals d_1..d_k, take the target's distribution p at the k+1 positions that
decide d_1..d_k and the token after, and run the lossless rejection sampler with the draft's exact sparse q.
KV of rejected proposals is dropped at once, so afterwards the KV holds every committed token but the newest.
A prefill is the same operation with the prompt as delta and no proposals: it samples the first token.

`verify` reads top to bottom: check and rewind each sequence, reserve KV for its delta and proposals, gather the
batch's fields, run the step program (verify_steps.py: forward, decision and logprobs, one graph replay on a GPU),
then per sequence drop the KV of rejected proposals and build its verdict from the one packed result. A prefill of
short prompts runs as the same step program without proposals (prompts padded to a common length); longer ones are
ragged: an eager forward, then the same decision. After a call of plain decodes the verifier may launch the next
step ahead (decode_ahead.py).
"""

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from specsplit.services.errors import InvalidArgument, KVCacheFull
from specsplit.services.runtime.cuda_graphs import BATCH_BUCKETS, bucket_for
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
from specsplit.services.runtime.worker_sequences import WorkerSampling, WorkerSequence, WorkerSequences
from specsplit.services.sampling.batch_sampling import sampling_fields, sampling_flags
from specsplit.services.sampling.token_logprob import TokenLogprob
from specsplit.services.sampling_params import MAX_LOGPROBS
from specsplit.services.target.acceptance_method import TYPICAL, AcceptancePolicy
from specsplit.services.target.decode_ahead import DecodeAhead, decode_ahead_enabled
from specsplit.services.target.synthetic_acceptance import check_alpha, warn_enabled
from specsplit.services.target.verify_steps import VerifyShape, VerifySteps, decide, pack_decision

log = logging.getLogger(__name__)


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
    q_token_ids: torch.Tensor | np.ndarray | None = None  # [k, K] int64
    q_probs: torch.Tensor | np.ndarray | None = None      # [k, K] float32
    logprobs: int | None = None
    bonus_guess: int | None = None           # the draft's guess of the bonus token (overlapped rounds); read only by
                                             # the synthetic-acceptance benchmark mode, whose coin decides if it is right
    decode_ahead: bool = False               # the coordinator's word that the sequence's next round is a plain decode
                                             # of the token this call emits (target/decode_ahead.py)


@dataclass
class Verdict:
    num_accepted: int
    token_ids: list[int]               # accepted proposals + the recovered or bonus token
    logprobs: list[TokenLogprob] | None
    num_cached: int                    # tokens now in the target's KV
    acceptance_method: str = ""        # prefill only: the method the sequence got (acceptance_method.py)


class TargetVerifier:
    def __init__(self, runner: ModelRunner, max_speculative_tokens: int = 16, synthetic_acceptance: float | None = None,
                 acceptance: AcceptancePolicy | None = None, decode_ahead: str = "auto"):
        """`synthetic_acceptance`: BENCHMARK ONLY, not lossless (see synthetic_acceptance.py); None in serving.
        `acceptance`: rejection sampling (lossless) unless it enables typical acceptance (NOT lossless).
        `decode_ahead`: auto, on or off (decode_ahead.py; auto = on a GPU)."""
        self.runner = runner
        self.decode_ahead = DecodeAhead(decode_ahead_enabled(decode_ahead, runner.device))
        # Short prefills as step programs, where those replay graphs (on the CPU the eager forward is as fast): opt-in
        # (SPECSPLIT_PREFILL_STEPS=on) until its time to first token is measured; each new prompt width and batch
        # bucket captures a graph on first use.
        self.prefill_steps = runner.graphs is not None and os.environ.get(PREFILL_STEPS_ENV, "off") == "on"
        self.sequences = WorkerSequences(runner)
        self.max_speculative_tokens = max_speculative_tokens
        self.acceptance = acceptance or AcceptancePolicy()
        self.acceptance.warn_if_lossy("the target verifier")
        self.synthetic_acceptance = None
        if synthetic_acceptance is not None:
            self.synthetic_acceptance = check_alpha(synthetic_acceptance)
            warn_enabled(self.synthetic_acceptance, "the target verifier")

    def prefill(self, items: list[TargetPrefill]) -> list[Verdict | Exception]:
        """Create sequences, run their prompts, sample each first token: short prompts as one step program (a graph
        replay on a GPU, padded to a common length), others in an eager forward (prompts are ragged)."""
        results: list = [None] * len(items)
        started: list[tuple[int, WorkerSequence, ForwardItem]] = []
        for i, item in enumerate(items):
            try:
                sampling = self.acceptance.resolve(item.sampling)  # the method this sequence keeps
                sequence, cached = self.sequences.start(item.handle, sampling, item.token_ids, "target")
            except Exception as error:
                results[i] = error
                continue
            forward = ForwardItem(sequence.table, list(item.token_ids[cached:]), 1)
            try:
                self.runner.reserve_tokens(sequence.table, len(forward.token_ids))
                started.append((i, sequence, forward))
            except Exception as error:  # a prompt that does not fit leaves nothing behind
                results[i] = error
                self.sequences.release(item.handle)
        if not started:
            return results
        if self._prefill_takes_step(started):
            packed = self._plain_step([(s, s.table.num_tokens - len(f.token_ids), f.token_ids, items[i].logprobs)
                                       for i, s, f in started], PREFILL_STEP_SIZES)
        else:
            packed = self._prefill_eager(started, items)
        for b, (i, sequence, _) in enumerate(started):
            results[i] = self._verdict(packed[b], sequence, sequence.table.num_tokens, 0, items[i].logprobs)
            results[i].acceptance_method = sequence.sampling.acceptance_method
            self.sequences.prompt_written(sequence, items[i].token_ids)
        return results

    def _prefill_takes_step(self, started) -> bool:
        """Whether a prefill runs as a step program (a graph replay on a GPU) instead of an eager forward: short
        uncached prompts in a batch whose padded tokens stay few (a 7B's eager prefill of 32 tokens spends 13-21 ms
        launching ~400 kernels for ~4 ms of GPU work)."""
        if not self.prefill_steps:
            return False
        longest = max(len(forward.token_ids) for _, _, forward in started)
        if longest > PREFILL_STEP_SIZES[-1]:
            return False
        rows = bucket_for(len(started)) if self.runner.graphs is not None else len(started)
        return rows is not None and rows * self.runner.shape_size(longest, PREFILL_STEP_SIZES) <= PREFILL_STEP_TOKENS

    def _prefill_eager(self, started, items) -> np.ndarray:
        logits = self.runner.forward_flat([forward for _, _, forward in started])[:, None]  # [n, 1, vocab]
        sequences = [sequence for _, sequence, _ in started]
        shape = self._shape(sequences, [items[i].logprobs for i, _, _ in started], width=1, steps=0, support=1)
        fields = {name: torch.from_numpy(values).to(logits.device)
                  for name, values in sampling_fields([s.sampling for s in sequences]).items()}
        fields["temperature"], fields["top_p"] = fields["temperature"].float(), fields["top_p"].float()
        positions = torch.tensor([s.table.num_tokens for s in sequences], device=logits.device)
        no_proposals = torch.zeros(len(started), 0, dtype=torch.int64, device=logits.device)
        none_drafted = torch.zeros(len(started), dtype=torch.int64, device=logits.device)
        with torch.inference_mode():
            decision = decide(logits, no_proposals, none_drafted, None, None, fields, positions, shape)
            return pack_decision(decision, logits if shape.logprobs else None).cpu().numpy()

    def verify(self, items: list[VerifyItem]) -> list[Verdict | Exception]:
        # A step launched ahead (decode_ahead.py) answers the calls that ask exactly what it ran; the rest run now.
        ahead = self.decode_ahead.claim([item.handle for item in items])
        results = self._verify(items, ahead)
        if self.decode_ahead.enabled and not any(item.draft_token_ids for item in items):
            try:
                self._launch_ahead([(self.sequences.get(item.handle), item.logprobs, result) for item, result
                                    in zip(items, results) if item.decode_ahead and isinstance(result, Verdict)])
            except Exception:  # this call's verdicts stand; the next call runs its own step (its rewind frees the slots)
                log.exception("decode ahead failed to launch")
        return results

    def _verify(self, items: list[VerifyItem], ahead: dict) -> list[Verdict | Exception]:
        results: list = [None] * len(items)
        checked: list[tuple[int, WorkerSequence]] = []
        for i, item in enumerate(items):
            try:
                self._check(item, len(item.draft_token_ids))
                sequence = self.sequences.get(item.handle)
                packed = self.decode_ahead.answer(ahead.get(item.handle), sequence, item.cached_len, item.delta,
                                                  len(item.draft_token_ids), item.logprobs)
                if packed is not None:
                    results[i] = self._verdict(packed, sequence, item.cached_len + 1, 0, item.logprobs)
                else:
                    checked.append((i, sequence))
            except Exception as error:  # per-item failure; the rest of the batch goes on
                results[i] = error
        q = _stack_q([items[i] for i, _ in checked], self.runner.vocab_size)
        batch: list[tuple[int, WorkerSequence, int]] = []  # (item index, sequence, tokens in KV before the call)
        for b, (i, sequence) in enumerate(checked):
            item = items[i]
            try:
                if q is not None and not q.valid[b]:
                    raise InvalidArgument(f"q token ids must be in [0, {self.runner.vocab_size}) and q probabilities "
                                          "finite and non-negative")
                self.sequences.rewind(sequence, item.cached_len)
                start = sequence.table.num_tokens
                self.runner.reserve_tokens(sequence.table, len(item.delta) + len(item.draft_token_ids))
                batch.append((i, sequence, start))
            except Exception as error:
                results[i] = error
        if not batch:
            return results

        batch_items = [items[i] for i, _, _ in batch]
        sequences = [sequence for _, sequence, _ in batch]
        steps = max(len(item.draft_token_ids) for item in batch_items)
        steps = self.runner.shape_size(steps, STEP_SIZES) if steps else 0
        width = steps + self.runner.shape_size(max(len(item.delta) for item in batch_items), STEP_SIZES)
        sampled = [item for item, s in zip(batch_items, sequences) if not s.sampling.greedy and item.draft_token_ids]
        support = max([item.q_token_ids.shape[1] for item in sampled] or [1], default=1)
        support = self.runner.shape_size(support, SUPPORT_SIZES)
        starts = np.array([start for _, _, start in batch], dtype=np.int64)
        shape = self._shape(sequences, [item.logprobs for item in batch_items], width, steps, support,
                            int(starts.max()) + width)
        fields = self._step_fields(
            shape, sequences, starts, [list(item.delta) + list(item.draft_token_ids) for item in batch_items],
            [len(item.delta) for item in batch_items], [len(item.draft_token_ids) for item in batch_items],
            [-1 if item.bonus_guess is None else item.bonus_guess for item in batch_items]
            if shape.synthetic is not None else None)
        if not shape.greedy and steps:
            rows = [b for b, (i, _) in enumerate(checked) if results[i] is None]
            fields["q_ids"] = _widen(q.ids[rows], steps, support).reshape(len(rows), -1)
            fields["q_probs"] = _widen(q.probs[rows], steps, support).reshape(len(rows), -1)
        packed = self.runner.run_step(VerifySteps, shape, fields, [s.table for s in sequences])

        for b, (i, sequence, start) in enumerate(batch):
            item = items[i]
            results[i] = self._verdict(packed[b], sequence, start + len(item.delta), steps, item.logprobs)
        return results

    def _launch_ahead(self, decoded: list[tuple[WorkerSequence, int | None, Verdict]]) -> None:
        """Launch the next plain decode step of sequences that just decoded one token: each row's input is that token
        (decode_ahead.py). A row whose KV has no room, or whose context is full, is left to its call."""
        self.decode_ahead.prune(lambda handle: self.sequences.get(handle) if handle in self.sequences else None)
        rows = []
        for sequence, logprobs, verdict in decoded:
            if len(verdict.token_ids) != 1 or verdict.num_cached + 1 > self.runner.max_model_len:
                continue
            try:
                self.runner.reserve_tokens(sequence.table, 1)
            except KVCacheFull:
                continue
            rows.append((sequence, verdict.num_cached, verdict.token_ids[0], logprobs))
        if not rows:
            return
        step = self._plain_step([(sequence, cached, [token], logprobs) for sequence, cached, token, logprobs in rows],
                                (1,), launch=True)
        self.decode_ahead.add(rows, step)

    def _plain_step(self, rows: list[tuple[WorkerSequence, int, list[int], int | None]], sizes: tuple[int, ...],
                    launch: bool = False):
        """A verification step without proposals over rows (sequence, tokens in KV before, tokens to run, logprobs)
        whose slots are reserved: each row runs its tokens and the last one's distribution decides its next token (a
        prefill of short prompts, a decode ahead). The packed result, or with `launch` the PendingStep."""
        sequences = [sequence for sequence, _, _, _ in rows]
        width = self.runner.shape_size(max(len(tokens) for _, _, tokens, _ in rows), sizes)
        starts = np.array([start for _, start, _, _ in rows], dtype=np.int64)
        shape = self._shape(sequences, [logprobs for _, _, _, logprobs in rows], width=width, steps=0, support=1,
                            longest=int(starts.max()) + width)
        fields = self._step_fields(shape, sequences, starts, [tokens for _, _, tokens, _ in rows],
                                   [len(tokens) for _, _, tokens, _ in rows], [0] * len(rows), [-1] * len(rows))
        run = self.runner.launch_step if launch else self.runner.run_step
        return run(VerifySteps, shape, fields, [s.table for s in sequences])

    def _step_fields(self, shape: VerifyShape, sequences: list[WorkerSequence], starts: np.ndarray,
                     rows: list[list[int]], n_delta: list[int], num_draft: list[int], guesses: list[int] | None) -> dict:
        """A verification step's per-sequence fields (verify_steps.py) but q: each row's tokens (its delta, then its
        proposals) padded to the shape's width, where they start, how many of them are delta and proposals, the
        sampling settings, and the fields only some shapes read."""
        tokens = np.zeros((len(rows), shape.width), dtype=np.int64)
        for b, row in enumerate(rows):
            tokens[b, : len(row)] = row
        fields = {"start": starts, "n_delta": n_delta, "tokens": tokens, "k": num_draft,
                  **sampling_fields([s.sampling for s in sequences])}
        if shape.synthetic is not None:  # benchmark only: the synthetic coin may confirm a bonus guess
            fields["guess"] = guesses
        if shape.typical != "none":  # NOT lossless, opted in: each sequence's choice and parameters
            samplings = [s.sampling for s in sequences]
            fields["typical"] = [s.acceptance_method == TYPICAL for s in samplings]
            fields["posterior_threshold"] = [s.posterior_threshold or 0.0 for s in samplings]
            fields["posterior_alpha"] = [s.posterior_alpha or 0.0 for s in samplings]
        return fields

    def warm_up(self, max_batch: int = 64, max_k: int = 4, sampled: bool = True) -> int:
        """Capture the verifications a round is likely to run (every batch bucket up to `max_batch`, plain decodes
        and every proposal count up to `max_k` as padded, greedy and plain-temperature sampling) before serving, so
        no request waits for a capture. A no-op without graphs. Returns the graphs captured."""
        graphs = self.runner.graphs
        if graphs is None:
            return 0
        before = len(graphs.steps)
        counts = sorted({0, *(self.runner.shape_size(k, STEP_SIZES) for k in range(1, max_k + 1))})
        settings = [WorkerSampling(0.0, 0, 1.0, 0)] + ([WorkerSampling(1.0, 0, 1.0, 0)] if sampled else [])
        for bucket in (b for b in BATCH_BUCKETS if b <= max_batch):
            if self.runner.block_manager.num_free_blocks < 2 * bucket + 2:
                break  # a cache this small serves few sequences: capture the rest when they come
            for sampling in settings:
                handles = [f"warm-up-{i}" for i in range(bucket)]
                self.prefill([TargetPrefill(h, [0], sampling) for h in handles])
                for k in counts:
                    # q with the draft's default support of 32: the sampled graphs are captured for that width.
                    q = (torch.zeros(k, 32, dtype=torch.int64), torch.nn.functional.one_hot(torch.zeros(k, dtype=torch.int64), 32).float())
                    self.verify([VerifyItem(h, 1, [0], [0] * k, *q) for h in handles])
                self.release(handles)
        return len(graphs.steps) - before

    def release(self, handles: list[str]) -> int:
        self.decode_ahead.forget(handles)
        return sum(self.sequences.release(h) for h in handles)

    def _check(self, item: VerifyItem, k: int) -> None:
        if not item.delta:
            raise InvalidArgument("delta must hold at least the last committed token")
        if k > self.max_speculative_tokens:
            raise InvalidArgument(f"at most {self.max_speculative_tokens} proposals per sequence, got {k}")
        vocab = self.runner.vocab_size
        tokens = list(item.delta) + list(item.draft_token_ids)
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise InvalidArgument(f"token ids must be in [0, {vocab})")
        if k:
            if item.q_token_ids is None or item.q_probs is None:
                raise InvalidArgument("proposals need their draft distribution q")
            if item.q_token_ids.shape != item.q_probs.shape or item.q_token_ids.shape[0] != k:
                raise InvalidArgument(f"q must have one row per proposal ({k}), got {tuple(item.q_token_ids.shape)}")
        if item.cached_len + len(item.delta) + k > self.runner.max_model_len:
            raise InvalidArgument(f"sequence would exceed the target's context of {self.runner.max_model_len}")

    def _shape(self, sequences, logprobs, width: int, steps: int, support: int, longest: int = 0) -> VerifyShape:
        typical = [s.sampling.acceptance_method == TYPICAL for s in sequences]
        return VerifyShape(width=width, steps=steps, support=support,
                           typical="all" if all(typical) else "some" if any(typical) else "none",
                           greedy=all(s.sampling.greedy for s in sequences),
                           sampling=sampling_flags([s.sampling for s in sequences], self.runner.vocab_size,
                                                   fewer_shapes=self.runner.graphs is not None),
                           logprobs=any(n is not None for n in logprobs), synthetic=self.synthetic_acceptance,
                           max_context=self.runner.context_bound(longest or 1))

    def _verdict(self, packed: np.ndarray, sequence: WorkerSequence, committed: int, steps: int,
                 logprobs: int | None) -> Verdict:
        """One sequence's verdict from its row of the packed result; rejected proposals leave its KV, which then
        holds every committed token but the newest."""
        width = steps + 1
        num_accepted = int(packed[width])
        emitted = packed[: num_accepted + 1].tolist()
        self.runner.block_manager.truncate(sequence.table, committed + num_accepted)
        lp = None
        if logprobs is not None:
            top = packed[width + 1 :]
            chosen = top[:width].view(np.float32)
            ids = top[width : width * (1 + MAX_LOGPROBS)].reshape(width, MAX_LOGPROBS)
            values = top[width * (1 + MAX_LOGPROBS) :].reshape(width, MAX_LOGPROBS).view(np.float32)
            lp = [TokenLogprob(token, float(chosen[j]), list(zip(ids[j, :logprobs].tolist(), values[j, :logprobs].tolist())))
                  for j, token in enumerate(emitted)]
        return Verdict(num_accepted, emitted, lp, sequence.table.num_tokens)


# Proposal counts (and delta widths) and q supports a verification graph is captured for: a batch pads to the next.
STEP_SIZES = (1, 2, 4, 8, 16)
SUPPORT_SIZES = (32, 64, 128, 256)
# Uncached prompt lengths a prefill runs as a step program for (padded to the next), and the most tokens such a step
# runs in all (padding included: past a few hundred tokens a forward is no longer bound by its weights' reads, and
# an eager forward's launches no longer dominate).
PREFILL_STEP_SIZES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_STEP_TOKENS = 512
PREFILL_STEPS_ENV = "SPECSPLIT_PREFILL_STEPS"  # "on": short prefills as step programs on a GPU (opt-in, not yet timed)


def _widen(array: np.ndarray, steps: int, support: int) -> np.ndarray:
    """[n, k, K] -> [n, steps, support] (k <= steps), cut or padded with zeros (id 0 with probability 0): a support
    entry past a sequence's own is always padding."""
    out = np.zeros((array.shape[0], steps, support), dtype=array.dtype)
    width = min(support, array.shape[2])
    out[:, : array.shape[1], :width] = array[:, :, :width]
    return out


@dataclass
class StackedQ:
    ids: np.ndarray     # [n, max k, max support] int64, padding: id 0
    probs: np.ndarray   # [n, max k, max support] float64, padding: probability 0
    valid: np.ndarray   # [n] bool: every id in the vocabulary, every probability finite and non-negative


def _stack_q(items: list[VerifyItem], vocab: int | None = None) -> StackedQ | None:
    """The draft distributions of a batch in one padded array, checked for all sequences at once (numpy over the
    batch: a few passes instead of several small operations per sequence)."""
    with_q = [item for item in items if item.draft_token_ids]
    if not with_q:
        return None
    steps = max(len(item.draft_token_ids) for item in with_q)
    support = max(item.q_token_ids.shape[1] for item in with_q)
    ids = np.zeros((len(items), steps, support), dtype=np.int64)
    probs = np.zeros((len(items), steps, support), dtype=np.float64)
    for b, item in enumerate(items):
        k = len(item.draft_token_ids)
        if k:
            width = item.q_token_ids.shape[1]
            ids[b, :k, :width] = np.asarray(item.q_token_ids)  # torch (in process) or numpy (from the wire)
            probs[b, :k, :width] = np.asarray(item.q_probs)
    valid = (ids >= 0).all(axis=(1, 2)) & np.isfinite(probs).all(axis=(1, 2)) & (probs >= 0).all(axis=(1, 2))
    if vocab is not None:
        valid &= (ids < vocab).all(axis=(1, 2))
    return StackedQ(ids, probs, valid)
