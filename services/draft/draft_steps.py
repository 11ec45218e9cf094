"""The draft's whole propose call as one step program: catch up, then k forwards each followed by sampling.

Inputs per sequence (runtime/step_inputs.py): its block-table row, `start` (tokens in KV before the call),
`delta` (the committed tokens to catch up on, `n_delta` of them, padded to the shape's width), `k` (proposals
wanted), and its sampling settings. Proposal d_s is sampled from q_s, the top-K truncation of the processed
distribution, with the counter uniform of its absolute position; its KV is written by the next forward only if
another proposal follows (the last proposal's KV is never computed). Sequences wanting fewer than the shape's k
run the extra steps with their KV sent to the scratch block and their results dropped by the host.

Everything is tensor work on the device: positions, slots and the next step's token are computed there, so the
program runs eagerly on the CPU and as one captured CUDA graph on a GPU, with the same result.
Output: one int32 tensor [rows, k, 1 + 2K]: the token, then q's support ids, then their probabilities (as bits).
"""

from dataclasses import dataclass

import torch

from specsplit.kernels.counter_rng import STREAM_DRAFT
from specsplit.kernels.dispatch import counter_uniform
from specsplit.services.runtime.device_block_tables import UPDATE_SLOTS
from specsplit.services.runtime.step_inputs import Field, StepLayout
from specsplit.services.sampling.draft_distribution import sample_sparse, sparse_draft_distribution
from specsplit.services.sampling.logits_processing import SamplingFlags, processed_probs


@dataclass(frozen=True)
class DraftShape:
    catch_up: int            # width of `delta`: the longest catch-up of the batch
    steps: int               # k of the call: the most proposals any sequence wants (0: a catch-up only)
    support: int             # K, entries of each q sent back (1 when every sequence is greedy)
    sampling: SamplingFlags  # which processing the batch needs; all-greedy batches skip it (argmax)
    max_context: int         # attention is sized for contexts up to this (runtime/model_runner.context_bound)


class DraftSteps:
    name = "draft"

    @staticmethod
    def layout(shape: DraftShape, rows: int) -> StepLayout:
        return StepLayout((
            Field("row"), Field("update_col", UPDATE_SLOTS, pad=-1), Field("update_id", UPDATE_SLOTS),
            Field("start"), Field("n_delta", pad=1), Field("delta", shape.catch_up), Field("k"),
            Field("temperature", is_float=True), Field("top_k"), Field("top_p", is_float=True, pad=1.0),
            Field("seed"),
        ), rows)

    @staticmethod
    def run(runner, shape: DraftShape, f: dict[str, torch.Tensor]) -> torch.Tensor:
        num_seqs = f["row"].shape[0]
        seqs = torch.arange(num_seqs, device=f["row"].device)
        tables = runner.block_tables.gather(f["row"], -(-shape.max_context // runner.block_size))
        # Catch-up: the committed tokens the draft has not run; logits from each sequence's last real one.
        write = torch.arange(shape.catch_up, device=seqs.device)[None, :] < f["n_delta"][:, None]
        hidden = runner.forward_rows(f["delta"], f["start"], write, tables, shape.max_context)
        if shape.steps == 0:  # a catch-up only: the KV is written, nothing is sampled
            return torch.zeros(num_seqs, 0, 1 + 2 * shape.support, dtype=torch.int32, device=seqs.device)
        last = hidden.view(num_seqs, shape.catch_up, -1)[seqs, f["n_delta"] - 1]
        first = f["start"] + f["n_delta"]  # absolute position of d_1
        results = []
        for step in range(shape.steps):
            logits = runner.model.compute_logits(last)
            token, support_ids, support_probs = _propose(logits, f, first + step, shape)
            results.append(torch.cat([token[:, None].to(torch.int32), support_ids.to(torch.int32),
                                      support_probs.view(torch.int32)], dim=1))
            if step + 1 < shape.steps:
                keep_kv = (step + 1 < f["k"])[:, None]  # d_{step+1}'s KV matters only if another proposal follows
                last = runner.forward_rows(token[:, None], first + step, keep_kv, tables, shape.max_context)
        return torch.stack(results, dim=1)


def _propose(logits: torch.Tensor, f: dict, position: torch.Tensor, shape: DraftShape):
    """One proposal per row and the sparse q it was drawn from: (token [n], ids [n, K], probs [n, K] float32)."""
    if not (shape.sampling.top_k or shape.sampling.top_p) and shape.support == 1:
        token = logits.argmax(dim=-1)  # every row greedy: q is one-hot at the argmax
        return token, token[:, None], torch.ones(token.shape[0], 1, device=logits.device)
    probs = processed_probs(logits, f["temperature"], f["top_k"], f["top_p"], shape.sampling)
    support_ids, support_probs = sparse_draft_distribution(probs, shape.support)
    token = sample_sparse(support_ids, support_probs, counter_uniform(f["seed"], position, STREAM_DRAFT))
    return token, support_ids, support_probs
