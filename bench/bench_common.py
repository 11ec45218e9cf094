"""What every benchmark records beside its numbers, now in the product: specsplit/bench/records.py (used by
`specsplit bench` too). Kept for the scripts that import it from here; results go to bench/results unless $OUT is
set."""

from pathlib import Path

from specsplit.bench import records
from specsplit.bench.records import commit, machine, print_table  # noqa: F401

__all__ = ["RESULTS", "commit", "machine", "print_table", "write_results"]

RESULTS = Path(__file__).parent / "results"


def write_results(name: str, rows: list[dict], extra: dict | None = None) -> Path:
    return records.write_results(name, rows, extra, out_dir=RESULTS)
