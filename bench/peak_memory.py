"""Peak memory of a command and every process it starts, summed over the processes alive at each moment (`specsplit
serve` runs three): resident (RSS) and anonymous (RssAnon, what the processes allocated, without the pages of files
they read), sampled every 0.1 s from /proc. `/usr/bin/time -v` reports only the largest single process.

    python bench/peak_memory.py -- specsplit serve --chat --prompt "Write a Python function that checks whether a number is prime."
"""

import json
import subprocess
import sys
import time
from pathlib import Path


def process_status(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of one process, in bytes ({} once it is gone)."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields


def process_tree(root: int) -> list[int]:
    """`root` and every process under it, `root` first."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parent = int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(pid)
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def main() -> int:
    argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    start = time.monotonic()
    process = subprocess.Popen(argv)
    peak = {"VmRSS": 0, "RssAnon": 0}
    most_processes = 0
    while process.poll() is None:
        pids = process_tree(process.pid)
        most_processes = max(most_processes, len(pids))
        totals = {"VmRSS": 0, "RssAnon": 0}
        for pid in pids:
            for key, value in process_status(pid).items():
                totals[key] += value
        for key in peak:
            peak[key] = max(peak[key], totals[key])
        time.sleep(0.1)
    report = {"command": argv, "exit_code": process.returncode, "seconds": round(time.monotonic() - start, 1),
              "processes": most_processes, "peak_rss_gb": round(peak["VmRSS"] / 1e9, 2),
              "peak_anonymous_gb": round(peak["RssAnon"] / 1e9, 2)}
    print(json.dumps(report), file=sys.stderr)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
