"""The processes of one tensor-parallel replica: who is which rank, the collectives the sharded layers use, and the
command channel through which rank 0 drives the others in lockstep.

Process groups are built directly on a TCP store (no global `init_process_group`), so one process can hold several
replicas' groups at once: the in-process engine drives a target and a draft group, each with its own followers.

- the model group: NCCL between GPUs (graph-capturable collectives), gloo on the CPU. The sharded layers' all-reduces
  and all-gathers (models/tensor_parallel.py) run on it.
- the command group: always gloo (host memory). Rank 0 broadcasts each device operation's metadata here before it
  runs it (token ids, positions, block ids, the step's packed inputs), and every other rank runs the same operation
  on its own shard (runtime/tensor_parallel_runner.py). Never tensors a rank can compute itself.
"""

import datetime
import os
import pickle

import torch
import torch.distributed as dist

from specsplit.services.errors import InvalidArgument

# Model collectives that take longer than this mean a rank is gone (or stuck): fail rather than hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("SPECSPLIT_TP_TIMEOUT_SECONDS", "120")))
# A step's command (its packed inputs and shape) usually fits one frame: one broadcast per operation.
COMMAND_FRAME_BYTES = 4096
# Followers wait for rank 0's next command as long as the replica is idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def check_tensor_parallel_degree(degree: int, num_heads: int, num_kv_heads: int, device: str) -> None:
    """A clear error for a degree the model or the machine cannot take."""
    if degree < 1:
        raise InvalidArgument(f"tensor parallel size must be at least 1, got {degree}")
    if degree == 1:
        return
    if num_heads % degree:
        raise InvalidArgument(f"tensor parallel size {degree} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % degree and degree % num_kv_heads:
        raise InvalidArgument(
            f"tensor parallel size {degree} must divide the model's {num_kv_heads} KV heads or be a multiple of them "
            "(then each KV head is replicated)"
        )
    if torch.device(device).type == "cuda":
        present = torch.cuda.device_count()
        if degree > present:
            raise InvalidArgument(f"tensor parallel size {degree} exceeds the {present} GPUs present")


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a GPU replica runs on the r-th GPU after the replica's first one; CPU ranks share the CPU."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, store_address: tuple[str, int], device: torch.device,
                 store: dist.TCPStore | None = None):
        """`store`: rank 0 passes the store it created (listening at `store_address`); the others connect to it."""
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        host, port = store_address
        self.store = store or dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=120))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL binds its communicator to the current device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self.model_group = dist.ProcessGroupNCCL(dist.PrefixStore("model", self.store), rank, world_size, options)
        else:
            self.model_group = _gloo_group(dist.PrefixStore("model", self.store), rank, world_size, COLLECTIVE_TIMEOUT)
        self.command_group = _gloo_group(dist.PrefixStore("command", self.store), rank, world_size, IDLE_TIMEOUT)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # -- collectives of the sharded layers (graph-capturable on NCCL: no host reads) --------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""
        self.model_group.allreduce([tensor]).wait()
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along its last dimension, rank order."""
        flat = tensor.contiguous().reshape(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        self.model_group._allgather_base(out, flat).wait()
        out = out.view(self.world_size, *tensor.shape)
        return out.movedim(0, -2).reshape(*tensor.shape[:-1], self.world_size * tensor.shape[-1])

    # -- the command channel ----------------------------------------------------------------------------------------

    def send_command(self, command: tuple) -> None:
        """Rank 0: every other rank will run `command` (metadata only) next. One broadcast of a fixed-size frame
        (its first 8 bytes the payload's length); a payload larger than the frame sends its rest in a second one."""
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        frame = torch.zeros(COMMAND_FRAME_BYTES, dtype=torch.uint8)
        frame[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
        head = payload[: COMMAND_FRAME_BYTES - 8]
        frame[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.command_group.broadcast([frame], dist.BroadcastOptions()).wait()
        if len(payload) > len(head):
            rest = torch.frombuffer(bytearray(payload[len(head):]), dtype=torch.uint8)
            self.command_group.broadcast([rest], dist.BroadcastOptions()).wait()

    def receive_command(self) -> tuple:
        """Ranks > 0: block until rank 0 sends the next command."""
        frame = torch.empty(COMMAND_FRAME_BYTES, dtype=torch.uint8)
        self.command_group.broadcast([frame], dist.BroadcastOptions()).wait()
        raw = frame.numpy().tobytes()
        size = int.from_bytes(raw[:8], "little")
        payload = raw[8 : 8 + size]
        if size > len(payload):
            rest = torch.empty(size - len(payload), dtype=torch.uint8)
            self.command_group.broadcast([rest], dist.BroadcastOptions()).wait()
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)


def _gloo_group(store, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose ranks meet on this host's loopback (or SPECSPLIT_TP_HOST: the address other hosts reach
    this one at, for replicas across machines)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=os.environ.get("SPECSPLIT_TP_HOST", "127.0.0.1"))]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
