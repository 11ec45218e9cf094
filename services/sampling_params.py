"""What a request asks for: how to sample, when to stop, what to return. Validated once, at admission."""

from dataclasses import dataclass, field

from specsplit.services.errors import InvalidArgument
from specsplit.services.request_limits import INT32_MAX, UINT32_MAX, check_temperature, check_top_k, check_top_p, \
    effective_temperature
from specsplit.services.target.acceptance_method import check_acceptance

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256
SPECULATION_MODES = (None, "adaptive", "fixed")


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = no top-k
    seed: int | None = None           # None = a fresh random seed per request
    max_tokens: int | None = None     # None = until end of sequence, bounded by the model's context
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # None = no logprobs; n >= 0 = chosen token plus top-n alternatives
    num_speculative_tokens: int | None = None  # the most per round; None = the server's default; 0 = off
    speculation: str | None = None    # None / "adaptive": the deployment's policy picks k per round, up to the above;
                                      # "fixed": exactly num_speculative_tokens (or the server's k) every round
    # None = the deployment's; "typical" is NOT lossless (services/target/acceptance_method.py)
    acceptance_method: str | None = None
    posterior_threshold: float | None = None  # typical acceptance only; None = the deployment's
    posterior_alpha: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_speculative_tokens: int = 16) -> "SamplingParams":
        check_temperature(self.temperature)
        self.temperature = effective_temperature(self.temperature)  # tiny positive temperatures are greedy
        check_top_p(self.top_p)
        check_top_k(self.top_k)
        if self.max_tokens is not None and not (1 <= self.max_tokens <= UINT32_MAX):  # None: until end of sequence
            raise InvalidArgument(f"max_tokens must be in [1, {UINT32_MAX}], got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidArgument(f"seed must be in [0, 2^63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_LENGTH for s in self.stop):
            raise InvalidArgument(
                f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_LENGTH} chars"
            )
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidArgument(f"stop_token_ids must be in [0, {INT32_MAX}]")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        k = self.num_speculative_tokens
        if k is not None and not (0 <= k <= max_speculative_tokens):
            raise InvalidArgument(f"num_speculative_tokens must be in [0, {max_speculative_tokens}], got {k}")
        if self.speculation not in SPECULATION_MODES:
            raise InvalidArgument(f"speculation must be 'adaptive' or 'fixed', got {self.speculation!r}")
        check_acceptance(self.acceptance_method, self.posterior_threshold, self.posterior_alpha)
        return self

    @property
    def fixed_speculation(self) -> bool:
        return self.speculation == "fixed"
