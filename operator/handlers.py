"""kopf handlers: thin, each turning one kind of event into a reconcile pass, a scaling or a canary decision.

Registered into a given registry by `register()` (the `kopf run` entry point uses the default one; tests
their own), so the timers' wake-up interval is a setting, not an import-time constant.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import kopf

from specsplit.operator import canary_policy, conditions, naming, scaling_policy
from specsplit.operator.apply import OwnershipConflict, apply_merge_patch, last_applied
from specsplit.operator.kube_client import DEPLOYMENTS, ApiError
from specsplit.operator.reconcile import (
    Outcome,
    healthy_status,
    invalid_status,
    owned_names,
    reconcile,
    remove_if_present,
    status_changes,
)
from specsplit.operator.scraping import aggregate, canary_reports, scrape_role
from specsplit.operator.settings import OperatorConfig, OperatorContext, configure_kopf
from specsplit.operator.spec import DeploymentSpec, InvalidSpecError, parse_spec
from specsplit.operator.state import PROMOTED, ROLLED_BACK, OperatorState, Promotion

RESOURCE = (naming.GROUP, naming.VERSION, naming.PLURAL)
RETRY_SECONDS = 15


# --- operator lifecycle ---------------------------------------------------------------------------------------

async def operator_startup(settings: kopf.OperatorSettings, memo: Any, config: OperatorConfig, **_: Any) -> None:
    if getattr(memo, "context", None) is None:
        memo.context = OperatorContext.create(config)
    configure_kopf(settings, memo.context.config)


async def operator_login(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: the kubeconfig. The operator's own client reuses the same."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        memo.context.client.connect(info)
    return info


async def operator_cleanup(memo: Any, **_: Any) -> None:
    await memo.context.close()


# --- SpeculativeDeployment ------------------------------------------------------------------------------------

async def speculativedeployment_create(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    await _reconcile_handler(body, patch, memo.context)


async def speculativedeployment_update(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    await _reconcile_handler(body, patch, memo.context)


async def speculativedeployment_resume(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    await _reconcile_handler(body, patch, memo.context)


async def speculativedeployment_delete(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """Owner references would let the garbage collector do this later; deleting now makes removal prompt
    and complete (the canary's objects included) before the resource itself goes."""
    context: OperatorContext = memo.context
    namespace, instance = body["metadata"]["namespace"], body["metadata"]["name"]
    state = context.state_of(body)
    async with state.lock:
        state.deleted = True
        for kind, name in owned_names(instance):
            if await remove_if_present(context.client, namespace, kind, name, body["metadata"]["uid"]):
                logger.info("deleted %s %s", kind, name)
    context.states.pop(body["metadata"]["uid"], None)


async def speculativedeployment_autoscale(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    """Every autoscaling.intervalSeconds: scrape both pools, decide each on its own, apply, keep objects in shape."""
    context: OperatorContext = memo.context
    spec = _valid_spec_or_none(body)
    if spec is None:
        return  # the change handlers have put the reasons in status
    now = context.config.clock()
    state = context.state_of(body)
    async with state.lock:
        if state.deleted or body["metadata"].get("deletionTimestamp"):
            return
        if state.last_autoscale is not None and now - state.last_autoscale < spec.autoscaling.interval_seconds:
            return
        state.last_autoscale = now
        state.follow_spec(spec, now)
        for role, role_spec in ((naming.TARGET, spec.target), (naming.DRAFT, spec.draft)):
            await _scale_role(context, body, spec, state, role, role_spec.replicas.min, role_spec.replicas.max,
                              role_spec.metric_targets, now)
        await _apply_and_record(context, body, patch, spec, state, now)


async def speculativedeployment_canary(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    """Every promotion.intervalSeconds of a running canary: compare the variants, then step, promote or roll back."""
    context: OperatorContext = memo.context
    spec = _valid_spec_or_none(body)
    if spec is None or spec.canary is None:
        return
    now = context.config.clock()
    state = context.state_of(body)
    async with state.lock:
        if state.deleted or body["metadata"].get("deletionTimestamp"):
            return
        state.follow_spec(spec, now)
        canary = state.canary
        if canary is None or not state.canary_active():
            return
        if state.last_canary_evaluation is not None and \
                now - state.last_canary_evaluation < spec.canary.promotion.interval_seconds:
            return
        state.last_canary_evaluation = now
        meta = body["metadata"]
        reports = await canary_reports(context.client, context.scraper, meta["namespace"], meta["name"],
                                       colocated=spec.coordinator.colocated)
        decision = canary_policy.decide(canary_policy.merge_reports(reports), canary.weight, spec.canary.promotion,
                                        naming.STABLE_VARIANT, naming.CANARY_VARIANT)
        context.notify(meta["namespace"], meta["name"], "canary", now, decision)
        if decision.action == canary_policy.HOLD and decision.code == canary.last_decision_code:
            return  # nothing new to record or do
        if decision.action == canary_policy.PROMOTE:
            state.promotion = Promotion(model=canary.model, replaced_model=spec.draft.model, time=now)
            canary.phase = PROMOTED
        elif decision.action == canary_policy.ROLLBACK:
            canary.phase = ROLLED_BACK
        canary.weight = decision.weight
        canary.last_decision, canary.last_decision_code = decision.action, decision.code
        canary.last_decision_message, canary.last_decision_time = decision.message, now
        reason = {canary_policy.PROMOTE: "CanaryPromoted", canary_policy.ROLLBACK: "CanaryRolledBack",
                  canary_policy.STEP_UP: "CanaryStepUp"}.get(decision.action, "CanaryHold")
        kopf.event(body, type="Warning" if decision.action == canary_policy.ROLLBACK else "Normal",
                   reason=reason, message=f"{canary.model}: {decision.message}")
        await _apply_and_record(context, body, patch, spec, state, now)


# --- owned Deployments ----------------------------------------------------------------------------------------

async def deployment_event(type: str | None, body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """The operator alone sets replica counts: a count someone else wrote is put back, and the owner is told."""
    if type == "DELETED":
        return  # a deleted pool comes back with the next reconcile pass
    owner = _owner_reference(body)
    previous = last_applied(body)
    if owner is None or previous is None:
        return
    wanted, actual = previous.get("spec", {}).get("replicas"), body.get("spec", {}).get("replicas")
    if wanted is None or actual == wanted:
        return
    context: OperatorContext = memo.context
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    state = context.states.get(owner["uid"])
    async with (state.lock if state is not None else contextlib.nullcontext()):
        fresh = await context.client.get(DEPLOYMENTS, namespace, name)  # the lock may have waited on a write
        if fresh is None or (last_applied(fresh) or {}).get("spec", {}).get("replicas") != wanted \
                or fresh.get("spec", {}).get("replicas") == wanted:
            return
        await context.client.patch(DEPLOYMENTS, namespace, name, {"spec": {"replicas": wanted}})
    owner_body = {"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                  "metadata": {"name": owner["name"], "namespace": namespace, "uid": owner["uid"]}}
    message = (f"{name}: replicas set to {actual} by someone else; the operator owns replica counts "
               f"and set it back to {wanted}")
    logger.info(message)
    kopf.event(owner_body, type="Warning", reason="ReplicasOverridden", message=message)


# --- shared steps ---------------------------------------------------------------------------------------------

def _valid_spec_or_none(body: Mapping[str, Any]) -> DeploymentSpec | None:
    try:
        return parse_spec(body.get("spec"), body["metadata"]["name"])
    except InvalidSpecError:
        return None


async def _reconcile_handler(body: kopf.Body, patch: kopf.Patch, context: OperatorContext) -> None:
    now = context.config.clock()
    generation = body["metadata"].get("generation")
    state = context.state_of(body)
    if state.deleted:
        return
    status = _seen_status(body, state)
    try:
        spec = parse_spec(body.get("spec"), body["metadata"]["name"])
    except InvalidSpecError as error:
        _record_status(patch, state, status, invalid_status(status, error.errors, generation, now))
        kopf.event(body, type="Warning", reason="InvalidSpec", message="; ".join(error.errors))
        # Permanent: retrying cannot fix a spec; the next edit of the spec runs this handler again.
        raise kopf.PermanentError(f"invalid spec: {error}") from None
    async with state.lock:
        await _apply_and_record(context, body, patch, spec, state, now)


async def _apply_and_record(context: OperatorContext, body: kopf.Body, patch: kopf.Patch, spec: DeploymentSpec,
                            state: OperatorState, now: float) -> Outcome:
    status = _seen_status(body, state)
    generation = body["metadata"].get("generation")
    try:
        outcome = await reconcile(context.client, body, spec, state, now)
    except OwnershipConflict as error:
        _record_degraded(patch, state, status, "OwnershipConflict", str(error), generation, now)
        kopf.event(body, type="Warning", reason="OwnershipConflict", message=str(error))
        raise kopf.TemporaryError(str(error), delay=60) from None
    except ApiError as error:
        # Conflicts, throttling, an API server restart, an admission webhook saying no: all may pass.
        _record_degraded(patch, state, status, "ApiError", str(error), generation, now)
        raise kopf.TemporaryError(f"Kubernetes API: {error}", delay=RETRY_SECONDS) from None
    _announce(body, outcome)
    _record_status(patch, state, status, healthy_status(status, spec, state, outcome, generation, now))
    context.notify(body["metadata"]["namespace"], body["metadata"]["name"], "reconcile", now, outcome)
    return outcome


async def _scale_role(context: OperatorContext, body: kopf.Body, spec: DeploymentSpec, state: OperatorState,
                      role: str, low: int, high: int, targets: Mapping[str, float], now: float) -> None:
    meta = body["metadata"]
    role_state = state.roles[role]
    samples = await scrape_role(context.client, context.scraper, meta["namespace"], meta["name"], role)
    metrics = aggregate(samples, role_state.previous_samples)
    role_state.previous_samples = {sample.pod: sample for sample in samples}
    policy = scaling_policy.ScalingPolicy(
        min_replicas=low, max_replicas=high, targets=targets,
        scale_down_window_seconds=spec.autoscaling.scale_down_window_seconds,
        scale_up_window_seconds=spec.autoscaling.scale_up_window_seconds,
        scale_down_cooldown_seconds=spec.autoscaling.scale_down_cooldown_seconds,
        max_step=spec.autoscaling.max_step,
    )
    current = role_state.desired_replicas if role_state.desired_replicas is not None else low
    decision, role_state.history = scaling_policy.decide(current, metrics.observed(role), metrics.pods_reporting,
                                                         role_state.history, policy, now)
    context.notify(meta["namespace"], meta["name"], role, now, decision)
    if decision.changes(current):
        role_state.desired_replicas = decision.replicas
        role_state.last_scale_reason = decision.reason
        kopf.event(body, type="Normal", reason="Scaled", message=f"{role}: {decision.reason}")


def _announce(body: kopf.Body, outcome: Outcome) -> None:
    created = [f"{a.live['kind']} {a.live['metadata']['name']}" for a in outcome.applied if a.action == "created"]
    patched = [f"{a.live['kind']} {a.live['metadata']['name']}" for a in outcome.applied if a.action == "patched"]
    for reason, items in (("Created", created), ("Updated", patched), ("Removed", outcome.removed)):
        if items:
            kopf.event(body, type="Normal", reason=reason, message=", ".join(items))
    for name, theirs, ours in outcome.overridden:
        kopf.event(body, type="Warning", reason="ReplicasOverridden",
                   message=f"{name}: replicas set to {theirs} by someone else; the operator owns replica "
                           f"counts and set it back to {ours}")


def _seen_status(body: Mapping[str, Any], state: OperatorState) -> dict[str, Any]:
    """The status as in the body, or as this process last wrote it where the body may not show that yet."""
    return apply_merge_patch(body.get("status") or {}, state.written_status)


def _record_status(patch: kopf.Patch, state: OperatorState, current: Mapping[str, Any],
                   wanted: Mapping[str, Any]) -> None:
    """Put into kopf's patch only what differs from `current` (a _seen_status())."""
    changes = status_changes(current, wanted)
    state.written_status = apply_merge_patch(state.written_status, changes)
    for key, value in changes.items():
        patch.status[key] = value


def _record_degraded(patch: kopf.Patch, state: OperatorState, status: Mapping[str, Any], reason: str,
                     message: str, generation: int | None, now: float) -> None:
    wanted = [item for item in status.get("conditions") or [] if item.get("type") != conditions.DEGRADED]
    wanted = [{key: item[key] for key in ("type", "status", "reason", "message") if key in item} for item in wanted]
    wanted.append(conditions.condition(conditions.DEGRADED, True, reason, message))
    _record_status(patch, state, status,
                   {"conditions": conditions.merge(status.get("conditions"), wanted, generation, now)})


def _owner_reference(body: Mapping[str, Any]) -> dict[str, Any] | None:
    for reference in body.get("metadata", {}).get("ownerReferences") or []:
        if reference.get("controller") and reference.get("kind") == naming.KIND \
                and reference.get("apiVersion") == naming.API_VERSION:
            return dict(reference)
    return None


# --- registration ---------------------------------------------------------------------------------------------

def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Attach every handler to `registry`, with the timers waking every `config.tick_seconds`."""
    kopf.on.startup(registry=registry, id="operator_startup")(functools.partial(operator_startup, config=config))
    kopf.on.login(registry=registry)(operator_login)
    kopf.on.cleanup(registry=registry)(operator_cleanup)
    kopf.on.create(*RESOURCE, registry=registry)(speculativedeployment_create)
    kopf.on.update(*RESOURCE, registry=registry)(speculativedeployment_update)
    kopf.on.resume(*RESOURCE, registry=registry)(speculativedeployment_resume)
    kopf.on.delete(*RESOURCE, registry=registry)(speculativedeployment_delete)
    kopf.timer(*RESOURCE, registry=registry, interval=config.tick_seconds)(speculativedeployment_autoscale)
    kopf.timer(*RESOURCE, registry=registry, interval=config.tick_seconds)(speculativedeployment_canary)
    kopf.on.event("apps", "v1", "deployments", registry=registry,
                  labels={naming.LABEL_MANAGED_BY: naming.MANAGER})(deployment_event)
