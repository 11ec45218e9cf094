"""Observability of the split services as real processes: OTLP traces across coordinator, draft and target (the
caller's context honoured over gRPC and over the OpenAI HTTP API); Prometheus metrics over HTTP; the canary split, its statistics (/v1/canary, GetDraftVariantStats) and the
draft-variants file applied live."""

import json
import math
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster import Cluster, scrape
from dashboard_queries import missing, named_metrics
from otlp_collector import OtlpCollector
from specsplit.client import Client
from specsplit.services.coordinator import public_messages as pm
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.telemetry.trace_propagation import traceparent

WEIGHTS = {"stable": 3, "canary": 1}
CANARY_KEYS = {"name", "weight", "requests", "drafted_tokens", "accepted_tokens", "acceptance_rate",
               "acceptance_rate_ci95", "tokens_per_second", "tokens_per_second_ci95"}


@pytest.fixture(scope="module")
def observed(tiny_pair, tmp_path_factory):
    """Target, two drafts and a coordinator routing stable/canary 3:1 from a variants file, all exporting spans
    over OTLP to a collector in this process and serving metrics on free ports."""
    collector = OtlpCollector()
    variants_file = tmp_path_factory.mktemp("variants") / "variants.json"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    c = Cluster()
    local = ["--host", "127.0.0.1", "--metrics-port", "0"]
    model = ["--dtype", "float64", "--num-kv-blocks", "512", *local]
    # Ports chosen up front so the coordinator starts beside the workers (it waits for them to answer).
    target, draft_a, draft_b = (f"127.0.0.1:{port}" for port in free_ports(3))
    variants_file.write_text(json.dumps({"variants": [
        {"name": "stable", "weight": WEIGHTS["stable"], "addresses": [draft_a]},
        {"name": "canary", "weight": WEIGHTS["canary"], "addresses": [draft_b]},
    ]}))
    try:
        c.start({
            "target": ["target", "--model", str(tiny_pair["target"]), *model, "--port", target.rsplit(":")[1]],
            "draft_a": ["draft", "--model", str(tiny_pair["close"]), *model, "--port", draft_a.rsplit(":")[1]],
            "draft_b": ["draft", "--model", str(tiny_pair["close"]), *model, "--port", draft_b.rsplit(":")[1]],
            # Serial rounds, whose spans the trace test counts (a propose per verify with proposals): `auto` may try
            # an overlapped round where its measured costs say it could pay, as on a loaded CI machine.
            "coordinator": ["coordinator", "--target", target, "--draft-variants-file", str(variants_file), "-k", "4",
                            "--speculation", "fixed", "--overlap", "off", *local, "--port", "0", "--http-port", "0"],
        }, env)
        c.variants_file = variants_file
        yield c, collector
    finally:
        c.stop()
        collector.stop()


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def canary_report(cluster) -> dict:
    with urllib.request.urlopen(cluster.metrics_url("coordinator") + "/v1/canary", timeout=10) as response:
        return json.loads(response.read())


def test_one_trace_per_request_across_the_three_services(observed):
    cluster, collector = observed
    provider = TracerProvider()  # the caller's own tracing, kept in memory
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    caller = provider.get_tracer("test-caller")
    prompts = ["def add(a, b):", "hello world", "1 2 3 4 5"]
    with Client(cluster.addresses["coordinator"], timeout=60) as client:

        def call(prompt):
            with caller.start_as_current_span("caller") as span:
                metadata = [("traceparent", traceparent(span.get_span_context()))]
                request = pm.request_pb(prompt, SamplingParams(max_tokens=16, ignore_eos=True), False, "")
                if prompt == prompts[0]:  # one streamed, the others unary: both honour the caller's context
                    return [c for c in client.stub.GenerateStream(request, metadata=metadata, timeout=60)][-1]
                return client.stub.Generate(request, metadata=metadata, timeout=60)

        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(call, prompts))  # concurrent, so worker steps batch several requests
    callers = exporter.get_finished_spans()
    assert len(callers) == len(prompts)
    trace_ids = {f"{s.context.trace_id:032x}": f"{s.context.span_id:016x}" for s in callers}

    def complete(spans):
        ended = {(s.trace_id, s.service, s.name) for s in spans}
        return all((t, "specsplit-target", "verify") in ended and (t, "specsplit-draft", "propose") in ended
                   and (t, "specsplit-coordinator", "text_completion target") in ended for t in trace_ids)

    spans = collector.wait_for(complete)
    by_id = {s.span_id: s for s in spans}
    for trace_id, caller_span_id in trace_ids.items():
        mine = [s for s in spans if s.trace_id == trace_id]
        assert {s.service for s in mine} == {"specsplit-coordinator", "specsplit-draft", "specsplit-target"}
        (request,) = [s for s in mine if s.name.startswith("text_completion")]
        assert request.parent_span_id == caller_span_id  # the caller's context is honoured
        a = request.attributes
        assert a["gen_ai.request.model"] == "target" and a["gen_ai.request.max_tokens"] == 16
        assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.usage.output_tokens"] == 16
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.response.finish_reasons"] == ("length",)
        variant = a["specsplit.draft_variant"]
        assert variant in WEIGHTS
        calls = [s for s in mine if s.service == "specsplit-coordinator" and s.parent_span_id == request.span_id]
        assert {s.name for s in calls} == {
            "specsplit.v1.TargetWorker/Prefill", "specsplit.v1.DraftWorker/Prefill",
            "specsplit.v1.DraftWorker/Propose", "specsplit.v1.TargetWorker/Verify",
        }
        proposes = [s for s in calls if s.name.endswith("/Propose")]
        verifies = [s for s in calls if s.name.endswith("/Verify")]
        assert len(verifies) == a["specsplit.rounds"]
        assert len(proposes) == sum(s.attributes["specsplit.k"] > 0 for s in verifies)  # k = 0: nothing left to draft
        assert sum(s.attributes["specsplit.accepted_tokens"] for s in verifies) == a["specsplit.accepted_tokens"]
        # Sticky: every round of the request went to the same variant and the same draft replica.
        assert {s.attributes["specsplit.draft_variant"] for s in proposes} == {variant}
        assert len({s.attributes["server.address"] for s in proposes}) == 1
        expected_draft = cluster.addresses["draft_a" if variant == "stable" else "draft_b"]
        assert proposes[0].attributes["server.address"] == expected_draft
        # Worker spans are children of the coordinator's call spans, in the worker's own process.
        for s in mine:
            if s.service == "specsplit-coordinator":
                continue
            parent = by_id[s.parent_span_id]
            assert parent.service == "specsplit-coordinator" and parent.parent_span_id == request.span_id
            role = "DraftWorker" if s.service == "specsplit-draft" else "TargetWorker"
            assert parent.name == f"specsplit.v1.{role}/" + {"prefill": "Prefill", "propose": "Propose"}.get(s.name, "Verify")
            assert s.start_ns >= parent.start_ns and s.end_ns <= parent.end_ns  # within the call, clocks shared here
        worker_names = sorted({(s.service, s.name) for s in mine if s.service != "specsplit-coordinator"})
        assert worker_names == [("specsplit-draft", "prefill"), ("specsplit-draft", "propose"),
                                ("specsplit-target", "prefill"), ("specsplit-target", "score"), ("specsplit-target", "verify")]
        for s in mine:
            if s.name == "verify" and s.service == "specsplit-target":
                assert by_id[s.parent_span_id].attributes["specsplit.accepted_tokens"] == s.attributes["specsplit.accepted_tokens"]
    # A batched step is its own span linking to every request it served; item spans link back to it.
    steps = [s for s in spans if s.name in ("draft.step", "target.step")]
    assert steps and all(s.trace_id not in trace_ids for s in steps)
    for step in steps:
        linked = [by_id[span_id] for _, span_id in step.links if span_id in by_id]
        assert len(step.links) == step.attributes["specsplit.batch_size"]  # every item carried its request's context
        assert all(link.service == "specsplit-coordinator" for link in linked)
    shared = [s for s in steps if len({t for t, _ in s.links} & set(trace_ids)) >= 2]
    assert shared, "no worker step served two of the concurrent requests"
    served = [s for s in spans if s.trace_id in trace_ids and s.links and s.service != "specsplit-coordinator"]
    assert all(any(by_id.get(span_id) in steps for _, span_id in s.links) for s in served)


def test_http_requests_carry_the_callers_trace_context(observed):
    """`traceparent` / `tracestate` headers on the OpenAI HTTP API make the request span a child of the caller's
    span, whole or streamed, as gRPC metadata does."""
    cluster, collector = observed
    url = cluster.http_url("coordinator")
    provider = TracerProvider()
    caller = provider.get_tracer("test-caller")
    callers = {}
    for path, body in (("/completions", {"prompt": "def add(a, b):", "max_tokens": 6}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                              "stream": True})):
        with caller.start_as_current_span("caller") as span:
            context = span.get_span_context()
            headers = {"Content-Type": "application/json", "traceparent": traceparent(context),
                       "tracestate": "vendor=value"}
            request = urllib.request.Request(url + path, data=json.dumps({**body, "temperature": 0}).encode(),
                                             headers=headers)
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 200
                response.read()
            callers[f"{context.trace_id:032x}"] = f"{context.span_id:016x}"

    def requests_of(spans):
        return [s for s in spans if s.trace_id in callers and s.name.startswith("text_completion")]

    spans = collector.wait_for(lambda spans: len(requests_of(spans)) == len(callers))
    for request in requests_of(spans):
        assert request.parent_span_id == callers[request.trace_id]
        assert request.attributes["gen_ai.usage.output_tokens"] > 0


def test_the_grafana_dashboard_reads_metrics_the_services_export(observed):
    """Every metric (and label) a panel of the chart's dashboard queries, but the operator's, is on the /metrics
    page of the real coordinator, target or drafts once requests have run (the operator's: test_operator_command)."""
    cluster, _ = observed
    with Client(cluster.addresses["coordinator"], timeout=60) as client:
        for prompt in ("def add(a, b):", "hello world", "1 2 3"):
            client.generate(prompt, max_tokens=12, ignore_eos=True)
    scraped = [scrape(cluster.metrics_url(name)) for name in ("coordinator", "target", "draft_a", "draft_b")]
    read = named_metrics(operator=False)
    assert len(read) >= 15 and missing(read, scraped) == []


def test_metrics_move_as_requests_run(observed):
    cluster, _ = observed
    urls = {name: cluster.metrics_url(name) for name in ("coordinator", "target", "draft_a", "draft_b")}
    before = {name: scrape(url) for name, url in urls.items()}
    for name, role in (("target", "target"), ("draft_a", "draft")):
        assert value(before[name], "specsplit_kv_blocks_total", role=role) > 0
    with Client(cluster.addresses["coordinator"], timeout=60) as client:
        # Long enough to still be running when the scrapes below are done (the rounds of tiny models take ms).
        stream = client.generate_stream("import os\nimport sys\n", max_tokens=400, ignore_eos=True)
        next(stream)  # decoding has started: the request is running and holds KV
        during = {name: scrape(urls[name]) for name in ("coordinator", "target")}
        chunks = list(stream)
        results = [client.generate(p, max_tokens=20, ignore_eos=True) for p in ("def f(x):", "hello world")]
    assert value(during["coordinator"], "specsplit_running_sequences", role="coordinator") >= 1
    assert value(during["target"], "specsplit_running_sequences", role="target") >= 1
    assert value(during["target"], "specsplit_kv_blocks_used", role="target") > 0
    after = {name: scrape(url) for name, url in urls.items()}

    def grew(service, name, **labels):
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    drafted = sum(grew("coordinator", "specsplit_drafted_tokens_total", variant=v, method="rejection") for v in WEIGHTS)
    accepted = sum(grew("coordinator", "specsplit_accepted_tokens_total", variant=v, method="rejection") for v in WEIGHTS)
    assert drafted == sum(r.stats.draft_tokens for r in results) + chunks[-1].speculation.drafted_tokens
    assert accepted == sum(r.stats.accepted_tokens for r in results) + chunks[-1].speculation.accepted_tokens
    assert sum(grew("coordinator", "specsplit_requests_total", variant=v, finish_reason="length") for v in WEIGHTS) == 3
    assert sum(grew("coordinator", "specsplit_time_to_first_token_seconds_count", variant=v) for v in WEIGHTS) == 3
    for service, stages in (("coordinator", ("prefill", "propose", "verify")), ("target", ("prefill", "score", "verify"))):
        for stage in stages:
            assert grew(service, "specsplit_stage_latency_seconds_count", stage=stage) > 0, (service, stage)
    assert sum(grew(d, "specsplit_stage_latency_seconds_count", stage="propose") for d in ("draft_a", "draft_b")) > 0
    c1 = after["coordinator"]
    for v in WEIGHTS:
        labels = dict(variant=v, method="rejection")
        if value(c1, "specsplit_speculative_rounds_total", **labels):
            ratio = value(c1, "specsplit_accepted_tokens_total", **labels) / value(c1, "specsplit_drafted_tokens_total", **labels)
            assert value(c1, "specsplit_acceptance_rate", **labels) == pytest.approx(ratio)
            assert 1.0 <= value(c1, "specsplit_mean_accepted_length", **labels) <= 5.0
            assert 0.2 <= value(c1, "specsplit_system_efficiency", **labels) <= 1.0
    assert value(c1, "specsplit_running_sequences", role="coordinator") == 0
    # The prefix cache: the second of two identical 40-token prompts finds its first two blocks on both workers.
    with Client(cluster.addresses["coordinator"], timeout=60) as client:
        twice = [client.generate("def prefix_cached(x):\n    return x + 1\n#", max_tokens=4, ignore_eos=True)
                 for _ in range(2)]
    last = {name: scrape(url) for name, url in urls.items()}
    assert value(last["target"], "specsplit_prefix_cache_hit_tokens_total", role="target") - \
        value(after["target"], "specsplit_prefix_cache_hit_tokens_total", role="target") == 32
    assert value(last["target"], "specsplit_prefix_cache_queried_tokens_total", role="target") - \
        value(after["target"], "specsplit_prefix_cache_queried_tokens_total", role="target") == 2 * 40
    # The drafts: a hit only if the canary split sent both requests to the same one.
    same_draft = twice[0].draft_variant == twice[1].draft_variant
    assert sum(value(last[d], "specsplit_prefix_cache_hit_tokens_total", role="draft") -
               value(after[d], "specsplit_prefix_cache_hit_tokens_total", role="draft")
               for d in ("draft_a", "draft_b")) == (32 if same_draft else 0)


def test_canary_split_honours_weights_and_reports_per_variant(observed):
    cluster, _ = observed
    before = {v["name"]: v["requests"] for v in canary_report(cluster)["variants"]}
    n = 48
    with Client(cluster.addresses["coordinator"], timeout=60) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: client.generate(f"request {i}", max_tokens=3, ignore_eos=True), range(n)))
        stats = client.draft_variant_stats()
    report = canary_report(cluster)
    assert [v["name"] for v in report["variants"]] == ["stable", "canary"]
    assert all(set(v) == CANARY_KEYS for v in report["variants"])
    served = {v: sum(r.draft_variant == v for r in results) for v in WEIGHTS}
    assert sum(served.values()) == n
    for v in report["variants"]:
        assert v["weight"] == WEIGHTS[v["name"]]
        assert v["requests"] - before[v["name"]] == served[v["name"]]
    # The split: each request picks a variant independently with p = weight share; 4 sigma of the binomial.
    p = WEIGHTS["canary"] / sum(WEIGHTS.values())
    assert abs(served["canary"] - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    for v in report["variants"]:
        if v["drafted_tokens"]:
            low, high = v["acceptance_rate_ci95"]
            assert low <= v["acceptance_rate"] <= high
        if v["requests"] >= 2:
            low, high = v["tokens_per_second_ci95"]
            assert low <= v["tokens_per_second"] <= high
    by_name = {s.name: s for s in stats.variants}
    assert set(by_name) == set(WEIGHTS)
    for v in report["variants"]:
        s = by_name[v["name"]]
        assert s.requests >= v["requests"] and s.drafted_tokens >= v["drafted_tokens"]
        if s.drafted_tokens:
            assert s.acceptance_rate_low <= s.acceptance_rate <= s.acceptance_rate_high
            assert len(s.acceptance_per_position) >= 1


def test_variants_file_applied_live(observed):
    cluster, _ = observed
    cluster.variants_file.write_text(json.dumps({"variants": [
        {"name": "stable", "weight": 1, "addresses": [cluster.addresses["draft_a"]]},
        {"name": "candidate", "weight": 1, "addresses": [cluster.addresses["draft_b"]]},
    ]}))
    deadline = time.monotonic() + 20
    while True:
        report = canary_report(cluster)
        names = [v["name"] for v in report["variants"]]
        if names == ["stable", "candidate"]:
            break
        assert time.monotonic() < deadline, f"the file was not applied: {report}"
        time.sleep(0.2)
    removed = dict(variant="canary", finish_reason="length")
    canary_before = value(scrape(cluster.metrics_url("coordinator")), "specsplit_requests_total", **removed)
    # The new variant's replica may still be connecting: route until both have served.
    with Client(cluster.addresses["coordinator"], timeout=60) as client:
        seen = set()
        for i in range(60):
            seen.add(client.generate(f"after {i}", max_tokens=2, ignore_eos=True).draft_variant)
            if seen == {"stable", "candidate"}:
                break
    assert seen == {"stable", "candidate"}
    canary_after = value(scrape(cluster.metrics_url("coordinator")), "specsplit_requests_total", **removed)
    assert canary_after == canary_before  # the removed variant gets no new requests
    assert {v["name"]: v["weight"] for v in canary_report(cluster)["variants"]} == {"stable": 1, "candidate": 1}
