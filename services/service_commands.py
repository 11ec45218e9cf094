"""`specsplit target | draft | coordinator | serve`: run the services, each its own process."""

import asyncio
import os
import signal
import subprocess
import sys
import threading

from specsplit.services.coordinator.call_deadlines import add_call_deadline_args, deadline_settings_from_args
from specsplit.services.draft.proposer_flags import add_proposer_args, ngram_options, proposer_argv
from specsplit.services.models.weight_formats import DRAFT_ONLY_FORMATS, WEIGHT_FORMATS
from specsplit.services.runtime.batch_invariance import check_tensor_parallel_sizes
from specsplit.services.runtime.cpu_threads import add_threads_arg, apply_threads
from specsplit.services.runtime.cpu_wait_policy import WAIT_REASON_ENV
from specsplit.services.rpc.security import ChannelSecurity, add_server_tls_args, read_tokens, server_security_from_args
from specsplit.services.rpc.worker_credentials import WORKER_SECRET_ENV, load_worker_secret, new_worker_secret
from specsplit.services.target.acceptance_flags import acceptance_argv, acceptance_policy_from_args, add_acceptance_args
from specsplit.services.target.decode_ahead import DECODE_AHEAD_MODES


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_HTTP_PORT = 8000  # the coordinator's OpenAI-compatible HTTP API
DEFAULT_WARM_UP_K = 4  # workers capture the round graphs of up to this many proposals before serving (operator: WORKERS_WARM_UP_K)


def add_service_commands(sub, add_model_args, add_sampling_args) -> None:
    for role in ("target", "draft"):
        p = sub.add_parser(role, help=f"run a {role} worker (gRPC)")
        p.add_argument("--model", required=role == "target",
                       help="a built-in name, a Hugging Face folder or a GGUF file" + (" (not with --proposer ngram)" if role == "draft" else ""))
        p.add_argument("--host", default="0.0.0.0")
        p.add_argument("--port", type=int, default=50051, help="0 = any free port (printed)")
        p.add_argument("--round-port", type=int, default=0,
                       help="the round channel's port: the round's calls and prefills as frames over plain TCP (or TLS), "
                       "beside gRPC, which tells coordinators where it is (0 = any free port, -1 = none: over gRPC)")
        p.add_argument("--lease-seconds", type=float, default=600.0, help="free sequences idle this long")
        p.add_argument("--draft-support", type=int, default=32, help="top-K support of the draft's q")
        if role == "target":
            p.add_argument("--synthetic-acceptance", type=float, default=None, metavar="ALPHA",
                           help="BENCHMARK ONLY, NOT LOSSLESS: accept each proposal with probability ALPHA instead of "
                           "the rejection test (for random-weight models); never use when serving")
            add_acceptance_args(p)
            add_decode_ahead_arg(p)
        p.add_argument("--weights", default="auto",
                       choices=WEIGHT_FORMATS if role == "draft" else [f for f in WEIGHT_FORMATS if f not in DRAFT_ONLY_FORMATS],
                       help="how linear weights are held on the CPU: auto = the fastest of "
                       + ("dense, packed, int8 and bf16 (where the CPU has it)" if role == "draft" else "dense and packed float32")
                       + " for float32 on the CPU, measured once per machine and cached; dense elsewhere")
        p.add_argument("--layout-k", type=int, default=4, metavar="K",
                       help="the proposals per round an auto layout is measured for (0 = a target decoding alone)")
        add_threads_arg(p, role)
        p.add_argument("--warm-up-k", type=int, default=DEFAULT_WARM_UP_K, metavar="K",
                       help="on a GPU, capture the CUDA graphs of rounds with up to K proposals before listening "
                       "(a few seconds; 0 = capture each shape when it first comes up)")
        p.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="shard the model over this many GPUs, one process each (this one serves as rank 0); "
                       "on the CPU, processes joined by gloo. Must divide the model's attention heads")
        if role == "draft":
            add_proposer_args(p)
        else:
            colocated = p.add_argument_group(
                "co-located coordinator", "--coordinate runs the coordinator in this target's process: a round makes "
                "one hop (to the draft pool) instead of two. The flags below are the coordinator's")
            colocated.add_argument("--coordinate", action="store_true",
                                   help="also serve the public API (gRPC on --coordinator-port, OpenAI HTTP on "
                                   "--http-port) from a coordinator whose preferred target is this one")
            colocated.add_argument("--coordinator-port", type=int, default=50050,
                                   help="the co-located coordinator's public gRPC port (0 = any free port, printed)")
            colocated.add_argument("--coordinator-metrics-port", type=int, default=9091,
                                   help="the co-located coordinator's /metrics (0 = any, -1 = none); --metrics-port "
                                   "keeps the target's")
            colocated.add_argument("--target", default="", help="HOST:PORT[,...] of other target replicas to fail "
                                   "over to (this one is preferred while it is live)")
            add_coordinating_args(colocated)
        add_batch_invariant_arg(p)
        add_server_tls_args(p)
        add_worker_secret_args(p, worker=True)
        add_metrics_port_arg(p)
        add_model_args(p)
        p.set_defaults(handler=_run_worker, role=role)

    c = sub.add_parser("coordinator", help="run the coordinator (public gRPC API)")
    c.add_argument("--target", required=True, help="HOST:PORT[,HOST:PORT...] of target replicas")
    c.add_argument("--host", default="0.0.0.0")
    c.add_argument("--port", type=int, default=50051)
    add_coordinating_args(c)
    add_server_tls_args(c)
    add_worker_secret_args(c, worker=False)
    add_metrics_port_arg(c)
    add_threads_arg(c, "coordinator")
    c.set_defaults(handler=_run_coordinator)

    s = sub.add_parser(
        "serve",
        help="run target, draft and coordinator on this machine, one process each; with --prompt, send one "
        "request through them, print it and stop",
    )
    s.add_argument("--target", default=DEFAULT_TARGET, help=f"target MODEL (default {DEFAULT_TARGET})")
    s.add_argument("--draft", default=None, help=f"draft MODEL (default {DEFAULT_DRAFT}; 'none' = target-only; "
                   "not with --proposer ngram)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051, help="the coordinator's port (0 = any)")
    s.add_argument("--metrics-port", type=int, default=9090,
                   help="the coordinator's metrics port (0 = any, -1 = none); the workers' are chosen free and printed")
    add_metrics_host_arg(s)
    s.add_argument("--http-port", type=int, default=None,
                   help=f"the coordinator's OpenAI-compatible HTTP API (default {DEFAULT_HTTP_PORT}; none with --prompt; "
                   "0 = any, -1 = none)")
    add_sampling_args(s)
    add_model_args(s)
    add_weight_format_args(s)
    add_tensor_parallel_args(s)
    add_speculation_arg(s)
    add_acceptance_args(s)
    add_logprobs_switch_arg(s)
    add_batch_invariant_arg(s)
    add_decode_ahead_arg(s)
    for role in ("target", "draft", "coordinator"):
        s.add_argument(f"--{role}-threads", type=int, default=0, metavar="N",
                       help=f"intra-op CPU threads of the {role} process (0 = "
                       + ("1" if role == "coordinator" else "all cores: draft and target take turns within a round") + ")")
    add_proposer_args(s)
    s.set_defaults(handler=_run_serve)


def add_coordinating_args(c) -> None:
    """What a coordinator is told, wherever it runs (`coordinator`, or `target --coordinate`)."""
    c.add_argument("--draft", default="", help="HOST:PORT[,...] of draft replicas (one variant named 'default')")
    c.add_argument("--draft-variant", action="append", default=[], metavar="NAME:WEIGHT:HOST:PORT[,...]",
                   help="a named draft variant with its routing weight (repeatable; canaries)")
    c.add_argument("--draft-variants-file", default=None, metavar="PATH",
                   help='JSON {"variants": [{"name", "weight", "addresses"}]}, re-read when it changes (instead of --draft)')
    c.add_argument("--tokenizer", default=None, help="MODEL whose tokenizer to use (default: the target's)")
    c.add_argument("--num-speculative-tokens", "-k", type=int, default=4,
                   help="the most proposals per round (adaptive), or exactly this many (fixed); 0 = target only")
    add_speculation_arg(c)
    c.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoding at once (at least 1)")
    c.add_argument("--max-waiting", type=int, default=1024,
                   help="admitted requests waiting for a place; past that RESOURCE_EXHAUSTED (HTTP 429). 0: every "
                   "new request is refused (a coordinator being drained)")
    c.add_argument("--arrival-window-ms", type=float, default=0.0,
                   help="an idle coordinator's first prefill waits up to this long for more requests while they keep "
                   "arriving (each within an eighth of it of the last), so a burst is prefilled in one step; costs a "
                   "lone request an eighth of it in time to first token (4: 0.5 ms). 0 (default) = prefill at once")
    c.add_argument("--disable-speculation-batch-size", type=int, default=0)
    c.add_argument("--replica-recovery-seconds", type=float, default=30.0,
                   help="how long a request waits for a target replica to come back before UNAVAILABLE")
    add_call_deadline_args(c)
    add_logprobs_switch_arg(c)
    c.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) "
                   "on this port, with the gRPC API's TLS and bearer tokens; 0 = any free port (printed), -1 = none")
    c.add_argument("--auth-token-file", help="require `authorization: Bearer TOKEN` with a token from this file")
    c.add_argument("--worker-tls-ca", help="dial workers over TLS, verifying them with this CA")
    c.add_argument("--worker-tls-cert", help="client certificate for workers that require mutual TLS")
    c.add_argument("--worker-tls-key", help="its private key")
    c.add_argument("--worker-tls-server-name", help="name to verify in workers' certificates (default: the address's host)")
    c.add_argument("--worker-transport", default="channel", choices=["channel", "stream", "unary"],
                   help="how the round's calls reach workers: channel (default: the worker's round channel, frames over "
                   "TCP or TLS, where it has one; else a gRPC stream), stream (one long-lived gRPC stream), unary")
    c.add_argument("--spin-wait", default="auto", choices=["auto", "on", "off"],
                   help="keep the coordinator's loop turning while a round's answer is awaited (no wake-up delay; "
                   "costs a core while waiting). auto: on where this process has at least four cores")


def add_speculation_arg(p) -> None:
    """For commands that run a coordinator (coordinator, serve, generate --local; generate --server: the request's)."""
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive (default): each round proposes the k (0 to --num-speculative-tokens) that the "
                   "measured acceptance and costs say is fastest, so speculation never loses to plain decoding; "
                   "fixed: always --num-speculative-tokens (benchmarks; with generate --server, this request only)")
    add_overlap_arg(p)


def add_overlap_arg(p) -> None:
    """For commands that run a coordinator (coordinator, serve, generate --local)."""
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="overlapped rounds: the draft proposes the next round from the optimistic continuation while "
                   "the target verifies (output unchanged). auto (default): where the measured costs and acceptance "
                   "say it pays (never for in-process workers or workers sharing a device); on: always; off: never")


def add_weight_format_args(p) -> None:
    """For commands that load both models (serve, generate --local)."""
    p.add_argument("--target-weights", default="auto", choices=[f for f in WEIGHT_FORMATS if f not in DRAFT_ONLY_FORMATS],
                   help="the target's weight format (auto: dense or packed float32, whichever this CPU runs the "
                   "target's rows faster; measured once and cached, see `specsplit models list`)")
    p.add_argument("--draft-weights", default="auto", choices=WEIGHT_FORMATS,
                   help="the draft's weight format (auto: the fastest of dense, packed, int8 and bf16 where the CPU "
                   "has it, measured once and cached)")


def add_tensor_parallel_args(p) -> None:
    """For commands that run both models (serve, generate --local): each side's tensor-parallel degree."""
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the target over N GPUs (processes; gloo on the CPU)")
    p.add_argument("--draft-tensor-parallel-size", type=int, default=1, metavar="M",
                   help="shard the draft over M GPUs (usually 1: a small draft gains little from sharding)")


def add_decode_ahead_arg(p) -> None:
    """`--decode-ahead` (target, serve, generate --local): the target's plain decodes run their next step ahead."""
    p.add_argument("--decode-ahead", choices=DECODE_AHEAD_MODES, default="auto",
                   help="the target runs a plain decode's next step (a sequence with no proposals) as soon as it "
                   "answers, while the reply travels and the coordinator commits; the next call takes its result. "
                   "Same tokens either way. auto = on a GPU (on the CPU the step runs before the reply: no gain)")


def add_batch_invariant_arg(p) -> None:
    """`--batch-invariant` (serve, target, draft, generate --local): applied for the whole process by cli.main."""
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels: a sequence's every result is bit for bit the same whatever else is "
                   "batched with it, so greedy speculative output equals the target alone's exactly, in bf16 too "
                   "(slower matmuls; needs tensor-parallel size 1 and dense weights)")


def batch_invariant_argv(args) -> list[str]:
    """What `serve` hands its workers: the flag, once the sizes it cannot serve are refused (cli.main has switched
    the mode on for this process already; the workers inherit it through the environment too, the flag keeps it
    visible in their command lines)."""
    if not args.batch_invariant:
        return []
    check_tensor_parallel_sizes({"target": args.target_tensor_parallel_size, "draft": args.draft_tensor_parallel_size})
    return ["--batch-invariant"]


def add_logprobs_switch_arg(p) -> None:
    """For commands that run a coordinator (coordinator, serve, generate --local)."""
    p.add_argument("--no-logprobs-while-speculating", dest="logprobs_while_speculating", action="store_false",
                   help="never compute logprobs in speculative rounds: a request asking for logprobs is refused with "
                   "INVALID_ARGUMENT unless it turns speculation off (num_speculative_tokens 0), which gets them from "
                   "the target alone")


def add_worker_secret_args(p, worker: bool) -> None:
    """The workers' shared secret (services/rpc/worker_credentials.py); never a value on the command line."""
    p.add_argument("--worker-secret-file", default=None, metavar="PATH",
                   help=("require this shared secret on every call (default: $SPECSPLIT_WORKER_SECRET; with neither, "
                         "nor --tls-client-ca, the worker listens on 127.0.0.1 only)") if worker else
                   "send this shared secret on every worker call (default: $SPECSPLIT_WORKER_SECRET)")
    if worker:
        p.add_argument("--allow-unauthenticated", action="store_true",
                       help="listen on --host without a secret or mutual TLS (only on a network that is itself private)")


def add_metrics_port_arg(p) -> None:
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus /metrics (and the coordinator's /v1/canary) on this port; 0 = any free port "
                   "(printed), -1 = none")
    add_metrics_host_arg(p)


def add_metrics_host_arg(p) -> None:
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the metrics port (plain HTTP, no authentication: loopback by default; 0.0.0.0 "
                   "where a scraper must reach it, behind a NetworkPolicy as the Helm chart sets it)")


def parse_draft_variants(args) -> list[tuple[str, float, list[str]]]:
    variants = []
    if args.draft:
        variants.append(("default", 1.0, [a for a in args.draft.split(",") if a]))
    for spec in args.draft_variant:
        name, weight, addresses = spec.split(":", 2)
        variants.append((name, float(weight), [a for a in addresses.split(",") if a]))
    return variants


def _run_worker(args) -> int:
    from specsplit.services.rpc.worker_process import serve_worker

    print(f"specsplit {args.role} uses {apply_threads(args.role, args.threads)} CPU threads", flush=True)
    print(f"specsplit {args.role} OpenMP threads wait: {os.environ.get(WAIT_REASON_ENV, 'as set')}", flush=True)
    options = dict(dtype=args.dtype, device=args.device, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                   weight_format=args.weights, prefix_caching=args.prefix_caching, warm_up_k=args.warm_up_k,
                   layout_k=args.layout_k, tensor_parallel_size=args.tensor_parallel_size)
    if args.role == "draft":
        options["draft_support"] = args.draft_support
        options.update(ngram_options(args))
        if args.proposer == "ngram" and args.model:
            raise SystemExit("specsplit: error: --proposer ngram uses no model; leave out --model")
        if args.proposer == "model" and not args.model:
            raise SystemExit("specsplit: error: the draft needs --model MODEL (or --proposer ngram)")
    else:
        options["acceptance"] = acceptance_policy_from_args(args)
        options["decode_ahead"] = args.decode_ahead
        if args.synthetic_acceptance is not None:
            options["synthetic_acceptance"] = args.synthetic_acceptance
    worker = dict(lease_seconds=args.lease_seconds, metrics_port=args.metrics_port, round_port=args.round_port,
                  security=server_security_from_args(args),
                  secret=load_worker_secret(args.worker_secret_file), allow_unauthenticated=args.allow_unauthenticated,
                  metrics_host=args.metrics_host, **options)
    if args.role == "target" and args.coordinate:
        from specsplit.services.coordinator.colocated import serve_colocated

        if args.draft_variants_file and (args.draft or args.draft_variant):
            raise SystemExit("give either --draft/--draft-variant or --draft-variants-file, not both")
        coordinator = _coordinator_options(args)
        coordinator.update(metrics_port=args.coordinator_metrics_port, security=worker["security"])
        asyncio.run(serve_colocated(args.model, args.host, args.port, args.coordinator_port,
                                    [a for a in args.target.split(",") if a], parse_draft_variants(args), coordinator,
                                    **worker))
        return 0
    asyncio.run(serve_worker(args.role, args.model, args.host, args.port, **worker))
    return 0


def _coordinator_options(args) -> dict:
    """start_coordinator's options from a coordinator's flags (coordinator/process.py)."""
    from specsplit.services.coordinator.coordinator import CoordinatorConfig

    if args.arrival_window_ms < 0:
        raise SystemExit(f"specsplit: error: --arrival-window-ms must be >= 0, got {args.arrival_window_ms}")
    for flag, value, low in (("--max-num-seqs", args.max_num_seqs, 1), ("--max-waiting", args.max_waiting, 0)):
        if value < low:
            raise SystemExit(f"specsplit: error: {flag} must be >= {low}, got {value}")
    config = CoordinatorConfig(
        num_speculative_tokens=args.num_speculative_tokens,
        speculation=args.speculation,
        overlap=args.overlap,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        arrival_window_seconds=args.arrival_window_ms / 1e3,
        disable_speculation_batch_size=args.disable_speculation_batch_size,
        replica_recovery_seconds=args.replica_recovery_seconds,
        logprobs_while_speculating=args.logprobs_while_speculating,
        call_deadlines=deadline_settings_from_args(args),
    )
    worker_security = ChannelSecurity(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key, args.worker_tls_server_name,
                                      secret=load_worker_secret(args.worker_secret_file))
    return dict(tokenizer=args.tokenizer, config=config, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                draft_variants_file=args.draft_variants_file, worker_security=worker_security,
                auth_tokens=read_tokens(args.auth_token_file) if args.auth_token_file else None, http_port=args.http_port,
                worker_transport=args.worker_transport, spin_wait=args.spin_wait)


def _run_coordinator(args) -> int:
    from specsplit.services.coordinator.process import serve_coordinator

    print(f"specsplit coordinator uses {apply_threads('coordinator', args.threads)} CPU threads", flush=True)
    targets = [a for a in args.target.split(",") if a]
    if args.draft_variants_file and (args.draft or args.draft_variant):
        raise SystemExit("give either --draft/--draft-variant or --draft-variants-file, not both")
    asyncio.run(serve_coordinator(targets, parse_draft_variants(args), args.host, args.port,
                                  security=server_security_from_args(args), **_coordinator_options(args)))
    return 0


def address_after(process: subprocess.Popen, role: str) -> str:
    """Read a started service's output on to the line where `role` ("coordinator") says where it listens (a
    co-located target prints its own address first, then its coordinator's)."""
    for line in process.stdout:
        process.startup_lines.append(line.rstrip("\n"))
        if line.startswith(f"specsplit {role} listening on "):
            return line.strip().rsplit(" ", 1)[-1]
    raise RuntimeError(f"the process exited with {process.wait()} before its {role} listened")


def spawn_service(argv: list[str], env=None, stderr=None,
                  timeout: float | None = None) -> tuple[subprocess.Popen, str]:
    """Start `specsplit ARGV` and wait for its 'listening on HOST:PORT' line; returns (process, address). A start
    that has not listened after `timeout` seconds is stopped as stop_processes stops one (SIGTERM first, so a
    `serve` stops the services it started) and raises TimeoutError. -P: the child imports nothing from the working
    directory (run in a checkout, its kernels/ folder would shadow the `kernels` distribution transformers imports)."""
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "specsplit", *argv], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )
    process.startup_lines = []  # what it printed before listening (e.g. where its metrics are)
    timed_out = threading.Event()

    def give_up():
        timed_out.set()
        stop_processes([process])

    watchdog = threading.Timer(timeout, give_up) if timeout is not None else None
    if watchdog:
        watchdog.daemon = True
        watchdog.start()
    try:
        for line in process.stdout:
            process.startup_lines.append(line.rstrip("\n"))
            # Its own line, not a log line that mentions listening (those land here where stderr joins stdout).
            if line.startswith("specsplit ") and (" listening on " in line or " serving on " in line):
                return process, line.strip().rsplit(" ", 1)[-1]
    finally:
        if watchdog:
            watchdog.cancel()
    if timed_out.is_set():
        raise TimeoutError(f"`specsplit {' '.join(argv)}` not listening after {timeout:g}s")
    # Where its errors went into the pipe too, they are shown here or nowhere.
    output = "".join(f"\n{line}" for line in process.startup_lines[-30:]) if stderr == subprocess.STDOUT else ""
    raise RuntimeError(f"`specsplit {' '.join(argv)}` exited with {process.wait()} before listening{output}")


def printed(lines: list[str], marker: str, prefix: str = "specsplit") -> str | None:
    """The address or URL a started service printed: the last word of its first line that starts with `prefix` and
    holds `marker` (" metrics on ", " OpenAI API on "); None if no such line (yet)."""
    return next((line.rsplit(" ", 1)[-1] for line in lines if line.startswith(prefix) and marker in line), None)


def stop_processes(processes, timeout: float = 20.0) -> None:
    """SIGTERM each, in the order given; then wait up to `timeout` for each and SIGKILL one that has not exited."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run_serve(args) -> int:
    ngram = ngram_options(args)["proposer"] == "ngram"
    if ngram and args.draft not in (None, "none", ""):
        raise SystemExit("specsplit: error: --proposer ngram uses no draft model; leave out --draft")
    if args.draft is None and not ngram:
        args.draft = DEFAULT_DRAFT
    if args.draft in ("none", ""):
        args.draft = None
    speculating = bool(args.draft) or ngram
    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else 4
    model_flags = ["--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size)]
    # On a GPU the workers capture the graphs of rounds up to the coordinator's bound before serving, so no round
    # of a larger k (the policy climbs to it) waits for a capture mid-stream.
    model_flags += ["--warm-up-k", str(max(k, DEFAULT_WARM_UP_K))] + batch_invariant_argv(args)
    worker_metrics = ["--metrics-port", "0" if args.metrics_port >= 0 else "-1"]
    if args.num_kv_blocks:
        model_flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if not args.prefix_caching:
        model_flags += ["--no-prefix-caching"]
    acceptance_policy_from_args(args)  # refuse bad values before anything starts
    # The workers and the coordinator share a fresh secret, through the environment (not argv, which `ps` shows).
    env = {**os.environ, WORKER_SECRET_ENV: new_worker_secret()}
    processes = []
    try:
        drafting = f" and draft ({args.draft})" if args.draft else " and the n-gram proposer" if ngram else ""
        print(f"starting target ({args.target}){drafting} ...", file=sys.stderr)
        # An auto target layout is measured for the rows it runs: k+1 to verify, 1 to decode alone.
        target, target_addr = spawn_service(["target", "--model", args.target, "--host", "127.0.0.1", "--port", "0",
                                             "--weights", args.target_weights, "--layout-k", str(k if speculating else 0),
                                             "--threads", str(args.target_threads), *model_flags, *worker_metrics,
                                             *acceptance_argv(args), "--decode-ahead", args.decode_ahead,
                                             "--tensor-parallel-size", str(args.target_tensor_parallel_size)], env)
        processes.append(target)
        coordinator_argv = ["coordinator", "--target", target_addr, "--host", args.host, "--port", str(args.port),
                            "-k", str(k if speculating else 0), "--metrics-port", str(args.metrics_port),
                            "--metrics-host", args.metrics_host,
                            "--speculation", args.speculation, "--overlap", args.overlap,
                            "--threads", str(args.coordinator_threads), "--http-port", str(_serve_http_port(args))]
        if not args.logprobs_while_speculating:
            coordinator_argv.append("--no-logprobs-while-speculating")
        if args.draft:
            draft, draft_addr = spawn_service(["draft", "--model", args.draft, "--host", "127.0.0.1", "--port", "0",
                                               "--weights", args.draft_weights, "--layout-k", str(k),
                                               "--threads", str(args.draft_threads), *model_flags, *worker_metrics,
                                               "--tensor-parallel-size", str(args.draft_tensor_parallel_size)], env)
            processes.append(draft)
            coordinator_argv += ["--draft", draft_addr]
        elif ngram:
            draft, draft_addr = spawn_service(["draft", *proposer_argv(args), "--host", "127.0.0.1", "--port", "0",
                                               *worker_metrics], env)
            processes.append(draft)
            coordinator_argv += ["--draft", draft_addr]
        coordinator, address = spawn_service(coordinator_argv, env)
        processes.append(coordinator)
        print(f"specsplit serving on {address}", flush=True)
        for line in (line for p in processes[:-1] for line in p.startup_lines if " listening on " in line):
            print(line, file=sys.stderr)  # the workers (on loopback, requiring the secret)
        for line in (line for p in processes for line in p.startup_lines
                     if " metrics on " in line or " CPU threads" in line or " API on " in line
                     or " OpenMP threads wait: " in line):
            print(line, file=sys.stderr)
        if _one_shot(args):
            return _one_request(args, address)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while all(p.poll() is None for p in processes):
            try:
                processes[-1].wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_processes(reversed(processes), timeout=10)  # the coordinator first, while its workers still answer


def _serve_http_port(args) -> int:
    """The HTTP API serves by default, but not for the one request of `serve --prompt`."""
    if args.http_port is not None:
        return args.http_port
    return -1 if _one_shot(args) else DEFAULT_HTTP_PORT


def _one_shot(args) -> bool:
    return args.prompt is not None or bool(args.prompt_ids) or bool(args.messages)


def _one_request(args, address: str) -> int:
    """The quick start: one generation through the running services, streamed to the terminal."""
    from specsplit.cli import messages_from_args, print_result, prompt_from_args, sampling_params_from_args
    from specsplit.client import generate_from_cli

    args.server, args.timeout = address, None
    args.messages_list = messages_from_args(args)
    return generate_from_cli(args, sampling_params_from_args(args), prompt_from_args(args), print_result)
