"""What switching a CPU target between its two float32 layouts at run time would cost and save: the time to convert
every linear weight dense -> packed and back (done layer by layer, as a switch would), against what one forward's
matmuls take in each layout at the row counts a speculating target runs (layout_calibration.MatmulTimer).

A speculating target holds one layout (services/models/layout_calibration.py picks it for its k+1-row
verifications); when the speculation policy settles on k = 0 (a draft that never helps), it runs one-row steps in
that layout. Switching to the one-row layout then pays once the steps' saving exceeds the conversion.

    python bench/bench_layout_switch_cost.py [--model qwen2.5-coder-1.5b-instruct] [--rows 1,2,5,16,64]
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.models.layout_calibration import MatmulTimer  # noqa: E402
from specsplit.services.models.loader import load_model  # noqa: E402
from specsplit.services.models.weight_formats import PackedLinear  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", default="1,2,5,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="layout_switch_cost_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "float32", "cpu")
    timer = MatmulTimer(loaded.model)
    rows = []
    for r in (int(x) for x in args.rows.split(",")):
        seconds = timer(("dense", "packed"), r)
        rows.append({"what": f"matmuls of one forward, {r} rows", "dense_ms": round(1e3 * seconds["dense"], 1),
                     "packed_ms": round(1e3 * seconds["packed"], 1)})
    linears = [m for m in loaded.model.modules() if isinstance(m, nn.Linear)]
    weights = sum(m.weight.numel() for m in linears)
    with torch.no_grad():
        started = time.perf_counter()
        packed = []
        for m in linears:  # one layer at a time: a switch holds one extra copy of one weight at most
            packed.append(PackedLinear(m))
            m.weight = None
        to_packed = time.perf_counter() - started
        started = time.perf_counter()
        for m, p in zip(linears, packed):
            m.weight = nn.Parameter(p.packed_weight.to_dense(), requires_grad=False)
        to_dense = time.perf_counter() - started
    rows.append({"what": f"convert {len(linears)} linears ({weights / 1e9:.2f} B weights)",
                 "dense_ms": round(1e3 * to_dense, 1), "packed_ms": round(1e3 * to_packed, 1)})
    print_table(rows, ["what", "dense_ms", "packed_ms"])
    print("(the last row: time to convert to that layout)")
    print(f"wrote {write_results(args.name, rows, {'model': args.model, 'threads': args.threads})}")


if __name__ == "__main__":
    main()
