"""The workload cpu_wait_policy.py times each OpenMP wait policy with, in a fresh process (the policy is read when
torch loads OpenMP): decoder-shaped steps (norms, a fused QKV, an output projection, a gated MLP; 4 layers, hidden 1024,
~200 MB of float32 weights, one row), so a step is a few hundred parallel regions and tens of milliseconds.

    python -m specsplit.services.runtime.wait_probe --layout one|turns [--steps N]

prints the median seconds per step ("one") or per round of two processes taking turns ("turns": this process and a
partner it starts, each running a step while the other waits on a pipe, as `serve`'s target and draft do).
"""

import argparse
import statistics
import subprocess
import sys
import time

HIDDEN, INTERMEDIATE, LAYERS = 1024, 2816, 4


def build():
    import torch

    torch.manual_seed(0)
    layers = [(torch.randn(3 * HIDDEN, HIDDEN) * 0.02, torch.randn(HIDDEN, HIDDEN) * 0.02,
               torch.randn(2 * INTERMEDIATE, HIDDEN) * 0.02, torch.randn(HIDDEN, INTERMEDIATE) * 0.02)
              for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN)

    def step():
        h = x
        with torch.no_grad():
            for qkv, out, gate_up, down in layers:
                normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
                h = h + (normed @ qkv.T)[:, :HIDDEN] @ out.T
                normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
                gate, up = (normed @ gate_up.T).chunk(2, dim=-1)
                h = h + (torch.nn.functional.silu(gate) * up) @ down.T
        return h

    return step


def serve_turns(step) -> None:
    """The partner: a step each time the parent says go, then done."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"r")
    stdout.flush()
    while stdin.read(1) == b"g":
        step()
        stdout.write(b"d")
        stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["one", "turns"], default="one")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--partner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    step = build()
    if args.partner:
        serve_turns(step)
        return
    partner = None
    if args.layout == "turns":
        partner = subprocess.Popen([sys.executable, "-P", "-m", __spec__.name, "--partner"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        assert partner.stdout.read(1) == b"r"
    samples = []
    try:
        for i in range(args.steps + 2):  # two untimed: first-call costs
            started = time.perf_counter()
            step()
            if partner is not None:
                partner.stdin.write(b"g")
                partner.stdin.flush()
                assert partner.stdout.read(1) == b"d"
            if i >= 2:
                samples.append(time.perf_counter() - started)
    finally:
        if partner is not None:
            partner.stdin.close()
            partner.wait(timeout=30)
    print(statistics.median(samples))


if __name__ == "__main__":
    main()
