"""`specsplit bench serve | latency | throughput`: the command line of the benchmark harness.

    specsplit bench serve --url http://127.0.0.1:8000/v1 --workload random --input-len 128 --output-len 128 \
        --num-prompts 200 --request-rate 1,4,inf --max-concurrency 32 --json result.json --plot result.png
    specsplit bench serve --grpc 127.0.0.1:50051 --workload humaneval --num-prompts 164
    specsplit bench latency --target MODEL --draft MODEL --batch-size 1 --output-len 128
    specsplit bench throughput --target MODEL --draft MODEL --num-prompts 64

Exit status: 0 when every run completed; 1 when the server went away mid-run (what was measured until then is
printed and written) or nothing completed; 2 for a workload that cannot be read.
"""

import asyncio
import math
import os
import sys

from specsplit.bench.workloads import WORKLOADS, WorkloadError


def add_bench_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark a running server (serve) or an engine in this process "
                           "(latency, throughput): TTFT / TPOT / ITL percentiles, throughput, acceptance")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    s = bench_sub.add_parser("serve", help="send a workload to a running OpenAI-compatible server (--url) or to "
                             "this project's gRPC API (--grpc) and measure it as its users would")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an OpenAI-compatible server's base URL (http://HOST:PORT or .../v1): this one "
                       "or any other engine, to compare side by side")
    where.add_argument("--grpc", metavar="HOST:PORT", help="this project's coordinator, over its gRPC API")
    s.add_argument("--model", default=None, help="--url: the model to ask for (default: the first /v1/models lists)")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="--url: bearer token ($OPENAI_API_KEY)")
    s.add_argument("--token", default=os.environ.get("SPECSPLIT_TOKEN"), help="--grpc: bearer token ($SPECSPLIT_TOKEN)")
    s.add_argument("--tls-ca", default=None, help="--grpc: verify the coordinator's TLS certificate with this CA")
    s.add_argument("--tls-cert", default=None, help="--grpc: client certificate for mutual TLS")
    s.add_argument("--tls-key", default=None, help="--grpc: its private key")
    s.add_argument("--tls-server-name", default=None, help="--grpc: name to verify in the coordinator's certificate")
    _add_workload_args(s, default_prompts=100)
    s.add_argument("--request-rate", default="inf", metavar="RATE[,RATE...]",
                   help="requests per second, Poisson arrivals; inf = all at once (default). Several rates: one run "
                   "each, and --plot draws the latencies against the rate")
    s.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    s.add_argument("--num-warmups", type=int, default=1, help="requests sent first and not measured")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds a request may go without a byte (HTTP) or "
                   "a stream message (gRPC); not a bound on the whole request")
    _add_output_args(s, plot=True)
    s.set_defaults(handler=_run_serve_bench)

    latency = bench_sub.add_parser("latency", help="target alone against speculation in this process: latency of "
                                   "a batch of requests, repeated")
    _add_engine_args(latency)
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--batch-size", type=int, default=1)
    latency.add_argument("--num-iters", type=int, default=3)
    latency.add_argument("--num-iters-warmup", type=int, default=1)
    latency.add_argument("--workload", default="random", help="random (default), humaneval or a JSONL file")
    latency.add_argument("--tokenizer", default=None, help="random workload: whose vocabulary (default: --target)")
    latency.add_argument("--seed", type=int, default=0)
    latency.add_argument("--temperature", type=float, default=0.0)
    _add_output_args(latency, plot=False)
    latency.set_defaults(handler=_run_latency)

    throughput = bench_sub.add_parser("throughput", help="target alone against speculation in this process: many "
                                      "requests at once")
    _add_engine_args(throughput)
    _add_workload_args(throughput, default_prompts=64)
    throughput.add_argument("--max-concurrency", type=int, default=None)
    throughput.add_argument("--num-warmups", type=int, default=1)
    _add_output_args(throughput, plot=False)
    throughput.set_defaults(handler=_run_throughput)


def _add_workload_args(p, default_prompts: int) -> None:
    p.add_argument("--workload", default="random",
                   help=f"{' | '.join(WORKLOADS)} | FILE.jsonl (one {{\"prompt\"}} or {{\"messages\"}} per line)")
    p.add_argument("--tokenizer", default=None, help="random workload: the MODEL whose vocabulary prompts are drawn "
                   "from (default: the model the server or --target names)")
    p.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=default_prompts)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="for the random workload and the arrival times")


def _add_output_args(p, plot: bool) -> None:
    p.add_argument("--json", default=None, metavar="FILE", help="write every number, the command, commit and machine")
    if plot:
        p.add_argument("--plot", default=None, metavar="FILE.png", help="latency percentiles (against the request "
                       "rate when several are given)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _add_engine_args(p) -> None:
    from specsplit.services.service_commands import add_speculation_arg, add_weight_format_args

    p.add_argument("--target", required=True, help="target MODEL: a built-in name, a Hugging Face folder or a GGUF file")
    p.add_argument("--draft", required=True, help="draft MODEL")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    add_weight_format_args(p)
    add_speculation_arg(p)


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part == "inf" else float(part)
        if not rate > 0:
            raise SystemExit(f"specsplit bench: --request-rate {part}: must be > 0 or inf")
        rates.append(rate)
    return rates


# ---- bench serve -------------------------------------------------------------------------------------------------


def _run_serve_bench(args) -> int:
    rates = parse_rates(args.request_rate)
    try:
        return asyncio.run(_serve_bench(args, rates))
    except WorkloadError as error:
        print(f"specsplit bench: error: {error}", file=sys.stderr)
        return 2


async def _serve_bench(args, rates: list[float]) -> int:
    from specsplit.bench.load_generator import run_load, warm_up
    from specsplit.bench.request_record import ServerGone
    from specsplit.bench.workloads import load_workload

    if args.url:
        from specsplit.bench.http_client import OpenAIHTTPClient

        client = OpenAIHTTPClient(args.url, args.model, args.api_key, args.temperature, args.timeout)
    else:
        from specsplit.bench.grpc_client import GrpcClient
        from specsplit.services.rpc.security import ChannelSecurity

        security = ChannelSecurity(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        client = GrpcClient(args.grpc, args.token, args.temperature, args.timeout, security)
    try:
        await client.start()
    except ServerGone as error:
        print(f"specsplit bench: error: cannot reach the server: {error}", file=sys.stderr)
        return 1
    try:
        tokenizer = _tokenizer_for(args, getattr(client, "model", None))
        requests = load_workload(args.workload, args.num_prompts, args.input_len, args.output_len, args.seed, tokenizer)
        try:
            await warm_up(client, requests[: args.num_warmups])
        except ServerGone as error:
            print(f"specsplit bench: error: the server went away during the warm-up: {error}", file=sys.stderr)
            return 1
        runs = []
        for rate in rates:
            label = f"rate {rate:g} req/s" if len(rates) > 1 else None
            runs.append(await run_load(client, requests, rate, args.max_concurrency, args.seed, args.progress, label))
            if runs[-1].interrupted:
                break
    finally:
        await client.close()
    config = {"backend": "openai-http" if args.url else "grpc", "server": args.url or args.grpc,
              "model": getattr(client, "model", None), "workload": args.workload, "input_len": args.input_len,
              "output_len": args.output_len, "num_prompts": args.num_prompts, "request_rates": args.request_rate,
              "max_concurrency": args.max_concurrency, "temperature": args.temperature, "seed": args.seed}
    return _report_runs(args, runs, config)


def _tokenizer_for(args, served_model: str | None):
    if args.workload != "random":
        return None
    source = args.tokenizer or getattr(args, "target", None) or served_model
    if not source:
        raise WorkloadError("the random workload draws token ids from a vocabulary: give --tokenizer MODEL")
    from specsplit.services.coordinator.process import load_tokenizer
    from specsplit.services.errors import SpecsplitError

    try:
        return load_tokenizer(source)
    except (OSError, ValueError, SpecsplitError) as error:
        raise WorkloadError(f"no tokenizer for {source!r} here ({error}); give --tokenizer MODEL") from None


def _report_runs(args, runs: list, config: dict) -> int:
    from specsplit.bench.records import result_record, write_json
    from specsplit.bench.report import print_side_by_side, print_summary
    from specsplit.bench.summary import summarize

    summaries = [summarize(run) for run in runs]
    for summary in summaries:
        print_summary(summary, "Serving Benchmark Result")
    if len(summaries) > 1:
        print_side_by_side({f"rate {s['request_rate']}": s for s in summaries})
    if args.json:
        body = {**config, **(summaries[0] if len(summaries) == 1 else {}), "runs": summaries}
        print(f"wrote {write_json(args.json, result_record('serve', body))}", file=sys.stderr)
    if args.plot:
        from specsplit.bench.plot import plot_runs
        from specsplit.bench.summary import latency_samples

        plot_runs(args.plot, summaries, [latency_samples(run) for run in runs], title=f"{config['server']}")
        print(f"wrote {args.plot}", file=sys.stderr)
    interrupted = next((s["interrupted"] for s in summaries if s["interrupted"]), None)
    if interrupted:
        print(f"specsplit bench: error: the run ended early, the server went away: {interrupted}", file=sys.stderr)
        return 1
    if not any(s["completed"] for s in summaries):
        print("specsplit bench: error: no request completed", file=sys.stderr)
        return 1
    return 0


# ---- bench latency / throughput ----------------------------------------------------------------------------------


def _run_latency(args) -> int:
    return _run_in_process(args, "latency")


def _run_throughput(args) -> int:
    return _run_in_process(args, "throughput")


def _run_in_process(args, kind: str) -> int:
    from specsplit.bench import in_process
    from specsplit.bench.records import result_record, write_json
    from specsplit.bench.report import print_side_by_side
    from specsplit.bench.workloads import load_workload

    try:
        count = args.batch_size if kind == "latency" else args.num_prompts
        tokenizer = _tokenizer_for(args, None)
        requests = load_workload(args.workload, count, args.input_len, args.output_len, args.seed, tokenizer)
    except WorkloadError as error:
        print(f"specsplit bench: error: {error}", file=sys.stderr)
        return 2
    engine = in_process.build_engine(args)

    async def measure():
        try:
            if kind == "latency":
                return await in_process.measure_latency(engine, requests, args.batch_size, args.num_iters,
                                                        args.num_iters_warmup, args.temperature, args.progress)
            return await in_process.measure_throughput(engine, requests, args.max_concurrency, args.num_warmups,
                                                       args.temperature, args.progress)
        finally:
            await engine.close()

    result = asyncio.run(measure())
    print_side_by_side({mode: result[mode] for mode in in_process.MODES})
    speedup = result["speedup"]
    print("speculative / target-only: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedup.items() if v is not None))
    if args.json:
        config = {"target": args.target, "draft": args.draft, "num_speculative_tokens": args.num_speculative_tokens,
                  "speculation": args.speculation, "workload": args.workload, "input_len": args.input_len,
                  "output_len": args.output_len, "dtype": args.dtype, "device": args.device}
        config.update({"batch_size": args.batch_size, "num_iters": args.num_iters} if kind == "latency" else
                      {"num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency})
        print(f"wrote {write_json(args.json, result_record(kind, {**config, **result}))}", file=sys.stderr)
    return 0
