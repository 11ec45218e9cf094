"""One-way latency of a tensor-parallel step command on the CPU: rank 0 (this process) sends step commands on the
replica's command channel (runtime/tensor_parallel_commands.py) to rank 1 (a child process), one every --gap-ms
milliseconds as a decoding replica would, each carrying its send time in its packed inputs; rank 1 notes when it
has the whole command. Both read CLOCK_MONOTONIC (time.perf_counter_ns on Linux), so the difference is the one-way
latency.

  gloo          a broadcast of the pickled command on a gloo group (SPECSPLIT_TP_COMMANDS=gloo, the former channel)
  socket        the Unix socket with binary step frames, follower blocking on it (what CPU replicas use)
  socket_poll   the same, follower polling for SPECSPLIT_TP_SPIN_SECONDS (0.02) before blocking (GPU replicas);
                on a loaded 2-core machine the poll competes with rank 0 for a core, so this one says little here

    python bench/bench_tp_command_channel.py [--commands 400] [--rounds 3] [--gap-ms 2]

Variants run interleaved, the order rotated each round; each round opens a fresh channel. The load average before
and after is recorded: on a shared machine compare the variants of one run, not the absolute numbers.
"""

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402

VARIANTS = {"gloo": ("gloo", False), "socket": ("socket", False), "socket_poll": ("socket", True)}
INPUT_INTS = 64  # a batch-1 verification's packed inputs are of this order


def _store(port: int, is_master: bool):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, 2, is_master, timeout=datetime.timedelta(seconds=60),
                         wait_for_workers=False)


def follower(pipe) -> None:
    """Rank 1: for each (kind, poll, port, count) from the pipe, join that channel and time `count` commands."""
    from specsplit.services.runtime.tensor_parallel_commands import open_command_channel

    while True:
        job = pipe.recv()
        if job is None:
            return
        kind, poll, port, count = job
        channel = open_command_channel(1, 2, _store(port, False), poll, kind)
        latencies = []
        for _ in range(count):
            command = channel.receive()
            arrived = time.perf_counter_ns()
            latencies.append((arrived - int(command[4][0])) / 1000.0)
        channel.close()
        pipe.send(latencies)


def measure(pipe, kind: str, poll: bool, count: int, gap_s: float) -> list[float]:
    from specsplit.services.runtime.tensor_parallel_commands import open_command_channel

    store = _store(0, True)
    pipe.send((kind, poll, store.port, count))
    channel = open_command_channel(0, 2, store, poll, kind)
    host = np.zeros(INPUT_INTS, dtype=np.int64)
    shape = ("bench", 1)
    for _ in range(count):
        time.sleep(gap_s)
        host[0] = time.perf_counter_ns()
        channel.send_step("verify", shape, 8, host, 8)
    latencies = pipe.recv()
    channel.close()
    return latencies[len(latencies) // 10:]  # the first commands pay the connection's warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--name", default="tp_command_channel_cpu")
    args = parser.parse_args()
    variants = args.variants.split(",")

    load_before = os.getloadavg()
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=follower, args=(theirs,), daemon=True)
    child.start()
    samples: dict[str, list[float]] = {v: [] for v in variants}
    per_round: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for round_index in range(args.rounds):
            order = variants[round_index % len(variants):] + variants[: round_index % len(variants)]
            for variant in order:
                kind, poll = VARIANTS[variant]
                got = measure(ours, kind, poll, args.commands, args.gap_ms / 1000.0)
                samples[variant] += got
                per_round[variant].append(round(statistics.median(got), 1))
    finally:
        ours.send(None)
        child.join(timeout=30)
    load_after = os.getloadavg()

    rows = []
    for variant in variants:
        values = sorted(samples[variant])
        rows.append(dict(channel=variant, commands=len(values),
                         median_us=round(statistics.median(values), 1),
                         p90_us=round(values[int(0.9 * (len(values) - 1))], 1),
                         round_medians_us=per_round[variant]))
    print_table(rows, ["channel", "commands", "median_us", "p90_us", "round_medians_us"])
    path = write_results(args.name, rows, {
        "what": "one-way latency of a step command (64 int64 inputs), rank 0 to rank 1, CPU processes",
        "gap_ms": args.gap_ms, "rounds": args.rounds,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
    })
    print(path)


if __name__ == "__main__":
    main()
