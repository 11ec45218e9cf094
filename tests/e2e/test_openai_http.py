"""The OpenAI-compatible HTTP API, through the real `openai` client, against coordinators in their own processes
with tiny models: completions and chat, whole and streamed, the same output as the gRPC API, usage, logprobs
(token strings of whole characters, each token's bytes), OpenAI-shaped errors of each status, a client that leaves
mid-stream freeing its KV on both workers, and a coordinator stopping mid-request answering with an error, never a
finish_reason the API does not define."""

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from cluster import Cluster
from specsplit.client import Client

TOKEN = "http-test-token-5b2e"
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def served(tiny_pair, tmp_path_factory):
    """A target and a draft; `main` (bearer token, metrics) over them; `full` (a queue that takes nothing) and
    `ending` (stopped by its test) over the same workers; `orphan` over a target of its own that the 503 test
    stops."""
    tokens = tmp_path_factory.mktemp("http") / "tokens"
    tokens.write_text(TOKEN + "\n")
    c = Cluster()
    model = ["--dtype", "float64", "--num-kv-blocks", "256", "--host", "127.0.0.1", "--port", "0"]
    try:
        c.start({
            "target": ["target", "--model", str(tiny_pair["target"]), *model, "--metrics-port", "0"],
            "draft": ["draft", "--model", str(tiny_pair["close"]), *model, "--metrics-port", "0"],
            "lone_target": ["target", "--model", str(tiny_pair["target"]), *model, "--metrics-port", "-1"],
        })
        a = c.addresses
        local = ["--host", "127.0.0.1", "--port", "0", "--http-port", "0"]
        c.start({
            "main": ["coordinator", "--target", a["target"], "--draft", a["draft"], *local, "-k", "4",
                     "--speculation", "fixed", "--metrics-port", "0", "--auth-token-file", str(tokens)],
            "full": ["coordinator", "--target", a["target"], "--draft", a["draft"], *local, "--max-waiting", "0",
                     "--metrics-port", "-1"],
            "orphan": ["coordinator", "--target", a["lone_target"], *local, "--replica-recovery-seconds", "0.5",
                       "--metrics-port", "-1"],
            "ending": ["coordinator", "--target", a["target"], "--draft", a["draft"], *local, "--metrics-port", "0"],
        })
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def model_id(served):
    return served.worker_info("target").model  # the served model's name, as /v1/models lists it


@pytest.fixture(scope="module")
def http(served):
    return openai.OpenAI(base_url=served.http_url("main"), api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(served):
    with Client(served.addresses["main"], timeout=60, token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair["target"])


def test_models_and_health(served, http, model_id):
    assert [m.id for m in http.models.list().data] == [model_id]
    with urllib.request.urlopen(served.http_url("main").removesuffix("/v1") + "/health", timeout=10) as response:
        assert response.status == 200 and json.load(response) == {"status": "ok"}  # open without a token (probes)


def test_greedy_completion_matches_grpc(http, grpc_client, model_id, tokenizer):
    expected = grpc_client.generate(PROMPT, max_tokens=24, temperature=0.0)
    got = http.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = got.choices[0]
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert got.object == "text_completion" and got.model == model_id
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert got.usage.prompt_tokens == prompt_tokens == expected.prompt_tokens
    assert got.usage.completion_tokens == len(expected.token_ids) and got.usage.total_tokens == prompt_tokens + len(expected.token_ids)
    stats = got.model_extra["specsplit"]["speculation"]  # the extension field; the standard ones stay standard
    assert stats["rounds"] > 0 and stats["drafted_tokens"] >= stats["accepted_tokens"] > 0


def test_streamed_completion_is_the_whole_one(http, grpc_client, model_id):
    expected = grpc_client.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)
    chunks = list(http.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed, not one piece
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert finishing[0].model_extra["specsplit"]["speculation"]["rounds"] > 0
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 40 == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_sampled_with_a_seed_matches_grpc(http, grpc_client, model_id):
    params = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    expected = grpc_client.generate(PROMPT, top_k=50, ignore_eos=True, **params)
    got = http.completions.create(model=model_id, prompt=PROMPT, extra_body={"top_k": 50, "ignore_eos": True}, **params)
    assert got.choices[0].text == expected.text
    other_seed = http.completions.create(model=model_id, prompt=PROMPT, extra_body={"top_k": 50, "ignore_eos": True},
                                         **{**params, "seed": 99})
    assert other_seed.choices[0].text != expected.text  # the seed reaches the sampler


def test_chat_matches_grpc_chat(http, grpc_client, model_id, tokenizer):
    expected = grpc_client.generate("write a loop", chat=True, max_tokens=20, temperature=0.0)
    got = http.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "write a loop"}],
                                       max_completion_tokens=20, temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == expected.prompt_tokens
    streamed = list(http.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "write a loop"}],
                                                 max_tokens=20, temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text


def test_chat_history_and_system_prompt_go_through_the_template(http, model_id, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    got = http.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert got.usage.prompt_tokens == len(rendered)


def test_stop_string_and_logprobs(http, grpc_client, model_id):
    whole = grpc_client.generate(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    stop = next(ch for ch in whole.text[3:] if ch.strip())  # a character the greedy text really reaches
    cut = http.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == whole.text[: whole.text.index(stop)]
    got = http.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in whole.logprobs])
    assert all(len(top) <= 2 for top in lp.top_logprobs) and len(lp.tokens) == 24
    chat = http.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                        temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)


def test_logprobs_tokens_are_whole_characters_with_their_bytes(http, model_id):
    """The tiny models' vocabulary is one token per byte and their random weights emit bytes in any order, so many
    tokens end inside a UTF-8 character. Such a token's string holds only the characters it completes (nothing, for
    a lead byte), never U+FFFD for a character cut in two; its bytes are its own, and they join to the text."""
    chat = http.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "日本語のテキスト"}],
                                        max_tokens=64, temperature=1.0, seed=3, logprobs=True, top_logprobs=2,
                                        extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    raw = bytes(b for entry in content for b in entry.bytes)
    assert len(content) == 64 and all(len(entry.bytes) == 1 for entry in content)  # one byte per token
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content
    joined = "".join(entry.token for entry in content)
    # The text, but for the replacement characters at its very end that only the end of the response settles (the
    # response's own detokenizer holds a trailing U+FFFD until the next token says whether a character was cut).
    assert joined == chat.choices[0].message.content.rstrip("\ufffd")
    cut = [entry for entry in content if not entry.token]
    assert any(entry.bytes[0] >= 0xC2 for entry in cut)  # a lead byte: a character begins, none completes
    # Completions: the strings of the tokens join to the text, and text_offset counts in them.
    prompt = list(range(0x80, 0xC0, 4))  # token ids as the prompt
    completion = http.completions.create(model=model_id, prompt=prompt, max_tokens=48, temperature=1.0, seed=5,
                                         logprobs=1, extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == 48 and completion.choices[0].text.startswith("".join(lp.tokens))
    assert "".join(lp.tokens) and lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_bad_requests_are_400_with_openai_errors(served, http, model_id):
    with pytest.raises(openai.BadRequestError) as error:
        http.completions.create(model=model_id, prompt=PROMPT, n=2)
    assert error.value.status_code == 400 and "n must be 1" in error.value.body["message"]
    assert error.value.body["param"] == "n" and error.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        http.completions.create(model=model_id, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        http.completions.create(model="no-such-model", prompt=PROMPT)
    # The raw body, as any HTTP client sees it.
    request = urllib.request.Request(served.http_url("main") + "/chat/completions", data=b'{"messages": 3}',
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=10)
    body = json.loads(raw.value.read())
    assert raw.value.code == 400 and set(body["error"]) == {"message", "type", "param", "code"}


def test_the_http_token_is_compared_as_exactly_as_over_grpc(served, model_id):
    """One parser for both APIs (caller_auth.bearer_header): only `Bearer TOKEN` exactly."""
    def status(header):
        request = urllib.request.Request(served.http_url("main") + "/models",
                                         headers={"Authorization": header} if header is not None else {})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    # (A trailing space is no case here: HTTP strips a field value's surrounding whitespace before anyone reads it.)
    for header in (f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer  {TOKEN}", f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN[:-1]}",
                   None):
        assert status(header) == 401, header
    assert status(f"Bearer {TOKEN}") == 200


def test_bad_token_is_401(served, model_id):
    wrong = openai.OpenAI(base_url=served.http_url("main"), api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as error:
        wrong.completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"


def test_full_queue_is_429(served, model_id):
    full = openai.OpenAI(base_url=served.http_url("full"), api_key="unused", max_retries=0)
    with pytest.raises(openai.RateLimitError) as error:
        full.completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
    assert error.value.status_code == 429 and "queue full" in error.value.body["message"]
    with pytest.raises(openai.RateLimitError):  # a stream is refused before it starts
        list(full.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], stream=True))


def test_no_replica_is_503(served, model_id):
    orphan = openai.OpenAI(base_url=served.http_url("orphan"), api_key="unused", max_retries=0)
    assert orphan.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
    served.processes["lone_target"].kill()
    served.processes["lone_target"].wait()
    with pytest.raises(openai.InternalServerError) as error:
        orphan.completions.create(model=model_id, prompt=PROMPT, max_tokens=2)
    assert error.value.status_code == 503 and error.value.body["code"] == "no_replica"
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(served.http_url("orphan").removesuffix("/v1") + "/health", timeout=10)
    assert health.value.code == 503


def test_a_request_ended_by_shutdown_is_an_error_not_a_finish_reason(served, model_id):
    """`ending` gets a streamed and a whole request of many tokens, then SIGTERM: each client gets a 503-shaped
    error (`server_shutting_down`), the stream's before `data: [DONE]`; no finish_reason outside the API's; the
    workers free the KV."""
    url = served.http_url("ending")
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    whole = {}

    def post_whole():
        request = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                whole["status"], whole["body"] = response.status, json.load(response)
        except urllib.error.HTTPError as error:
            whole["status"], whole["body"] = error.code, json.loads(error.read())

    waiting = threading.Thread(target=post_whole)
    waiting.start()
    request = urllib.request.Request(url + "/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as stream:
        for line in stream:
            if not line.startswith(b"data: "):
                continue
            events.append(line[6:].strip())
            if len(events) == 1:  # streaming: stop the coordinator once the whole request runs beside it
                metrics = served.metrics_url("ending")
                deadline = time.monotonic() + 30
                while _scrape(metrics)['specsplit_running_sequences{role="coordinator"}'] < 2:
                    assert time.monotonic() < deadline, "the whole request never started"
                    time.sleep(0.02)
                served.processes["ending"].send_signal(signal.SIGTERM)
    waiting.join(60)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = {c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")} - {None}
    assert not reasons, reasons  # it did not finish: no finish_reason at all, "abort" least of all
    assert chunks[-1]["error"]["code"] == "server_shutting_down" and chunks[-1]["error"]["type"] == "service_unavailable_error"
    assert sum(len(c["choices"][0]["text"]) for c in chunks[:-1]) > 0
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "server_shutting_down", whole
    assert served.processes["ending"].wait(timeout=30) == 0
    workers = {name: served.metrics_url(name) for name in ("target", "draft")}
    deadline = time.monotonic() + 15
    while any(_scrape(u)['specsplit_kv_blocks_used{role="%s"}' % n] for n, u in workers.items()):
        assert time.monotonic() < deadline, "KV still held after the coordinator stopped"
        time.sleep(0.1)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and not line.startswith("#")}


def _aborts(served) -> float:
    metrics = _scrape(served.metrics_url("main"))
    return sum(v for k, v in metrics.items() if k.startswith("specsplit_requests_total{") and 'finish_reason="abort"' in k)


def test_client_leaving_mid_stream_frees_kv_on_both_workers(served, http, model_id):
    workers = {name: served.metrics_url(name) for name in ("target", "draft")}
    aborts_before = _aborts(served)
    stream = http.completions.create(model=model_id, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(stream))
    held = {name: _scrape(url)['specsplit_kv_blocks_used{role="%s"}' % name] for name, url in workers.items()}
    stream.close()  # the client goes away with most of its 400 tokens still to come
    assert all(blocks > 0 for blocks in held.values()), held  # it held KV on both workers while it streamed
    deadline = time.monotonic() + 15
    while True:
        after = {name: _scrape(url) for name, url in workers.items()}
        freed = all(m['specsplit_kv_blocks_used{role="%s"}' % n] == 0 and m['specsplit_running_sequences{role="%s"}' % n] == 0
                    for n, m in after.items())
        if freed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert freed, after
    assert _aborts(served) == aborts_before + 1  # aborted, not run to the end
    # The coordinator goes on serving.
    assert http.completions.create(model=model_id, prompt=PROMPT, max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_concurrent_streams_each_get_their_own_answer(http, grpc_client, model_id):
    prompts = [f"{PROMPT} # {i}" for i in range(4)]
    expected = [grpc_client.generate(p, max_tokens=16, temperature=0.0, ignore_eos=True).text for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        chunks = http.completions.create(model=model_id, prompt=prompts[i], max_tokens=16, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        got[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "a loop?"}]


def test_grpc_chat_takes_a_conversation_as_http_does(served, http, grpc_client, model_id, tmp_path):
    over_grpc = grpc_client.chat(CONVERSATION, max_tokens=16, temperature=0.0)
    over_http = http.chat.completions.create(model=model_id, messages=CONVERSATION, max_tokens=16, temperature=0)
    assert over_grpc.text == over_http.choices[0].message.content
    assert over_grpc.prompt_tokens == over_http.usage.prompt_tokens
    streamed = "".join(chunk.text for chunk in grpc_client.chat_stream(CONVERSATION, max_tokens=16, temperature=0.0))
    assert streamed == over_grpc.text
    # The command line: --system, a JSON file of the turns so far, --prompt as the last user turn.
    (tmp_path / "turns.json").write_text(json.dumps(CONVERSATION[1:3]))
    command = [sys.executable, "-m", "specsplit", "generate", "--server", served.addresses["main"], "--token", TOKEN,
               "--chat", "--system", "be brief", "--messages", str(tmp_path / "turns.json"), "--prompt", "a loop?",
               "--max-tokens", "16", "--json"]
    printed = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout)
    assert printed["text"] == over_grpc.text and printed["usage"]["prompt_tokens"] == over_grpc.prompt_tokens


def test_grpc_refuses_both_a_prompt_and_messages(grpc_client):
    from specsplit.proto.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(text="hi", messages=[generation_pb2.ChatMessage(role="user", content="x")])
    with pytest.raises(grpc.RpcError) as error:
        grpc_client.stub.Generate(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in error.value.details()
    bad_role = generation_pb2.GenerateRequest(messages=[generation_pb2.ChatMessage(role="tool", content="x")])
    with pytest.raises(grpc.RpcError, match="role"):
        grpc_client.stub.Generate(bad_role, timeout=30)


def test_without_max_tokens_the_answer_runs_to_its_end(http, grpc_client, model_id):
    """As OpenAI's API: no max_tokens = until end of sequence, bounded by the context (here the tiny model's 512)."""
    context = http.models.list().data[0].model_extra["max_model_len"]
    got = http.completions.create(model=model_id, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens + got.usage.completion_tokens == context
    over_grpc = grpc_client.generate(PROMPT, temperature=0.0, ignore_eos=True)  # max_tokens unset on the wire too
    assert over_grpc.text == got.choices[0].text
