"""Public API messages between protobuf and the coordinator's own types; used by the server and the client."""

from specsplit.proto.v1 import generation_pb2
from specsplit.services.coordinator.generation import GenerationResult, SpeculationStats, TokenEvent
from specsplit.services.errors import InvalidArgument
from specsplit.services.rpc.acceptance_messages import acceptance_method_from_pb, acceptance_method_pb
from specsplit.services.request_limits import MAX_REQUEST_ID_BYTES, check_string
from specsplit.services.rpc.logprob_messages import logprobs_from_pb, logprobs_pb
from specsplit.services.sampling_params import SamplingParams

MAX_PROMPT_CHARS = 1 << 20

FINISH_REASONS = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def request_pb(prompt, params: SamplingParams, chat: bool = False, request_id: str = "",
               messages: list[dict] | None = None) -> generation_pb2.GenerateRequest:
    """`prompt` (text or token ids), or `messages` ([{"role", "content"}]) with prompt None."""
    m = generation_pb2.GenerateRequest(request_id=request_id, chat=chat or bool(messages))
    for message in messages or []:
        m.messages.add(role=message["role"], content=message["content"])
    if isinstance(prompt, str):
        m.text = prompt
    elif prompt is not None:
        m.token_ids.ids.extend(prompt)
    m.sampling.temperature = params.temperature
    m.sampling.top_p = params.top_p
    m.sampling.top_k = params.top_k
    if params.seed is not None:
        m.sampling.seed = params.seed
    if params.max_tokens is not None:  # unset: until end of sequence, bounded by the context
        m.stopping.max_tokens = params.max_tokens
    m.stopping.stop.extend(params.stop)
    m.stopping.stop_token_ids.extend(params.stop_token_ids)
    m.stopping.ignore_eos = params.ignore_eos
    if params.logprobs is not None:
        m.logprobs = params.logprobs
    k = params.num_speculative_tokens
    if k == 0:
        m.speculation.mode = generation_pb2.SPECULATION_MODE_OFF
    elif params.speculation == "fixed":
        m.speculation.mode = generation_pb2.SPECULATION_MODE_FIXED
        m.speculation.num_speculative_tokens = k or 0
    elif k is not None:
        m.speculation.mode = generation_pb2.SPECULATION_MODE_CUSTOM
        m.speculation.num_speculative_tokens = k
    if params.acceptance_method is not None:
        m.acceptance.method = acceptance_method_pb(params.acceptance_method)
    if params.posterior_threshold is not None:
        m.acceptance.posterior_threshold = params.posterior_threshold
    if params.posterior_alpha is not None:
        m.acceptance.posterior_alpha = params.posterior_alpha
    return m


def params_from_pb(m: generation_pb2.GenerateRequest) -> SamplingParams:
    s, stop = m.sampling, m.stopping
    mode, speculation = m.speculation.mode, None
    if mode == generation_pb2.SPECULATION_MODE_OFF:
        k = 0
    elif mode == generation_pb2.SPECULATION_MODE_CUSTOM:
        k = m.speculation.num_speculative_tokens
    elif mode == generation_pb2.SPECULATION_MODE_FIXED:  # exactly k; 0 = the server's k, fixed
        k, speculation = m.speculation.num_speculative_tokens or None, "fixed"
    elif mode == generation_pb2.SPECULATION_MODE_DEFAULT:
        k = None
    else:
        raise InvalidArgument(f"unknown speculation mode {mode}")
    acceptance = m.acceptance
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=stop.max_tokens if stop.HasField("max_tokens") else None,
        stop=list(stop.stop),
        stop_token_ids=list(stop.stop_token_ids),
        ignore_eos=stop.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        num_speculative_tokens=k,
        speculation=speculation,
        acceptance_method=acceptance_method_from_pb(acceptance.method) or None,
        posterior_threshold=acceptance.posterior_threshold if acceptance.HasField("posterior_threshold") else None,
        posterior_alpha=acceptance.posterior_alpha if acceptance.HasField("posterior_alpha") else None,
    )


def request_id_from_pb(m: generation_pb2.GenerateRequest) -> str:
    """The caller's request_id, bounded: it is echoed in every stream message."""
    check_string("request_id", m.request_id, MAX_REQUEST_ID_BYTES)
    return m.request_id


def messages_from_pb(m: generation_pb2.GenerateRequest) -> list[dict]:
    """The conversation of a request, [] when it sends a prompt instead."""
    if m.messages and m.WhichOneof("prompt"):
        raise InvalidArgument("set either messages or a prompt (text or token_ids), not both")
    return [{"role": message.role, "content": message.content} for message in m.messages]


def prompt_from_pb(m: generation_pb2.GenerateRequest):
    which = m.WhichOneof("prompt")
    if which == "text":
        if len(m.text) > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"prompt text longer than {MAX_PROMPT_CHARS} characters")
        return m.text
    if which == "token_ids":
        return list(m.token_ids.ids)
    raise InvalidArgument("prompt must not be empty: set text or token_ids")


def _stats_pb(stats: SpeculationStats, variant: str, acceptance_method: str) -> generation_pb2.SpeculationStats:
    return generation_pb2.SpeculationStats(
        rounds=stats.rounds,
        drafted_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        drafted_per_position=stats.drafted_per_position,
        accepted_per_position=stats.accepted_per_position,
        draft_variant=variant,
        acceptance_method=acceptance_method_pb(acceptance_method),
        pre_proposed_rounds=stats.pre_proposed_rounds,
    )


def response_pb(result: GenerationResult) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        request_id=result.request_id,
        token_ids=result.token_ids,
        text=result.text,
        finish_reason=FINISH_REASONS.get(result.finish_reason, generation_pb2.FINISH_REASON_UNSPECIFIED),
        usage=generation_pb2.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens),
        speculation=_stats_pb(result.stats, result.draft_variant, result.acceptance_method),
        timings=generation_pb2.Timings(time_to_first_token_s=result.time_to_first_token, total_s=result.total_time),
        logprobs=logprobs_pb(result.logprobs),
    )


def stream_event_pb(event, request_id: str) -> generation_pb2.GenerateStreamResponse:
    if isinstance(event, TokenEvent):
        return generation_pb2.GenerateStreamResponse(
            request_id=request_id, token_ids=event.token_ids, text=event.text, logprobs=logprobs_pb(event.logprobs)
        )
    whole = response_pb(event)
    return generation_pb2.GenerateStreamResponse(
        request_id=request_id, finish_reason=whole.finish_reason, usage=whole.usage, speculation=whole.speculation, timings=whole.timings
    )


def result_from_pb(m: generation_pb2.GenerateResponse, wants_logprobs: bool = False) -> GenerationResult:
    s = m.speculation
    stats = SpeculationStats(
        rounds=s.rounds,
        draft_tokens=s.drafted_tokens,
        accepted_tokens=s.accepted_tokens,
        accepted_per_position=list(s.accepted_per_position),
        drafted_per_position=list(s.drafted_per_position),
        pre_proposed_rounds=s.pre_proposed_rounds,
    )
    return GenerationResult(
        request_id=m.request_id,
        token_ids=list(m.token_ids),
        text=m.text,
        finish_reason=FINISH_NAMES.get(m.finish_reason, "unknown"),
        prompt_tokens=m.usage.prompt_tokens,
        stats=stats,
        time_to_first_token=m.timings.time_to_first_token_s,
        total_time=m.timings.total_s,
        logprobs=logprobs_from_pb(m.logprobs) if wants_logprobs else None,
        draft_variant=s.draft_variant,
        acceptance_method=acceptance_method_from_pb(s.acceptance_method) or "rejection",
    )
