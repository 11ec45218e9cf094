"""How a model's linear layers hold their weights on the CPU, chosen per role.

- dense: torch's own layout. Often the fastest for one row at a time (target-only decoding at batch 1; which one is,
  depends on the CPU: layout_calibration.py measures it), and the only format off the CPU or outside float32.
- packed: float32 weights reordered once into oneDNN's blocked layout. A verification of k+1 rows, or a batched
  decode, then costs little more than one row, where the dense layout repacks the weight on every call and costs
  2-3x one row. Same float32 arithmetic; results differ from dense only in the last bits, as any two GEMM kernels'
  do. The target's default on the CPU.
- int8: weights quantized per output channel, activations per call (fbgemm): about half the draft's step time.
  Drafts only — it changes the draft's distributions, hence acceptance, but never the output: every token is
  verified against the target's own distribution. The draft's default on the CPU.
- bf16: weights held in bfloat16 and activations cast to it per call, float32 out. Drafts only, for the same reason
  as int8; fast only where the CPU multiplies bf16 natively (avx512_bf16, AMX), so calibration offers it there only.
- dual: both float32 layouts of every weight, twice the memory: dense for calls of up to DUAL_DENSE_ROWS rows,
  packed above. For a speculating target on a CPU where dense is fastest for one row and packed for a verification:
  its one-row steps (every round while the speculation policy finds the draft does not pay) run as fast as the
  target alone's, its verifications as fast as packed ones. The same float32 arithmetic as the layout each call
  uses. Only when asked for (`--target-weights dual`): "auto" never takes it (its gain was measured once, on a
  loaded machine, and the second copy is 6 GB for a float32 1.5B target).

"auto" picks the defaults above for float32 on the CPU and dense everywhere else; the services and the in-process
engine resolve "auto" by measurement instead (layout_calibration.py), falling back to these defaults.

The batch-invariant mode (kernels/dispatch.py) needs dense: its matmul is one fixed-order formulation over the
dense weight, where oneDNN's packed GEMM blocks by the row count and int8 quantizes activations per call (so one
row's result would depend on the others'). "auto" is then dense, and the other formats are refused.
"""

import os
import warnings

import torch
from torch import nn

from specsplit.kernels.dispatch import batch_invariant
from specsplit.services.errors import InvalidArgument

WEIGHT_FORMATS = ("auto", "dense", "packed", "dual", "int8", "bf16")
# Formats that change the model's arithmetic beyond the last bits: never for a target (its outputs are the output).
DRAFT_ONLY_FORMATS = ("int8", "bf16")

# oneDNN picks its blocking for an expected row count; 5 = a k=4 verification. On the developer CPU
# (bench/bench_cpu_weight_formats.py --matrix) 2-64 rows run within ~10% of the best of hints 1/5/16/64 for their
# count; one row is ~20% slower than with hint 1 (and dense is faster still there).
PACKED_ROWS_HINT = 5

# The dual layout's split: dense up to this many rows (on the developer CPU dense is faster
# at 1 and 2 rows, packed from about 4; bench/results/cpu_weight_formats_matrix.json).
DUAL_DENSE_ROWS = 2

# oneDNN, and torch's ideep layer above it, cache one primitive per input shape (1024 of each by default), and a
# cached primitive keeps buffers about the size of its output (rows x out_features floats). Every new row count a
# packed layer meets (a verification's batch x (k+1), a prefill's prompt length) therefore costs memory that is
# never returned: 0.3-0.55 GB under load for the 1.5B target. Both caches are bounded: a forward meets 5 weight
# shapes, so 16 primitives hold the shapes of the last 3 row counts, and a miss costs one primitive creation, small
# beside a forward (bench/bench_packed_memory.py). Padding rows to a few counts would bound the shapes instead, but
# costs time on every verification.
ONEDNN_CACHE_CAPACITY = 16


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Both caches read their capacity once, at the process's first oneDNN primitive: this runs at import, before
    any model is loaded. An operator's own setting of either variable wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))


bound_onednn_caches()


def target_weight_request(requested: str, speculative: bool) -> str:
    """A target that only decodes (no draft) keeps "auto" dense: the fastest layout for one row at a time."""
    return "dense" if requested == "auto" and not speculative else requested


def resolve_weight_format(requested: str, role: str, device: torch.device, dtype: torch.dtype) -> str:
    if requested not in WEIGHT_FORMATS:
        raise InvalidArgument(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, not {requested!r}")
    if batch_invariant():
        if requested not in ("auto", "dense"):
            raise InvalidArgument(f"the {requested} weight format is not batch-invariant: --batch-invariant needs "
                                  f"dense weights (or auto)")
        return "dense"
    on_cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if requested == "auto":
        if not on_cpu_fp32:
            return "dense"
        if role == "draft" and _int8_available():
            return "int8"
        if role == "target" and torch.backends.mkldnn.is_available():
            return "packed"
        return "dense"
    if requested != "dense" and not on_cpu_fp32:
        raise InvalidArgument(f"the {requested} weight format needs float32 weights on the CPU")
    if requested in DRAFT_ONLY_FORMATS and role != "draft":
        raise InvalidArgument(f"{requested} weights would change the target's outputs; they are for drafts only")
    return requested


def use_weight_format(loaded, requested: str, role: str) -> str:
    """Resolve `requested` for this model and role and convert its layers once; returns the format in use."""
    param = next(loaded.model.parameters())
    chosen = resolve_weight_format(requested, role, param.device, param.dtype)
    if chosen != loaded.weight_format:
        if loaded.weight_format != "dense":
            raise InvalidArgument(f"{loaded.name} already holds {loaded.weight_format} weights, cannot switch to {chosen}")
        apply_weight_format(loaded.model, chosen)
        loaded.weight_format = chosen
    return chosen


def apply_weight_format(model: nn.Module, weight_format: str) -> None:
    """Replace every nn.Linear under `model` (in place) with the format's version; dense leaves it as it is."""
    if weight_format == "dense":
        return
    convert = LINEAR_LAYOUTS[weight_format]
    with torch.no_grad(), warnings.catch_warnings():
        # torch marks its quantized-tensor constructors as deprecated; they are still the int8 path it ships.
        warnings.simplefilter("ignore")
        _replace_linears(model, convert)


def _replace_linears(module: nn.Module, convert) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, convert(child))  # the dense weight goes unless shared (a tied embedding keeps it)
        else:
            _replace_linears(child, convert)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight, PACKED_ROWS_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class Int8DynamicLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self._packed = torch.ops.quantized.linear_prepack(quantized, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range=True keeps activations to 7 bits so fbgemm's int16 accumulation cannot saturate.
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)


class Bf16Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias).float()


class DualLinear(nn.Module):
    """The dense weight and its packed copy: dense for calls of up to `dense_rows` rows, packed above."""

    def __init__(self, linear: nn.Linear, dense_rows: int = DUAL_DENSE_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dense_rows = dense_rows
        self.register_buffer("weight", linear.weight.detach())  # shared with the source (a tied embedding's too)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.packed = PackedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.dense_rows * self.in_features:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self.packed(x)


def extra_bytes(model: nn.Module, weight_format: str) -> int:
    """Memory a format holds beyond the dense weights: the dual layout's packed copies."""
    if weight_format != "dual":
        return 0
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))


# How each non-dense format converts one nn.Linear (the source layer is left as it is).
LINEAR_LAYOUTS = {"packed": PackedLinear, "dual": DualLinear, "int8": Int8DynamicLinear, "bf16": Bf16Linear}


def _int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines
