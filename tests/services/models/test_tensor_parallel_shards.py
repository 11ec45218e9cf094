"""Which slice of every weight a tensor-parallel rank holds, and that it reads exactly that slice from the
checkpoint (no processes: loading needs no collectives)."""

import pytest
import torch

from specsplit.services.models.config import DecoderConfig
from specsplit.services.models.sharded_loader import load_model_shard
from specsplit.services.models.tensor_parallel import ShardPlan
from tiny_models import build_model, save_model


def config(heads=4, kv_heads=2, vocab=257, intermediate=128):
    model = build_model("qwen2", num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                        intermediate_size=intermediate)
    return DecoderConfig.from_hf(model.config)


def test_kv_heads_are_split_or_replicated_by_the_query_heads_that_read_them():
    split = [ShardPlan(config(heads=4, kv_heads=2), r, 2) for r in range(2)]
    assert [(p.heads, p.kv_heads) for p in split] == [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    replicated = [ShardPlan(config(heads=4, kv_heads=2), r, 4) for r in range(4)]
    # query head h reads KV head h // 2: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1
    assert [(p.heads, p.kv_heads) for p in replicated] == [
        (range(0, 1), range(0, 1)), (range(1, 2), range(0, 1)), (range(2, 3), range(1, 2)), (range(3, 4), range(1, 2))]
    shard = replicated[3].shard_config()
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.vocab_size) == (1, 1, 32, 257)


def test_vocabulary_rows_are_padded_to_equal_slices():
    plans = [ShardPlan(config(vocab=257), r, 2) for r in range(2)]
    assert [p.vocab for p in plans] == [range(0, 129), range(129, 258)]


class NoCollectives:
    """Loading never communicates; a forward would."""

    def all_reduce(self, tensor):
        raise AssertionError("no collective while loading")

    all_gather_last = all_reduce


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_loads_exactly_its_slices(tmp_path, rank):
    hf = build_model("qwen2", seed=4)
    path = save_model(hf, tmp_path / "model")
    shard = load_model_shard(str(path), rank, 2, NoCollectives(), "float32", with_tokenizer=False)
    full = {name: tensor for name, tensor in hf.state_dict().items()}
    attn, mlp = shard.model.model.layers[1].self_attn, shard.model.model.layers[1].mlp
    head_dim = 16
    q_rows = slice(rank * 2 * head_dim, (rank + 1) * 2 * head_dim)  # two query heads per rank
    kv_rows = slice(rank * head_dim, (rank + 1) * head_dim)         # one KV head per rank
    expected_qkv = torch.cat([full["model.layers.1.self_attn.q_proj.weight"][q_rows],
                              full["model.layers.1.self_attn.k_proj.weight"][kv_rows],
                              full["model.layers.1.self_attn.v_proj.weight"][kv_rows]])
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    assert torch.equal(attn.o_proj.linear.weight, full["model.layers.1.self_attn.o_proj.weight"][:, q_rows])
    units = slice(rank * 64, (rank + 1) * 64)
    assert torch.equal(mlp.down_proj.linear.weight, full["model.layers.1.mlp.down_proj.weight"][:, units])
    assert torch.equal(mlp.gate_up_proj.weight[:64], full["model.layers.1.mlp.gate_proj.weight"][units])
    rows = shard.model.model.embed_tokens.weight
    expected_rows = full["model.embed_tokens.weight"][rank * 129 : (rank + 1) * 129]
    assert torch.equal(rows[: len(expected_rows)], expected_rows)
    assert not rows[len(expected_rows):].any()  # padding past the vocabulary
    assert shard.config.num_kv_heads == 1 and shard.model.model.layers[0].self_attn.num_heads == 2


def test_random_weights_folders_load_whole_and_as_shards(tmp_path):
    """BENCHMARKS ONLY: a config and the random-weights marker, no weights: each process draws its weights on its
    device, tensor by tensor, each from a generator seeded by its name, so the whole model (degree 1) and the shards
    of degrees 2 and 4 are one model, the same on every load."""
    import json

    from specsplit.services.models.loader import RANDOM_WEIGHTS_MARKER, load_model

    path = tmp_path / "random"
    build_model("qwen2").config.save_pretrained(path)
    (path / RANDOM_WEIGHTS_MARKER).write_text(json.dumps({"seed": 5, "std": 0.02}))
    whole, again = load_model(str(path)), load_model(str(path))
    params = dict(whole.model.named_parameters())
    assert params["model.layers.0.mlp.gate_up_proj.weight"].shape == (256, 64)
    assert all(torch.equal(p, dict(again.model.named_parameters())[n]) for n, p in params.items())
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    assert 0.015 < float(params["model.layers.1.self_attn.qkv_proj.weight"].std()) < 0.025
    shards = [load_model_shard(str(path), r, 2, NoCollectives(), "float32", with_tokenizer=False) for r in (0, 1)]
    weights = [s.model.model.layers[0].mlp.gate_up_proj.weight for s in shards]
    assert weights[0].shape == (128, 64) and not torch.equal(weights[0], weights[1])
    quarters = [load_model_shard(str(path), r, 4, NoCollectives(), "float32", with_tokenizer=False) for r in range(4)]
    for half, pair in ((shards[0], quarters[:2]), (shards[1], quarters[2:])):
        down = [s.model.model.layers[1].mlp.down_proj.linear.weight for s in (half, *pair)]
        assert torch.equal(down[0], torch.cat(down[1:], 1))  # row-parallel: columns
    vocab = build_model("qwen2").config.vocab_size  # the last rank's rows are padded past it
    whole_vocab = [torch.cat([s.model.model.embed_tokens.weight for s in each])[:vocab] for each in (shards, quarters)]
    assert torch.equal(*whole_vocab)  # the vocabulary: rows
    assert torch.equal(whole_vocab[0], params["model.embed_tokens.weight"])  # the unsharded model's too
    down = [s.model.model.layers[1].mlp.down_proj.linear.weight for s in shards]
    assert torch.equal(torch.cat(down, 1), params["model.layers.1.mlp.down_proj.weight"])
