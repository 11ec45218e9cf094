"""Decoding ahead (services/target/decode_ahead.py): the target runs a plain decode's next step before it is asked,
and the call that asks exactly that takes it. The tokens, logprobs and KV must be those of the normal path; a call
that asks something else must run its own step on a KV that holds nothing of the step ahead. On the CPU the mode is
forced on (its `auto` is on only on a GPU; tests/services/test_gpu_engine.py checks it there)."""

import asyncio

import pytest

from specsplit.services.errors import InvalidArgument
from specsplit.services.local_engine import LocalEngine
from specsplit.services.models.loader import load_model
from specsplit.services.rpc import worker_messages
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.runtime.worker_sequences import WorkerSampling
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.decode_ahead import decode_ahead_enabled
from specsplit.services.target.verifier import TargetPrefill, TargetVerifier, VerifyItem
from tiny_models import byte_tokenizer

PROMPTS = ["def add(a, b):", "x", "Once upon a time", "1, 2, 3, 5, 8,"]
GREEDY = WorkerSampling(0.0, 0, 1.0, 0)


def _generate(engine, params):
    tok = byte_tokenizer()

    async def main():
        results = await asyncio.gather(*(engine.coordinator.generate(engine.request(tok.encode(p), sp))
                                         for p, sp in zip(PROMPTS, params)))
        await engine.coordinator.wait_idle()
        return results

    return asyncio.run(main())


@pytest.mark.parametrize("sampled", [False, True])
def test_target_only_output_is_the_same_with_the_steps_run_ahead(tiny_pair, sampled):
    """Greedy, and seeded sampling with logprobs (its tokens come from the counter randomness of their positions):
    the same tokens and logprobs as without decode ahead, nearly every round answered ahead, no step wasted on a
    sequence that ends by its length, and every KV block back."""
    if sampled:
        params = [SamplingParams(max_tokens=12 + i, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True,
                                 logprobs=2) for i in range(len(PROMPTS))]
    else:
        params = [SamplingParams(max_tokens=16, ignore_eos=True) for _ in PROMPTS]
    runs = {}
    for mode in ("off", "on"):
        engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64", decode_ahead=mode)
        results = _generate(engine, params)
        runs[mode] = ([r.token_ids for r in results], [r.logprobs for r in results], engine.verifier.decode_ahead)
        assert engine.kv_blocks_used() == {"target": 0}
    assert runs["on"][0] == runs["off"][0]
    assert runs["on"][1] == runs["off"][1]
    ahead = runs["on"][2]
    decode_calls = sum(sp.max_tokens - 1 for sp in params)  # the first token comes from the prefill
    assert ahead.taken >= decode_calls - len(PROMPTS)  # all but each sequence's first decode
    assert ahead.launched == ahead.taken and ahead.missed == 0
    assert runs["off"][2].launched == 0


def test_speculating_sequences_never_run_ahead(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                         speculation="fixed", decode_ahead="on")
    results = _generate(engine, [SamplingParams(max_tokens=16, ignore_eos=True) for _ in PROMPTS])
    assert all(r.stats.draft_tokens > 0 for r in results)
    assert engine.verifier.decode_ahead.launched == 0


@pytest.fixture
def verifiers(tiny_pair):
    """A verifier that decodes ahead and one that does not, each on its own runner of the tiny target."""
    loaded = load_model(str(tiny_pair["target"]), dtype="float64")
    return (TargetVerifier(ModelRunner(loaded, num_blocks=64), decode_ahead="on"),
            TargetVerifier(ModelRunner(loaded, num_blocks=64), decode_ahead="off"))


def _prefill(verifier, handles, prompt):
    return [v.token_ids[0] for v in verifier.prefill([TargetPrefill(h, list(prompt), GREEDY) for h in handles])]


def test_a_call_that_asks_something_else_runs_its_own_step(verifiers):
    """After a step ahead from token t, a call that rewinds one token and asks for another delta (as after a
    preemption or a coordinator's retry) gets what a verifier that never ran ahead gives, and the KV of the step
    ahead is gone."""
    ahead, plain = verifiers
    prompt = byte_tokenizer().encode("Once upon a time")
    first = _prefill(ahead, ["a"], prompt)
    assert first == _prefill(plain, ["a"], prompt)
    cached = len(prompt)
    verdict = ahead.verify([VerifyItem("a", cached, [first[0]], decode_ahead=True)])[0]
    plain.verify([VerifyItem("a", cached, [first[0]])])
    assert ahead.decode_ahead.launched == 1
    assert ahead.sequences.get("a").table.num_tokens == verdict.num_cached + 1  # the step ahead holds one more slot
    other = [(verdict.token_ids[0] + 1) % ahead.runner.vocab_size, 5]
    got = ahead.verify([VerifyItem("a", verdict.num_cached - 1, other)])[0]
    want = plain.verify([VerifyItem("a", verdict.num_cached - 1, other)])[0]
    assert (got.token_ids, got.num_cached) == (want.token_ids, want.num_cached)
    assert ahead.decode_ahead.missed == 1 and ahead.decode_ahead.taken == 0
    # and the sequence goes on from there as the plain one does
    got = ahead.verify([VerifyItem("a", got.num_cached, got.token_ids)])[0]
    want = plain.verify([VerifyItem("a", want.num_cached, want.token_ids)])[0]
    assert (got.token_ids, got.num_cached) == (want.token_ids, want.num_cached)


def test_a_sequence_joining_runs_beside_the_rows_answered_ahead(verifiers):
    ahead, plain = verifiers
    prompt = byte_tokenizer().encode("def add(a, b):")
    tokens = {}
    for verifier in verifiers:
        first = _prefill(verifier, ["a", "b"], prompt)
        verdicts = verifier.verify([VerifyItem(h, len(prompt), [t], decode_ahead=True) for h, t in zip("ab", first)])
        third = _prefill(verifier, ["c"], prompt)
        calls = [VerifyItem(h, v.num_cached, v.token_ids, decode_ahead=True) for h, v in zip("ab", verdicts)]
        calls.append(VerifyItem("c", len(prompt), third, decode_ahead=True))
        tokens[verifier is ahead] = [(v.token_ids, v.num_cached) for v in verifier.verify(calls)]
    assert tokens[True] == tokens[False]
    assert ahead.decode_ahead.taken == 2 and ahead.decode_ahead.launched == 2 + 3


def test_a_call_that_asks_for_logprobs_the_step_ahead_did_not_compute_runs_its_own(verifiers):
    ahead, plain = verifiers
    prompt = byte_tokenizer().encode("1, 2, 3, 5, 8,")
    for verifier in verifiers:
        first = _prefill(verifier, ["a"], prompt)
        verdict = verifier.verify([VerifyItem("a", len(prompt), first, decode_ahead=True)])[0]
        got = verifier.verify([VerifyItem("a", verdict.num_cached, verdict.token_ids, logprobs=2)])[0]
        assert got.logprobs is not None and len(got.logprobs[0].top) == 2
        if verifier is ahead:
            with_ahead = got
    assert ahead.decode_ahead.missed == 1
    assert with_ahead.token_ids == got.token_ids
    assert with_ahead.logprobs[0].logprob == pytest.approx(got.logprobs[0].logprob, abs=1e-9)


def test_typical_acceptance_requests_decode_ahead_alike(tiny_pair):
    """Typical acceptance (NOT lossless, opted in) adds its fields to a step: a step ahead carries them too."""
    from specsplit.services.target.acceptance_method import AcceptancePolicy

    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    outputs = []
    for mode in ("off", "on"):
        engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64", decode_ahead=mode,
                             acceptance=AcceptancePolicy(method="typical"))
        outputs.append([r.token_ids for r in _generate(engine, params)])
        assert mode == "off" or engine.verifier.decode_ahead.taken > 0
    assert outputs[0] == outputs[1]


def test_release_drops_the_step_ahead_and_its_kv(verifiers):
    ahead, _ = verifiers
    free = ahead.runner.block_manager.num_free_blocks
    prompt = byte_tokenizer().encode("x" * 40)
    first = _prefill(ahead, ["a"], prompt)
    ahead.verify([VerifyItem("a", len(prompt), first, decode_ahead=True)])
    assert ahead.decode_ahead.rows
    ahead.release(["a"])
    assert not ahead.decode_ahead.rows
    assert ahead.runner.block_manager.num_free_blocks == free
    # the handle can start over, and its first call is not answered by the dropped step
    first = _prefill(ahead, ["a"], prompt)
    ahead.verify([VerifyItem("a", len(prompt), first)])
    assert ahead.decode_ahead.taken == 0


def test_no_step_ahead_without_room_or_at_the_context_end(tiny_pair):
    loaded = load_model(str(tiny_pair["target"]), dtype="float64")
    verifier = TargetVerifier(ModelRunner(loaded, num_blocks=2, block_size=16), decode_ahead="on")
    prompt = list(range(1, 31))  # 30 tokens: the call's token is the 31st of 32 slots, the next would be the 32nd
    first = _prefill(verifier, ["a"], prompt)
    verdict = verifier.verify([VerifyItem("a", 30, first, decode_ahead=True)])[0]
    assert verdict.num_cached == 31 and verifier.decode_ahead.launched == 1
    verdict = verifier.verify([VerifyItem("a", 31, verdict.token_ids, decode_ahead=True)])[0]
    assert verdict.num_cached == 32 and verifier.decode_ahead.taken == 1
    assert verifier.decode_ahead.launched == 1  # no 33rd slot: nothing run ahead
    assert verifier.sequences.get("a").table.num_tokens == 32


def test_the_hint_travels_in_the_verify_message():
    items = [VerifyItem("a", 3, [1], decode_ahead=True), VerifyItem("b", 4, [2])]
    decoded = worker_messages.verify_items(worker_messages.verify_request(items))
    assert [i.decode_ahead for i in decoded] == [True, False]
    plain = worker_messages.verify_request([VerifyItem("a", 3, [1])])
    assert list(plain.decode_ahead) == []  # none set: the column stays empty
    assert [i.decode_ahead for i in worker_messages.verify_items(plain)] == [False]
    plain.decode_ahead.extend([True, True])  # a column that does not line up with the handles: the request is refused
    with pytest.raises(InvalidArgument, match="decode_ahead holds 2 values for 1 sequences"):
        worker_messages.verify_items(plain)


def test_modes():
    assert decode_ahead_enabled("auto", "cuda") and not decode_ahead_enabled("auto", "cpu")
    assert decode_ahead_enabled("on", "cpu") and not decode_ahead_enabled("off", "cuda")
    with pytest.raises(ValueError, match="auto, on, off"):
        decode_ahead_enabled("sometimes", "cpu")
