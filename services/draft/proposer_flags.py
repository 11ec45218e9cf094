"""`--proposer {model,ngram}` and the n-gram sizes, for every command that runs a draft (draft, serve, generate --local).

`model` (default) drafts with a model (`--model` / `--draft`); `ngram` proposes by prompt lookup (ngram_proposer.py):
no model, no device, lossless at any temperature.
"""

from specsplit.services.draft.ngram_proposer import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, check_ngram_range

PROPOSERS = ("model", "ngram")


def add_proposer_args(p) -> None:
    p.add_argument("--proposer", default="model", choices=PROPOSERS,
                   help="model (default): a draft model proposes; ngram: prompt lookup, proposing what followed the "
                   "latest earlier occurrence of the context's last n tokens (no draft model, no GPU; pays off when "
                   "the output repeats its prompt, e.g. code editing)")
    p.add_argument("--ngram-max", type=int, default=DEFAULT_NGRAM_MAX, metavar="N",
                   help=f"--proposer ngram: the longest tail to match (tried first; default {DEFAULT_NGRAM_MAX})")
    p.add_argument("--ngram-min", type=int, default=DEFAULT_NGRAM_MIN, metavar="N",
                   help=f"--proposer ngram: the shortest tail to match (default {DEFAULT_NGRAM_MIN})")


def ngram_options(args) -> dict:
    """{"proposer": ..., "ngram_max": ..., "ngram_min": ...} from the flags; refuses bad sizes before anything starts."""
    if args.proposer == "ngram":
        try:
            check_ngram_range(args.ngram_max, args.ngram_min)
        except ValueError as error:
            raise SystemExit(f"specsplit: error: {error}") from None
    return {"proposer": args.proposer, "ngram_max": args.ngram_max, "ngram_min": args.ngram_min}


def proposer_argv(args) -> list[str]:
    """The flags again, for a draft process `serve` starts."""
    return ["--proposer", args.proposer, "--ngram-max", str(args.ngram_max), "--ngram-min", str(args.ngram_min)]
