"""A replica's model group, built directly on its store, registered in c10d's registry under a name
(runtime/tensor_parallel_all_reduce.register_named_group): torch's ops that take a group name (the one-shot
all-reduce over symmetric memory, its rendezvous) resolve it there; and the ranks' agreement on an all-reduce mode
(AllReduce._agree), which the GPU alone reaches in serving. On the CPU with gloo: two ranks in threads."""

import datetime
import socket
import threading
import uuid
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group, _unregister_process_group

from specsplit.services.runtime.tensor_parallel_all_reduce import AllReduce, register_named_group
from specsplit.services.runtime.tensor_parallel_group import gloo_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORLD = 2
TIMEOUT = datetime.timedelta(seconds=30)


def on_two_ranks(rank_main) -> dict:
    """rank_main(rank, store, backend) on two gloo ranks in threads; returns {rank: its result}."""
    port, results, errors = free_port(), {}, []

    def run(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=TIMEOUT)
            results[rank] = rank_main(rank, store, gloo_group(dist.PrefixStore("model", store), rank, WORLD, TIMEOUT))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_a_registered_group_resolves_by_name_and_sums_over_its_ranks():
    name, registered = f"test-{uuid.uuid4().hex[:8]}", []  # the registry holds its groups weakly: the test keeps its own

    def rank_main(rank, store, backend):
        if rank == 0:
            registered.append(register_named_group(name, backend, store, rank, WORLD, torch.device("cpu")))
            group = _resolve_process_group(name)  # what torch's named-group ops do
            assert group.group_name == name and group.size() == WORLD and group.rank() == 0
            tensor = torch.tensor([1.0, 2.0])
            group.allreduce([tensor]).wait()
        else:
            tensor = torch.tensor([10.0, 20.0])
            backend.allreduce([tensor]).wait()  # the same backend object, reached directly on the other rank
        return tensor

    try:
        sums = on_two_ranks(rank_main)
        assert torch.equal(sums[0], torch.tensor([11.0, 22.0])) and torch.equal(sums[1], sums[0])
    finally:
        _unregister_process_group(name)


def test_the_ranks_agree_only_where_every_rank_says_yes():
    def rank_main(rank, store, backend):
        all_reduce = AllReduce(SimpleNamespace(model_group=backend, device=torch.device("cpu")))
        return (all_reduce._agree(True), all_reduce._agree(rank == 0), all_reduce._same_setup_counts())

    assert on_two_ranks(rank_main) == {0: (True, False, True), 1: (True, False, True)}
