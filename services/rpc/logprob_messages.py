"""Token log-probabilities between protobuf and TokenLogprob; torch-free so the Python client stays light."""

from specsplit.proto.v1 import common_pb2
from specsplit.services.sampling.token_logprob import TokenLogprob


def logprobs_pb(logprobs: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
        )
        for lp in logprobs or []
    ]


def logprobs_from_pb(items) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top]) for m in items]
