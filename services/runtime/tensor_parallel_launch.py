"""Start a tensor-parallel replica: one process per rank. Rank 0 is the caller (the worker process that serves gRPC,
or the in-process engine); it starts ranks 1..N-1 as child processes (runtime/tensor_parallel_follower.py), meets
them on a TCP store, loads its own shard and drives them (runtime/tensor_parallel_runner.py).

A watchdog thread polls the children: one that exits takes the replica down (`on_rank_lost`: a worker process exits
so its coordinator fails over; the in-process engine's calls then fail UNAVAILABLE), and the others are stopped.
Followers watch their parent the same way, so no rank outlives its replica.
"""

import datetime
import json
import logging
import os
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from specsplit.services.models.sharded_loader import load_model_shard, read_decoder_config
from specsplit.services.models.weight_formats import use_weight_format
from specsplit.services.runtime.tensor_parallel_group import (TensorParallelGroup, check_tensor_parallel_degree,
                                                              rank_device)
from specsplit.services.runtime.tensor_parallel_runner import DrivingModelRunner

log = logging.getLogger(__name__)

WATCH_INTERVAL_SECONDS = 0.2


class FollowerProcesses:
    """Ranks 1..N-1 of one replica, watched."""

    def __init__(self, processes: list[subprocess.Popen], on_rank_lost=None):
        self.processes = processes
        self.on_rank_lost = on_rank_lost
        self.runner: DrivingModelRunner | None = None
        self._stopping = threading.Event()
        self._lost = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tensor-parallel-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def on_lost(self, reason: str) -> None:
        """Take the replica down once: refuse further calls, stop the other ranks, tell the owner."""
        if self._lost.is_set() or self._stopping.is_set():
            return
        self._lost.set()
        if self.runner is not None:
            self.runner.rank_lost(reason)
        self._terminate()
        if self.on_rank_lost is not None:
            self.on_rank_lost(reason)

    def expect_exit(self) -> None:
        """Rank 0 is about to tell the followers to stop: their exit is no loss."""
        self._stopping.set()

    def stop(self, timeout: float = 10.0) -> None:
        """The replica is closing: wait for the followers to leave (after rank 0's stop), then make sure."""
        self._stopping.set()
        for process in self.processes:
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _terminate(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_SECONDS):
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None and not self._stopping.is_set():
                    self.on_lost(f"rank {rank} (pid {process.pid}) exited with {code}")
                    return


def start_tensor_parallel_runner(model: str, world_size: int, role: str, dtype="float32", device="cpu",
                                 weight_format="auto", on_rank_lost=None, **runner_options) -> DrivingModelRunner:
    """Rank 0 of a new replica of `model` over `world_size` ranks; its `loaded` is rank 0's shard. Raises
    InvalidArgument (before starting anything) when the degree does not fit the model's heads or the GPUs."""
    config = read_decoder_config(model)
    check_tensor_parallel_degree(world_size, config.num_heads, config.num_kv_heads, device)
    if config.intermediate_size % world_size:
        from specsplit.services.errors import InvalidArgument

        raise InvalidArgument(f"tensor parallel size {world_size} does not divide the MLP's "
                              f"{config.intermediate_size} units")
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=300),
                          wait_for_workers=False)
    spec = dict(model=str(model), role=role, world_size=world_size, store=["127.0.0.1", store.port], dtype=dtype,
                device=str(device), weight_format=weight_format)
    processes = [
        subprocess.Popen([sys.executable, "-P", "-m", "specsplit.services.runtime.tensor_parallel_follower",
                          json.dumps({**spec, "rank": rank})], stdout=sys.stderr)
        for rank in range(1, world_size)
    ]
    followers = FollowerProcesses(processes, on_rank_lost)
    try:
        device0 = rank_device(device, 0)
        group = TensorParallelGroup(0, world_size, tuple(spec["store"]), device0, store=store)
        loaded = load_model_shard(model, 0, world_size, group, dtype, device0)
        use_weight_format(loaded, weight_format, role)
        runner = DrivingModelRunner(loaded, group, followers, **runner_options)
    except BaseException:
        followers.expect_exit()
        followers._terminate()
        raise
    followers.runner = runner
    runner.tensor_parallel_store = store  # keep the store (and its listening socket) alive with the replica
    return runner


def follower_threads(world_size: int) -> int:
    """CPU threads per follower rank: the machine's cores shared by the ranks (rank 0 keeps torch's default)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def set_follower_threads(world_size: int) -> None:
    torch.set_num_threads(follower_threads(world_size))
