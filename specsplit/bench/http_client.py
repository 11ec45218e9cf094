"""A benchmark client of any OpenAI-compatible server (this one, vLLM, SGLang, ...): streamed completions for prompts,
streamed chat completions for conversations, timed per server-sent event. Token counts come from the usage the
server sends last (stream_options.include_usage); this server's `specsplit` field says what speculation did."""

import json

import aiohttp

from specsplit.bench.request_record import RequestClock, RequestRecord, ServerGone
from specsplit.bench.workloads import BenchRequest


class OpenAIHTTPClient:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, temperature: float = 0.0,
                 timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model = model
        self.temperature = temperature
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> "OpenAIHTTPClient":
        """Connect; without a model name, take the first the server lists."""
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout,
                                              connector=aiohttp.TCPConnector(limit=0))
        if self.model is None:
            try:
                async with self._session.get(self.base_url + "/models") as response:
                    if response.status != 200:
                        raise ServerGone(f"GET {self.base_url}/models: HTTP {response.status} {await response.text()}")
                    self.model = (await response.json())["data"][0]["id"]
            except aiohttp.ClientError as error:
                raise ServerGone(f"{self.base_url}: {error}") from None
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, request: BenchRequest) -> RequestRecord:
        chat = request.messages is not None
        temperature = self.temperature if request.temperature is None else request.temperature
        body = {"model": self.model, "max_tokens": request.output_len, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        if request.seed is not None:
            body["seed"] = request.seed
        if chat:
            body["messages"] = request.messages
        else:
            body["prompt"] = request.prompt
        url = self.base_url + ("/chat/completions" if chat else "/completions")
        record = RequestRecord()
        clock = RequestClock(record)
        try:
            async with self._session.post(url, json=body) as response:
                if response.status != 200:
                    message = _error_message(await response.text())
                    if response.status == 503:
                        raise ServerGone(f"HTTP 503: {message}")
                    record.error = f"HTTP {response.status}: {message}"
                    return clock.finish()
                pieces = 0
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = chunk["error"]
                        if error.get("type") == "service_unavailable_error":
                            raise ServerGone(f"in the stream: {error.get('message')}")
                        record.error = f"in the stream: {error.get('message')}"
                        return clock.finish()
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if piece:
                            clock.output()
                            pieces += 1
                    if chunk.get("usage"):
                        record.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                        record.output_tokens = chunk["usage"].get("completion_tokens") or 0
                    speculation = (chunk.get("specsplit") or {}).get("speculation")
                    if speculation:
                        record.rounds = speculation.get("rounds")
                        record.drafted_tokens = speculation.get("drafted_tokens")
                        record.accepted_tokens = speculation.get("accepted_tokens")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            raise ServerGone(f"{url}: {type(error).__name__}: {error}") from None
        record.output_tokens = record.output_tokens or pieces  # a server that sends no usage: one token per chunk
        record.ok = True
        return clock.finish()


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]
