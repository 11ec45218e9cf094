"""A benchmark client of an engine in this process (`specsplit bench latency | throughput`): the coordinator's
stream timed per event, as the servers' clients time theirs. `num_speculative_tokens` 0 runs the target alone on
the same engine, so both modes share the models, the KV cache and the process."""

from specsplit.bench.request_record import RequestClock, RequestRecord
from specsplit.bench.workloads import BenchRequest
from specsplit.services.coordinator.generation import GenerationRequest, GenerationResult
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.tokenization import encode_messages, encode_prompt


class EngineClient:
    def __init__(self, engine, temperature: float = 0.0, num_speculative_tokens: int | None = None):
        self.engine = engine
        self.temperature = temperature
        self.num_speculative_tokens = num_speculative_tokens

    async def start(self) -> "EngineClient":
        return self

    async def close(self) -> None:
        await self.engine.coordinator.wait_idle()

    async def send(self, request: BenchRequest) -> RequestRecord:
        temperature = self.temperature if request.temperature is None else request.temperature
        params = SamplingParams(temperature=temperature, seed=request.seed, max_tokens=request.output_len,
                                ignore_eos=True, num_speculative_tokens=self.num_speculative_tokens)
        tokenizer = self.engine.tokenizer
        ids = encode_messages(tokenizer, request.messages) if request.messages else encode_prompt(tokenizer, request.prompt, False)
        record = RequestRecord(prompt_tokens=len(ids))
        clock = RequestClock(record)
        async for event in self.engine.coordinator.stream(GenerationRequest(ids, params)):
            if isinstance(event, GenerationResult):
                record.output_tokens = event.completion_tokens
                record.rounds = event.stats.rounds
                record.drafted_tokens = event.stats.draft_tokens
                record.accepted_tokens = event.stats.accepted_tokens
            elif event.token_ids:
                clock.output()
        record.ok = True
        return clock.finish()
