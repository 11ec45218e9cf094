"""The `specsplit` command: run the services, generate text, prepare models."""

import argparse
import asyncio
import json
import logging
import sys

# Before torch loads OpenMP: whether its threads spin or sleep between parallel regions, by the machine's load and
# the command's process layout, measured once per machine (services/runtime/cpu_wait_policy.py; it imports no torch).
# OMP_WAIT_POLICY or GOMP_SPINCOUNT set by hand are kept.
from specsplit.services.runtime.cpu_wait_policy import choose_for_command  # noqa: E402

choose_for_command(sys.argv[1:])

from specsplit.services.sampling_params import SamplingParams  # noqa: E402


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="prompt text (raw completion unless --chat)")
    p.add_argument("--prompt-ids", help="prompt as comma-separated token ids instead of text")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--system", default=None, help="with --chat: a system message before the conversation")
    p.add_argument("--messages", default=None, metavar="FILE.json",
                   help='with --chat: the conversation so far, a JSON list of {"role": "system"|"user"|"assistant", '
                   '"content": TEXT}; --prompt, if given, is added as the last user message')
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens to generate (default: until end of sequence, bounded by the model's context)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="return the chosen token's logprob and top-N others")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="the most proposals per round, each round's k picked by the speculation policy (exactly this "
                   "many with --speculation fixed); 0 = target only")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: 1 GiB worth)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="run every prompt in full instead of reusing the KV of earlier prompts' identical leading blocks")


def sampling_params_from_args(args) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=list(args.stop),
        stop_token_ids=list(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        num_speculative_tokens=args.num_speculative_tokens,
        speculation="fixed" if getattr(args, "speculation", None) == "fixed" else None,
        acceptance_method=getattr(args, "acceptance_method", None),
        posterior_threshold=getattr(args, "posterior_threshold", None),
        posterior_alpha=getattr(args, "posterior_alpha", None),
    )


def messages_from_args(args) -> list[dict] | None:
    """The conversation of `--chat --system/--messages` (then --prompt is its last user turn), None without them."""
    if not (getattr(args, "system", None) or getattr(args, "messages", None)):
        return None
    if not args.chat:
        raise SystemExit("--system and --messages need --chat")
    if args.prompt_ids:
        raise SystemExit("--messages and --system take text: give --prompt, not --prompt-ids")
    messages = []
    if args.messages:
        with open(args.messages) as f:
            loaded = json.load(f)
        if not isinstance(loaded, list) or not all(isinstance(m, dict) and set(m) >= {"role", "content"} for m in loaded):
            raise SystemExit(f"{args.messages}: expected a JSON list of {{\"role\", \"content\"}} objects")
        messages = [{"role": m["role"], "content": m["content"]} for m in loaded]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    if args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
    return messages


def prompt_from_args(args):
    if getattr(args, "messages_list", None):
        return None  # the conversation is the prompt
    if args.prompt_ids:
        return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    if args.prompt is None:
        raise SystemExit("give --prompt TEXT or --prompt-ids IDS")
    return args.prompt


def result_json(result) -> dict:
    stats = result.stats
    out = {
        "request_id": result.request_id,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens},
        "stats": {
            "rounds": stats.rounds,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "accepted_per_position": stats.accepted_per_position,
            "drafted_per_position": stats.drafted_per_position,
        },
        "timings": {"time_to_first_token_s": result.time_to_first_token, "total_s": result.total_time},
        "draft_variant": result.draft_variant,
        "acceptance_method": result.acceptance_method,  # "typical" is NOT lossless
    }
    if result.logprobs is not None:
        out["logprobs"] = [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]} for lp in result.logprobs
        ]
    return out


async def _generate_local(args) -> int:
    from specsplit.services.coordinator.coordinator import CoordinatorConfig
    from specsplit.services.draft.proposer_flags import ngram_options
    from specsplit.services.local_engine import LocalEngine
    from specsplit.services.target.acceptance_flags import acceptance_policy_from_args

    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else 4
    engine = LocalEngine(
        args.target, args.draft, num_speculative_tokens=k, dtype=args.dtype, device=args.device,
        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, prefix_caching=args.prefix_caching,
        target_weights=args.target_weights, draft_weights=args.draft_weights,
        target_tensor_parallel_size=args.target_tensor_parallel_size,
        draft_tensor_parallel_size=args.draft_tensor_parallel_size,
        acceptance=acceptance_policy_from_args(args), decode_ahead=args.decode_ahead, **ngram_options(args),
        coordinator_config=CoordinatorConfig(speculation=args.speculation, overlap=args.overlap,
                                             logprobs_while_speculating=args.logprobs_while_speculating),
    )
    params = sampling_params_from_args(args)
    if args.messages_list:
        from specsplit.services.coordinator.generation import GenerationRequest
        from specsplit.services.tokenization import encode_messages

        request = GenerationRequest(encode_messages(engine.tokenizer, args.messages_list), params)
    else:
        request = engine.request(prompt_from_args(args), params, chat=args.chat)
    result = None
    async for event in engine.coordinator.stream(request):
        if hasattr(event, "finish_reason"):
            result = event
        elif not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    await engine.close()
    print_result(args, result)
    return 0


def print_result(args, result) -> None:
    if args.json:
        print(json.dumps(result_json(result)))
    else:
        sys.stdout.write("\n")
        s = result.stats
        lossy = ", typical acceptance: NOT lossless" if result.acceptance_method == "typical" else ""
        print(
            f"[{result.finish_reason}] {result.completion_tokens} tokens, {s.rounds} rounds, "
            f"acceptance {s.acceptance_rate:.2f}{lossy}, {result.total_time:.2f}s",
            file=sys.stderr,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, in-process (--local) or through a coordinator (--server)")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run draft, target and coordinator in this process")
    where.add_argument("--server", metavar="HOST:PORT", help="a coordinator's address")
    gen.add_argument("--target", help="target MODEL (--local): a built-in name, a Hugging Face folder or a GGUF file")
    gen.add_argument("--draft", help="draft MODEL (--local)")
    gen.add_argument("--timeout", type=float, default=None, help="request deadline in seconds (--server)")
    gen.add_argument("--token", default=None, help="bearer token for the coordinator (--server; or $SPECSPLIT_TOKEN)")
    gen.add_argument("--tls-ca", default=None, help="verify the coordinator's TLS certificate with this CA (--server)")
    gen.add_argument("--tls-cert", default=None, help="client certificate for mutual TLS (--server)")
    gen.add_argument("--tls-key", default=None, help="its private key (--server)")
    gen.add_argument("--tls-server-name", default=None, help="name to verify in the coordinator's certificate (--server)")
    _add_sampling_args(gen)
    _add_model_args(gen)
    from specsplit.services.service_commands import (add_batch_invariant_arg, add_decode_ahead_arg,
                                                     add_logprobs_switch_arg, add_speculation_arg,
                                                     add_weight_format_args)
    from specsplit.services.target.acceptance_flags import add_acceptance_args

    add_weight_format_args(gen)
    from specsplit.services.service_commands import add_tensor_parallel_args

    add_tensor_parallel_args(gen)
    add_acceptance_args(gen, deployment=False)
    add_logprobs_switch_arg(gen)
    add_speculation_arg(gen)
    add_batch_invariant_arg(gen)  # --local
    add_decode_ahead_arg(gen)  # --local
    from specsplit.services.draft.proposer_flags import add_proposer_args

    add_proposer_args(gen)  # --local
    gen.set_defaults(handler=_cmd_generate)

    from specsplit.services.service_commands import add_service_commands

    add_service_commands(sub, _add_model_args, _add_sampling_args)
    try:
        from specsplit.services.models.commands import add_models_commands
    except ImportError:
        add_models_commands = None
    if add_models_commands is not None:
        add_models_commands(sub)
    from specsplit.services.canary.commands import add_canary_commands

    add_canary_commands(sub, _add_model_args)
    from specsplit.bench.commands import add_bench_commands

    add_bench_commands(sub)
    return parser


def _cmd_generate(args) -> int:
    args.messages_list = messages_from_args(args)
    if args.local:
        if not args.target:
            raise SystemExit("--local needs --target MODEL (and --draft MODEL or --proposer ngram to speculate)")
        if args.proposer == "ngram" and args.draft:
            raise SystemExit("specsplit: error: --proposer ngram uses no draft model; leave out --draft")
        return asyncio.run(_generate_local(args))
    from specsplit.client import generate_from_cli

    return generate_from_cli(args, sampling_params_from_args(args), prompt_from_args(args), print_result)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specsplit.services.errors import SpecsplitError

    if getattr(args, "batch_invariant", False):
        if getattr(args, "server", None):
            raise SystemExit("--batch-invariant is a setting of the models' processes (generate --local, serve, "
                             "target, draft), not of a client")
        from specsplit.kernels.dispatch import set_batch_invariant

        set_batch_invariant(True)
    try:
        return args.handler(args) or 0
    except SpecsplitError as error:
        print(f"specsplit: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
