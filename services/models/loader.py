"""Load a decoder from a Hugging Face folder (config.json + safetensors), a GGUF file, or a built-in model name."""

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from specsplit.services.errors import InvalidArgument
from specsplit.services.models.config import DecoderConfig
from specsplit.services.models.decoder import CausalDecoder
from specsplit.services.models.random_checkpoint import RandomCheckpoint
from specsplit.services.models.rotary import RotaryEmbedding

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A folder with config.json, this file ({"seed", "std"}) and no weights: BENCHMARKS ONLY, random weights drawn in
# place on the model's device (a 70B shape need not exist on any disk); a sharded rank draws its own shard
# (models/sharded_loader.py).
RANDOM_WEIGHTS_MARKER = "random_weights.json"


@dataclass
class LoadedModel:
    model: CausalDecoder
    config: DecoderConfig
    tokenizer: object | None
    path: str
    name: str
    weight_format: str = "dense"  # how its linear layers hold weights (services/models/weight_formats.py)


def resolve_model_path(model: str) -> Path:
    """A built-in name (prepared on first use), a Hugging Face folder, or a .gguf file."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    try:
        from specsplit.services.models.prepare import is_builtin, resolve_model
    except ImportError:  # preparation support not installed: only paths are accepted
        is_builtin = None
    if is_builtin is not None and is_builtin(model):
        return Path(resolve_model(model))
    raise InvalidArgument(
        f"unknown model '{model}': not a built-in name (see `specsplit models list`), a folder or a .gguf file"
    )


def load_model(model: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> LoadedModel:
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    path = resolve_model_path(model)
    random_settings = None if path.is_file() else random_weights_settings(path)
    if path.is_file():
        hf_config, state, tokenizer = _read_gguf(path)
    elif random_settings is not None:  # BENCHMARKS ONLY: drawn on the device, by name (as the shards)
        hf_config, state, tokenizer = AutoConfig.from_pretrained(path), None, _tokenizer_or_none(path)
    else:
        hf_config, state, tokenizer = _read_folder(path)
    config = DecoderConfig.from_hf(hf_config)
    with torch.device("meta"):
        decoder = CausalDecoder(config)
    decoder = decoder.to(torch_dtype).to_empty(device=device)  # cast on meta: memory for the final dtype only
    if config.tie_word_embeddings:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    # Rotary frequencies stay float32 whatever the weights' dtype.
    decoder.rotary = RotaryEmbedding(hf_config, config.head_dim).to(device)
    if state is None:
        state = RandomCheckpoint(config, random_settings, torch_dtype, device)
    decoder.load_hf_state_dict(state)
    decoder.eval().requires_grad_(False)
    return LoadedModel(decoder, config, tokenizer, str(path), os.path.basename(str(path).rstrip("/")))


def random_weights_settings(path: Path) -> dict | None:
    """BENCHMARKS ONLY: a random-weights folder's settings, or None for any other model."""
    if not (path / RANDOM_WEIGHTS_MARKER).exists() or glob.glob(str(path / "*.safetensors")):
        return None
    return json.loads((path / RANDOM_WEIGHTS_MARKER).read_text())


def _read_folder(path: Path):
    if not (path / "config.json").exists():
        raise InvalidArgument(f"{path} is not a Hugging Face model folder (no config.json)")
    hf_config = AutoConfig.from_pretrained(path)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise InvalidArgument(f"{path} has no .safetensors weights")
    return hf_config, LazySafetensors(files), _tokenizer_or_none(path)


class LazySafetensors:
    """Checkpoint tensors read one at a time on demand, so loading never holds the whole file in memory beside
    the model (a 1.5B model in float32 then peaks near its own size instead of twice it)."""

    def __init__(self, files: list[str]):
        self._handles = [safe_open(f, framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def pop(self, name: str, default=None):
        handle = self._where.pop(name, None)
        return handle.get_tensor(name) if handle is not None else default

    def items(self):
        for name in list(self._where):
            yield name, self.pop(name)


def _read_gguf(path: Path):
    # transformers dequantizes GGUF tensors (into float32, which holds them exactly) and maps their names to
    # Hugging Face ones. Asked to dequantize explicitly: where it could keep GGUF blocks packed, the state dict
    # would hold raw bytes.
    from transformers import AutoModelForCausalLM

    from specsplit.services.models.prepare import dequantize_option

    hf_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **dequantize_option()
    )
    state = {k: v for k, v in hf_model.state_dict().items()}
    hf_config = hf_model.config
    del hf_model
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception:  # a GGUF without tokenizer metadata still serves token-id requests
        tokenizer = None
    return hf_config, state, tokenizer


def _tokenizer_or_none(path: Path):
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # a folder without tokenizer files still serves token-id requests
        return None
