"""Layer-invariant values are computed once per forward (kernels/forward_memo.py), and the model's output is
bit-identical to computing them in every layer."""

import contextlib

import torch

from specsplit.kernels import paged_attention
from specsplit.kernels.forward_memo import memoized, one_forward
from specsplit.services.models import decoder
from specsplit.services.models.loader import load_model
from specsplit.services.runtime.model_runner import ModelRunner
from engine_runs import run_prompt


def test_reused_inside_one_forward_only():
    a, b = torch.zeros(2), torch.zeros(2)
    calls = []

    def compute():
        calls.append(1)
        return torch.ones(1)

    with one_forward():
        first = memoized("x", (a,), (1,), compute)
        assert memoized("x", (a,), (1,), compute) is first  # the same tensors and extras: reused
        memoized("x", (b,), (1,), compute)  # another tensor
        memoized("x", (a,), (2,), compute)  # other extras
        memoized("y", (a,), (1,), compute)  # another name
    assert len(calls) == 4
    memoized("x", (a,), (1,), compute)  # outside a forward nothing is kept
    memoized("x", (a,), (1,), compute)
    assert len(calls) == 6


def test_decoder_output_bit_identical_without_the_memo(tiny_pair, monkeypatch):
    loaded = load_model(str(tiny_pair["target"]), "float32", "cpu")
    runner = ModelRunner(loaded, num_blocks=16, prefix_caching=False)
    plans = []
    real_plan = paged_attention.attention_plan
    monkeypatch.setattr(paged_attention, "attention_plan", lambda *a: plans.append(1) or real_plan(*a))

    prompt = list(range(3, 40))
    with_memo = run_prompt(runner, prompt)
    assert len(plans) == 1  # one plan for the whole forward, not one per layer
    monkeypatch.setattr(decoder, "one_forward", contextlib.nullcontext)
    without = run_prompt(runner, prompt)
    assert len(plans) == 1 + loaded.config.num_layers
    assert torch.equal(with_memo, without)
