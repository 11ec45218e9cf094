"""Load one rank's shard of a decoder straight from safetensors slices: no rank ever reads the whole model.

Each checkpoint tensor is opened with `safe_open(...).get_slice(name)` and only this rank's rows (q/k/v, gate/up,
the vocabulary) or columns (o_proj, down_proj) are read; norms and the biases of row-parallel layers are read
whole (they are replicated). GGUF files are dequantized whole by transformers, so they are refused here: prepare a
Hugging Face folder first (built-in names already are one).
"""

import glob
import os
import zlib

import torch
from safetensors import safe_open
from transformers import AutoConfig

from specsplit.services.errors import InvalidArgument
from specsplit.services.models.config import DecoderConfig
from specsplit.services.models.decoder import CausalDecoder
from specsplit.services.models.loader import (DTYPES, LoadedModel, _tokenizer_or_none, random_weights_settings,
                                              resolve_model_path)
from specsplit.services.models.rotary import RotaryEmbedding
from specsplit.services.models.tensor_parallel import ShardPlan, shard_decoder



def read_decoder_config(model: str) -> DecoderConfig:
    """The whole model's shape (to check a tensor-parallel degree before any process starts)."""
    path = resolve_model_path(model)
    if path.is_file():
        raise InvalidArgument(f"tensor parallelism loads Hugging Face safetensors folders, not GGUF files ({path}); "
                              "prepare a folder first (`specsplit models prepare`)")
    return DecoderConfig.from_hf(AutoConfig.from_pretrained(path))


def load_model_shard(model: str, rank: int, world_size: int, group, dtype="float32",
                     device: str | torch.device = "cpu", with_tokenizer: bool = True) -> LoadedModel:
    """Rank `rank`'s shard as a LoadedModel whose `config` is the per-rank shape (models/tensor_parallel.py)."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    path = resolve_model_path(model)
    if path.is_file():
        read_decoder_config(model)  # raises the GGUF error
    hf_config = AutoConfig.from_pretrained(path)
    full = DecoderConfig.from_hf(hf_config)
    plan = ShardPlan(full, rank, world_size)
    with torch.device("meta"):
        decoder = CausalDecoder(plan.shard_config())
        shard_decoder(decoder, plan, group)
    decoder = decoder.to(torch_dtype).to_empty(device=device)  # cast on meta: memory for the final dtype only
    decoder.rotary = RotaryEmbedding(hf_config, full.head_dim).to(device)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    settings = random_weights_settings(path)
    if settings is not None:  # BENCHMARKS ONLY: each rank draws the whole model's tensors on its device, one at a time
        random = RandomCheckpoint(full, settings, torch_dtype, device)
        _load_slices(decoder, plan, {name: random for name in random.shapes})
    elif not files:
        raise InvalidArgument(f"{path} has no .safetensors weights")
    else:
        handles = [safe_open(f, framework="pt") for f in files]
        _load_slices(decoder, plan, {name: h for h in handles for name in h.keys()})
    if full.tie_word_embeddings:
        decoder.lm_head.linear.weight = decoder.model.embed_tokens.weight
    decoder.eval().requires_grad_(False)
    tokenizer = _tokenizer_or_none(path) if with_tokenizer else None
    return LoadedModel(decoder, plan.shard_config(), tokenizer, str(path), os.path.basename(str(path).rstrip("/")))


def _load_slices(decoder: CausalDecoder, plan: ShardPlan, where: dict) -> None:
    """`where`: checkpoint name -> what holds it (a safe_open handle, or a RandomCheckpoint)."""
    config = plan.config
    own = dict(decoder.named_parameters())
    loaded: set[str] = set()
    head_dim = config.head_dim

    def rows_of(heads: range) -> slice:
        return slice(heads.start * head_dim, heads.stop * head_dim)

    def read(name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor | None:
        handle = where.get(name)
        if handle is None:
            return None
        part = handle.get_slice(name)
        if rows is not None:
            return part[rows]
        if cols is not None:
            return part[:, cols]
        return part[:]

    def put(own_name: str, tensor: torch.Tensor) -> None:
        target = own[own_name]
        if target.shape != tensor.shape:
            raise ValueError(f"shard of {own_name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        loaded.add(own_name)

    mlp_rows = slice(plan.intermediate.start, plan.intermediate.stop)
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            parts = [read(f"{attn}q_proj.{kind}", rows_of(plan.heads)),
                     read(f"{attn}k_proj.{kind}", rows_of(plan.kv_heads)),
                     read(f"{attn}v_proj.{kind}", rows_of(plan.kv_heads))]
            if all(p is not None for p in parts):
                put(f"{attn}qkv_proj.{kind}", torch.cat(parts, 0))
            parts = [read(f"{mlp}gate_proj.{kind}", mlp_rows), read(f"{mlp}up_proj.{kind}", mlp_rows)]
            if all(p is not None for p in parts):
                put(f"{mlp}gate_up_proj.{kind}", torch.cat(parts, 0))
        put(f"{attn}o_proj.linear.weight", read(f"{attn}o_proj.weight", cols=rows_of(plan.heads)))
        put(f"{mlp}down_proj.linear.weight", read(f"{mlp}down_proj.weight", cols=mlp_rows))
        for bias in (f"{attn}o_proj.bias", f"{mlp}down_proj.bias"):
            if bias in own:
                put(bias, read(bias))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(f"model.layers.{i}.{norm}.weight", read(f"model.layers.{i}.{norm}.weight"))
    put("model.norm.weight", read("model.norm.weight"))
    put("model.embed_tokens.weight", _vocab_rows(read, "model.embed_tokens.weight", plan))
    if config.tie_word_embeddings:
        loaded.add("lm_head.linear.weight")  # tied to the embedding's rows after loading
    else:
        put("lm_head.linear.weight", _vocab_rows(read, "lm_head.weight", plan))
    missing = set(own) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing parameters: {sorted(missing)[:8]}")


def _vocab_rows(read, name: str, plan: ShardPlan) -> torch.Tensor:
    """This rank's vocabulary rows, padded with zeros past the vocabulary's end."""
    first, rows = plan.vocab.start, plan.vocab_per_rank
    stop = min(first + rows, plan.config.vocab_size)
    tensor = read(name, slice(first, stop))
    if tensor is None:
        raise ValueError(f"checkpoint is missing {name}")
    if stop - first < rows:
        tensor = torch.cat([tensor, tensor.new_zeros(rows - (stop - first), tensor.shape[1])])
    return tensor


class RandomCheckpoint:
    """BENCHMARKS ONLY: a checkpoint of random weights under the Hugging Face names, each tensor drawn whole from a
    generator seeded by its name (norms 1, every other tensor normal(0, std)), so every degree's shards are slices
    of one model and a degree-2 replica computes what a degree-4 one does. Read like safe_open's handles: a tensor
    is drawn when a slice of it is read and dropped after."""

    def __init__(self, full: DecoderConfig, settings: dict, dtype: torch.dtype, device):
        self.settings, self.dtype, self.device = settings, dtype, device
        hidden, q, kv = full.hidden_size, full.num_heads * full.head_dim, full.num_kv_heads * full.head_dim
        shapes = {"model.norm.weight": (hidden,), "model.embed_tokens.weight": (full.vocab_size, hidden)}
        if not full.tie_word_embeddings:
            shapes["lm_head.weight"] = (full.vocab_size, hidden)
        for i in range(full.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            shapes.update({f"{attn}q_proj.weight": (q, hidden), f"{attn}k_proj.weight": (kv, hidden),
                           f"{attn}v_proj.weight": (kv, hidden), f"{attn}o_proj.weight": (hidden, q),
                           f"{mlp}gate_proj.weight": (full.intermediate_size, hidden),
                           f"{mlp}up_proj.weight": (full.intermediate_size, hidden),
                           f"{mlp}down_proj.weight": (hidden, full.intermediate_size),
                           f"model.layers.{i}.input_layernorm.weight": (hidden,),
                           f"model.layers.{i}.post_attention_layernorm.weight": (hidden,)})
            if full.qkv_bias:
                shapes.update({f"{attn}q_proj.bias": (q,), f"{attn}k_proj.bias": (kv,), f"{attn}v_proj.bias": (kv,)})
            if full.o_bias:
                shapes[f"{attn}o_proj.bias"] = (hidden,)
            if full.mlp_bias:
                shapes.update({f"{mlp}gate_proj.bias": (full.intermediate_size,),
                               f"{mlp}up_proj.bias": (full.intermediate_size,), f"{mlp}down_proj.bias": (hidden,)})
        self.shapes = shapes

    def get_slice(self, name: str) -> "_Drawn":
        return _Drawn(self, name)

    def draw(self, name: str) -> torch.Tensor:
        tensor = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
        if "norm" in name:
            return tensor.fill_(1.0)
        seed = self.settings.get("seed", 0) * (1 << 32) + zlib.crc32(name.encode())
        generator = torch.Generator(device=tensor.device).manual_seed(seed)
        return tensor.normal_(0.0, self.settings.get("std", 0.02), generator=generator)


class _Drawn:
    def __init__(self, checkpoint: RandomCheckpoint, name: str):
        self.checkpoint, self.name = checkpoint, name

    def __getitem__(self, index) -> torch.Tensor:
        return self.checkpoint.draw(self.name)[index]
