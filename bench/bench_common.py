"""What every benchmark records beside its numbers: where it ran, on what commit, with what command."""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def commit() -> str:
    if os.environ.get("SPECSPLIT_COMMIT"):  # set it where the tree is a copy without its history (a GPU machine)
        return os.environ["SPECSPLIT_COMMIT"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, text=True).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=Path(__file__).parent, text=True).strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(name: str, rows: list[dict], extra: dict | None = None) -> Path:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "commit": commit(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
        "rows": rows,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=2))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)
