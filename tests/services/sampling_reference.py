"""Distributions a request samples from, computed without the engine's filter (services/sampling/logits_processing.py),
so tests that compare against them can catch a bug in it.

- `warped_probs`: transformers' own TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in that order.
- `defined_probs`: the rules written out for one row in plain Python, ties included: top-k keeps every token at or
  above the k-th largest logit; top-p goes down from the most likely token while the mass before it is below top_p
  and keeps every token tied with the last one taken. Without ties at a cut the two agree; with them transformers'
  top-p keeps only the tied tokens its sort puts first.
"""

import math

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def warped_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [N, V] (every row with the same settings) -> probs [N, V] in the logits' dtype; temperature 0 is
    greedy: one-hot at the argmax."""
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if 0 < top_k < logits.shape[-1]:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


def defined_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """One row, in float64 Python arithmetic."""
    if temperature == 0:
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))  # the first of tied maxima, as argmax
        return [float(i == best) for i in range(len(logits))]
    scaled = [x / temperature for x in logits]
    kept = list(range(len(scaled)))
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        kept = [i for i in kept if scaled[i] >= kth]
    if top_p < 1.0:
        top = max(scaled[i] for i in kept)
        total = sum(math.exp(scaled[i] - top) for i in kept)
        mass, last = 0.0, None
        for value in sorted((scaled[i] for i in kept), reverse=True):
            if mass >= top_p:
                break
            last = value
            mass += math.exp(value - top) / total
        kept = [i for i in kept if scaled[i] >= last]
    probs = _softmax({i: scaled[i] for i in kept})
    return [probs.get(i, 0.0) for i in range(len(scaled))]


def _softmax(scaled: dict[int, float]) -> dict[int, float]:
    top = max(scaled.values())
    weights = {i: math.exp(x - top) for i, x in scaled.items()}
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}
