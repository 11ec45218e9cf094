"""The processes of one tensor-parallel replica: who is which rank, the collectives the sharded layers use, and the
command channel through which rank 0 drives the others in lockstep.

Process groups are built directly on a TCP store (no global `init_process_group`), so one process can hold several
replicas' groups at once: the in-process engine drives a target and a draft group, each with its own followers.

- the model group: NCCL between GPUs (graph-capturable collectives), gloo on the CPU. The sharded layers'
  all-reduces (runtime/tensor_parallel_all_reduce.py: NCCL, or peer-to-peer over NVLink for small messages) and
  the logits' all-gather run on it.
- the command channel (runtime/tensor_parallel_commands.py): rank 0 sends each device operation's metadata there
  before it runs it (token ids, positions, block ids, the step's packed inputs), and every other rank runs the same
  operation on its own shard (runtime/tensor_parallel_runner.py). Never tensors a rank can compute itself.
"""

import datetime
import os

import torch
import torch.distributed as dist

from specsplit.services.errors import InvalidArgument
from specsplit.services.runtime.tensor_parallel_all_reduce import DEFAULT_MODE, MODE_ENV, AllReduce
from specsplit.services.runtime.tensor_parallel_commands import open_command_channel

# Model collectives that take longer than this mean a rank is gone (or stuck): fail rather than hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("SPECSPLIT_TP_TIMEOUT_SECONDS", "120")))


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
        """`store`: rank 0 passes the store it created (listening at `store_address`); the others connect to it.
        Collective: every rank of the replica constructs its group at the same time."""
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
            self.model_group = gloo_group(dist.PrefixStore("model", self.store), rank, world_size, COLLECTIVE_TIMEOUT)
        self.commands = open_command_channel(rank, world_size, self.store, poll=self.device.type == "cuda")
        self.all_reduce = AllReduce(self)
        self.use_all_reduce()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def use_all_reduce(self, mode: str | None = None) -> str:
        """Collective: the all-reduce every rank uses from now on (SPECSPLIT_TP_ALL_REDUCE, default "auto");
        returns the mode all ranks could agree on. Graphs captured before hold the old one (drop them)."""
        return self.all_reduce.use(mode or os.environ.get(MODE_ENV, DEFAULT_MODE))

    # -- collectives of the sharded layers (graph-capturable on a GPU: no host reads) ------------------------------

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum over ranks of `partial`, then the residual add and RMSNorm of models/decoder.RMSNorm."""
        return self.all_reduce.add_rms_norm(partial, residual, weight, eps, slot)

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along its last dimension, rank order."""
        flat = tensor.contiguous().reshape(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        self.model_group._allgather_base(out, flat).wait()
        out = out.view(self.world_size, *tensor.shape)
        return out.movedim(0, -2).reshape(*tensor.shape[:-1], self.world_size * tensor.shape[-1])

    # -- the command channel ----------------------------------------------------------------------------------------

    def send_command(self, command: tuple) -> None:
        """Rank 0: every other rank will run `command` (metadata only) next."""
        self.commands.send(command)

    def send_step(self, name: str, shape, rows: int, host, bucket: int | None) -> None:
        """Rank 0: every other rank will run step program `name` of `shape` on the packed inputs `host` next."""
        self.commands.send_step(name, shape, rows, host, bucket)

    def receive_command(self) -> tuple:
        """Ranks > 0: block until rank 0 sends the next command."""
        return self.commands.receive()

    def close(self) -> None:
        self.commands.close()


def gloo_group(store, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose ranks meet on this host's loopback (or SPECSPLIT_TP_HOST: the address other hosts reach
    this one at, for replicas across machines)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=os.environ.get("SPECSPLIT_TP_HOST", "127.0.0.1"))]
    return dist.ProcessGroupGloo(store, rank, world_size, options)
