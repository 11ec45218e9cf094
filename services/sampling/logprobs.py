"""Log-probabilities of emitted tokens under the target model's raw distribution, with the top-n alternatives."""

import torch

from specsplit.kernels.dispatch import top_k_rows
from specsplit.services.sampling.token_logprob import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """logits [len(token_ids), V]: the rows that produced each emitted token."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(1).tolist()
    if top_n > 0:
        top_values, top_ids = top_k_rows(logprobs, top_n)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]
