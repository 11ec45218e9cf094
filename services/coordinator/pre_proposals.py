"""Proposals with a bonus guess, and proposals made ahead (overlapped rounds, services/coordinator/overlap_policy.py).

In an overlapped round the draft proposes k+1 tokens: d_1..d_k go to the target, d_{k+1} is the guess of the bonus
token. While the target verifies, the draft proposes the next round from `committed + d_1..d_k + guess` (a
*pre-proposal*). It is used only when the verdict commits exactly that continuation (all k accepted and the bonus
equals the guess): then its tokens were drawn from the draft's q given the context that is now the true one, with
the same counter uniforms (seed, absolute position) a fresh proposal would use, so rejection sampling stays exact
and seeded output does not depend on whether the round overlapped. Otherwise it is dropped; the next propose call
rewinds the draft's KV to the accepted prefix (ProposeItem.cached_len).

A sequence left without a pre-proposal *catches up* in the next overlapped round (coordinator.py): the target decodes
one token for it with no proposals, while the draft runs the committed tokens it has not seen, draws d_1 (its guess
of that token) and d_2..d_{k+1} (+ a bonus guess) beyond it. When the target's token is d_1, d_2.. is a pre-proposal
for the round after, drawn, as above, from the context that came true. Seeded sampled sequences never catch up: their
tokens depend on how many proposals each round verifies.
"""

from dataclasses import dataclass

from specsplit.services.draft.proposer import Proposal


@dataclass
class PreProposal:
    proposal: Proposal   # the next round's proposals (and its own guess as the last token, when it has one)
    client: object       # the draft replica that holds its KV
    valid_at: int        # len(committed) it was drawn for (the optimistic continuation)


def split_guess(proposal: Proposal, k: int) -> tuple[Proposal, int | None]:
    """The first k proposals (to verify) and the token after them (the bonus guess), or the proposal as it is and no
    guess when it holds no more than k tokens (no guess asked, or the draft's KV ran out). `num_cached` of the part
    kept counts the draft's KV up to d_k: the KV past it (of a cut-off tail) is rewound by the next propose."""
    tokens = proposal.token_ids
    if len(tokens) <= k:
        return proposal, None
    cut = len(tokens) - 1 - k  # proposals dropped past the guess (a pre-proposal cut to a smaller k)
    kept = Proposal(tokens[:k], proposal.q_token_ids[:k], proposal.q_probs[:k], proposal.num_cached - cut)
    return kept, tokens[k]
