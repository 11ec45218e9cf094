"""The target's verification as one step program: the k+1-position forward, the target's probabilities, the
accept decisions, the recovered or bonus token and the requested logprobs, in one packed result.

Inputs per sequence (runtime/step_inputs.py): its block-table row, `start` (tokens in KV before the call), `tokens`
= the committed tokens not yet in KV (`n_delta`, normally the newest one) followed by the `k` proposals, padded to
the shape's width; its sampling settings; and, when any sequence samples, the draft's sparse q of each proposal.
Target row j (j = 0..k) is the distribution after delta + d_1..d_j: it decides d_{j+1}, and row k gives the bonus
token. Randomness is the counter uniform of the decided position, so a sequence's tokens do not depend on its batch.

`decide` is shared with the prefill (rows from an eager forward): greedy batches compare with the argmax (what the
rejection sampler reduces to for one-hot distributions, without computing them), sampled ones run the lossless
rejection sampler (kernels/rejection_sampling.py) or, for sequences that opted in, typical acceptance (NOT lossless,
kernels/typical_acceptance.py), and the synthetic-acceptance benchmark mode tosses its coin.
Output: one int32 tensor [rows, width]: the k+1 emitted-token slots (-1 past the last), the accepted count, then
with logprobs each slot's logprob and its top alternatives (floats as bits).
"""

from dataclasses import dataclass

import torch

from specsplit.kernels.counter_rng import STREAM_ACCEPT, STREAM_SAMPLE
from specsplit.kernels.dispatch import counter_uniform, rejection_sample, top_k_rows, typical_accept
from specsplit.services.runtime.device_block_tables import UPDATE_SLOTS
from specsplit.services.runtime.step_inputs import Field, StepLayout
from specsplit.services.sampling.logits_processing import SamplingFlags, processed_probs
from specsplit.services.sampling_params import MAX_LOGPROBS
from specsplit.services.target.synthetic_acceptance import synthetic_accept


@dataclass(frozen=True)
class VerifyShape:
    width: int               # tokens per sequence: the longest delta + k of the batch
    steps: int               # k of the call: the most proposals any sequence carries (0 = plain decode)
    support: int             # K of the draft's q (travels only when some sequence samples)
    greedy: bool             # every sequence greedy: decide by argmax, no q, no probabilities
    sampling: SamplingFlags  # which processing the batch needs
    logprobs: bool           # whether any sequence asked for logprobs
    synthetic: float | None  # BENCHMARK ONLY: the synthetic acceptance rate (target/synthetic_acceptance.py)
    max_context: int         # attention is sized for contexts up to this (runtime/model_runner.context_bound)
    typical: str = "none"    # NOT LOSSLESS, opted in (target/acceptance_method.py): "none", "all" or "some" sequences


@dataclass(frozen=True)
class Decision:
    output: torch.Tensor          # [n, k + 1] int64 emitted tokens, -1 past the last
    num_accepted: torch.Tensor    # [n] int64


class VerifySteps:
    name = "verify"

    @staticmethod
    def layout(shape: VerifyShape, rows: int) -> StepLayout:
        fields = [Field("row"), Field("update_col", UPDATE_SLOTS, pad=-1), Field("update_id", UPDATE_SLOTS),
                  Field("start"), Field("n_delta", pad=1), Field("tokens", shape.width), Field("k"),
                  Field("temperature", is_float=True), Field("top_k"), Field("top_p", is_float=True, pad=1.0),
                  Field("seed")]
        if shape.typical != "none":  # each sequence's choice and parameters (typical acceptance, NOT lossless)
            fields += [Field("typical"), Field("posterior_threshold", is_float=True),
                       Field("posterior_alpha", is_float=True)]
        if shape.synthetic is not None:  # benchmark only: the bonus guesses the synthetic coin may confirm
            fields.append(Field("guess", pad=-1))
        if not shape.greedy and shape.steps:
            fields += [Field("q_ids", shape.steps * shape.support),
                       Field("q_probs", shape.steps * shape.support, is_float=True)]
        return StepLayout(tuple(fields), rows)

    @staticmethod
    def run(runner, shape: VerifyShape, f: dict[str, torch.Tensor]) -> torch.Tensor:
        num_seqs, k = f["row"].shape[0], shape.steps
        device = f["row"].device
        seqs = torch.arange(num_seqs, device=device)
        tables = runner.block_tables.gather(f["row"], -(-shape.max_context // runner.block_size))
        offsets = torch.arange(max(shape.width, k + 1), device=device)
        write = offsets[None, : shape.width] < (f["n_delta"] + f["k"])[:, None]
        hidden = runner.forward_rows(f["tokens"], f["start"], write, tables, shape.max_context)
        hidden = hidden.view(num_seqs, shape.width, -1)
        # The k+1 rows that decide: from the last delta token on (padding rows of short sequences are ignored).
        decide_at = ((f["n_delta"] - 1)[:, None] + offsets[None, : k + 1]).clamp(max=shape.width - 1)
        logits = runner.model.compute_logits(hidden[seqs[:, None], decide_at])  # [n, k + 1, vocab]
        if not runner.decides:  # a tensor-parallel rank > 0: its part ends with the logits' all-gather
            return logits.new_zeros(1, dtype=torch.int32)
        proposals = f["tokens"].gather(1, (f["n_delta"][:, None] + offsets[None, :k]).clamp(max=shape.width - 1))
        q_ids = q_probs = None
        if not shape.greedy and k:
            q_ids = f["q_ids"].view(num_seqs, k, shape.support)
            q_probs = f["q_probs"].view(num_seqs, k, shape.support)
        decision = decide(logits, proposals, f["k"], q_ids, q_probs, f, f["start"] + f["n_delta"], shape)
        return pack_decision(decision, logits if shape.logprobs else None)


def decide(logits: torch.Tensor, proposals: torch.Tensor, num_draft: torch.Tensor, q_ids, q_probs, f: dict,
           first_position: torch.Tensor, shape: VerifyShape) -> Decision:
    """logits [n, k+1, vocab]; proposals [n, k]; num_draft [n] (<= k); q [n, k, K] or None when greedy;
    first_position [n]: the absolute position row 0 decides. No host reads."""
    num_seqs, width, vocab = logits.shape
    k = width - 1
    positions = first_position[:, None] + torch.arange(width, device=logits.device)[None, :]
    seeds = f["seed"][:, None].expand(num_seqs, width)
    if shape.synthetic is not None:  # benchmark only: a coin decides, the emitted token is the target's
        probs = _probs(logits, f, shape) if not shape.greedy else None
        output, accepted = synthetic_accept(shape.synthetic, logits, probs, proposals, num_draft, seeds, positions,
                                            f.get("guess"))
        return Decision(output, accepted)
    if shape.greedy:  # typical acceptance reduces to this too: greedy output is exact whatever the method
        best = logits.argmax(dim=-1)  # one-hot p: accept while the proposal is the argmax, then emit the argmax
        columns = torch.arange(width, device=logits.device)[None, :]
        matched = (proposals == best[:, :k]) & (columns[:, :k] < num_draft[:, None])
        accepted = matched.to(torch.int64).cumprod(dim=1).sum(dim=1)
        output = torch.where(columns < accepted[:, None], torch.cat([proposals, best[:, k:]], dim=1), -1)
        output.scatter_(1, accepted[:, None], best.gather(1, accepted[:, None]))
        return Decision(output, accepted)
    probs = _probs(logits, f, shape)
    sample_u = counter_uniform(seeds, positions, STREAM_SAMPLE)
    if shape.typical != "none" and k:  # NOT lossless: the requests (or the deployment) opted in
        typical = Decision(*typical_accept(probs, proposals, num_draft, sample_u, f["posterior_threshold"],
                                           f["posterior_alpha"]))
        if shape.typical == "all":
            return typical
    if k == 0:
        q_ids = torch.zeros(num_seqs, 0, 1, dtype=torch.int64, device=logits.device)
        q_probs = torch.zeros(num_seqs, 0, 1, device=logits.device)
    accept_u = counter_uniform(seeds[:, :k], positions[:, :k], STREAM_ACCEPT)
    output, accepted = rejection_sample(probs, proposals, q_ids, q_probs, num_draft, accept_u, sample_u)
    if shape.typical == "some" and k:  # a mixed batch: the typical verdicts for the sequences that opted in
        chosen = f["typical"].bool()
        output = torch.where(chosen[:, None], typical.output, output)
        accepted = torch.where(chosen, typical.num_accepted, accepted)
    return Decision(output, accepted)


def pack_decision(decision: Decision, logits: torch.Tensor | None) -> torch.Tensor:
    """[n, (k + 1) + 1 (+ (k + 1) * (1 + 2 * MAX_LOGPROBS))] int32: tokens, accepted count, then logprobs (raw
    distribution of each emitted slot: the chosen token's, then the top MAX_LOGPROBS ids and values)."""
    parts = [decision.output.to(torch.int32), decision.num_accepted[:, None].to(torch.int32)]
    if logits is not None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(2, decision.output.clamp(min=0)[..., None]).squeeze(-1)
        top_values, top_ids = top_k_rows(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]))
        n = logits.shape[0]
        parts += [chosen.view(torch.int32), top_ids.to(torch.int32).reshape(n, -1),
                  top_values.contiguous().view(torch.int32).reshape(n, -1)]
    return torch.cat(parts, dim=1)


def _probs(logits: torch.Tensor, f: dict, shape: VerifyShape) -> torch.Tensor:
    """The request's processed distribution at every row: [n, k+1, vocab] float32."""
    num_seqs, width, vocab = logits.shape
    expand = lambda t: t[:, None].expand(num_seqs, width).reshape(-1)  # noqa: E731 (per-row settings)
    probs = processed_probs(logits.reshape(-1, vocab), expand(f["temperature"]), expand(f["top_k"]),
                            expand(f["top_p"]), shape.sampling)
    return probs.view(num_seqs, width, vocab)
