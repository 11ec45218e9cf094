"""The OpenAI API's JSON bodies to the coordinator's types and back: completions and chat completions, whole and
streamed (server-sent event chunks), logprobs, usage and OpenAI-shaped errors. No HTTP here (openai_http.py).

Standard fields keep their OpenAI meaning; what speculation did goes in the extension field `specsplit`. Fields the
API defines but this server does not implement are refused with a 400 when set to anything but their default,
never silently ignored.
"""

import time
from dataclasses import dataclass, field

from specsplit.services.coordinator.generation import GenerationResult, TokenEvent
from specsplit.services.coordinator.token_bytes import TokenTexts, token_bytes_of
from specsplit.services.errors import InvalidArgument
from specsplit.services.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the gRPC API's is 0, greedy)
MAX_PROMPT_CHARS = 1 << 20

# Defined by the API, not implemented here: accepted only at these (default) values.
NOT_IMPLEMENTED = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


class InvalidField(InvalidArgument):
    """A bad request naming the field at fault (the error body's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class OpenAIRequest:
    chat: bool
    model: str | None
    params: SamplingParams
    prompt: str | list[int] | None = None        # completions
    messages: list[dict] = field(default_factory=list)  # chat completions
    stream: bool = False
    include_usage: bool = False


def parse_request(body, chat: bool) -> OpenAIRequest:
    """A /v1/completions (chat=False) or /v1/chat/completions body -> OpenAIRequest; InvalidArgument when wrong."""
    if not isinstance(body, dict):
        raise InvalidField("the request body must be a JSON object")
    for name, defaults in NOT_IMPLEMENTED.items():
        if body.get(name) not in defaults:
            raise InvalidField(f"{name} is not supported by this server", name)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise InvalidField("response_format other than text is not supported by this server", "response_format")
    n = _integer(body, "n", 1, low=1)
    if n != 1:
        raise InvalidField("n must be 1: this server returns one choice per request (send several requests)", "n")
    if chat:
        messages = _messages(body.get("messages"))
        wants_logprobs = _boolean(body, "logprobs", False)
        top = _integer(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
        if top is not None and not wants_logprobs:
            raise InvalidField("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if wants_logprobs else None
        max_tokens = _integer(body, "max_completion_tokens", None, low=1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None, low=1)
        prompt = None
    else:
        messages = []
        prompt = _prompt(body.get("prompt"))
        logprobs = _integer(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
        max_tokens = _integer(body, "max_tokens", None, low=1)
    top_k = _integer(body, "top_k", 0, low=-1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidField("stop must be a string or a list of strings", "stop")
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidField("stream_options must be an object", "stream_options")
        if not stream:
            raise InvalidField("stream_options is only allowed with stream: true", "stream_options")
    include_usage = _boolean(options or {}, "include_usage", False, "stream_options.include_usage")
    k = _integer(body, "num_speculative_tokens", None, low=0)  # extension: the most per round, 0 = target only
    speculation = body.get("speculation")  # extension: "fixed" = exactly num_speculative_tokens every round
    if speculation not in (None, "adaptive", "fixed"):
        raise InvalidField('speculation must be "adaptive" or "fixed"', "speculation")
    params = SamplingParams(
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, low=0.0),
        top_p=_number(body, "top_p", 1.0, low=0.0),
        top_k=max(top_k, 0),  # -1 = off, as vLLM takes it
        seed=_integer(body, "seed", None, low=0),
        max_tokens=max_tokens,  # None: until end of sequence, bounded by the context
        stop=stop,
        stop_token_ids=_integer_list(body, "stop_token_ids"),
        ignore_eos=_boolean(body, "ignore_eos", False),
        logprobs=logprobs,
        num_speculative_tokens=k,
        speculation=speculation,
    )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidField("model must be a string", "model")
    return OpenAIRequest(chat, model, params, prompt, messages, stream, include_usage)


def _messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise InvalidField("messages must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise InvalidField(f"messages[{i}] must be an object", "messages")
        role = "system" if message.get("role") == "developer" else message.get("role")  # OpenAI's newer name
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise InvalidField(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidField(f"messages[{i}].content must be a string or a list of text parts", "messages")
        messages.append({"role": role, "content": content})
    return messages


def _prompt(raw) -> str | list[int]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        if not raw:
            raise InvalidField("prompt must not be empty", "prompt")
        if len(raw) > MAX_PROMPT_CHARS:
            raise InvalidField(f"prompt longer than {MAX_PROMPT_CHARS} characters", "prompt")
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return list(raw)
    if isinstance(raw, list) and len(raw) > 1:
        raise InvalidField("one prompt per request: batches of prompts are not supported", "prompt")
    raise InvalidField("prompt must be a non-empty string or a list of token ids", "prompt")


def _integer(body: dict, name: str, default, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidField(f"{name} must be an integer", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidField(f"{name} must be {bounds}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, low: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidField(f"{name} must be a number", name)
    if value < low:
        raise InvalidField(f"{name} must be >= {low}, got {value}", name)
    return float(value)


def _boolean(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidField(f"{param or name} must be true or false", param or name)
    return value


def _integer_list(body: dict, name: str) -> list[int]:
    value = body.get(name) or []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidField(f"{name} must be a list of integers", name)
    return value


# ---- responses --------------------------------------------------------------------------------------------------


class ResponseWriter:
    """Builds one request's response JSON: whole (`whole`) or as stream chunks (`chunks`), in the API's shapes."""

    def __init__(self, request: OpenAIRequest, model: str, tokenizer):
        self.request = request
        self.model = model
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.id = ""
        self._text_offset = 0
        self._texts: TokenTexts | None = None  # made when logprobs are first written
        self._sent_role = False

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.request.chat else "text_completion"

    def start(self, request_id: str) -> None:
        self.id = ("chatcmpl-" if self.request.chat else "cmpl-") + request_id

    def whole(self, result: GenerationResult) -> dict:
        choice = {"index": 0, "finish_reason": result.finish_reason,
                  "logprobs": self._logprobs(result.logprobs) if self.request.params.logprobs is not None else None}
        if self.request.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage_json(result), "specsplit": specsplit_json(result)}

    def chunks(self, event) -> list[dict]:
        """The stream chunks for one coordinator event: new text (with its logprobs), or the end (finish_reason,
        the speculation statistics, then usage when stream_options.include_usage asks for it)."""
        out = []
        if self.request.chat and not self._sent_role:
            out.append(self._chunk({"role": "assistant", "content": ""}, None, None))
            self._sent_role = True
        if isinstance(event, TokenEvent):
            wants_logprobs = self.request.params.logprobs is not None
            if event.text or (wants_logprobs and event.logprobs):
                logprobs = self._logprobs(event.logprobs or []) if wants_logprobs else None
                out.append(self._chunk(event.text, logprobs, None))
            return out
        last = self._chunk({} if self.request.chat else "", None, event.finish_reason)
        last["specsplit"] = specsplit_json(event)
        out.append(last)
        if self.request.include_usage:
            out.append({"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                        "choices": [], "usage": usage_json(event)})
        return out

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.request.chat else "text_completion"

    def _chunk(self, content, logprobs, finish_reason) -> dict:
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.request.chat:
            choice["delta"] = {"content": content} if isinstance(content, str) else content
        else:
            choice["text"] = content
        chunk = {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                 "choices": [choice]}
        if self.request.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def _logprobs(self, logprobs) -> dict:
        """Token strings are the whole characters each token completes (token_bytes.py); a token that ends inside
        a UTF-8 character shows it in `bytes` (chat) instead of U+FFFD."""
        if self._texts is None:
            self._texts = TokenTexts(token_bytes_of(self.tokenizer))
        entries = []
        for lp in logprobs:
            top = [(*self._texts.alternative(t), v) for t, v in lp.top]  # read before the chosen token moves on
            entries.append((*self._texts.chosen(lp.token_id), lp.logprob, top))
        if self.request.chat:
            return {"content": [
                {**_entry(text, raw, logprob), "top_logprobs": [_entry(t, r, v) for t, r, v in top]}
                for text, raw, logprob, top in entries
            ], "refusal": None}
        offsets = []
        for text, *_ in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": [text for text, *_ in entries],
            "token_logprobs": [logprob for _, _, logprob, _ in entries],
            "top_logprobs": [{_legacy_key(t, r): v for t, r, v in top} for *_, top in entries],
            "text_offset": offsets,
        }


def _entry(text: str, raw: bytes, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def _legacy_key(text: str, raw: bytes) -> str:
    """A completions top_logprobs key: the token's characters, or, for a token that completes none, its bytes
    written as OpenAI's completions API writes them ("bytes:\\xe4\\xbd"), so alternatives stay apart."""
    return text if text or not raw else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def usage_json(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def specsplit_json(result: GenerationResult) -> dict:
    """The extension field: what speculation did for this request (the gRPC API's SpeculationStats and Timings)."""
    s = result.stats
    return {
        "request_id": result.request_id,
        "speculation": {
            "rounds": s.rounds,
            "drafted_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "drafted_per_position": s.drafted_per_position,
            "accepted_per_position": s.accepted_per_position,
            "draft_variant": result.draft_variant,
            "acceptance_method": result.acceptance_method,  # "typical" is NOT lossless
        },
        "timings": {"time_to_first_token_s": result.time_to_first_token, "total_s": result.total_time},
        "preemptions": result.preemptions,
    }


def error_json(message: str, error_type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
