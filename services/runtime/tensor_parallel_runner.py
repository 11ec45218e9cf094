"""Lockstep of a tensor-parallel replica: rank 0's model runner drives, the other ranks' runners follow.

Rank 0 is an ordinary ModelRunner over its shard that, before each operation touching the device, sends the
operation's metadata on the command channel (runtime/tensor_parallel_commands.py):

- `copy_blocks`: the copy-on-write copies a KV reservation asked for (block ids);
- `forward`: a ragged forward (prefills): per item its block ids, token count, new token ids and logits rows;
- `step`: a step program (draft k-step call, verification): its name, shape and the packed int64 inputs;
- `tables`: a change of the device block tables made outside a step program;
- `all_reduce`: every rank switches its all-reduce mode (runtime/tensor_parallel_all_reduce.py) and drops its graphs;
- `profile`: benchmarks only, a torch.profiler trace of each follower (start; stop, writing it to a file).

Every rank then runs the same operation on its own shard and its own paged KV (its KV heads only). Host-side state
(block manager, prefix cache, sequences) lives on rank 0 alone: the followers only ever see block ids.

Step programs run whole on every rank (on a GPU, each rank captures the same graph with its collectives inside).
The verification decides on rank 0 only: followers stop after the logits' all-gather (`runner.decides`), and do
not wait for their replay to finish: they go straight back to the channel for the next command. A draft's
k-step program needs each proposal on every rank for the next forward: every rank samples it from the same
all-gathered logits with the same counter RNG (identical tokens, no broadcast on the step's critical path), and
rank 0's result is the one returned.

A lost rank (its process exited, or a collective failed) makes every later call raise Unavailable and calls
`on_rank_lost`, which a worker process answers by exiting, so its coordinator fails over as for any lost replica.
"""

import logging
import threading

import numpy as np

from specsplit.services.errors import Unavailable
from specsplit.services.kv.block_manager import BlockTable
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
from specsplit.services.runtime.pending_step import PendingStep

log = logging.getLogger(__name__)


class DrivingModelRunner(ModelRunner):
    """Rank 0's runner: an ordinary ModelRunner over its shard that has the other ranks mirror its device work."""

    def __init__(self, loaded, group, followers=None, **runner_options):
        super().__init__(loaded, **runner_options)
        self.group = group
        self.followers = followers  # runtime/tensor_parallel_launch.FollowerProcesses (None: started elsewhere)
        self.tensor_parallel_size = group.world_size
        self.lost: str | None = None
        self._lock = threading.Lock()
        self.block_tables.on_change = lambda change: self._command("tables", change)
        self._command("runner", dict(num_blocks=self.block_manager.num_blocks, block_size=self.block_size,
                                     max_batch_tokens=self.max_batch_tokens, cuda_graphs=self.graphs is not None))

    def reserve_tokens(self, table: BlockTable, count: int) -> None:
        copies = self.block_manager.append(table, count)
        if copies:
            self._command("copy_blocks", copies)
        self._guarded(self.cache.copy_blocks, copies)

    def forward_flat(self, items: list[ForwardItem]):
        self._command("forward", [(list(i.table.block_ids), i.table.num_tokens, list(i.token_ids), i.num_logits)
                                  for i in items])
        return self._guarded(super().forward_flat, items)

    def execute_step(self, program, shape, layout, host: np.ndarray, bucket: int | None) -> np.ndarray:
        self._check_up()
        self._guarded(self.group.send_step, program.name, shape, layout.rows, host, bucket)
        return self._guarded(super().execute_step, program, shape, layout, host, bucket)

    def start_step(self, program, shape, layout, host: np.ndarray, bucket: int | None) -> PendingStep:
        self._check_up()
        self._guarded(self.group.send_step, program.name, shape, layout.rows, host, bucket)
        return _GuardedStep(self._guarded(super().start_step, program, shape, layout, host, bucket), self._guarded)

    def use_all_reduce(self, mode: str) -> str:
        """Switch every rank's all-reduce (nccl, symm, fused, auto); returns the mode they agreed on. The graphs
        captured so far hold the old one: every rank drops them (captured again on their next use)."""
        self._command("all_reduce", mode)
        chosen = self._guarded(self.group.use_all_reduce, mode)
        if self.graphs is not None:
            self.graphs.clear()
        return chosen

    def profile_followers(self, action: str, path: str | None = None) -> None:
        """BENCHMARKS ONLY: "start" a torch.profiler trace on every other rank, or "stop" it, each rank writing a
        Chrome trace to `path` with "{rank}" replaced by its rank."""
        self._command("profile", action, path)

    def rank_lost(self, reason: str) -> None:
        """A rank is gone: refuse every later call (the followers are stopped by whoever noticed)."""
        if self.lost is None:
            self.lost = reason
            log.error("tensor-parallel replica lost a rank: %s", reason)

    def close(self) -> None:
        """Stop the followers (they leave their command loop) and wait for them."""
        if self.followers is not None:
            self.followers.expect_exit()
        if self.lost is None:
            try:
                self._command("stop")
            except Unavailable:
                pass
            self.lost = "closed"
        if self.followers is not None:
            self.followers.stop()
        self.group.close()

    def _command(self, *command) -> None:
        self._check_up()
        self._guarded(self.group.send_command, command)

    def _check_up(self) -> None:
        if self.lost is not None:
            raise Unavailable(f"tensor-parallel replica is down: {self.lost}")

    def _guarded(self, operation, *args):
        """Run a step of the lockstep; a collective that fails means a rank is gone."""
        try:
            return operation(*args)
        except RuntimeError as error:  # gloo / NCCL report a dead peer or a timeout as RuntimeError
            if not _is_collective_error(error):
                raise
            self.rank_lost(str(error).splitlines()[0])
            if self.followers is not None:
                self.followers.on_lost(self.lost)
            raise Unavailable(f"tensor-parallel replica is down: {self.lost}") from None


class _GuardedStep(PendingStep):
    """A launched step whose wait, like every step of the lockstep, reads a failed collective as a lost rank."""

    def __init__(self, step: PendingStep, guarded):
        super().__init__(None)
        self._step = step
        self._guarded = guarded

    def result(self):
        return self._guarded(self._step.result)


def _is_collective_error(error: RuntimeError) -> bool:
    text = str(error).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "closed", "timed out", "timeout", "peer"))


def follow(group, make_runner) -> None:
    """Ranks > 0: run rank 0's commands until it says stop. `make_runner(**options)` builds this rank's runner
    when rank 0 has sized its own (its first command)."""
    from specsplit.services.draft.draft_steps import DraftSteps
    from specsplit.services.target.verify_steps import VerifySteps

    programs = {VerifySteps.name: VerifySteps, DraftSteps.name: DraftSteps}
    layouts = {}  # (program, shape, rows) -> a graph step's input layout: built once, not on every step
    runner = profiler = None
    while True:
        kind, *args = group.receive_command()
        if kind == "stop":
            group.close()
            return
        if kind == "runner":
            runner = make_runner(**args[0])
            runner.decides = False
        elif kind == "copy_blocks":
            runner.cache.copy_blocks(args[0])
        elif kind == "forward":
            items = [ForwardItem(BlockTable(block_ids, num_tokens), token_ids, num_logits)
                     for block_ids, num_tokens, token_ids, num_logits in args[0]]
            runner.forward_flat(items)
        elif kind == "step":
            name, shape, rows, host, bucket = args
            program = programs[name]
            layout = layouts.get((name, shape, rows))
            if layout is None:
                layout = program.layout(shape, rows)
                if bucket is not None:  # eager shapes follow the exact context: keeping them would grow forever
                    layouts[(name, shape, rows)] = layout
            runner.execute_step(program, shape, layout, host, bucket)
        elif kind == "tables":
            change = args[0]
            if change[0] == "write":
                runner.block_tables.write(change[1])
            else:
                runner.block_tables.grow()
        elif kind == "all_reduce":
            group.use_all_reduce(args[0])
            if runner is not None and runner.graphs is not None:
                runner.graphs.clear()
        elif kind == "profile":
            profiler = _profile(profiler, group.rank, *args)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {kind!r}")


def _profile(profiler, rank: int, action: str, path: str | None):
    """BENCHMARKS ONLY: start a torch.profiler trace of this rank, or stop it and write it as a Chrome trace."""
    import torch

    if action == "start":
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()
        return profiler
    if profiler is not None:
        import os

        profiler.stop()
        path = path.replace("{rank}", str(rank))
        profiler.export_chrome_trace(path + ".partial")
        os.replace(path + ".partial", path)  # whoever waits for the file sees it whole
    return None
