"""The draft-variants file (a ConfigMap key mounted into the coordinator), applied live.

    {"variants": [{"name": "stable", "weight": 90, "addresses": ["coder-draft:50051"]},
                  {"name": "canary", "weight": 10, "addresses": ["coder-draft-canary:50051"]}]}

A variant may name its proposer: "model" (the default: its addresses serve a draft model) or "ngram" (prompt lookup,
draft/ngram_proposer.py), with optional "ngram_max" and "ngram_min". An n-gram variant without addresses runs in the
coordinator itself (it needs no model and no device); with addresses, they are `specsplit draft --proposer ngram`
services, and a replica that describes itself as another kind is refused. So an n-gram variant can be a canary
beside a model draft, its acceptance and speed in the same per-variant metrics.

Polled every couple of seconds (a ConfigMap update swaps the file, changing its inode or mtime). On a change:
weights update at once; a new variant gets a pool at once and replicas as they answer (connecting never blocks
routing: a pool with no live replica is not chosen); a removed variant, or a removed address, stops receiving new
requests while the sequences pinned to it finish, and its channels close once none is left. Addresses are
re-resolved (a headless Service gives one replica per pod) whenever the file changes; replicas that failed to
connect are retried at every poll.
"""

import asyncio
import json
import logging
import os
from dataclasses import dataclass

from specsplit.services.coordinator.replica_pools import ReplicaPool
from specsplit.services.draft.ngram_proposer import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, check_ngram_range
from specsplit.services.errors import InvalidArgument
from specsplit.services.request_limits import MAX_VARIANT_NAME_BYTES, check_finite_weight, check_string

log = logging.getLogger(__name__)

# Weights are relative shares. Infinity or 1e308 made every pick fail (every request UNAVAILABLE) and NaN was
# silently ignored: anything non-finite, negative or above this is refused and the last good file stays.
MAX_VARIANT_WEIGHT = 1e6


PROPOSER_KINDS = ("model", "ngram")


@dataclass(frozen=True)
class DraftVariantSpec:
    name: str
    weight: float
    addresses: tuple[str, ...]
    proposer: str = "model"
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN

    @property
    def in_process(self) -> bool:
        """An n-gram variant without addresses: proposed by the coordinator itself."""
        return self.proposer == "ngram" and not self.addresses


def parse_draft_variants(text: str) -> list[DraftVariantSpec]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidArgument(f"draft variants file is not JSON: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("variants"), list):
        raise InvalidArgument('draft variants file must be {"variants": [...]}')
    specs, names = [], set()
    for entry in document["variants"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise InvalidArgument(f"each variant needs a name: {entry!r}")
        name = entry["name"]
        check_string("variant name", name, MAX_VARIANT_NAME_BYTES)
        if name in names:
            raise InvalidArgument(f"variant '{name}' appears twice")
        names.add(name)
        weight = check_finite_weight(f"variant '{name}'", entry.get("weight", 1), MAX_VARIANT_WEIGHT)
        addresses = entry.get("addresses", [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in addresses):
            raise InvalidArgument(f"variant '{name}': addresses must be a list of HOST:PORT")
        proposer = entry.get("proposer", "model")
        if proposer not in PROPOSER_KINDS:
            raise InvalidArgument(f"variant '{name}': proposer must be one of {', '.join(PROPOSER_KINDS)}, got {proposer!r}")
        sizes = {}
        for key in ("ngram_max", "ngram_min"):
            if key in entry:
                if proposer != "ngram":
                    raise InvalidArgument(f"variant '{name}': {key} is for proposer 'ngram' only")
                if isinstance(entry[key], bool) or not isinstance(entry[key], int):
                    raise InvalidArgument(f"variant '{name}': {key} must be an integer, got {entry[key]!r}")
                sizes[key] = entry[key]
        spec = DraftVariantSpec(name, float(weight), tuple(addresses), proposer, **sizes)
        if proposer == "ngram":
            try:
                check_ngram_range(spec.ngram_max, spec.ngram_min)
            except InvalidArgument as error:
                raise InvalidArgument(f"variant '{name}': {error}") from None
        specs.append(spec)
    return specs


def read_draft_variants(path: str) -> list[DraftVariantSpec]:
    with open(path, encoding="utf-8") as f:
        return parse_draft_variants(f.read())


class DraftVariantsWatcher:
    """Keeps `coordinator.drafts` equal to the file's variants."""

    def __init__(self, path: str, coordinator, connect, resolve, poll_seconds: float = 2.0):
        """connect: async (address) -> a connected draft client (raises when it cannot);
        resolve: (HOST:PORT) -> [replica addresses]."""
        self.path = path
        self.coordinator = coordinator
        self.connect = connect
        self.resolve = resolve
        self.poll_seconds = poll_seconds
        self.desired: dict[str, tuple[float, list[str]]] = {}  # variant -> (weight, replica addresses)
        self.in_process: dict[str, DraftVariantSpec] = {}  # n-gram variants the coordinator proposes for itself
        self.kinds: dict[str, str] = {}  # variant -> the proposer kind its replicas must serve
        self._signature = None
        self._connecting: dict[tuple[str, str], asyncio.Task] = {}
        self._retiring: list[tuple[ReplicaPool, object]] = []  # (pool, client) to close once nothing is pinned to it

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except InvalidArgument as error:  # a bad edit: say why in one line; the last good variants stay
                log.error("draft variants file %s refused, keeping the last good variants: %s", self.path, error)
            except Exception:  # anything else must not stop the watching either
                log.exception("draft variants file %s", self.path)
            await asyncio.sleep(self.poll_seconds)

    async def poll(self) -> bool:
        """Apply the file if it changed; retry connections; close what retired. Returns whether it changed."""
        changed = False
        signature = _signature(self.path)
        if signature != self._signature:
            self._signature = signature  # a bad file is reported once, not at every poll
            specs = read_draft_variants(self.path)  # raises before anything is applied
            await self.apply(specs)
            changed = True
        self._reconcile()
        await self._close_retired()
        return changed

    async def apply(self, specs: list[DraftVariantSpec]) -> None:
        loop = asyncio.get_running_loop()
        desired = {}
        for spec in specs:
            resolved = await asyncio.gather(*(loop.run_in_executor(None, self.resolve, a) for a in spec.addresses))
            desired[spec.name] = (spec.weight, sorted({r for rs in resolved for r in rs}))
        self.desired = desired
        self.in_process = {spec.name: spec for spec in specs if spec.in_process}
        self.kinds = {spec.name: spec.proposer for spec in specs}
        log.info("draft variants: %s", {name: weight for name, (weight, _) in desired.items()})
        self._reconcile()

    async def wait_connected(self, timeout: float) -> bool:
        """Wait until every variant with addresses has a replica (or time runs out)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            pools = {p.name: p for p in self.coordinator.drafts}
            if all(pools.get(name) and pools[name].replicas for name, (_, addrs) in self.desired.items() if addrs):
                return True
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)

    def _reconcile(self) -> None:
        pools = {p.name: p for p in self.coordinator.drafts}
        for pool in pools.values():
            if pool.name not in self.desired and pool.replicas:
                log.info("draft variant %s removed: no new requests; its sequences finish", pool.name)
                self._retire(pool, list(pool.replicas))
                pool.weight = 0.0
        for name, (weight, addresses) in self.desired.items():
            pool = pools.get(name)
            if pool is None:
                pool = ReplicaPool(name, [], weight)
                self.coordinator.drafts.append(pool)
            pool.weight = weight
            local = self.in_process.get(name)
            if local is not None:
                addresses = [_in_process_name(local)]
            self._retire(pool, [c for c in pool.replicas if c.name not in addresses])
            present = {c.name for c in pool.replicas}
            if local is not None:
                if addresses[0] not in present:
                    pool.replicas.append(_in_process_ngram(local))
                    log.info("draft variant %s: n-gram proposer in the coordinator (%s)", name, addresses[0])
                continue
            for address in addresses:
                key = (name, address)
                if address not in present and key not in self._connecting:
                    self._connecting[key] = asyncio.get_running_loop().create_task(self._connect(name, address))

    def _retire(self, pool: ReplicaPool, clients: list) -> None:
        """No new sequences go to these clients; the pinned ones keep them until they finish."""
        for client in clients:
            pool.replicas.remove(client)
            self._retiring.append((pool, client))

    async def _connect(self, name: str, address: str) -> None:
        try:
            client = await self.connect(address)
        except Exception as error:
            log.warning("draft %s (%s) not reachable yet: %s", address, name, error)
            return
        finally:
            self._connecting.pop((name, address), None)
        pool = next((p for p in self.coordinator.drafts if p.name == name), None)
        if pool is None or name not in self.desired or address not in self.desired[name][1]:
            await _close(client)  # the file changed while it was connecting
            return
        declared, served = self.kinds.get(name, "model"), getattr(client, "proposer_kind", "model")
        if declared != served:
            log.warning("draft %s serves proposer %r, but variant %s declares %r: not used", address, served, name, declared)
            await _close(client)
            return
        pool.down.discard(client.name)
        pool.replicas.append(client)
        log.info("draft %s joined variant %s", address, name)

    async def _close_retired(self) -> None:
        still = []
        for pool, client in self._retiring:
            if pool.load.get(client.name, 0) > 0:
                still.append((pool, client))
            else:
                await _close(client)
        self._retiring = still
        busy = {id(pool) for pool, _ in still}
        for pool in list(self.coordinator.drafts):
            # A removed variant's pool stays until its sequences are done: they unpin through it.
            if pool.name not in self.desired and not pool.replicas and id(pool) not in busy:
                self.coordinator.drafts.remove(pool)


def _in_process_name(spec: DraftVariantSpec) -> str:
    return f"in-process-ngram[{spec.ngram_min}-{spec.ngram_max}]"


def _in_process_ngram(spec: DraftVariantSpec):
    from specsplit.services.coordinator.worker_clients import LocalDraftClient
    from specsplit.services.draft.ngram_proposer import NgramProposer

    return LocalDraftClient(NgramProposer(spec.ngram_max, spec.ngram_min), name=_in_process_name(spec))


def _signature(path: str):
    stat = os.stat(path)
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


async def _close(client) -> None:
    close = getattr(client, "close", None)
    if close is not None:
        try:
            await close()
        except Exception as error:
            log.warning("closing %s: %s", getattr(client, "name", client), error)


async def start_draft_variants_watcher(
    path: str, coordinator, connect_timeout: float, security=None, client_options: dict | None = None
) -> tuple[DraftVariantsWatcher, asyncio.Task]:
    """Apply the file now, wait (up to connect_timeout) for every variant to have a replica, then keep watching.
    `security`: the coordinator's client-side TLS settings for workers; `client_options`: the other settings of its
    worker clients (transport, spin_wait; grpc_clients.py)."""
    from specsplit.services.coordinator.grpc_clients import GrpcDraftClient, expand_address

    vocab = coordinator.targets.replicas[0].vocab_size

    async def connect(address: str):
        client = GrpcDraftClient(address, security=security, **(client_options or {}))
        try:
            await client.connect(timeout=min(connect_timeout, 10.0))
            if client.vocab_size and client.vocab_size != vocab:  # 0: any vocabulary (n-gram proposer)
                raise InvalidArgument(
                    f"mismatched vocabularies: draft {address} has {client.vocab_size} tokens, target has {vocab}"
                )
        except BaseException:
            await client.close()
            raise
        return client

    watcher = DraftVariantsWatcher(path, coordinator, connect, expand_address)
    await watcher.poll()
    if not await watcher.wait_connected(connect_timeout):
        log.warning("some draft variants have no replica yet; they get requests once one answers")
    return watcher, asyncio.get_running_loop().create_task(watcher.run())
