"""The operator's own knobs (from the environment) and how kopf is set up with them.

Leader election: kopf peering. Every replica of the operator joins the `specsplit` peering object with a
priority; a replica that sees a live peer of higher priority pauses. Each process takes a random priority
unless one is given, so with several replicas exactly one works and another takes over when it stops
(at once on a clean exit, after `peering lifetime` seconds on a crash). Same-priority peers would both
work (kopf only warns), which random priorities make vanishingly unlikely.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

import kopf

from specsplit.operator.kube_client import KubeClient
from specsplit.operator.metrics import start_operator_metrics
from specsplit.operator.scraping import PodScraper
from specsplit.operator.state import OperatorState

PEERING_NAME = "specsplit"
FINALIZER = "specsplit.dev/finalizer"
ANNOTATION_PREFIX = "specsplit.dev"


@dataclasses.dataclass
class OperatorConfig:
    tick_seconds: float = 5.0  # how often the timers wake; each spec's own intervals gate the real work
    scrape_timeout_seconds: float = 3.0
    api_timeout_seconds: float = 30.0
    peering_name: str | None = PEERING_NAME  # None: standalone (a single replica, no peering object needed)
    peering_priority: int | None = None  # None: random, see the module docstring
    clock: Callable[[], float] = time.time  # injected in tests to walk through windows without sleeping
    # Called with every decision: (namespace, name, what, now, decision), `what` being target, draft,
    # canary or reconcile (the decision then is the pass's Outcome). Tests and audit hooks listen here.
    decision_listeners: list[Callable[..., None]] = dataclasses.field(default_factory=list)
    metrics_port: int = -1  # the operator's own Prometheus metrics (operator/metrics.py); < 0: none
    metrics_host: str = "127.0.0.1"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        env = dict(os.environ if env is None else env)
        priority = env.get("SPECSPLIT_OPERATOR_PRIORITY")
        return cls(
            tick_seconds=float(env.get("SPECSPLIT_OPERATOR_TICK_SECONDS", cls.tick_seconds)),
            scrape_timeout_seconds=float(env.get("SPECSPLIT_OPERATOR_SCRAPE_TIMEOUT_SECONDS",
                                                 cls.scrape_timeout_seconds)),
            peering_name=env.get("SPECSPLIT_OPERATOR_PEERING", PEERING_NAME) or None,
            peering_priority=int(priority) if priority else None,
            metrics_port=int(env.get("SPECSPLIT_OPERATOR_METRICS_PORT", cls.metrics_port)),
            metrics_host=env.get("SPECSPLIT_OPERATOR_METRICS_HOST", cls.metrics_host),
        )


@dataclasses.dataclass
class OperatorContext:
    """Shared by every handler of one operator process (kopf copies the memo per object, shallowly)."""
    config: OperatorConfig
    client: KubeClient
    scraper: PodScraper
    states: dict[str, OperatorState] = dataclasses.field(default_factory=dict)  # by the resource's uid
    metrics_server: Any = None

    @classmethod
    def create(cls, config: OperatorConfig) -> OperatorContext:
        """The context, its metrics server (if the config asks for one) already serving."""
        context = cls(config=config, client=KubeClient(timeout_seconds=config.api_timeout_seconds),
                      scraper=PodScraper(timeout_seconds=config.scrape_timeout_seconds))
        context.metrics_server = start_operator_metrics(context, config.metrics_host, config.metrics_port)
        return context

    def state_of(self, body: Any) -> OperatorState:
        """The state of the resource in `body`, with its name and the body's status (for the metrics)."""
        meta = body["metadata"]
        state = self.state(meta["uid"], body.get("status"))
        state.namespace, state.name = meta["namespace"], meta["name"]
        state.seen_status = body.get("status") or {}
        return state

    def state(self, uid: str, status: Any) -> OperatorState:
        if uid not in self.states:
            self.states[uid] = OperatorState.from_status(status)
        return self.states[uid]

    def notify(self, *record: Any) -> None:
        for listener in self.config.decision_listeners:
            listener(*record)

    async def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await asyncio.gather(self.client.close(), self.scraper.close())


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Peering, event posting and where kopf keeps its own bookkeeping."""
    if config.peering_name and not settings.peering.standalone:
        settings.peering.name = config.peering_name
        settings.peering.mandatory = True
        settings.peering.priority = (config.peering_priority if config.peering_priority is not None
                                     else random.randint(1, 1_000_000))
    # Handler log lines at WARNING and above become Events on the resource; decisions are posted explicitly.
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = FINALIZER
    # Keep kopf's progress and diff-base in annotations: the CRD's status schema is structural and kopf's
    # free-form `status.kopf` would be pruned by the API server.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
