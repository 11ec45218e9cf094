"""The whole split system in one process: draft and target workers called directly by the coordinator's loop.

Used by `specsplit generate --local` and by tests that prove correctness before the network is involved.
"""

from specsplit.services.coordinator.coordinator import Coordinator, CoordinatorConfig
from specsplit.services.coordinator.generation import GenerationRequest, GenerationResult
from specsplit.services.coordinator.replica_pools import ReplicaPool
from specsplit.services.coordinator.worker_clients import LocalDraftClient, LocalTargetClient
from specsplit.services.draft.ngram_proposer import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, NgramProposer
from specsplit.services.draft.proposer import DraftProposer
from specsplit.services.errors import InvalidArgument
from specsplit.services.models.loader import LoadedModel, load_model
from specsplit.services.models.layout_calibration import role_rows, use_calibrated_layout
from specsplit.services.models.weight_formats import target_weight_request
from specsplit.services.runtime.batch_invariance import check_tensor_parallel_sizes
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.acceptance_method import AcceptancePolicy
from specsplit.services.target.verifier import TargetVerifier
from specsplit.services.tokenization import encode_prompt


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's vocabulary, or its proposals mean other tokens."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise InvalidArgument(
            f"mismatched vocabularies: target has {target.config.vocab_size} tokens, draft has {draft.config.vocab_size}"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise InvalidArgument("mismatched vocabularies: the draft's tokenizer differs from the target's")


class LocalEngine:
    def __init__(
        self,
        target: str | LoadedModel,
        draft: str | LoadedModel | None,
        num_speculative_tokens: int = 4,
        dtype: str = "float32",
        device: str = "cpu",
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        draft_support: int = 32,
        coordinator_config: CoordinatorConfig | None = None,
        synthetic_acceptance: float | None = None,
        target_weights: str = "auto",
        draft_weights: str = "auto",
        prefix_caching: bool = True,
        speculation: str = "adaptive",
        warm_up: bool = True,
        acceptance: AcceptancePolicy | None = None,
        overlap: str | None = None,
        target_tensor_parallel_size: int = 1,
        draft_tensor_parallel_size: int = 1,
        proposer: str = "model",
        ngram_max: int = DEFAULT_NGRAM_MAX,
        ngram_min: int = DEFAULT_NGRAM_MIN,
        decode_ahead: str = "auto",
    ):
        """`synthetic_acceptance`: BENCHMARK ONLY, not lossless (services/target/synthetic_acceptance.py).
        `target_weights` / `draft_weights`: how each model's linear layers hold weights (models/weight_formats.py);
        "auto" on a float32 CPU model is measured once per machine for the rows each role runs
        (models/layout_calibration.py); `self.layouts` says what was chosen and why.
        `speculation`: "adaptive" (k per round, up to num_speculative_tokens) or "fixed" (always that k); a given
        `coordinator_config` keeps its own. `warm_up`: on a GPU, capture the rounds' graphs before the first request
        (a few seconds) instead of when each shape first comes up.
        `acceptance`: the target's acceptance method; None = lossless rejection sampling (typical is NOT lossless).
        `overlap`: overlapped rounds ("auto", "on", "off"; None = the config's, "auto" by default). In one process the
        two models' calls run one after the other, so "auto" never overlaps; "on" runs the pipelined logic anyway.
        `target_tensor_parallel_size` / `draft_tensor_parallel_size`: shard a model (given by name or folder) over
        that many ranks, this process being rank 0 (runtime/tensor_parallel_launch.py); gloo on the CPU. A sharded
        model keeps the fixed default layouts (no calibration).
        `proposer`: "model" (the `draft` model proposes) or "ngram" (prompt lookup with tails of `ngram_max` down to
        `ngram_min` tokens, draft/ngram_proposer.py; `draft` must be None).
        `decode_ahead`: the target runs plain decodes' next steps ahead ("auto", "on", "off"; target/decode_ahead.py:
        auto = on a GPU, where the step runs while the coordinator commits)."""
        if num_speculative_tokens < 0:
            raise InvalidArgument(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if proposer not in ("model", "ngram"):
            raise InvalidArgument(f"proposer must be 'model' or 'ngram', not {proposer!r}")
        if proposer == "ngram" and draft is not None:
            raise InvalidArgument("the n-gram proposer uses no draft model; give draft=None")
        check_tensor_parallel_sizes({"target": target_tensor_parallel_size, "draft": draft_tensor_parallel_size})
        ngram = proposer == "ngram" and num_speculative_tokens > 0
        speculative = draft is not None and num_speculative_tokens > 0
        runner_options = dict(num_blocks=num_kv_blocks, block_size=block_size, prefix_caching=prefix_caching)
        self.sharded_runners = []
        target_format = target_weight_request(target_weights, speculative or ngram)
        if target_tensor_parallel_size > 1:
            self.target_runner = self._sharded(target, target_tensor_parallel_size, "target", dtype, device,
                                               target_format, runner_options)
            self.target = self.target_runner.loaded
        else:
            self.target = target if isinstance(target, LoadedModel) else load_model(target, dtype, device)
        self.draft = None
        if speculative:
            if draft_tensor_parallel_size > 1:
                self.draft_runner = self._sharded(draft, draft_tensor_parallel_size, "draft", dtype, device,
                                                  draft_weights, runner_options)
                self.draft = self.draft_runner.loaded
            else:
                self.draft = draft if isinstance(draft, LoadedModel) else load_model(draft, dtype, device)
            check_compatible(self.target, self.draft)
        k = num_speculative_tokens if self.draft is not None or ngram else 0
        self.layouts = {}
        if target_tensor_parallel_size <= 1:
            self.layouts["target"] = use_calibrated_layout(self.target, target_weights, "target", role_rows("target", k))
            self.target_runner = ModelRunner(self.target, **runner_options)
        if self.draft is not None and draft_tensor_parallel_size <= 1:
            self.layouts["draft"] = use_calibrated_layout(self.draft, draft_weights, "draft", role_rows("draft", k))
        self.verifier = TargetVerifier(self.target_runner, synthetic_acceptance=synthetic_acceptance, acceptance=acceptance,
                                       decode_ahead=decode_ahead)
        targets = ReplicaPool("target", [LocalTargetClient(self.verifier)])
        drafts = []
        self.proposer = None
        if self.draft is not None:
            if draft_tensor_parallel_size <= 1:
                self.draft_runner = ModelRunner(self.draft, **runner_options)
            self.proposer = DraftProposer(self.draft_runner, support_size=draft_support)
            drafts = [ReplicaPool("default", [LocalDraftClient(self.proposer)])]
        elif ngram:
            self.proposer = NgramProposer(ngram_max, ngram_min)
            drafts = [ReplicaPool("default", [LocalDraftClient(self.proposer, name="local-ngram")])]
        if warm_up:
            k = max(num_speculative_tokens, 1) if self.proposer is not None else 0
            self.verifier.warm_up(max_k=k)
            if self.proposer is not None:
                self.proposer.warm_up(max_k=DraftProposer.warm_up_bound(k))
        config = coordinator_config or CoordinatorConfig(speculation=speculation)
        config.num_speculative_tokens = num_speculative_tokens if self.proposer is not None else 0
        if overlap is not None:
            config.overlap = overlap
        self.coordinator = Coordinator(targets, drafts, self.target.tokenizer, self.target.config.eos_token_ids, config)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def request(self, prompt: str | list[int], params: SamplingParams, chat: bool = False) -> GenerationRequest:
        return GenerationRequest(encode_prompt(self.tokenizer, prompt, chat), params)

    async def generate(self, prompt: str | list[int], params: SamplingParams, chat: bool = False) -> GenerationResult:
        return await self.coordinator.generate(self.request(prompt, params, chat))

    def kv_blocks_used(self) -> dict[str, int]:
        used = {"target": self.target_runner.block_manager.num_used_blocks}
        if self.draft is not None:
            used["draft"] = self.draft_runner.block_manager.num_used_blocks
        return used

    def _sharded(self, model, degree: int, role: str, dtype, device, weight_format: str, runner_options: dict):
        from specsplit.services.runtime.tensor_parallel_launch import start_tensor_parallel_runner

        if isinstance(model, LoadedModel):
            raise InvalidArgument(f"a tensor-parallel {role} is loaded shard by shard: give its name or folder")
        runner = start_tensor_parallel_runner(model, degree, role, dtype, device, weight_format, **runner_options)
        self.sharded_runners.append(runner)
        return runner

    async def close(self) -> None:
        await self.coordinator.close()
        for runner in self.sharded_runners:  # stop the other ranks of sharded models
            runner.close()
        self.sharded_runners = []
