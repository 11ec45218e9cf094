"""How the coordinator reaches a draft or target replica: one interface, an in-process and a gRPC implementation.

Every call is batched: it carries many sequences and returns, per sequence, a result or the error for that
sequence alone. The in-process clients call the worker objects directly (the `--local` engine); the gRPC clients
live in specsplit.services.coordinator.grpc_clients.
"""

from typing import Protocol

from specsplit.services.draft.proposer import DraftPrefill, DraftProposer, Proposal, ProposeItem
from specsplit.services.target.verifier import TargetPrefill, TargetVerifier, Verdict, VerifyItem


class DraftClient(Protocol):
    name: str
    vocab_size: int
    max_model_len: int

    async def prefill(self, items: list[DraftPrefill]) -> list[int | Exception]: ...
    async def propose(self, items: list[ProposeItem]) -> list[Proposal | Exception]: ...
    async def release(self, handles: list[str]) -> None: ...


class TargetClient(Protocol):
    name: str
    vocab_size: int
    max_model_len: int

    async def prefill(self, items: list[TargetPrefill]) -> list[Verdict | Exception]: ...
    async def verify(self, items: list[VerifyItem]) -> list[Verdict | Exception]: ...
    async def release(self, handles: list[str]) -> None: ...


class LocalDraftClient:
    concurrent = False  # its calls run on the event loop's thread: nothing else runs meanwhile (no overlap to gain)
    in_process = True   # no deadline applies, and a call never lets the loop turn

    def __init__(self, proposer: DraftProposer, name: str = "local-draft"):
        self.proposer = proposer
        self.name = name
        self.vocab_size = proposer.vocab_size  # 0: any vocabulary (the n-gram proposer)
        self.max_model_len = proposer.max_model_len
        self.proposer_kind = proposer.kind

    async def prefill(self, items):
        return self.proposer.prefill(items)

    async def propose(self, items):
        return self.proposer.propose(items)

    async def release(self, handles):
        self.proposer.release(handles)


class LocalTargetClient:
    concurrent = False
    in_process = True

    def __init__(self, verifier: TargetVerifier, name: str = "local-target"):
        self.verifier = verifier
        self.name = name
        self.synthetic_acceptance = verifier.synthetic_acceptance  # benchmark only (target/synthetic_acceptance.py)
        self.vocab_size = verifier.runner.vocab_size
        self.max_model_len = verifier.runner.max_model_len

    async def prefill(self, items):
        return self.verifier.prefill(items)

    async def verify(self, items):
        return self.verifier.verify(items)

    async def release(self, handles):
        self.verifier.release(handles)
