"""The split services over real gRPC between real processes: same outputs as in-process, streams, replicas,
cancellation, deadlines and bad input."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specsplit.client import Client
from specsplit.proto.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from specsplit.services.local_engine import LocalEngine
from specsplit.services.rpc import worker_messages as msg
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.verifier import VerifyItem

from cluster import item_codes, item_tokens

WORKERS = ["target_a", "target_b", "draft_a", "draft_b"]
PROMPTS = ["def add(a, b):", "hello world", "import os\nimport sys\n", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def local(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64")
    only_target = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64")

    def run(eng, prompt, **params):
        async def main():
            result = await eng.generate(prompt, SamplingParams(**params))
            await eng.coordinator.wait_idle()
            return result

        return asyncio.run(main())

    return lambda prompt, target_only=False, **params: run(only_target if target_only else engine, prompt, **params)


@pytest.mark.parametrize("coordinator", ["one_target", "two_targets"])
def test_greedy_over_grpc_equals_in_process_and_target_alone(cluster, local, coordinator):
    with Client(cluster.addresses[coordinator], timeout=60) as client:
        for prompt in PROMPTS:
            expected = local(prompt, target_only=True, max_tokens=30, ignore_eos=True).token_ids
            assert local(prompt, max_tokens=30, ignore_eos=True).token_ids == expected
            unary = client.generate(prompt, max_tokens=30, ignore_eos=True)
            assert unary.token_ids == expected
            assert unary.finish_reason == "length" and unary.stats.draft_tokens > 0
            chunks = list(client.generate_stream(prompt, max_tokens=30, ignore_eos=True))
            streamed = [t for c in chunks for t in c.token_ids]
            assert streamed == expected  # every token once, in order
            assert "".join(c.text for c in chunks) == unary.text
            assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
            assert chunks[-1].usage.completion_tokens == 30


def test_seeded_sampling_same_through_both_paths(cluster, local):
    params = dict(temperature=0.8, top_k=40, top_p=0.9, seed=2024, max_tokens=25, ignore_eos=True)
    with Client(cluster.addresses["one_target"], timeout=60) as client:
        for prompt in PROMPTS[:2]:
            assert client.generate(prompt, **params).token_ids == local(prompt, **params).token_ids


def test_concurrent_requests_with_different_parameters(cluster, local):
    cases = [
        (PROMPTS[i % len(PROMPTS)], dict(temperature=t, seed=i, max_tokens=m, ignore_eos=True, num_speculative_tokens=k))
        for i, (t, m, k) in enumerate([(0.0, 20, 4), (0.7, 15, 2), (1.0, 25, 0), (0.0, 10, 1), (0.5, 30, 3), (0.0, 18, None)] * 2)
    ]
    with Client(cluster.addresses["one_target"], timeout=60) as client, ThreadPoolExecutor(8) as pool:
        remote = list(pool.map(lambda case: client.generate(case[0], **case[1]), cases))
    for (prompt, params), got in zip(cases, remote):
        assert got.token_ids == local(prompt, **params).token_ids
        if params["num_speculative_tokens"] == 0:
            assert got.stats.draft_tokens == 0
    assert cluster.wait_kv_free(WORKERS)["draft_a"].kv_blocks_used == 0


def test_replicas_share_the_load(cluster):
    before = {n: cluster.worker_info(n).sequences_prefilled for n in WORKERS}
    with Client(cluster.addresses["one_target"], timeout=60) as a, Client(cluster.addresses["two_targets"], timeout=60) as b:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: (a if i % 2 else b).generate(PROMPTS[i % 4], max_tokens=40, ignore_eos=True), range(16)))
    after = {n: cluster.worker_info(n).sequences_prefilled for n in WORKERS}
    served = {n: after[n] - before[n] for n in WORKERS}
    assert served["draft_b"] > 0 and served["draft_a"] > 0  # one_target spreads over two drafts
    assert served["target_b"] > 0 and served["target_a"] > served["target_b"]  # two_targets spreads over two targets
    infos = cluster.wait_kv_free(WORKERS)
    assert all(i.kv_blocks_used == 0 and i.sequences == 0 for i in infos.values())


def test_cancelled_and_timed_out_requests_free_kv_everywhere(cluster):
    address = cluster.addresses["one_target"]
    with Client(address) as client:
        # Cancel a stream after its first chunk.
        stream = client.stub.GenerateStream(
            generation_pb2.GenerateRequest(text="x" * 50, stopping=generation_pb2.StoppingCriteria(max_tokens=400, ignore_eos=True))
        )
        next(stream)
        stream.cancel()
        # A deadline far shorter than the generation.
        with pytest.raises(grpc.RpcError) as timed_out:
            client.stub.Generate(
                generation_pb2.GenerateRequest(text="y" * 50, stopping=generation_pb2.StoppingCriteria(max_tokens=400, ignore_eos=True)),
                timeout=0.5,
            )
        assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        infos = cluster.wait_kv_free(WORKERS)
        assert {n: (i.kv_blocks_used, i.sequences) for n, i in infos.items()} == {n: (0, 0) for n in WORKERS}
        assert len(client.generate("still serving", max_tokens=5).token_ids) > 0


@pytest.mark.parametrize(
    "request_fields,message",
    [
        (dict(), "prompt must not be empty"),
        (dict(text="hi", sampling=generation_pb2.SamplingParameters(temperature=-1.0)), "temperature"),
        (dict(text="hi", sampling=generation_pb2.SamplingParameters(top_p=1.5)), "top_p"),
        (dict(token_ids=generation_pb2.TokenIds(ids=[1, 2, 100000])), "token ids"),
        (dict(text="z" * 600), "exceeds the context"),
        (dict(text="hi", stopping=generation_pb2.StoppingCriteria(max_tokens=0)), "max_tokens"),
        (dict(text="hi", logprobs=99), "logprobs"),
        (dict(text="hi", speculation=generation_pb2.Speculation(mode=2, num_speculative_tokens=99)), "num_speculative_tokens"),
    ],
)
def test_malformed_requests_get_invalid_argument_and_service_goes_on(cluster, request_fields, message):
    with Client(cluster.addresses["one_target"], timeout=30) as client:
        for method in (client.stub.Generate, lambda r, timeout: list(client.stub.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as error:
                method(generation_pb2.GenerateRequest(**request_fields), timeout=30)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details()
        assert len(client.generate("ok", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_worker_rejects_inconsistent_items_but_serves_the_rest(cluster):
    with grpc.insecure_channel(cluster.addresses["target_b"]) as channel:
        stub = worker_pb2_grpc.TargetWorkerStub(channel)
        sampling = worker_pb2.WorkerSampling(temperature=0.0, top_p=1.0, seed=1)
        prefill = stub.Prefill(worker_pb2.TargetPrefillRequest(items=[
            worker_pb2.TargetPrefillItem(handle="h-good", token_ids=[1, 2, 3], sampling=sampling),
            worker_pb2.TargetPrefillItem(handle="h-bad", token_ids=[], sampling=sampling),
        ]), timeout=30)
        assert item_codes(prefill) == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0]]
        first = item_tokens(prefill)[0]
        assert len(first) == 1
        bad_q = VerifyItem("h-good", 3, first, [5, 6], torch.tensor([[10**9], [6]]), torch.tensor([[1.0], [1.0]]))
        verify = stub.Verify(msg.verify_request([bad_q, VerifyItem("nobody", 0, [1]), VerifyItem("h-good", 3, first)]),
                             timeout=30)
        codes = item_codes(verify)
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.NOT_FOUND.value[0], 0]
        # Columns that do not line up fail the call alone, with INVALID_ARGUMENT, and the worker goes on.
        misaligned = msg.verify_request([VerifyItem("h-good", 3, first)])
        misaligned.cached_lens.append(7)
        with pytest.raises(grpc.RpcError) as error:
            stub.Verify(misaligned, timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cached_lens" in error.value.details()
        assert stub.Release(worker_pb2.ReleaseRequest(handles=["h-good", "h-bad"]), timeout=30).released == 1
