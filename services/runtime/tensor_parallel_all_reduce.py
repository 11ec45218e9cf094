"""How the ranks of a tensor-parallel replica sum their partial results: the model's all-reduces.

Decode messages are small: a row-parallel layer's output for one token of a 7B is 7 KB, and a step has two per
layer. NCCL spends ~10 us on such a message (its protocol, its own stream); a one-shot all-reduce, in which every
rank reads every other rank's buffer over NVLink peer-to-peer and adds them in rank order, spends a few (what vLLM's
and TensorRT-LLM's custom all-reduces do). Modes (SPECSPLIT_TP_ALL_REDUCE, or DrivingModelRunner.use_all_reduce):

- "nccl" (the default): the model group's all-reduce (NCCL; gloo on the CPU), then the add_rms_norm kernel. Always
  available.
- "symm": torch's one-shot all-reduce over symmetric memory (torch.ops.symm_mem.one_shot_all_reduce_copy; torch's
  CUDA backend maps each rank's buffer into the others; NVLink multicast stays off), then add_rms_norm.
- "fused": as "symm" for the plain all-reduces (the embedding's); at the norms that follow o_proj and down_proj one
  launch of kernels/all_reduce_rms_norm_triton.py sums the ranks' rows, adds the residual and normalises.
- "auto" (the default): "fused" where it is available, else "nccl". Measured on 2x H200 (torch 2.11, a 7B-shaped
  bf16 target at degree 2; bench/results/gpu_tensor_parallel_h200x2_peer.json): decode 1.47x / 1.45x degree 1 at
  batch 1 / 8 with "fused", 1.35x / 1.29x "symm", 1.29x / 1.32x "nccl".

Torch's one-shot op and its symmetric-memory rendezvous find a group by name in c10d's registry, where a directly
built NCCL backend is not: `PeerBuffers` registers the replica's model group under its buffers' name
(`register_named_group`; without it, on torch 2.11, the rendezvous failed on every rank). The rendezvous exchanges
its handles under keys numbered by a per-process counter of torch's, so it only meets when every rank has made as
many rendezvous before it: true for a replica's first setup in fresh processes (a serving worker), not for a second
replica whose rank 0 lives in a process that set up peer buffers before (an in-process engine with a sharded target
and a sharded draft, or one rebuilt in the same process), whose ranks would wait for each other's keys until the
store times out. The ranks compare their counts (`_peer_setups` in this module) first, and such a replica uses
"nccl".

Messages above PEER_MAX_BYTES (prefill chunks) go to NCCL in every mode: there bandwidth counts, and NCCL's ring
has more of it than one rank reading all the others.

Choosing a mode is collective: every rank checks what it can (the ops exist, its GPU reaches the others'
peer-to-peer), the ranks agree on the weakest, set up the symmetric buffers (a rendezvous over the replica's
store), check the new mode against NCCL on a test message, and agree again; a failure anywhere puts every rank on
"nccl". Every mode returns the same bits on every rank; for two ranks the same bits in every mode (a + b, rounded
once), over more ranks rank order (one-shot, fused) and NCCL's ring order may differ in the last bit.
"""

import logging
import os
import uuid

import torch
import torch.distributed as dist

from specsplit.kernels.dispatch import add_rms_norm

log = logging.getLogger(__name__)

MODE_ENV = "SPECSPLIT_TP_ALL_REDUCE"
MODES = ("auto", "nccl", "symm", "fused")
DEFAULT_MODE = "auto"
PEER_MAX_BYTES = int(os.environ.get("SPECSPLIT_TP_PEER_MAX_BYTES", 1 << 20))
CHECK_MAX_SPINS = 1 << 24  # ~10-30 s of polling a flag over NVLink (ranks compile the kernel apart): then it gives up
_PEER_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one-shot kernels take
_peer_setups = 0  # symmetric-memory setups this process has started (PeerBuffers): see the module's docstring


class AllReduce:
    """The all-reduces of one rank of a replica, in the mode every rank agreed on."""

    def __init__(self, group):
        self.group = group
        self.mode = "nccl"
        self.peer: PeerBuffers | None = None
        self.peer_failed = False  # set up once: every rank saw the same outcome, none retries

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `tensor` (in place on NCCL and gloo)."""
        if self.mode != "nccl" and self._peer_fits(tensor):
            return self.peer.one_shot(tensor)
        self.group.model_group.allreduce([tensor]).wait()
        return tensor

    def add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * norm(sum + residual), sum + residual) of this rank's `partial`; `slot` (0 or 1) alternates
        between consecutive calls (models/tensor_parallel.ReducingRMSNorm)."""
        if self.mode == "fused" and self._peer_fits(partial):
            return self.peer.fused_add_rms_norm(partial.contiguous(), residual, weight, eps, slot)
        return add_rms_norm(self(partial), residual, weight, eps)

    def use(self, mode: str) -> str:
        """Collective: switch every rank to `mode` where all of them can, else to "nccl"; returns the mode."""
        if mode not in MODES:
            raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, not {mode!r}")
        wanted = "fused" if mode == "auto" else mode
        if wanted == "nccl" or self.group.device.type != "cuda" or self.group.world_size == 1:
            self.mode = "nccl"
            return self.mode
        ready = self._agree(_peer_ops_missing(self.group) is None) and not self.peer_failed
        if ready and self.peer is None and not self._same_setup_counts():
            log.warning("tensor-parallel %s all-reduce unavailable: rank 0's process set up peer buffers for another "
                        "replica before (torch's rendezvous would not meet); using nccl", wanted)
            self.peer_failed, ready = True, False
        if ready and self.peer is None:
            try:
                self.peer = PeerBuffers(self.group)
            except Exception as error:  # a rank that cannot map the others' memory: all fall back
                log.warning("tensor-parallel %s all-reduce unavailable: %s", wanted, error)
                ready = False
            ready = self._agree(ready)
            self.peer_failed = not ready
        if ready:
            ready = self._agree(self._check(wanted))
        self.mode = wanted if ready else "nccl"
        if not ready:
            log.warning("tensor-parallel all-reduce: %s unavailable, using nccl (%s)", wanted,
                        _peer_ops_missing(self.group) or "setup or check failed on some rank")
        return self.mode

    def _peer_fits(self, tensor: torch.Tensor) -> bool:
        size = tensor.numel() * tensor.element_size()
        return tensor.dtype in _PEER_DTYPES and size <= PEER_MAX_BYTES and size % 16 == 0

    def _agree(self, ok: bool) -> bool:
        """Whether every rank says ok (an all-reduce of the flags: every rank must ask, in the same order)."""
        return bool(self._reduce([1 if ok else 0], dist.ReduceOp.MIN)[0])

    def _same_setup_counts(self) -> bool:
        """Whether every rank's process has started as many symmetric-memory setups as the others (collective)."""
        largest, minus_smallest = self._reduce([_peer_setups, -_peer_setups], dist.ReduceOp.MAX)
        return largest == -minus_smallest

    def _reduce(self, values: list[int], op) -> list[int]:
        """`values` reduced elementwise over the ranks with `op` on the model group (collective)."""
        tensor = torch.tensor(values, dtype=torch.int64, device=self.group.device)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.group.model_group.allreduce([tensor], options).wait()
        return tensor.tolist()

    def _check(self, mode: str) -> bool:
        """The new mode's sums (and fused norms) equal NCCL's on a test message, on this rank."""
        try:
            generator = torch.Generator(device=self.group.device).manual_seed(1234 + self.group.rank)
            partial = torch.randn(3, 512, generator=generator, device=self.group.device).to(torch.bfloat16)
            residual = torch.ones_like(partial)
            weight = torch.ones(512, dtype=torch.bfloat16, device=self.group.device)
            expected = partial.clone()
            self.group.model_group.allreduce([expected]).wait()
            got = self.peer.one_shot(partial)
            # Two ranks add a + b whatever the algorithm; more may differ from NCCL's ring order in the last bit.
            ok = torch.equal(got, expected) if self.group.world_size == 2 else torch.allclose(
                got.float(), expected.float(), rtol=1e-2, atol=1e-2)
            want = add_rms_norm(got, residual, weight, 1e-6)  # the fused kernel sums in the one-shot's rank order
            if mode == "fused":  # its barrier gives up rather than hang here if the ranks never meet
                for slot in (0, 1):
                    normed, summed = self.peer.fused_add_rms_norm(partial, residual, weight, 1e-6, slot,
                                                                  max_spins=CHECK_MAX_SPINS)
                    ok = ok and torch.equal(summed, want[1]) and torch.equal(normed, want[0])
            torch.cuda.synchronize(self.group.device)
            return ok
        except Exception as error:
            log.warning("tensor-parallel %s all-reduce failed its check: %s", mode, error)
            return False


def peer_setups_in_this_process() -> int:
    """How many replicas' peer buffers this process has set up (or tried to)."""
    return _peer_setups


def _peer_ops_missing(group) -> str | None:
    """Why this rank cannot run the peer-to-peer all-reduces, or None."""
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy"
    if not hasattr(torch._C._distributed_c10d, "_SymmetricMemory"):
        return "this torch build has no symmetric memory"
    first = group.device.index - group.rank
    for rank in range(group.world_size):
        if rank != group.rank and not torch.cuda.can_device_access_peer(group.device.index, first + rank):
            return f"cuda:{group.device.index} cannot reach cuda:{first + rank} peer-to-peer"
    return None


class PeerBuffers:
    """This rank's symmetric-memory buffers, mapped into every other rank of the replica: one for torch's one-shot
    all-reduce, one of two slots for the fused kernel (each allocation has its own signal pad, so the two never
    share flags)."""

    def __init__(self, group):
        global _peer_setups
        _peer_setups += 1  # counted whether or not it succeeds: torch's own counter may have moved either way
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # one-shot reads need no multicast; never create it
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory

        self.group = group
        device = group.device
        if group.rank == 0:
            group.store.set("symm_name", f"specsplit-tp-{uuid.uuid4().hex[:12]}")
        self.name = group.store.get("symm_name").decode()
        self.named_group = register_named_group(self.name, group.model_group, group.store, group.rank,
                                                group.world_size, device)
        _SymmetricMemory.set_group_info(self.name, group.rank, group.world_size,
                                        dist.PrefixStore(f"symm/{self.name}", group.store))
        if hasattr(symm_mem, "set_backend"):
            try:
                symm_mem.set_backend("CUDA")  # peer-mapped device memory (not NVSHMEM)
            except Exception:  # noqa: BLE001 - older builds have one backend only
                pass
        with torch.cuda.device(device):
            self.one_shot_buffer = _symmetric_empty(symm_mem, _SymmetricMemory, PEER_MAX_BYTES, device, self.name)
            _SymmetricMemory.rendezvous(self.one_shot_buffer, self.name)
            self.fused_buffer = _symmetric_empty(symm_mem, _SymmetricMemory, 2 * PEER_MAX_BYTES, device, self.name)
            handle = _SymmetricMemory.rendezvous(self.fused_buffer, self.name)
        base = self.fused_buffer.data_ptr() - handle.buffer_ptrs[group.rank]
        self.slot_ptrs = [torch.tensor([p + base + slot * PEER_MAX_BYTES for p in handle.buffer_ptrs],
                                       dtype=torch.int64, device=device) for slot in (0, 1)]
        self.pad_ptrs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)

    def one_shot(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.contiguous().view(-1)
        buffer = self.one_shot_buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(buffer, flat, "sum", self.name)
        return out.view(tensor.shape)

    def fused_add_rms_norm(self, partial, residual, weight, eps: float, slot: int, max_spins: int = 0):
        from specsplit.kernels.all_reduce_rms_norm_triton import all_reduce_add_rms_norm_triton

        with torch.cuda.device(partial.device):
            return all_reduce_add_rms_norm_triton(partial, residual, weight, eps, self.slot_ptrs[slot],
                                                  self.pad_ptrs, self.group.rank, self.group.world_size, max_spins)


def register_named_group(name: str, backend, store, rank: int, world_size: int,
                         device: torch.device) -> dist.ProcessGroup:
    """Register `backend` (a ProcessGroupNCCL or gloo backend built directly on a store) in c10d's registry as a
    ProcessGroup called `name`, as `dist.new_group` would: torch's ops that take a group name resolve it there.
    The registry holds it weakly: keep the returned group as long as the name is used."""
    from torch._C._distributed_c10d import _register_process_group

    backend_type = (dist.ProcessGroup.BackendType.NCCL if device.type == "cuda"
                    else dist.ProcessGroup.BackendType.GLOO)
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(backend_type)
    group._register_backend(device, backend_type, backend)
    group._set_group_name(name)
    _register_process_group(name, group)
    return group


def _symmetric_empty(symm_mem, symmetric_memory, nbytes: int, device: torch.device, name: str) -> torch.Tensor:
    try:
        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    except Exception:  # noqa: BLE001 - builds whose allocation names its group
        return symmetric_memory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device, name)
