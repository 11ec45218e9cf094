"""Load one rank's shard of a decoder straight from safetensors slices: no rank ever reads the whole model.

Each checkpoint tensor is opened with `safe_open(...).get_slice(name)` and only this rank's rows (q/k/v, gate/up,
the vocabulary) or columns (o_proj, down_proj) are read; norms and the biases of row-parallel layers are read
whole (they are replicated). GGUF files are dequantized whole by transformers, so they are refused here: prepare a
Hugging Face folder first (built-in names already are one).
"""

import glob
import os

import torch
from safetensors import safe_open
from transformers import AutoConfig

from specsplit.services.errors import InvalidArgument
from specsplit.services.models.config import DecoderConfig
from specsplit.services.models.decoder import CausalDecoder
from specsplit.services.models.random_checkpoint import RandomCheckpoint
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
