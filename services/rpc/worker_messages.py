"""Worker messages between their protobuf form and the dataclasses the draft proposer and target verifier use.

Both ends use these functions, so what the coordinator sends is exactly what the worker computes on: q travels as
float32 and arrives bit-identical.
"""

import numpy as np

from specsplit.proto.v1 import worker_pb2
from specsplit.services.errors import InvalidArgument
from specsplit.services.request_limits import MAX_HANDLE_BYTES, check_string, check_temperature, check_top_k, \
    check_top_p, effective_temperature
from specsplit.services.rpc.acceptance_messages import acceptance_method_from_pb, acceptance_method_pb
from specsplit.services.draft.proposer import DraftPrefill, Proposal, ProposeItem
from specsplit.services.rpc.status_codes import code_number, error_from_status, status_code_for
from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.rpc.logprob_messages import logprobs_from_pb, logprobs_pb
from specsplit.services.sampling_params import MAX_LOGPROBS
from specsplit.services.target.acceptance_method import check_acceptance
from specsplit.services.target.verifier import TargetPrefill, Verdict, VerifyItem

OK = worker_pb2.ItemStatus(code=0)


def status_pb(error: Exception | None) -> worker_pb2.ItemStatus:
    if error is None:
        return OK
    return worker_pb2.ItemStatus(code=code_number(status_code_for(error)), message=str(error))


def sampling_pb(s: WorkerSampling) -> worker_pb2.WorkerSampling:
    return worker_pb2.WorkerSampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                                     acceptance_method=acceptance_method_pb(s.acceptance_method),
                                     posterior_threshold=s.posterior_threshold, posterior_alpha=s.posterior_alpha)


def sampling_from_pb(m: worker_pb2.WorkerSampling) -> WorkerSampling:
    """Checked like a public request's settings (a worker trusts no caller); raises InvalidArgument."""
    top_p = m.top_p if m.top_p > 0 else 1.0
    check_temperature(m.temperature)
    check_top_k(m.top_k)
    check_top_p(top_p)
    threshold, alpha = _optional(m, "posterior_threshold"), _optional(m, "posterior_alpha")
    check_acceptance(None, threshold, alpha)
    return WorkerSampling(effective_temperature(m.temperature), m.top_k, top_p, m.seed,
                          acceptance_method_from_pb(m.acceptance_method), threshold, alpha)


def _checked(decode, items) -> list:
    """Decode each item; one that fails its checks becomes its InvalidArgument, in place."""
    return _checked_columns([item.handle for item in items], lambda i: decode(items[i]))


def _logprobs(m):
    n = _optional(m, "logprobs")
    if n is not None and n > MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {n}")
    return n


def pack_ids(t) -> bytes:
    """Token ids (a torch tensor or numpy array) as packed little-endian int32."""
    return _as_numpy(t).astype("<i4", copy=False).tobytes()


def pack_probs(t) -> bytes:
    """Probabilities (a torch tensor or numpy array) as packed little-endian float32."""
    return _as_numpy(t).astype("<f4", copy=False).tobytes()


def _as_numpy(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    if t.device.type == "cpu" and not t.requires_grad:  # the usual case: numpy straight away (each torch call
        return t.numpy()                                 # costs microseconds, times sequences and fields)
    return t.detach().cpu().numpy()


def _concat(arrays: list) -> np.ndarray:
    """Several sequences' q rows as one flat array (numpy: a copy per piece, no torch call per sequence)."""
    return np.concatenate([_as_numpy(a).reshape(-1) for a in arrays])


def _optional(m, name):
    return getattr(m, name) if m.HasField(name) else None


# ---- draft ----------------------------------------------------------------------------------------------------

def draft_prefill_request(items: list[DraftPrefill], traceparents: list[str] | None = None) -> worker_pb2.DraftPrefillRequest:
    return worker_pb2.DraftPrefillRequest(
        items=[worker_pb2.DraftPrefillItem(handle=i.handle, token_ids=i.token_ids, sampling=sampling_pb(i.sampling)) for i in items],
        traceparents=traceparents or (),
    )


def draft_prefill_items(request: worker_pb2.DraftPrefillRequest) -> list:
    return _checked(lambda i: DraftPrefill(i.handle, list(i.token_ids), sampling_from_pb(i.sampling)), request.items)


def draft_prefill_response(results: list) -> worker_pb2.DraftPrefillResponse:
    return worker_pb2.DraftPrefillResponse(
        results=[
            worker_pb2.DraftPrefillResult(status=status_pb(r), num_cached=0)
            if isinstance(r, Exception)
            else worker_pb2.DraftPrefillResult(status=OK, num_cached=r)
            for r in results
        ]
    )


def draft_prefill_results(response: worker_pb2.DraftPrefillResponse) -> list:
    return [r.num_cached if r.status.code == 0 else error_from_status(r.status.code, r.status.message) for r in response.results]


def propose_request(items: list[ProposeItem], traceparents: list[str] | None = None) -> worker_pb2.ProposeRequest:
    """One message for the whole batch, a column per field."""
    return worker_pb2.ProposeRequest(
        handles=[i.handle for i in items], cached_lens=[i.cached_len for i in items],
        delta_lens=[len(i.delta) for i in items], delta_token_ids=[t for i in items for t in i.delta],
        ks=[i.k for i in items], traceparents=traceparents or (),
    )


def propose_items(request: worker_pb2.ProposeRequest) -> list:
    """Items in request order; one that fails its checks becomes its InvalidArgument in place. Columns that do not
    line up make the whole request invalid (InvalidArgument raised)."""
    handles = list(request.handles)
    _same_length(len(handles), cached_lens=request.cached_lens, delta_lens=request.delta_lens, ks=request.ks)
    deltas = _split(list(request.delta_token_ids), list(request.delta_lens), "delta_token_ids")
    return _checked_columns(handles, lambda i: ProposeItem(handles[i], request.cached_lens[i], deltas[i], request.ks[i]))


def propose_response(results: list) -> worker_pb2.ProposeResponse:
    errors, counts, supports, cached, tokens, ids, probs = [], [], [], [], [], [], []
    for index, r in enumerate(results):
        if isinstance(r, Exception):
            errors.append(worker_pb2.ItemError(index=index, status=status_pb(r)))
            counts.append(0), supports.append(1), cached.append(0)
            continue
        counts.append(len(r.token_ids))
        tokens += r.token_ids
        cached.append(r.num_cached)
        _add_q(r.token_ids, r.q_token_ids, r.q_probs, supports, ids, probs)
    return worker_pb2.ProposeResponse(errors=errors, counts=counts, token_ids=tokens, supports=supports,
                                      q_token_ids=pack_ids(_concat(ids)) if ids else b"",
                                      q_probs=pack_probs(_concat(probs)) if probs else b"", num_cached=cached)


def _add_q(tokens, q_ids, q_probs, supports: list, ids: list, probs: list) -> None:
    """One sequence's q into the columns: its support, and its rows where it has proposals."""
    if tokens:
        supports.append(q_ids.shape[1])
        ids.append(q_ids)
        probs.append(q_probs)
    else:
        supports.append(1)


def proposals(response: worker_pb2.ProposeResponse) -> list:
    counts, supports = list(response.counts), list(response.supports)
    _same_length(len(counts), supports=supports, num_cached=response.num_cached)
    tokens = _split(list(response.token_ids), counts, "token_ids")
    q_ids, q_probs = _q_rows(response.q_token_ids, response.q_probs, counts, supports)
    out = [Proposal(tokens[i], q_ids[i], q_probs[i], response.num_cached[i]) for i in range(len(counts))]
    for error in response.errors:
        out[error.index] = error_from_status(error.status.code, error.status.message)
    return out


def _same_length(n: int, **columns) -> None:
    for name, column in columns.items():
        if len(column) != n:
            raise InvalidArgument(f"{name} holds {len(column)} values for {n} sequences")


def _split(values: list, lengths: list[int], name: str) -> list[list]:
    """values cut into consecutive runs of `lengths`."""
    if sum(lengths) != len(values):
        raise InvalidArgument(f"{name} holds {len(values)} values, the lengths add up to {sum(lengths)}")
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out


def _q_rows(id_bytes: bytes, prob_bytes: bytes, counts: list[int], supports: list[int]) -> tuple[list, list]:
    """Each sequence's q as [count, support] numpy views into one array per field (None where it has no rows)."""
    sizes = [c * max(s, 1) for c, s in zip(counts, supports)]
    total = sum(sizes)
    if len(id_bytes) != 4 * total or len(prob_bytes) != 4 * total:
        raise InvalidArgument(f"q must hold {total} entries of 4 bytes; got {len(id_bytes)} and {len(prob_bytes)} bytes")
    ids = np.frombuffer(id_bytes, dtype="<i4").astype(np.int64)
    probs = np.frombuffer(prob_bytes, dtype="<f4")
    out_ids, out_probs, start = [], [], 0
    for size, count, support in zip(sizes, counts, supports):
        if count:
            out_ids.append(ids[start : start + size].reshape(count, max(support, 1)))
            out_probs.append(probs[start : start + size].reshape(count, max(support, 1)))
        else:
            out_ids.append(None)
            out_probs.append(None)
        start += size
    return out_ids, out_probs


def _checked_columns(handles: list[str], decode) -> list:
    """decode(i) per sequence; a bad handle or a failed check becomes that sequence's InvalidArgument in place."""
    out = []
    for i, handle in enumerate(handles):
        try:
            if not (0 < len(handle) <= MAX_HANDLE_BYTES and handle.isascii()):  # the usual handle: no call
                check_string("sequence handle", handle, MAX_HANDLE_BYTES, required=True)
            out.append(decode(i))
        except InvalidArgument as error:
            out.append(error)
    return out


# ---- target ---------------------------------------------------------------------------------------------------

def target_prefill_request(items: list[TargetPrefill], traceparents: list[str] | None = None) -> worker_pb2.TargetPrefillRequest:
    return worker_pb2.TargetPrefillRequest(
        items=[
            worker_pb2.TargetPrefillItem(handle=i.handle, token_ids=i.token_ids, sampling=sampling_pb(i.sampling), logprobs=i.logprobs)
            for i in items
        ],
        traceparents=traceparents or (),
    )


def target_prefill_items(request: worker_pb2.TargetPrefillRequest) -> list:
    return _checked(lambda i: TargetPrefill(i.handle, list(i.token_ids), sampling_from_pb(i.sampling), _logprobs(i)),
                    request.items)


def verify_request(items: list[VerifyItem], traceparents: list[str] | None = None) -> worker_pb2.VerifyRequest:
    """One message for the whole batch, a column per field; q of every sequence in one buffer per field."""
    ids, probs, supports = [], [], []
    for i in items:
        _add_q(i.draft_token_ids, i.q_token_ids, i.q_probs, supports, ids, probs)
    logprobs = [-1 if i.logprobs is None else i.logprobs for i in items]
    guesses = [-1 if i.bonus_guess is None else i.bonus_guess for i in items]
    return worker_pb2.VerifyRequest(
        handles=[i.handle for i in items], cached_lens=[i.cached_len for i in items],
        delta_lens=[len(i.delta) for i in items], delta_token_ids=[t for i in items for t in i.delta],
        draft_counts=[len(i.draft_token_ids) for i in items],
        draft_token_ids=[t for i in items for t in i.draft_token_ids], supports=supports,
        q_token_ids=pack_ids(_concat(ids)) if ids else b"", q_probs=pack_probs(_concat(probs)) if probs else b"",
        logprobs=logprobs if any(n >= 0 for n in logprobs) else (),
        bonus_guesses=guesses if any(g >= 0 for g in guesses) else (), traceparents=traceparents or (),
        decode_ahead=[i.decode_ahead for i in items] if any(i.decode_ahead for i in items) else (),
    )


def verify_items(request: worker_pb2.VerifyRequest) -> list:
    """Malformed items become InvalidArgument errors in place, so the rest of the batch still runs; columns that do
    not line up make the whole request invalid."""
    handles = list(request.handles)
    n = len(handles)
    _same_length(n, cached_lens=request.cached_lens, delta_lens=request.delta_lens, draft_counts=request.draft_counts,
                 supports=request.supports)
    logprobs = list(request.logprobs) or [-1] * n
    guesses = list(request.bonus_guesses) or [-1] * n
    ahead = list(request.decode_ahead) or [False] * n
    _same_length(n, logprobs=logprobs, bonus_guesses=guesses, decode_ahead=ahead)
    counts = list(request.draft_counts)
    deltas = _split(list(request.delta_token_ids), list(request.delta_lens), "delta_token_ids")
    drafts = _split(list(request.draft_token_ids), counts, "draft_token_ids")
    q_ids, q_probs = _q_rows(request.q_token_ids, request.q_probs, counts, list(request.supports))

    def decode(i):
        wanted = logprobs[i]
        if wanted > MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {wanted}")
        return VerifyItem(handles[i], request.cached_lens[i], deltas[i], drafts[i], q_ids[i], q_probs[i],
                          logprobs=wanted if wanted >= 0 else None, bonus_guess=guesses[i] if guesses[i] >= 0 else None,
                          decode_ahead=ahead[i])

    return _checked_columns(handles, decode)


def verify_response(results: list) -> worker_pb2.VerifyResponse:
    """Verdicts (and a target's prefill outcomes) in columns; logprobs only for the sequences that have them."""
    errors, accepted, counts, tokens, cached, logprobs, methods = [], [], [], [], [], [], []
    for index, r in enumerate(results):
        if isinstance(r, Exception):
            errors.append(worker_pb2.ItemError(index=index, status=status_pb(r)))
            accepted.append(0), counts.append(0), cached.append(0), methods.append(0)
            continue
        accepted.append(r.num_accepted)
        counts.append(len(r.token_ids))
        tokens += r.token_ids
        cached.append(r.num_cached)
        methods.append(acceptance_method_pb(r.acceptance_method))
        if r.logprobs is not None:  # one per emitted token, exactly when the sequence asked for them
            logprobs += logprobs_pb(r.logprobs)
    return worker_pb2.VerifyResponse(errors=errors, num_accepted=accepted, counts=counts, token_ids=tokens,
                                     num_cached=cached, logprobs=logprobs,
                                     acceptance_methods=methods if any(methods) else ())


def verdicts(response: worker_pb2.VerifyResponse, wants_logprobs: list[bool]) -> list:
    counts = list(response.counts)
    _same_length(len(counts), num_accepted=response.num_accepted, num_cached=response.num_cached,
                 wants_logprobs=wants_logprobs)
    tokens = _split(list(response.token_ids), counts, "token_ids")
    methods = list(response.acceptance_methods) or [0] * len(counts)
    failed = {error.index: error.status for error in response.errors}
    out, logprob_start = [], 0
    for i, count in enumerate(counts):
        if i in failed:
            out.append(error_from_status(failed[i].code, failed[i].message))
            continue
        lp = None
        if wants_logprobs[i]:
            lp = logprobs_from_pb(response.logprobs[logprob_start : logprob_start + count])
            logprob_start += count
        out.append(Verdict(response.num_accepted[i], tokens[i], lp, response.num_cached[i],
                           acceptance_method_from_pb(methods[i])))
    return out
