"""`specsplit canary compare`: which draft is better for a target, offline, on your prompts."""

import sys


def add_canary_commands(sub, add_model_args) -> None:
    canary = sub.add_parser("canary", help="compare draft models")
    canary_sub = canary.add_subparsers(dest="canary_command", required=True)
    c = canary_sub.add_parser(
        "compare", help="run the same prompts (greedy) through the target with each draft and write a report"
    )
    c.add_argument("--target", required=True, help="target MODEL")
    c.add_argument("--draft", action="append", required=True, help="a draft MODEL (repeat for each draft to compare)")
    c.add_argument("--prompts", required=True, help="FILE: one prompt per line, or .jsonl with a \"prompt\" field")
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    c.add_argument("--out", default="canary-report", help="folder for report.md, report.png and report.json")
    c.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    c.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    c.add_argument("--no-baseline", action="store_true", help="skip the target-alone run")
    add_model_args(c)
    c.set_defaults(handler=_run_compare)


def _run_compare(args) -> int:
    from specsplit.services.canary.compare import read_prompts, run_comparison
    from specsplit.services.canary.report import write_report

    prompts = read_prompts(args.prompts)
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompts}")
    comparison = run_comparison(
        args.target, args.draft, prompts, max_tokens=args.max_tokens, num_speculative_tokens=args.num_speculative_tokens,
        baseline=not args.no_baseline, dtype=args.dtype, device=args.device, chat=args.chat, ignore_eos=args.ignore_eos,
        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, prefix_caching=args.prefix_caching,
    )
    paths = write_report(comparison, args.out)
    sys.stdout.write(paths["markdown"].read_text(encoding="utf-8"))
    print(f"\nwrote {paths['markdown']}, {paths['plot']}, {paths['json']}", file=sys.stderr)
    return 0 if comparison.identical_outputs else 1
