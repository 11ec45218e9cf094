"""What goes in and comes out of the coordinator, independent of gRPC: a request, its stream events, its result."""

from dataclasses import dataclass, field

from specsplit.services.sampling.token_logprob import TokenLogprob
from specsplit.services.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""


@dataclass
class SpeculationStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at proposal position i
    drafted_per_position: list[int] = field(default_factory=list)
    pre_proposed_rounds: int = 0  # rounds whose proposals the draft made ahead, during the previous verification

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        while len(self.drafted_per_position) < num_draft:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_draft):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)


@dataclass
class TokenEvent:
    """New tokens committed for a request, with the text they complete."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str                      # "stop", "length" or "abort"
    prompt_tokens: int
    stats: SpeculationStats
    time_to_first_token: float
    total_time: float
    logprobs: list[TokenLogprob] | None = None
    draft_variant: str = ""
    preemptions: int = 0                    # times KV pressure evicted it (it resumed from its committed tokens)
    acceptance_method: str = "rejection"    # how proposals were accepted; "typical" is NOT lossless

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
