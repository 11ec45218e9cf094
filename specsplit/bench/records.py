"""What every benchmark records beside its numbers: where it ran, on what commit, with what command, when; written
as one JSON file and printed as a table. Used by `specsplit bench` and the scripts under bench/ (bench_common.py)."""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

_SOURCE = Path(__file__).resolve().parent  # inside the checkout when installed editable: git finds the commit here


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    # 1, 5, 15 minutes when the record is written (the run's end): how much other work ran beside it.
    info["load_average"] = [round(load, 2) for load in os.getloadavg()]
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # torch only where the run loaded it: importing it costs a client-only run (bench serve) seconds for nothing.
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def commit() -> str:
    if os.environ.get("SPECSPLIT_COMMIT"):  # set it where the tree is a copy without its history (a GPU machine)
        return os.environ["SPECSPLIT_COMMIT"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=_SOURCE, text=True, stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_SOURCE, text=True,
                                        stderr=subprocess.DEVNULL).strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    return " ".join([Path(sys.executable).name] + sys.argv)


def result_record(name: str, body: dict) -> dict:
    """`body` under the benchmark's name, command, commit, machine and date (UTC)."""
    return {
        "benchmark": name,
        "command": command_line(),
        "commit": commit(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **body,
    }


def write_json(path: str | Path, record: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def write_results(name: str, rows: list[dict], extra: dict | None = None, out_dir: str | Path | None = None) -> Path:
    """`<out_dir>/<name>.json` ($OUT when set, else `out_dir`) with rows of results and `extra` beside them."""
    directory = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(out_dir or ".")
    return write_json(directory / f"{name}.json", result_record(name, {**(extra or {}), "rows": rows}))


def print_table(rows: list[dict], columns: list[str], file=None) -> None:
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns]  # no rows: the header alone
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=file)
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)), file=file)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)
