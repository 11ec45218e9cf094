"""`--num-speculative-tokens` / a request's num_speculative_tokens is the most the speculation policy proposes, on
every entry point; a fixed k only where asked for (`--speculation fixed`, a request's fixed mode). Counted in
proposals, with a draft that never agrees (tiny models, one process); the services' side is in
tests/e2e/test_adaptive_speculation.py."""

import json

import pytest

from specsplit.cli import main
from specsplit.proto.v1 import generation_pb2
from specsplit.services.coordinator import public_messages as pm
from specsplit.services.coordinator.openai_messages import InvalidField, parse_request
from specsplit.services.errors import InvalidArgument
from specsplit.services.sampling_params import SamplingParams


def generate_local(capsys, tiny_pair, *flags) -> dict:
    assert main(["generate", "--local", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["unrelated"]),
                 "--prompt-ids", "5,6,7,8", "--max-tokens", "48", "--ignore-eos", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_local_k_is_the_policys_bound_and_fixed_only_when_asked(tiny_pair, capsys):
    bounded = generate_local(capsys, tiny_pair, "-k", "4")
    fixed = generate_local(capsys, tiny_pair, "-k", "4", "--speculation", "fixed")
    assert bounded["token_ids"] == fixed["token_ids"]
    # One process's first request: the policy measures plain decoding and one proposal, sees the draft never agree
    # and probes now and then; fixed proposes 4 every round but its last few.
    assert bounded["stats"]["draft_tokens"] <= 8, bounded["stats"]
    assert fixed["stats"]["draft_tokens"] >= 4 * (fixed["stats"]["rounds"] - 4), fixed["stats"]


def test_the_request_mode_on_the_grpc_api():
    def round_trip(params):
        return pm.params_from_pb(pm.request_pb([1, 2], params, False, ""))

    bound = round_trip(SamplingParams(num_speculative_tokens=3))
    assert (bound.num_speculative_tokens, bound.speculation) == (3, None)
    fixed = round_trip(SamplingParams(num_speculative_tokens=3, speculation="fixed"))
    assert (fixed.num_speculative_tokens, fixed.speculation) == (3, "fixed")
    servers_k_fixed = round_trip(SamplingParams(speculation="fixed"))  # FIXED with 0: the server's k, fixed
    assert (servers_k_fixed.num_speculative_tokens, servers_k_fixed.speculation) == (None, "fixed")
    off = pm.request_pb([1, 2], SamplingParams(num_speculative_tokens=0, speculation="fixed"), False, "")
    assert off.speculation.mode == generation_pb2.SPECULATION_MODE_OFF
    with pytest.raises(InvalidArgument, match="speculation must be"):
        SamplingParams(speculation="sometimes").validate()


def test_the_request_mode_on_the_openai_api():
    body = {"model": "m", "prompt": "x", "num_speculative_tokens": 2}
    assert parse_request(body, chat=False).params.speculation is None
    fixed = parse_request({**body, "speculation": "fixed"}, chat=False).params
    assert (fixed.num_speculative_tokens, fixed.speculation) == (2, "fixed")
    with pytest.raises(InvalidField, match="speculation") as refused:
        parse_request({**body, "speculation": 3}, chat=False)
    assert refused.value.param == "speculation"
