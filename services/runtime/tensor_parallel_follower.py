"""The process of one rank > 0 of a tensor-parallel replica (started by runtime/tensor_parallel_launch.py).

`python -m specsplit.services.runtime.tensor_parallel_follower SPEC_JSON`: join rank 0's store, load this rank's
shard, then run rank 0's commands until it stops. Exits when its parent (rank 0) is gone.
"""

import json
import os
import sys
import threading
import time

import torch


def _exit_with_parent(parent: int) -> None:
    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)  # rank 0 is gone: so is the replica

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    _exit_with_parent(os.getppid())
    from specsplit.services.models.sharded_loader import load_model_shard
    from specsplit.services.models.weight_formats import use_weight_format
    from specsplit.services.runtime.model_runner import ModelRunner
    from specsplit.services.runtime.tensor_parallel_group import TensorParallelGroup, rank_device
    from specsplit.services.runtime.tensor_parallel_launch import set_follower_threads
    from specsplit.services.runtime.tensor_parallel_runner import follow

    rank, world_size = spec["rank"], spec["world_size"]
    device = rank_device(spec["device"], rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_follower_threads(world_size)
    group = TensorParallelGroup(rank, world_size, tuple(spec["store"]), device)
    loaded = load_model_shard(spec["model"], rank, world_size, group, spec["dtype"], device, with_tokenizer=False)
    use_weight_format(loaded, spec["weight_format"], spec["role"])
    follow(group, lambda **options: ModelRunner(loaded, prefix_caching=False, **options))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
