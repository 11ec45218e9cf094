"""What checking every worker-request field costs: decoding one round's Verify and Propose requests (64 sequences,
k = 4, q support 32) into the worker's items, per call. Run it with two checkouts' packages to compare them.

    python bench/bench_worker_message_checks.py
"""

import time

from specsplit.proto.v1 import worker_pb2
from specsplit.services.rpc import worker_messages as msg


def main() -> None:
    verify = worker_pb2.VerifyRequest(items=[
        worker_pb2.VerifyItem(handle="%032x" % i, cached_len=100, delta=[5], draft_token_ids=[1, 2, 3, 4], support=32,
                              q_token_ids=bytes(4 * 4 * 32), q_probs=bytes(4 * 4 * 32)) for i in range(64)])
    propose = worker_pb2.ProposeRequest(items=[
        worker_pb2.ProposeItem(handle="%032x" % i, cached_len=100, delta=[5], k=4) for i in range(64)])
    for name, decode, request in (("verify_items", msg.verify_items, verify), ("propose_items", msg.propose_items, propose)):
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(200):
                decode(request)
            best = min(best, (time.perf_counter() - started) / 200)
        print(f"{name}: {best * 1e6:.1f} us per 64-item call (best of 5 x 200)")


if __name__ == "__main__":
    main()
