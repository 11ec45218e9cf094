"""The OpenAI-compatible HTTP API of the coordinator (aiohttp, on the coordinator's own event loop).

    POST /v1/completions, POST /v1/chat/completions (stream: true = server-sent events ending in `data: [DONE]`),
    GET /v1/models, GET /health.

Each request goes through the same path as the gRPC API: JSON -> GenerationRequest (openai_messages.py) ->
`Coordinator.stream` -> JSON. Nothing about speculation lives here. A client that disconnects cancels its handler
(aiohttp's handler cancellation); leaving the coordinator's stream then aborts the request, which releases its KV
on the draft and target replicas. Bearer tokens and TLS are the gRPC API's settings, and the two APIs share one
throttle of failed tokens (a valid token is always served; services/rpc/auth_throttle.py); a caller's W3C trace
context (`traceparent` / `tracestate` headers) becomes the request span's parent, as over gRPC.

`finish_reason` is only ever one the API defines: "stop" (end of sequence, a stop token or string) or "length"
(max_tokens or the model's context). A request the server ends before it finishes (shutdown) is a 503 error
(`server_shutting_down`; in a stream, an error event before `data: [DONE]`), never a finish_reason of its own.
"""

import asyncio
import json
import logging
import ssl
import time

from aiohttp import web

from specsplit.services.coordinator import openai_messages as om
from specsplit.services.coordinator.coordinator import Coordinator
from specsplit.services.coordinator.generation import GenerationRequest, GenerationResult
from specsplit.services.errors import InvalidArgument, ResourceExhausted, SpecsplitError, Unavailable
from specsplit.services.rpc.caller_auth import SecretCheck, bearer_header
from specsplit.services.telemetry import tracing
from specsplit.services.telemetry.trace_propagation import caller_context
from specsplit.services.tokenization import encode_for_request

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # answered without a token, for probes
MAX_BODY_BYTES = 8 << 20
MAX_REQUEST_ID_CHARS = 128


class ModelNotFound(SpecsplitError):
    """The request names a model this server does not serve: 404, as OpenAI answers."""


class EndedByShutdown(Unavailable):
    """The server stopped before the request finished: 503 (retry elsewhere), not a finish_reason."""


API_FINISH_REASONS = ("stop", "length")  # the ones this server produces of those the API defines


# error class -> (HTTP status, OpenAI error type, code); the first match wins.
_STATUS_OF = [
    (InvalidArgument, 400, "invalid_request_error", None),
    (ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (EndedByShutdown, 503, "service_unavailable_error", "server_shutting_down"),
    (ResourceExhausted, 429, "rate_limit_error", "queue_full"),
    (Unavailable, 503, "service_unavailable_error", "no_replica"),
]


def error_response(error: Exception) -> web.Response:
    for cls, status, error_type, code in _STATUS_OF:
        if isinstance(error, cls):
            body = om.error_json(str(error), error_type, code, getattr(error, "param", None))
            return web.json_response(body, status=status)
    log.exception("request failed", exc_info=error)
    return web.json_response(om.error_json("internal error in the coordinator", "server_error", "internal_error"), status=500)


class OpenAIHTTPServer:
    def __init__(self, coordinator: Coordinator, model: str, auth_tokens: SecretCheck | None = None, security=None):
        self.coordinator = coordinator
        self.model = model
        self._tokens = auth_tokens  # the gRPC API's SecretCheck (one throttle for both), or None
        self.security = security  # a ServerSecurity (TLS, optionally mutual), or None for plain HTTP
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self._in_flight: dict[int, GenerationRequest] = {}  # id -> request, for ending them at shutdown

    def app(self) -> web.Application:
        middlewares = [self._errors, self._authenticate] + ([self._trace_context] if tracing.enabled() else [])
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
        app.on_shutdown.append(self._end_requests)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
        ])
        return app

    async def start(self, host: str, port: int) -> int:
        """Serve on host:port (0 = any free port); returns the port bound."""
        # Keep-alive connections must not hold a stopping coordinator for long.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self._ssl_context())
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _end_requests(self, app) -> None:
        """At shutdown, once no new connection comes: end the requests still running, so each handler answers
        its client (503, or an error event in the stream) before the server waits for the handlers."""
        ours = self._in_flight.keys()
        for sequence in [*self.coordinator.running, *self.coordinator.waiting]:
            if id(sequence.request) in ours:
                self.coordinator.abort(sequence)

    def _ssl_context(self) -> ssl.SSLContext | None:
        s = self.security
        if s is None or not s.cert_file:
            if s is not None and s.client_ca_file:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(s.cert_file, s.key_file)
        if s.client_ca_file:  # mutual TLS, as on the gRPC port
            context.load_verify_locations(s.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    # ---- middlewares ------------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except SpecsplitError as error:
            return error_response(error)
        except web.HTTPException as error:  # unknown path, wrong method: still an OpenAI-shaped body
            if error.status < 400:
                raise
            kind = "not_found_error" if error.status == 404 else "invalid_request_error"
            return web.json_response(om.error_json(f"{request.method} {request.path}: {error.reason}", kind),
                                     status=error.status, headers={k: v for k, v in error.headers.items()
                                                                   if k.lower() == "allow"})
        except asyncio.CancelledError:
            raise
        except Exception as error:
            return error_response(error)

    @web.middleware
    async def _authenticate(self, request, handler):
        if self._tokens is not None and request.path not in OPEN_PATHS:
            if not self._tokens.valid(bearer_header(request.headers.get("Authorization", ""))):
                await self._tokens.refuse(request.remote or "?")  # slowed per address; valid tokens never wait
                body = om.error_json("missing or invalid bearer token", "authentication_error", "invalid_api_key")
                return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    @web.middleware
    async def _trace_context(self, request, handler):
        with caller_context(request.headers):
            return await handler(request)

    # ---- routes -----------------------------------------------------------------------------------------------

    async def health(self, request) -> web.Response:
        if not self.coordinator.targets.live():
            raise Unavailable("no target replica is available")
        return web.json_response({"status": "ok"})

    async def models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "specsplit",
                "max_model_len": self.coordinator.max_model_len}

    async def completions(self, request) -> web.StreamResponse:
        parsed = om.parse_request(await _json_body(request), chat=False)
        ids = await encode_for_request(self.coordinator.tokenizer, parsed.prompt)
        return await self._generate(request, parsed, ids)

    async def chat_completions(self, request) -> web.StreamResponse:
        parsed = om.parse_request(await _json_body(request), chat=True)
        ids = await encode_for_request(self.coordinator.tokenizer, messages=parsed.messages)
        return await self._generate(request, parsed, ids)

    async def _generate(self, request, parsed: om.OpenAIRequest, prompt_ids: list[int]) -> web.StreamResponse:
        if parsed.model not in (None, "", self.model):
            raise ModelNotFound(f"the model {parsed.model!r} does not exist here; this server serves {self.model!r}")
        request_id = request.headers.get("X-Request-Id", "")[:MAX_REQUEST_ID_CHARS]
        generation = GenerationRequest(prompt_ids, parsed.params, request_id)
        writer = om.ResponseWriter(parsed, self.model, self.coordinator.tokenizer)
        events = self.coordinator.stream(generation)
        self._in_flight[id(generation)] = generation
        try:
            # The first event settles admission: a refused request (400, 429) answers before any byte is sent.
            event = await events.__anext__()
            writer.start(generation.request_id)
            if not parsed.stream:
                while not isinstance(event, GenerationResult):
                    event = await events.__anext__()
                return web.json_response(writer.whole(_finished(event)))
            return await self._stream(request, events, event, writer)
        finally:
            del self._in_flight[id(generation)]
            await events.aclose()  # leaving early (disconnect, error) aborts the request: its KV is released

    async def _stream(self, request, events, event, writer: om.ResponseWriter) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            while True:
                if isinstance(event, GenerationResult):
                    _finished(event)
                for chunk in writer.chunks(event):
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if isinstance(event, GenerationResult):
                    break
                event = await events.__anext__()
        except SpecsplitError as error:  # after the headers: the error goes in the stream, as OpenAI's servers do
            body = json.loads(error_response(error).body)
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _finished(result: GenerationResult) -> GenerationResult:
    """The result, if it finished as the API defines finishing; else the error its client gets instead."""
    if result.finish_reason not in API_FINISH_REASONS:
        raise EndedByShutdown(f"the server stopped before the request finished ({result.completion_tokens} tokens "
                              "generated); retry it")
    return result


async def _json_body(request) -> object:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidArgument(f"the request body is not valid JSON: {error}")
