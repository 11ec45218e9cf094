"""Seeded determinism, KV accounting after every kind of ending, stop conditions, and clear errors."""

import asyncio

import pytest
import torch

from specsplit.services.coordinator.coordinator import CoordinatorConfig
from specsplit.services.errors import InvalidArgument
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from tiny_models import EOS_ID, build_model, byte_tokenizer, save_model


def run(engine, prompts, params_list):
    async def one(prompt, params):
        return await engine.coordinator.generate(engine.request(prompt, params))

    async def main():
        results = await asyncio.gather(*(one(p, params) for p, params in zip(prompts, params_list)), return_exceptions=True)
        await engine.coordinator.wait_idle()
        return results

    return asyncio.run(main())


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64")


def test_same_seed_same_output_whatever_the_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=30, ignore_eos=True)
    alone = run(engine, ["def f(x):"], [params])[0]
    others = [SamplingParams(temperature=t, seed=s, max_tokens=m, ignore_eos=True) for t, s, m in [(1.0, 1, 5), (0.5, 2, 40), (0.0, None, 12), (1.2, 3, 30)]]
    crowd = run(engine, ["hello", "def f(x):", "zzz", "def f(x):", "def f(x):"], others[:1] + [params] + others[1:])
    assert crowd[1].token_ids == alone.token_ids
    different_seed = run(engine, ["def f(x):"], [SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=30, ignore_eos=True)])[0]
    assert different_seed.token_ids != alone.token_ids
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_stops_drop_tokens_accepted_past_them_and_free_kv(engine):
    greedy = run(engine, ["def add(a, b):"], [SamplingParams(max_tokens=40, ignore_eos=True)])[0]
    tokens, text = greedy.token_ids, greedy.text
    # Stop token id: output ends at its first occurrence, even if a round accepted more after it.
    stop_id = tokens[5]
    by_id = run(engine, ["def add(a, b):"], [SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])])[0]
    assert by_id.token_ids == tokens[: tokens.index(stop_id) + 1] and by_id.finish_reason == "stop"
    # Stop string: text is cut before it, tokens end with the one that completed it.
    tok = byte_tokenizer()
    start = next(i for i in range(8, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop_text = text[start : start + 2]
    needed = next(n for n in range(1, len(tokens) + 1) if stop_text in tok.decode(tokens[:n]))
    by_text = run(engine, ["def add(a, b):"], [SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop_text])])[0]
    assert by_text.finish_reason == "stop" and by_text.text == text[: text.index(stop_text)]
    assert by_text.token_ids == tokens[:needed]
    # Max tokens.
    short = run(engine, ["def add(a, b):"], [SamplingParams(max_tokens=7, ignore_eos=True)])[0]
    assert short.token_ids == tokens[:7] and short.finish_reason == "length"
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_eos_stops_unless_ignored(tmp_path):
    model = build_model("qwen2", seed=5).to(torch.float64)
    with torch.no_grad():  # make EOS the most likely token after a few steps: bias its output row
        model.lm_head.weight[EOS_ID] = model.lm_head.weight[EOS_ID] * 0 + 0.02
    save_model(model, tmp_path / "m")
    engine = LocalEngine(tmp_path / "m", tmp_path / "m", num_speculative_tokens=3, dtype="float64")
    free = run(engine, ["abc"], [SamplingParams(max_tokens=60, ignore_eos=True)])[0]
    stopped = run(engine, ["abc"], [SamplingParams(max_tokens=60)])[0]
    if EOS_ID in free.token_ids:
        cut = free.token_ids.index(EOS_ID) + 1
        assert stopped.token_ids == free.token_ids[:cut] and stopped.finish_reason == "stop"
    else:
        assert stopped.token_ids == free.token_ids
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_logprobs_of_emitted_tokens(engine, tiny_pair):
    ids = byte_tokenizer().encode("def f(x):")
    result = run(engine, [ids], [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)])[0]
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    with torch.no_grad():
        logits = tiny_pair["hf_target"](torch.tensor([ids + result.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, -1)
    for i, lp in enumerate(result.logprobs):
        row = reference[len(ids) - 1 + i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_prompt_larger_than_the_kv_cache_is_a_clear_error_and_others_go_on(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64", num_kv_blocks=6, block_size=16)
    long_prompt = "x" * 120  # 8 blocks: can never fit in 6, so the served context is 96 tokens
    results = run(engine, [long_prompt, "short"], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, ignore_eos=True)])
    assert isinstance(results[0], InvalidArgument) and "exceeds the context of 96" in str(results[0])
    assert len(results[1].token_ids) == 8
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_waiting_requests_get_room_when_others_finish(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=2, dtype="float64", num_kv_blocks=6, block_size=16)
    prompts = ["y" * 40] * 4  # each needs 3-4 blocks: they cannot all run at once
    results = run(engine, prompts, [SamplingParams(max_tokens=8, ignore_eos=True)] * 4)
    assert all(len(r.token_ids) == 8 for r in results)
    assert len({tuple(r.token_ids) for r in results}) == 1
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_kv_pressure_preempts_and_recomputes_instead_of_failing(tiny_pair):
    prompts = ["ab", "cd", "ef", "gh"]
    params = [SamplingParams(max_tokens=80, ignore_eos=True, temperature=t, seed=3) for t in (0.0, 0.8, 0.0, 1.0)]
    roomy = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64")
    expected = run(roomy, prompts, params)
    # 12 blocks of 16 = 192 tokens: the four sequences (~330 tokens) cannot all be held at once.
    tight = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64", num_kv_blocks=12)
    results = run(tight, prompts, params)
    # Greedy output is unchanged by preemption; sampled output stays distributed as the target's (a preemption
    # changes which proposals were made, so the same seed can give other tokens) and completes.
    for params_i, got, want in zip(params, results, expected):
        if params_i.greedy:
            assert got.token_ids == want.token_ids
        assert len(got.token_ids) == 80 and got.finish_reason == "length"
    assert sum(r.preemptions for r in results) > 0
    assert tight.kv_blocks_used() == {"target": 0, "draft": 0}


class PrefillsOnTheWire:
    """A worker client whose prefills, once sent, run on the worker whatever the caller does next (cancelling the
    await of a gRPC call does not withdraw the message it wrote); its releases go at once, as a separate call may
    overtake a message still on the wire."""

    def __init__(self, client, delay: float):
        self.client, self.delay, self.sent = client, delay, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def prefill(self, items):
        async def on_the_worker():
            await asyncio.sleep(self.delay)
            return await self.client.prefill(items)

        self.sent.append(asyncio.ensure_future(on_the_worker()))
        return await asyncio.shield(self.sent[-1])


def test_a_coordinator_closing_mid_prefill_frees_what_the_prefill_took(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=2, dtype="float64")
    pools = [engine.coordinator.targets, *engine.coordinator.drafts]
    wires = [PrefillsOnTheWire(pool.replicas[0], delay=0.2) for pool in pools]
    for pool, wire in zip(pools, wires):
        pool.replicas[0] = wire

    async def main():
        request = asyncio.ensure_future(engine.coordinator.generate(engine.request("def f(x):", SamplingParams(max_tokens=50))))
        async with asyncio.timeout(30):
            while not all(wire.sent for wire in wires):  # both prefills sent, neither answered yet
                await asyncio.sleep(0.01)
        await engine.coordinator.close()
        await asyncio.gather(*(task for wire in wires for task in wire.sent))
        return await request

    assert asyncio.run(main()).finish_reason == "abort"
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ("", SamplingParams(), "prompt must not be empty"),
        ("x" * 600, SamplingParams(), "exceeds the context"),
        ("hi", SamplingParams(num_speculative_tokens=-1), "num_speculative_tokens"),
        ("hi", SamplingParams(temperature=-0.5), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2, 999], SamplingParams(), "token ids"),
    ],
)
def test_bad_requests_are_rejected_clearly(engine, prompt, params, message):
    result = run(engine, [prompt], [params])[0]
    assert isinstance(result, InvalidArgument) and message in str(result)
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_bad_engine_arguments(tiny_pair, tmp_path):
    with pytest.raises(InvalidArgument, match="unknown model"):
        LocalEngine(str(tmp_path / "nope"), None)
    with pytest.raises(InvalidArgument, match="num_speculative_tokens"):
        LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=-2)
    other = build_model("qwen2", seed=2, vocab_size=300)
    save_model(other, tmp_path / "other", with_tokenizer=False)
    with pytest.raises(InvalidArgument, match="mismatched vocabularies"):
        LocalEngine(tiny_pair["target"], tmp_path / "other", num_speculative_tokens=2)


def test_speculation_backs_off_at_large_batch(tiny_pair):
    config = CoordinatorConfig(disable_speculation_batch_size=3)
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64", coordinator_config=config)
    few = run(engine, ["a", "b"], [SamplingParams(max_tokens=10, ignore_eos=True)] * 2)
    many = run(engine, ["a", "b", "c", "d"], [SamplingParams(max_tokens=10, ignore_eos=True)] * 4)
    assert all(r.stats.draft_tokens > 0 for r in few)
    assert all(r.stats.draft_tokens == 0 for r in many)
    assert [r.token_ids for r in many[:2]] == [r.token_ids for r in few]
