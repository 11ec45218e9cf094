"""Short prefills as step programs (services/target/verifier.py): on a GPU they replay a graph instead of launching
an eager forward's kernels one by one. The first token, its logprobs and the KV must be the eager prefill's. On the
CPU the path is forced on (on a GPU it is opt-in, SPECSPLIT_PREFILL_STEPS=on; tests/services/test_gpu_engine.py
runs it there)."""

import asyncio

import pytest

from specsplit.services.local_engine import LocalEngine
from specsplit.services.models.loader import load_model
from specsplit.services.runtime.model_runner import ForwardItem, ModelRunner
from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.verifier import PREFILL_STEP_SIZES, TargetPrefill, TargetVerifier, VerifyItem
from tiny_models import byte_tokenizer

PROMPTS = ["x", "def add(a, b):", "Once upon a time there was a tiny model", "1, 2, 3, 5, 8, 13, 21, 34, 55, 89,"]


@pytest.fixture
def pair(tiny_pair):
    """(steps, eager): two verifiers of the tiny target, the first prefilling short prompts as step programs."""
    loaded = load_model(str(tiny_pair["target"]), dtype="float64")
    steps = TargetVerifier(ModelRunner(loaded, num_blocks=128))
    steps.prefill_steps = True
    return steps, TargetVerifier(ModelRunner(loaded, num_blocks=128))


@pytest.mark.parametrize("sampling", [WorkerSampling(0.0, 0, 1.0, 0), WorkerSampling(0.8, 20, 0.9, 7)],
                         ids=["greedy", "sampled"])
def test_a_batch_of_short_prompts_prefills_as_the_eager_forward_does(pair, sampling):
    tok = byte_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    got = {}
    eager_forwards = []
    for verifier in pair:
        forward_flat = verifier.runner.forward_flat
        verifier.runner.forward_flat = lambda items, f=forward_flat, v=verifier: eager_forwards.append(v) or f(items)
        verdicts = verifier.prefill([TargetPrefill(f"s{i}", p, sampling, logprobs=3) for i, p in enumerate(prompts)])
        # and the KV they wrote decodes the same next tokens
        after = verifier.verify([VerifyItem(f"s{i}", v.num_cached, v.token_ids) for i, v in enumerate(verdicts)])
        got[verifier is pair[0]] = [(v.token_ids, v.num_cached, v.logprobs) for v in verdicts + after]
    assert eager_forwards == [pair[1]]  # the step-program prefill ran no eager forward
    steps, eager = got[True], got[False]
    assert [g[:2] for g in steps] == [g[:2] for g in eager]
    for (_, _, a), (_, _, b) in zip(steps, eager):
        assert (a is None) == (b is None)
        for x, y in zip(a or [], b or []):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-9)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_a_prompt_whose_prefix_is_cached_runs_only_its_tail(pair):
    steps, eager = pair
    tok = byte_tokenizer()
    shared = tok.encode("a system prompt that both requests share, " * 2)  # several full blocks
    first, second = shared + tok.encode("first"), shared + tok.encode("second one")
    results = {}
    for verifier in pair:
        verifier.prefill([TargetPrefill("a", first, WorkerSampling(0.0, 0, 1.0, 0))])
        results[verifier is steps] = verifier.prefill([TargetPrefill("b", second, WorkerSampling(0.0, 0, 1.0, 0))])[0]
    assert (results[True].token_ids, results[True].num_cached) == (results[False].token_ids, results[False].num_cached)
    cache = steps.runner.block_manager.prefix_cache
    assert cache.hit_tokens >= 32  # the tail alone ran


def test_which_prefills_take_a_step(pair):
    steps, eager = pair
    table = lambda n: (0, None, ForwardItem(None, [1] * n, 1))  # noqa: E731
    assert steps._prefill_takes_step([table(PREFILL_STEP_SIZES[-1])])
    assert not steps._prefill_takes_step([table(PREFILL_STEP_SIZES[-1] + 1)])  # long: eager
    assert not steps._prefill_takes_step([table(64)] * 9)  # 9 x 64 padded tokens: past the bound, eager
    assert not eager._prefill_takes_step([table(4)])  # no graphs (the CPU): eager by default


def test_generation_with_prefill_steps_equals_eager(tiny_pair):
    tok = byte_tokenizer()
    outputs = []
    for forced in (True, False):
        engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64")
        engine.verifier.prefill_steps = forced
        params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, seed=3)
                  for t in (0.0, 0.0, 0.7, 1.0)]

        async def main():
            results = await asyncio.gather(*(engine.generate(tok.encode(p), sp) for p, sp in zip(PROMPTS, params)))
            await engine.coordinator.wait_idle()
            return results

        outputs.append([r.token_ids for r in asyncio.run(main())])
        assert engine.kv_blocks_used() == {"target": 0, "draft": 0}
    assert outputs[0] == outputs[1]
