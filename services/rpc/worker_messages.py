"""Worker messages between their protobuf form and the dataclasses the draft proposer and target verifier use.

Both ends use these functions, so what the coordinator sends is exactly what the worker computes on: q travels as
float32 and arrives bit-identical.
"""

import numpy as np
import torch

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
    out = []
    for item in items:
        try:
            handle = item.handle
            if not (0 < len(handle) <= MAX_HANDLE_BYTES and handle.isascii()):  # the usual handle: no call
                check_string("sequence handle", handle, MAX_HANDLE_BYTES, required=True)
            out.append(decode(item))
        except InvalidArgument as error:
            out.append(error)
    return out


def _logprobs(m):
    n = _optional(m, "logprobs")
    if n is not None and n > MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {n}")
    return n


def pack_ids(t: torch.Tensor) -> bytes:
    if t.device.type == "cpu" and not t.requires_grad:  # the usual case: numpy straight away (each torch call
        return t.numpy().astype("<i4").tobytes()         # costs microseconds, times sequences and fields)
    return t.detach().to("cpu", torch.int32).contiguous().numpy().astype("<i4", copy=False).tobytes()


def pack_probs(t: torch.Tensor) -> bytes:
    if t.device.type == "cpu" and not t.requires_grad and t.dtype == torch.float32:
        return t.numpy().astype("<f4", copy=False).tobytes()
    return t.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()


def unpack_ids(data: bytes, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<i4").astype(np.int64).reshape(rows, cols))


def unpack_probs(data: bytes, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(rows, cols).copy())


def _optional(m, name):
    return getattr(m, name) if m.HasField(name) else None


# ---- draft ----------------------------------------------------------------------------------------------------

def draft_prefill_request(items: list[DraftPrefill]) -> worker_pb2.DraftPrefillRequest:
    return worker_pb2.DraftPrefillRequest(
        items=[worker_pb2.DraftPrefillItem(handle=i.handle, token_ids=i.token_ids, sampling=sampling_pb(i.sampling)) for i in items]
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


def propose_request(items: list[ProposeItem]) -> worker_pb2.ProposeRequest:
    return worker_pb2.ProposeRequest(
        items=[worker_pb2.ProposeItem(handle=i.handle, cached_len=i.cached_len, delta=i.delta, k=i.k) for i in items]
    )


def propose_items(request: worker_pb2.ProposeRequest) -> list:
    return _checked(lambda i: ProposeItem(i.handle, i.cached_len, list(i.delta), i.k), request.items)


def propose_response(results: list) -> worker_pb2.ProposeResponse:
    out = []
    for r in results:
        if isinstance(r, Exception):
            out.append(worker_pb2.Proposal(status=status_pb(r)))
            continue
        support = r.q_token_ids.shape[1] if r.token_ids else 1
        out.append(
            worker_pb2.Proposal(
                status=OK,
                token_ids=r.token_ids,
                support=support,
                q_token_ids=pack_ids(r.q_token_ids),
                q_probs=pack_probs(r.q_probs),
                num_cached=r.num_cached,
            )
        )
    return worker_pb2.ProposeResponse(results=out)


def proposals(response: worker_pb2.ProposeResponse) -> list:
    out = []
    for r in response.results:
        if r.status.code != 0:
            out.append(error_from_status(r.status.code, r.status.message))
            continue
        k, support = len(r.token_ids), max(r.support, 1)
        out.append(
            Proposal(
                token_ids=list(r.token_ids),
                q_token_ids=unpack_ids(r.q_token_ids, k, support),
                q_probs=unpack_probs(r.q_probs, k, support),
                num_cached=r.num_cached,
            )
        )
    return out


# ---- target ---------------------------------------------------------------------------------------------------

def target_prefill_request(items: list[TargetPrefill]) -> worker_pb2.TargetPrefillRequest:
    return worker_pb2.TargetPrefillRequest(
        items=[
            worker_pb2.TargetPrefillItem(handle=i.handle, token_ids=i.token_ids, sampling=sampling_pb(i.sampling), logprobs=i.logprobs)
            for i in items
        ]
    )


def target_prefill_items(request: worker_pb2.TargetPrefillRequest) -> list:
    return _checked(lambda i: TargetPrefill(i.handle, list(i.token_ids), sampling_from_pb(i.sampling), _logprobs(i)),
                    request.items)


def verify_request(items: list[VerifyItem]) -> worker_pb2.VerifyRequest:
    out = []
    for i in items:
        m = worker_pb2.VerifyItem(handle=i.handle, cached_len=i.cached_len, delta=i.delta, logprobs=i.logprobs,
                                  bonus_guess=i.bonus_guess)
        if i.draft_token_ids:
            m.draft_token_ids.extend(i.draft_token_ids)
            m.support = i.q_token_ids.shape[1]
            m.q_token_ids = pack_ids(i.q_token_ids)
            m.q_probs = pack_probs(i.q_probs)
        out.append(m)
    return worker_pb2.VerifyRequest(items=out)


def verify_items(request: worker_pb2.VerifyRequest) -> list:
    """Malformed items become InvalidArgument errors in place, so the rest of the batch still runs."""

    def decode(i):
        k = len(i.draft_token_ids)
        item = VerifyItem(i.handle, i.cached_len, list(i.delta), list(i.draft_token_ids), logprobs=_logprobs(i),
                          bonus_guess=_optional(i, "bonus_guess"))
        if k:
            support = i.support
            if support < 1 or len(i.q_token_ids) != 4 * k * support or len(i.q_probs) != 4 * k * support:
                raise InvalidArgument(f"q must hold {k} x {support} entries of 4 bytes; got {len(i.q_token_ids)} and {len(i.q_probs)} bytes")
            item.q_token_ids = unpack_ids(i.q_token_ids, k, support)
            item.q_probs = unpack_probs(i.q_probs, k, support)
        return item

    return _checked(decode, request.items)


def verify_response(results: list) -> worker_pb2.VerifyResponse:
    out = []
    for r in results:
        if isinstance(r, Exception):
            out.append(worker_pb2.Verdict(status=status_pb(r)))
        else:
            out.append(
                worker_pb2.Verdict(
                    status=OK, num_accepted=r.num_accepted, token_ids=r.token_ids, logprobs=logprobs_pb(r.logprobs), num_cached=r.num_cached,
                    acceptance_method=acceptance_method_pb(r.acceptance_method),
                )
            )
    return worker_pb2.VerifyResponse(results=out)


def verdicts(response: worker_pb2.VerifyResponse, wants_logprobs: list[bool]) -> list:
    out = []
    for r, wants in zip(response.results, wants_logprobs):
        if r.status.code != 0:
            out.append(error_from_status(r.status.code, r.status.message))
        else:
            lp = logprobs_from_pb(r.logprobs) if wants else None
            out.append(Verdict(r.num_accepted, list(r.token_ids), lp, r.num_cached, acceptance_method_from_pb(r.acceptance_method)))
    return out
