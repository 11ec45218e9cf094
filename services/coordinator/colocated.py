"""The co-located mode: the coordinator runs inside a target replica's process (`specsplit target --coordinate`).

A round then makes one hop, to the draft pool, instead of two: the verification is a call into this process's
target worker (its step batcher, so the step runs inline when this coordinator is the target's only caller, and
merges with other coordinators' calls on the compute thread otherwise). The draft pool stays a service of its own,
scaled on its own; the target still serves TargetWorker over gRPC, so other coordinators can use it and this
coordinator can fail over to other target replicas (`--target`): the local replica is preferred while it is live,
and a sequence whose replica is lost is re-prefilled on another, as in the separate deployment.
"""

from specsplit.services.coordinator.process import start_coordinator
from specsplit.services.rpc.worker_credentials import COORDINATOR_ID, bind_handles, owned_handles
from specsplit.services.rpc.worker_info import worker_info
from specsplit.services.rpc.worker_process import start_worker, until_stopped
from specsplit.services.telemetry import round_timeline


INLINE_BATCH = 1  # the largest verification run on the coordinator's own thread


class ColocatedTargetClient:
    """The target replica of this process, as the coordinator's TargetClient: calls go to its step batcher under this
    coordinator's id (the handles live in the same namespace as over gRPC). Marked down after a failed step, it is
    probed back like a remote replica (`describe`)."""

    concurrent = True  # the draft's own process and device keep working while the target verifies
    in_process = True  # no deadline (nothing to hang on but this process itself)

    def __init__(self, service, name: str):
        self.service = service
        self.name = name
        self.info = worker_info("target", service.model_name, service.verifier.runner, service.verifier.sequences,
                                service.batcher, synthetic_acceptance=service.verifier.synthetic_acceptance)
        self.synthetic_acceptance = service.verifier.synthetic_acceptance  # benchmark only
        self.vocab_size = self.info.vocab_size
        self.max_model_len = self.info.max_model_len

    async def describe(self):
        """Whether the target serves: its step thread answers (a probe of a replica marked down)."""
        await self.service.batcher.submit("release", [])
        return self.info

    async def prefill(self, items):
        return await self.service.batcher.submit("prefill", bind_handles(list(items), COORDINATOR_ID))

    async def verify(self, items):
        round_timeline.mark("verify.built")
        # One sequence: the step runs on this thread (a hand-off to the compute thread and back costs more than the
        # one client-stream write it would let run meanwhile). Several: on the compute thread, while this thread
        # writes the last round's tokens to their clients instead of doing it in front of the next round.
        verdicts = await self.service.batcher.submit("verify", bind_handles(list(items), COORDINATOR_ID),
                                                     caller=COORDINATOR_ID, inline=len(items) <= INLINE_BATCH)
        round_timeline.mark("verify.unpacked")
        return verdicts

    async def release(self, handles):
        await self.service.batcher.submit("release", owned_handles(handles, COORDINATOR_ID))


async def serve_colocated(model: str, host: str, port: int, coordinator_port: int, peer_targets: list[str],
                          draft_variants: list, coordinator_options: dict, **worker_options) -> None:
    """A target worker on `port` and, in the same process, a coordinator on `coordinator_port` whose preferred
    target replica is that worker."""
    worker = await start_worker("target", model, host, port, **worker_options)
    local = ColocatedTargetClient(worker.service, f"local:{worker.address}")
    coordinator = await start_coordinator(peer_targets, draft_variants, host, coordinator_port, local_target=local,
                                          **coordinator_options)
    await until_stopped()
    await coordinator.stop()
    await worker.stop()
