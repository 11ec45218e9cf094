"""The loader keeps a GGUF's weights exact: loading the file itself and loading its prepared folder give the same
float32 parameters, equal to what the quantized tensors decode to (tiny Q8_0 GGUF, tests/services/models)."""

import pytest
import torch

from specsplit.services.models.loader import load_model
from specsplit.services.models.prepare import convert_gguf_to_folder

import tiny_gguf_packages as tiny_packages


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader-gguf") / "tiny.gguf"
    return path, tiny_packages.build_tiny_gguf(path)


def test_gguf_file_loads_as_exactly_its_decoded_weights(tiny_gguf):
    path, tiny = tiny_gguf
    loaded = load_model(str(path))  # the default dtype
    params = dict(loaded.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    decoded = {name: torch.from_numpy(values).to(torch.float32) for name, values in tiny.tensors.items()}
    assert torch.equal(params["model.embed_tokens.weight"], decoded["token_embd.weight"])
    # q, k and v are fused into one matrix at load time; each keeps its exact values.
    qkv = params["model.layers.1.self_attn.qkv_proj.weight"]
    q, k, v = (decoded[f"blk.1.attn_{x}.weight"] for x in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v]))
    assert not torch.equal(q.to(torch.bfloat16).float(), q)  # bf16 could not hold them
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up, torch.cat([decoded["blk.0.ffn_gate.weight"], decoded["blk.0.ffn_up.weight"]]))


def test_prepared_folder_loads_the_same_parameters_as_the_gguf(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    convert_gguf_to_folder(path, tmp_path / "folder", progress=False)
    from_file = dict(load_model(str(path)).model.named_parameters())
    from_folder = dict(load_model(str(tmp_path / "folder")).model.named_parameters())
    assert from_file.keys() == from_folder.keys()
    assert all(torch.equal(from_file[name], from_folder[name]) for name in from_file)
