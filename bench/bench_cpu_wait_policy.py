"""How OpenMP threads should wait on the CPU: passive, bounded spins, active, and the default specsplit chooses
(services/runtime/cpu_wait_policy.py), side by side, on the machine as it is and on the machine loaded by a busy
process this script starts (`--load N`: N processes spinning in pure Python, as another job would).

Workloads, each in fresh processes per policy (libgomp reads the policy once, at load):
- probe: the decoder-shaped steps the default is chosen by (services/runtime/wait_probe.py), in one process ("one":
  `generate --local`, a lone worker) and in two taking turns ("turns": `serve`'s draft and target); seconds per step;
- generate (with --target/--draft): `specsplit generate --local` and `specsplit serve --prompt` on one prompt, greedy,
  `--tokens` new tokens, k = 4; tokens per second from the request's own timing (model loading excluded).
Policies take turns within each repeat (a load that comes and goes weighs on all alike); medians over `--repeats`.
Every figure is labelled with the machine (`lscpu` model name) and the load average before and after it.

    python bench/bench_cpu_wait_policy.py [--repeats 3] [--load 1] [--states quiet,loaded]
        [--target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --tokens 96] [--policies spin:10000,active]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.services.runtime import cpu_wait_policy as wait  # noqa: E402 (imports no torch)
from specsplit.services.runtime.machine import cpu_model  # noqa: E402

POLICIES = wait.CANDIDATES
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return cpu_model()


class Load:
    """`n` processes spinning in pure Python, the busy job of a loaded machine."""

    def __init__(self, n: int):
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        time.sleep(1.0)

    def close(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            p.wait(timeout=10)


def generate(policy: str, how: str, args) -> float:
    """Tokens per second of one request (`how`: local or serve), its own timing."""
    common = ["--target", args.target, "--draft", args.draft, "-k", "4", "--prompt", PROMPT, "--max-tokens",
              str(args.tokens), "--ignore-eos", "--json"]
    argv = ["generate", "--local", *common] if how == "local" else ["serve", "--port", "0", "--metrics-port", "-1",
                                                                   *common]
    out = subprocess.run([sys.executable, "-m", "specsplit", *argv], env=wait.environment_for(policy), capture_output=True,
                         text=True, timeout=3600, check=True).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    return len(result["token_ids"]) / result["timings"]["total_s"]


def chosen(layout: str) -> wait.WaitChoice:
    """What the specsplit command would choose now for this layout (measuring, and caching, if it never did)."""
    argv = ["serve"] if layout == "turns" else ["generate", "--local"]
    return wait.decide(argv, wait.without_wait_choice(os.environ))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--load", type=int, default=1, help="busy processes of the loaded state")
    parser.add_argument("--states", default="quiet,loaded")
    parser.add_argument("--target", default=None, help="also time generate --local and serve with this pair")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="the candidates to time (the default's own among them, to compare it with others)")
    parser.add_argument("--name", default="cpu_wait_policy")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    rows, machine = [], lscpu_model()
    for state in args.states.split(","):
        load = Load(args.load) if state == "loaded" else None
        try:
            defaults = {layout: chosen(layout) for layout in ("one", "turns")}
            cells = [("probe", layout) for layout in ("one", "turns")]
            if args.target:
                cells += [("generate", "local"), ("generate", "serve")]
            for workload, layout in cells:
                default = defaults["turns" if layout in ("turns", "serve") else "one"]
                samples: dict[str, list[float]] = {p: [] for p in policies}
                load_before = os.getloadavg()[0]
                for _ in range(args.repeats):
                    for policy in policies:
                        if workload == "probe":
                            samples[policy].append(wait.probe_seconds(policy, layout, args.steps, timeout=600))
                        else:
                            samples[policy].append(generate(policy, layout, args))
                load_after = os.getloadavg()[0]
                medians = {p: statistics.median(v) for p, v in samples.items()}
                unit = "s_per_step" if workload == "probe" else "tokens_per_s"
                best = min(medians.values()) if workload == "probe" else max(medians.values())
                for policy, value in medians.items():
                    speed = best / value if workload == "probe" else value / best
                    rows.append({"state": state, "workload": workload, "layout": layout, "policy": policy,
                                 "default": policy == default.policy, "default_reason": default.reason,
                                 unit: value, "share_of_best": speed,
                                 "samples": samples[policy], "machine": machine, "load_avg_before": load_before,
                                 "load_avg_after": load_after,
                                 "busy_processes_started": args.load if state == "loaded" else 0})
                print_table([r for r in rows if r["state"] == state and r["workload"] == workload
                             and r["layout"] == layout],
                            ["state", "workload", "layout", "policy", "default", unit, "share_of_best",
                             "load_avg_before"])
        finally:
            if load is not None:
                load.close()
    write_results(args.name, rows, {"machine_lscpu": machine, "cores": os.cpu_count(),
                                    "policies": policies, "command": " ".join(sys.argv),
                                    "note": "quiet = the machine as it was (see each row's load average): on a shared "
                                            "machine other jobs may have run; loaded = plus --load busy processes"})


if __name__ == "__main__":
    main()
