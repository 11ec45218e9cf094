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
from specsplit.services.models.weight_formats import target_weight_request, use_weight_format
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
        proposer: str = "model",
        ngram_max: int = DEFAULT_NGRAM_MAX,
        ngram_min: int = DEFAULT_NGRAM_MIN,
    ):
        """`synthetic_acceptance`: BENCHMARK ONLY, not lossless (services/target/synthetic_acceptance.py).
        `target_weights` / `draft_weights`: how each model's linear layers hold weights (models/weight_formats.py);
        a target-only engine (no draft) turns "auto" into dense, the fastest layout for one row at a time.
        `speculation`: "adaptive" (k per round, up to num_speculative_tokens) or "fixed" (always that k); a given
        `coordinator_config` keeps its own. `warm_up`: on a GPU, capture the rounds' graphs before the first request
        (a few seconds) instead of when each shape first comes up.
        `acceptance`: the target's acceptance method; None = lossless rejection sampling (typical is NOT lossless).
        `proposer`: "model" (the `draft` model proposes) or "ngram" (prompt lookup with tails of `ngram_max` down to
        `ngram_min` tokens, draft/ngram_proposer.py; `draft` must be None)."""
        if num_speculative_tokens < 0:
            raise InvalidArgument(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.target = target if isinstance(target, LoadedModel) else load_model(target, dtype, device)
        if proposer not in ("model", "ngram"):
            raise InvalidArgument(f"proposer must be 'model' or 'ngram', not {proposer!r}")
        if proposer == "ngram" and draft is not None:
            raise InvalidArgument("the n-gram proposer uses no draft model; give draft=None")
        ngram = proposer == "ngram" and num_speculative_tokens > 0
        self.draft = None
        if draft is not None and num_speculative_tokens > 0:
            self.draft = draft if isinstance(draft, LoadedModel) else load_model(draft, dtype, device)
            check_compatible(self.target, self.draft)
        use_weight_format(self.target, target_weight_request(target_weights, self.draft is not None or ngram), "target")
        if self.draft is not None:
            use_weight_format(self.draft, draft_weights, "draft")
        self.target_runner = ModelRunner(self.target, num_blocks=num_kv_blocks, block_size=block_size,
                                         prefix_caching=prefix_caching)
        self.verifier = TargetVerifier(self.target_runner, synthetic_acceptance=synthetic_acceptance, acceptance=acceptance)
        targets = ReplicaPool("target", [LocalTargetClient(self.verifier)])
        drafts = []
        self.proposer = None
        if self.draft is not None:
            self.draft_runner = ModelRunner(self.draft, num_blocks=num_kv_blocks, block_size=block_size,
                                            prefix_caching=prefix_caching)
            self.proposer = DraftProposer(self.draft_runner, support_size=draft_support)
            drafts = [ReplicaPool("default", [LocalDraftClient(self.proposer)])]
        elif ngram:
            self.proposer = NgramProposer(ngram_max, ngram_min)
            drafts = [ReplicaPool("default", [LocalDraftClient(self.proposer, name="local-ngram")])]
        if warm_up:
            k = max(num_speculative_tokens, 1) if self.proposer is not None else 0
            self.verifier.warm_up(max_k=k)
            if self.proposer is not None:
                self.proposer.warm_up(max_k=k)
        config = coordinator_config or CoordinatorConfig(speculation=speculation)
        config.num_speculative_tokens = num_speculative_tokens if self.proposer is not None else 0
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

    async def close(self) -> None:
        await self.coordinator.close()
