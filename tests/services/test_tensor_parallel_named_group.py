"""A replica's model group, built directly on its store, registered in c10d's registry under a name
(runtime/tensor_parallel_all_reduce.register_named_group): torch's ops that take a group name (the one-shot
all-reduce over symmetric memory, its rendezvous) resolve it there. On the CPU with gloo: two ranks in threads."""

import datetime
import socket
import threading
import uuid

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group, _unregister_process_group

from specsplit.services.runtime.tensor_parallel_all_reduce import register_named_group
from specsplit.services.runtime.tensor_parallel_group import gloo_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_registered_group_resolves_by_name_and_sums_over_its_ranks():
    port, name, world = free_port(), f"test-{uuid.uuid4().hex[:8]}", 2
    timeout = datetime.timedelta(seconds=30)
    sums, errors, registered = {}, [], []  # the registry holds its groups weakly: the test keeps its own

    def rank_main(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
            backend = gloo_group(dist.PrefixStore("model", store), rank, world, timeout)
            if rank == 0:
                registered.append(register_named_group(name, backend, store, rank, world, torch.device("cpu")))
            store.set(f"registered{rank}", "1")
            if rank == 0:
                group = _resolve_process_group(name)  # what torch's named-group ops do
                assert group.group_name == name and group.size() == world and group.rank() == 0
                tensor = torch.tensor([1.0, 2.0])
                group.allreduce([tensor]).wait()
            else:
                tensor = torch.tensor([10.0, 20.0])
                backend.allreduce([tensor]).wait()  # the same backend object, reached directly on the other rank
            sums[rank] = tensor
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        assert torch.equal(sums[0], torch.tensor([11.0, 22.0])) and torch.equal(sums[1], sums[0])
    finally:
        _unregister_process_group(name)
