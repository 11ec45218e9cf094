"""The n-gram (prompt-lookup) proposer's matching rule and its draft-service protocol."""

import time

import pytest

from specsplit.services.draft.ngram_proposer import NgramProposer, NgramSequence
from specsplit.services.draft.proposer import DraftPrefill, ProposeItem
from specsplit.services.errors import InvalidArgument, UnknownSequence
from specsplit.services.runtime.worker_sequences import WorkerSampling

GREEDY = WorkerSampling(0.0, 0, 1.0, 0)
SAMPLED = WorkerSampling(1.0, 0, 1.0, 7)


def lookup(tokens, k, max_n=4, min_n=1):
    proposer = NgramProposer(max_n, min_n)
    proposer.prefill([DraftPrefill("s", tokens, GREEDY)])
    return proposer.lookup(proposer.sequences.get("s"), k)


def test_proposes_the_k_tokens_after_the_match():
    #         0  1  2  3  4  5  6  7  8   tail "1 2 3" matched at 0..2, followed by 4 5 6
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert lookup(tokens, 3) == [4, 5, 6]
    assert lookup(tokens, 1) == [4]
    assert lookup(tokens, 0) == []


def test_longest_tail_wins_over_a_later_shorter_match():
    # Tail "8 2 3": "2 3" occurs latest at 5..6 (followed by 9), but "8 2 3" occurs at 0..2 (followed by 4).
    tokens = [8, 2, 3, 4, 5, 2, 3, 9, 8, 2, 3]
    assert lookup(tokens, 2, max_n=3) == [4, 5]
    # Capped at n = 2, the latest "2 3" wins.
    assert lookup(tokens, 2, max_n=2) == [9, 8]


def test_latest_earlier_match_wins_among_equal_lengths():
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert lookup(tokens, 2) == [20, 21]


def test_fewer_tokens_when_the_context_ends_sooner():
    # Tail "5 6": earlier at 1..2, followed by only 7 and then the tail itself.
    tokens = [4, 5, 6, 7, 5, 6]
    assert lookup(tokens, 5) == [7, 5, 6]
    # A period-1 repetition: the latest earlier "7 7 7" leaves one token after it.
    assert lookup([7, 7, 7, 7, 7], 4, max_n=3) == [7]


def test_no_match_proposes_nothing():
    assert lookup([1, 2, 3, 4, 5], 4) == []
    assert lookup([9], 4) == []
    # Only a 1-token tail matches, and min_n = 2 refuses it.
    assert lookup([3, 1, 4, 1], 4, min_n=2) == []
    assert lookup([3, 1, 4, 1], 4, min_n=1) == [4, 1]


def test_index_matches_a_brute_force_search():
    import random

    rng = random.Random(0)
    for trial in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        max_n, min_n, k = rng.randrange(1, 5), 1, rng.randrange(1, 6)
        min_n = rng.randrange(1, max_n + 1)
        expected = []
        for n in range(max_n, min_n - 1, -1):
            if len(tokens) <= n:
                continue
            tail = tokens[-n:]
            starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tail]
            if starts:
                expected = tokens[starts[-1] + n : starts[-1] + n + k]
                break
        assert lookup(tokens, k, max_n, min_n) == expected, (tokens, max_n, min_n, k)


def test_protocol_catch_up_rewind_and_one_hot_q():
    proposer = NgramProposer(3, 1)
    assert proposer.prefill([DraftPrefill("a", [1, 2, 3, 4, 1, 2], SAMPLED)]) == [6]
    # The target's first token (3) arrives as the delta; "1 2 3" matched, followed by 4 1 2.
    (proposal,) = proposer.propose([ProposeItem("a", 6, [3], 4)])
    assert proposal.token_ids == [4, 1, 2, 3]
    assert proposal.q_token_ids.tolist() == [[4], [1], [2], [3]]  # one-hot q, even for a sampled request
    assert proposal.q_probs.tolist() == [[1.0]] * 4
    assert proposal.num_cached == 7  # the committed tokens it holds, none of its proposals
    # Two proposals accepted plus a recovered token: the coordinator sends them as the next delta.
    (proposal,) = proposer.propose([ProposeItem("a", 7, [4, 1, 9], 2)])
    assert proposer.sequences.get("a").tokens == [1, 2, 3, 4, 1, 2, 3, 4, 1, 9]
    assert proposal.token_ids == [] and tuple(proposal.q_token_ids.shape) == (0, 1)  # "9" never occurred before
    # A coordinator that keeps fewer tokens (e.g. after a retry) rewinds the context and its index.
    (proposal,) = proposer.propose([ProposeItem("a", 6, [3, 4], 3)])
    assert proposer.sequences.get("a").tokens == [1, 2, 3, 4, 1, 2, 3, 4]
    assert proposal.token_ids == [1, 2, 3]
    assert proposal.num_cached == 8


def test_bad_items_fail_alone():
    proposer = NgramProposer()
    results = proposer.prefill([DraftPrefill("a", [1, 2, 1], GREEDY), DraftPrefill("b", [], GREEDY)])
    assert results[0] == 3 and isinstance(results[1], InvalidArgument)
    results = proposer.propose([
        ProposeItem("a", 3, [2], 2),          # fine
        ProposeItem("missing", 0, [1], 2),    # never prefilled
        ProposeItem("a", 99, [1], 2),         # keeps more than it holds
        ProposeItem("a", 3, [], 2),           # no delta
        ProposeItem("a", 3, [1], 17),         # k beyond the most
    ])
    assert results[0].token_ids == [1, 2]
    assert isinstance(results[1], UnknownSequence)
    assert all(isinstance(r, InvalidArgument) for r in results[2:])
    assert proposer.release(["a", "a", "b"]) == 1 and len(proposer.sequences) == 0


@pytest.mark.parametrize("sizes", [(0, 0), (2, 3), (65, 1)])
def test_bad_sizes_are_refused(sizes):
    with pytest.raises(InvalidArgument):
        NgramProposer(*sizes)


def test_idle_sequences_expire():
    before = time.monotonic()
    assert before <= NgramSequence("x").last_used <= time.monotonic()  # a new sequence is not already idle
    proposer = NgramProposer()
    proposer.prefill([DraftPrefill("old", [1, 2], GREEDY), DraftPrefill("used", [1, 2], GREEDY)])
    proposer.sequences.get("old").last_used -= 100
    proposer.sequences.get("used").last_used -= 100
    (proposal,) = proposer.propose([ProposeItem("used", 2, [1], 1)])  # a call keeps its sequence alive
    assert proposal.token_ids == [2]
    proposer.prefill([DraftPrefill("new", [1, 2], GREEDY)])
    assert proposer.sequences.release_idle(50) == ["old"] and proposer.sequences.handles() == ["used", "new"]
    (gone,) = proposer.propose([ProposeItem("old", 2, [1], 1)])
    assert isinstance(gone, UnknownSequence)  # an expired handle is unknown to its coordinator's next call
