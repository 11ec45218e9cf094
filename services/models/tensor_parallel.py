"""Tensor-parallel layers (Megatron-style) and the plan that shards a decoder over `world_size` ranks.

Per layer each rank holds its heads' slice of q/k/v (column-parallel: no communication), the matching columns of
o_proj (row-parallel: one all-reduce after attention), its slice of gate/up (column-parallel) and the matching
columns of down_proj (row-parallel: one all-reduce after the MLP). Norms and the residual stream are replicated.
A row-parallel layer without a bias leaves its partial sums unreduced: the norm that reads them next (the post-
attention norm, the next layer's input norm, the final norm) is a ReducingRMSNorm, whose all-reduce, residual add
and RMSNorm can then be one kernel (runtime/tensor_parallel_all_reduce.py).
The vocabulary is split too: each rank embeds only its rows (an all-reduce joins them; the others contribute exact
zeros) and projects the final hidden state onto its rows of the output layer; the logits are all-gathered, so the
rank that samples (rank 0) sees the whole distribution.

KV heads are split across ranks like the query heads; a model with fewer KV heads than ranks replicates each KV
head on the ranks whose query heads read it. Each rank's paged KV then holds only its own KV heads, and the sharded
model's `config` carries the per-rank head and MLP sizes (vocabulary and hidden size stay whole), so the cache, the
kernels and the model runner work on a shard exactly as on a whole model.
"""

from dataclasses import dataclass, replace

import torch
from torch import nn

from specsplit.services.models.config import DecoderConfig
from specsplit.services.models.decoder import RMSNorm


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of every sharded dimension rank `rank` of `world_size` holds."""

    config: DecoderConfig      # the whole model's
    rank: int
    world_size: int

    @property
    def heads(self) -> range:
        per_rank = self.config.num_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads: its share, or (fewer KV heads than ranks) the one its query heads read."""
        kv, world = self.config.num_kv_heads, self.world_size
        if kv >= world:
            return range(self.rank * kv // world, (self.rank + 1) * kv // world)
        first = self.heads.start // (self.config.num_heads // kv)
        return range(first, first + 1)

    @property
    def intermediate(self) -> range:
        per_rank = self.config.intermediate_size // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.world_size)  # the last rank's slice is padded with zero rows

    @property
    def vocab(self) -> range:
        return range(self.rank * self.vocab_per_rank, (self.rank + 1) * self.vocab_per_rank)

    def shard_config(self) -> DecoderConfig:
        """The per-rank shape: its heads, its KV heads and its slice of the MLP; vocabulary and hidden size whole."""
        if self.config.intermediate_size % self.world_size:
            raise ValueError(f"{self.world_size} ranks do not divide the MLP's {self.config.intermediate_size} units")
        return replace(self.config, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.intermediate))


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b. The inner `linear` is a plain nn.Linear without bias, so weight
    formats (models/weight_formats.py) convert it like any other; the bias is added once, after the sum.
    `reduce` False (no bias): y is this rank's partial sum, reduced by the ReducingRMSNorm that reads it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group, reduce: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.group = group
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return self.linear(x)
        out = self.group.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias


class ReducingRMSNorm(RMSNorm):
    """The RMSNorm after a row-parallel layer that left its partial sums unreduced: norm(all_reduce(x) + residual).
    Consecutive ones in a forward alternate `slot` (0, 1, 0, ...: a forward has an even number of them), which the
    fused kernel needs to reuse its buffers without a second barrier."""

    def __init__(self, size: int, eps: float, group, slot: int):
        super().__init__(size, eps)
        self.group = group
        self.slot = slot

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.group.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.slot)


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + rows) of the (padded) embedding table; other ranks' tokens embed as exact zeros, so the
    all-reduce returns each token's own row bit for bit."""

    def __init__(self, rows: int, first: int, hidden_size: int, group):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size))
        self.first = first
        self.group = group

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(out * mine[:, None].to(out.dtype))


class VocabParallelHead(nn.Module):
    """The output layer's rows of this rank; logits of every rank are all-gathered and the padding columns cut."""

    def __init__(self, rows: int, hidden_size: int, vocab_size: int, group):
        super().__init__()
        self.linear = nn.Linear(hidden_size, rows, bias=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.linear(hidden))[..., : self.vocab_size]


def shard_decoder(model: nn.Module, plan: ShardPlan, group) -> None:
    """Turn a CausalDecoder built from `plan.shard_config()` into rank `plan.rank`'s shard, in place (on the meta
    device: nothing is allocated here): row-parallel o_proj and down_proj (reduced in the norms after them when they
    have no bias), vocabulary-parallel embedding and head."""
    config = plan.config
    layers = model.model.layers
    deferred = not (config.o_bias or config.mlp_bias)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.q_size, config.hidden_size, config.o_bias, group, reduce=not deferred)
        mlp.down_proj = RowParallelLinear(mlp.intermediate_size, config.hidden_size, config.mlp_bias, group,
                                          reduce=not deferred)
    if deferred:
        # The norms that read them: each layer's post-attention norm reads its o_proj's output, the next layer's
        # input norm (the final norm, after the last layer) its down_proj's. Two per layer, slots 0, 1, 0, 1, ...
        readers = [reader for i, layer in enumerate(layers) for reader in (
            (layer, "post_attention_layernorm"),
            (layers[i + 1], "input_layernorm") if i + 1 < len(layers) else (model.model, "norm"))]
        for slot, (owner, name) in enumerate(readers):
            norm = getattr(owner, name)
            setattr(owner, name, ReducingRMSNorm(norm.weight.shape[0], norm.eps, group, slot % 2))
    rows = plan.vocab_per_rank
    model.model.embed_tokens = VocabParallelEmbedding(rows, plan.vocab.start, config.hidden_size, group)
    model.lm_head = VocabParallelHead(rows, config.hidden_size, config.vocab_size, group)
    model.tensor_parallel = plan
