"""What a round's two worker hops cost on the CPU, and where it goes: the same Propose and Verify calls (tiny
random-weight models, k = 4, greedy) made over loopback gRPC to real worker processes and in-process on the same
models, at batch 1, 8 and 32, for each transport (a unary call per round, or one long-lived bidirectional stream).

Per row (medians over the rounds):
  grpc_ms        propose + verify calls, measured at the caller, over gRPC to the worker processes
  local_ms       the same calls on in-process workers (the model work and the workers' own host work)
  hop_ms         grpc_ms - local_ms: what the two hops add per round
  protobuf_ms    of which: building, serialising, parsing and unpacking the four messages (both ends, measured alone)
  transport_ms   of which the rest: gRPC loopback, event-loop turns, the worker's hand-off to its compute thread

    python bench/bench_round_hops_cpu.py [--batches 1,8,32] [--rounds 40] [--transports unary,stream,channel] [--name NAME]

Every process runs torch on one thread (the machine's cores are shared by the caller and both workers).

On a shared, loaded machine the difference of two noisy compute-bound timings is noise, so the hop is also measured
alone (`--null`, the default rows): the same calls against worker processes whose proposer and verifier return
ready-made results of the right shapes at once (k = 4 proposals with a q of support 32, as sampled requests send),
so what the caller measures is the hop itself: both ends' protobuf work, gRPC over loopback, the event loops and the
worker's hand-off to its compute thread. Rows: call_ms (propose + verify, median and min of --calls rounds),
protobuf_ms (the same messages built, serialised, parsed and unpacked alone, in one process), transport_ms = the rest.

    python bench/bench_round_hops_cpu.py --null [--batches 1,8,32] [--calls 200]

(The `--packing-ab` mode that compared q packing the earlier way with the current one is retired: the earlier
functions are gone; its results stay in bench/results/round_hops_packing_ab_cpu.json.)
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from bench_common import print_table, write_results  # noqa: E402
from specsplit.proto.v1 import worker_pb2  # noqa: E402
from specsplit.services.coordinator.grpc_clients import GrpcDraftClient, GrpcTargetClient  # noqa: E402
from specsplit.services.coordinator.worker_clients import LocalDraftClient, LocalTargetClient  # noqa: E402
from specsplit.services.draft.proposer import DraftPrefill, DraftProposer, Proposal, ProposeItem  # noqa: E402
from specsplit.services.models.loader import load_model  # noqa: E402
from specsplit.services.models.weight_formats import use_weight_format  # noqa: E402
from specsplit.services.rpc import worker_messages as msg  # noqa: E402
from specsplit.services.runtime.model_runner import ModelRunner  # noqa: E402
from specsplit.services.runtime.worker_sequences import WorkerSampling  # noqa: E402
from specsplit.services.service_commands import spawn_service  # noqa: E402
from specsplit.services.target.verifier import TargetPrefill, TargetVerifier, Verdict, VerifyItem  # noqa: E402
from tiny_models import build_model, perturbed_copy, save_model  # noqa: E402

K = 4
GREEDY = WorkerSampling(0.0, 0, 1.0, 0)


class Sequences:
    """The coordinator's view of a batch: committed tokens and what each worker holds."""

    def __init__(self, prefix: str, batch: int):
        self.handles = [f"{prefix}-{i}" for i in range(batch)]
        self.committed = [[1 + i % 200, 2, 3, 4, 5, 6, 7, 8] for i in range(batch)]
        self.draft_cached = [0] * batch
        self.target_cached = [0] * batch


async def prefill(draft, target, seqs: Sequences) -> None:
    drafted = await draft.prefill([DraftPrefill(h, list(c), GREEDY) for h, c in zip(seqs.handles, seqs.committed)])
    verdicts = await target.prefill([TargetPrefill(h, list(c), GREEDY) for h, c in zip(seqs.handles, seqs.committed)])
    for i, (n, verdict) in enumerate(zip(drafted, verdicts)):
        seqs.draft_cached[i] = n
        seqs.committed[i] += verdict.token_ids
        seqs.target_cached[i] = verdict.num_cached


async def one_round(draft, target, seqs: Sequences) -> tuple[float, float, list, list]:
    """One round's calls as the coordinator makes them; returns (propose s, verify s, the items and results)."""
    items = [ProposeItem(h, n, c[n:], K) for h, n, c in zip(seqs.handles, seqs.draft_cached, seqs.committed)]
    start = time.perf_counter()
    proposals = await draft.propose(items)
    proposed = time.perf_counter()
    verify_items = [VerifyItem(h, t, c[t:], p.token_ids, p.q_token_ids, p.q_probs)
                    for h, t, c, p in zip(seqs.handles, seqs.target_cached, seqs.committed, proposals)]
    verdicts = await target.verify(verify_items)
    verified = time.perf_counter()
    for i, (p, v) in enumerate(zip(proposals, verdicts)):
        seqs.draft_cached[i] = min(p.num_cached, len(seqs.committed[i]) + v.num_accepted)
        seqs.committed[i] += v.token_ids
        seqs.target_cached[i] = v.num_cached
    return proposed - start, verified - proposed, (items, proposals, verify_items, verdicts)


def protobuf_seconds(items, proposals, verify_items, verdicts, repeats: int = 20) -> float:
    """One round's message work at both ends, alone: request built and serialised by the caller, parsed and
    unpacked by the worker, response built and serialised by the worker, parsed and unpacked by the caller."""
    start = time.perf_counter()
    for _ in range(repeats):
        data = msg.propose_request(items).SerializeToString()
        msg.propose_items(worker_pb2.ProposeRequest.FromString(data))
        data = msg.propose_response(proposals).SerializeToString()
        msg.proposals(worker_pb2.ProposeResponse.FromString(data))
        data = msg.verify_request(verify_items).SerializeToString()
        msg.verify_items(worker_pb2.VerifyRequest.FromString(data))
        data = msg.verify_response(verdicts).SerializeToString()
        msg.verdicts(worker_pb2.VerifyResponse.FromString(data), [False] * len(verdicts))
    return (time.perf_counter() - start) / repeats


async def measure(draft, target, batch: int, rounds: int, prefix: str) -> dict:
    seqs = Sequences(prefix, batch)
    await prefill(draft, target, seqs)
    for _ in range(3):  # warm-up rounds
        await one_round(draft, target, seqs)
    propose, verify, protobuf = [], [], []
    for r in range(rounds):
        p, v, parts = await one_round(draft, target, seqs)
        propose.append(p)
        verify.append(v)
        if r % 10 == 0:
            protobuf.append(protobuf_seconds(*parts))
    await draft.release(seqs.handles)
    await target.release(seqs.handles)
    rounds_s = [a + b for a, b in zip(propose, verify)]
    return {"propose_ms": 1e3 * statistics.median(propose), "verify_ms": 1e3 * statistics.median(verify),
            "round_ms": 1e3 * statistics.median(rounds_s), "round_min_ms": 1e3 * min(rounds_s),
            "protobuf_ms": 1e3 * min(protobuf)}


async def run(args, target_dir: Path, draft_dir: Path, addresses: dict) -> list[dict]:
    runners = {}
    for role, path in (("target", target_dir), ("draft", draft_dir)):
        loaded = load_model(str(path), "float32", "cpu")
        use_weight_format(loaded, "auto", role)  # what the worker processes hold
        runners[role] = ModelRunner(loaded, num_blocks=2048, block_size=16)
    local_draft = LocalDraftClient(DraftProposer(runners["draft"]))
    local_target = LocalTargetClient(TargetVerifier(runners["target"]))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        local = await measure(local_draft, local_target, batch, args.rounds, f"local-{batch}")
        for transport in args.transports.split(","):
            draft = await GrpcDraftClient(addresses["draft"], transport=transport).connect()
            target = await GrpcTargetClient(addresses["target"], transport=transport).connect()
            remote = await measure(draft, target, batch, args.rounds, f"{transport}-{batch}")
            await draft.close()
            await target.close()
            hop = remote["round_ms"] - local["round_ms"]
            rows.append({
                "batch": batch, "transport": transport, "grpc_ms": round(remote["round_ms"], 3),
                "local_ms": round(local["round_ms"], 3), "hop_ms": round(hop, 3),
                "hop_min_ms": round(remote["round_min_ms"] - local["round_min_ms"], 3),
                "protobuf_ms": round(remote["protobuf_ms"], 3), "transport_ms": round(hop - remote["protobuf_ms"], 3),
                "grpc_propose_ms": round(remote["propose_ms"], 3), "grpc_verify_ms": round(remote["verify_ms"], 3),
                "local_propose_ms": round(local["propose_ms"], 3), "local_verify_ms": round(local["verify_ms"], 3),
            })
            print(rows[-1], flush=True)
    return rows


def serve_null(role: str, model: str) -> None:
    """A worker process whose step work is replaced by ready-made results (see the module docstring)."""
    from specsplit.services.rpc import worker_process

    build = worker_process.build_worker_service

    def build_null(role, model, **options):
        service, name = build(role, model, **options)
        if role == "draft":
            def propose(items):
                return [Proposal(list(range(10, 10 + i.k)), torch.arange(i.k * 32).view(i.k, 32) % 200,
                                 torch.full((i.k, 32), 1 / 32), 100) for i in items]
            service.batcher._handlers["propose"] = propose
        else:
            def verify(items):
                return [i if isinstance(i, Exception) else Verdict(len(i.draft_token_ids), list(i.draft_token_ids) + [5],
                                                                   None, 104) for i in items]
            service.batcher._handlers["verify"] = verify
        return service, name

    worker_process.build_worker_service = build_null
    asyncio.run(worker_process.serve_worker(role, model, "127.0.0.1", 0, 600.0, -1))


async def measure_null(address_draft, address_target, batch: int, calls: int, transports: list[str]) -> list[dict]:
    """Rounds over each transport, interleaved call by call, so a change in the machine's load hits all alike."""
    clients = {t: (await GrpcDraftClient(address_draft, transport=t).connect(),
                   await GrpcTargetClient(address_target, transport=t).connect()) for t in transports}
    items = [ProposeItem(f"h{i}", 100, [5], K) for i in range(batch)]
    samples = {t: [] for t in transports}
    parts = None
    for call in range(calls + 5):
        for transport, (draft, target) in clients.items():
            start = time.perf_counter()
            proposals = await draft.propose(items)
            verify_items = [VerifyItem(f"h{i}", 100, [5], p.token_ids, p.q_token_ids, p.q_probs)
                            for i, p in enumerate(proposals)]
            verdicts = await target.verify(verify_items)
            if call >= 5:
                samples[transport].append(time.perf_counter() - start)
            parts = (items, proposals, verify_items, verdicts)
    for draft, target in clients.values():
        await draft.close()
        await target.close()
    protobuf = min(protobuf_seconds(*parts) for _ in range(5))
    return [{"batch": batch, "transport": t, "call_ms": round(1e3 * statistics.median(s), 3),
             "call_min_ms": round(1e3 * min(s), 3), "protobuf_ms": round(1e3 * protobuf, 3),
             "transport_ms": round(1e3 * (statistics.median(s) - protobuf), 3)} for t, s in samples.items()]


def main_null(args, target_dir: Path, draft_dir: Path, env: dict) -> list[dict]:
    import subprocess

    processes, addresses = [], {}
    try:
        for role, path in (("target", target_dir), ("draft", draft_dir)):
            process = subprocess.Popen([sys.executable, __file__, "--serve-null", role, str(path)], env=env,
                                       stdout=subprocess.PIPE, text=True)
            processes.append(process)
            for line in process.stdout:
                if " listening on " in line:
                    addresses[role] = line.strip().rsplit(" ", 1)[-1]
                    break

        async def all_rows():
            rows = []
            for batch in [int(b) for b in args.batches.split(",")]:
                rows += await measure_null(addresses["draft"], addresses["target"], batch, args.calls,
                                           args.transports.split(","))
                print(rows[-2:], flush=True)
            return rows

        return asyncio.run(all_rows())
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def main() -> None:
    if sys.argv[1:2] == ["--serve-null"]:
        torch.set_num_threads(1)
        return serve_null(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--transports", default="unary,stream,channel")
    parser.add_argument("--name", default="round_hops_cpu")
    parser.add_argument("--null", action="store_true", help="the hop alone: workers return ready-made results")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    target = build_model("qwen2", seed=0)
    target_dir = save_model(target, root / "target")
    draft_dir = save_model(perturbed_copy(target, noise=0.01), root / "draft")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if args.null:
        load = open("/proc/loadavg").read().split()[:3]
        rows = main_null(args, target_dir, draft_dir, env)
        print_table(rows, ["batch", "transport", "call_ms", "call_min_ms", "protobuf_ms", "transport_ms"])
        path = write_results(args.name, rows, {
            "what": "one round's Propose + Verify calls against workers that return ready-made results (the hop "
                    "alone); protobuf_ms = the four messages built, serialised, parsed and unpacked alone",
            "k": K, "q_support": 32, "calls_per_row": args.calls, "load_average_at_start": load,
            "load_average_at_end": open("/proc/loadavg").read().split()[:3],
        })
        print(f"wrote {path}")
        return
    worker = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--num-kv-blocks", "2048"]
    processes = []
    try:
        addresses = {}
        for role, path in (("target", target_dir), ("draft", draft_dir)):
            process, addresses[role] = spawn_service([role, "--model", str(path), *worker], env=env)
            processes.append(process)
        rows = asyncio.run(run(args, target_dir, draft_dir, addresses))
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)
    print_table(rows, ["batch", "transport", "grpc_ms", "local_ms", "hop_ms", "hop_min_ms", "protobuf_ms", "transport_ms"])
    path = write_results(args.name, rows, {
        "models": "tiny random-weight qwen2 pair (tests/tiny_models.py), float32, CPU, torch on 1 thread per process",
        "k": K, "rounds_per_row": args.rounds,
        "note": "hop_ms = grpc_ms - local_ms; protobuf_ms measured alone for the same messages; transport_ms = the rest",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
