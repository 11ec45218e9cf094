"""TLS and bearer tokens on the gRPC ports: the Secrets each pod mounts, the flags its command gets, and how
Kubernetes can still probe it.

Internal TLS (spec.tls) is one kubernetes.io/tls Secret that also holds ca.crt, mounted in the coordinator and
in every worker: workers serve with its certificate (and, when mutual, require a client certificate signed by
its CA); the coordinator checks the workers' certificates against that CA and, when mutual, presents the same
certificate as its client certificate. The coordinator's public port has its own, optional, TLS Secret and
bearer-token Secret (spec.coordinator.tls / spec.coordinator.auth).
"""

from __future__ import annotations

from typing import Any

from specsplit.operator import naming
from specsplit.operator.spec import CoordinatorSpec, InternalTLS

# Secret files readable by the pod's user and group (fsGroup), by no one else.
SECRET_FILE_MODE = 0o440

INTERNAL_TLS_VOLUME = "tls"
PUBLIC_TLS_VOLUME = "public-tls"
AUTH_VOLUME = "auth-tokens"
WORKER_AUTH_VOLUME = "worker-auth"


def _file(directory: str, key: str) -> str:
    return f"{directory}/{key}"


def _worker_secret_file() -> str:
    return _file(naming.WORKER_AUTH_DIR, naming.WORKER_AUTH_KEY)


def worker_args(tls: InternalTLS | None, worker_auth: str | None = None) -> list[str]:
    """Flags of `specsplit target|draft`: the shared secret callers must send, serve TLS, and require client
    certificates when mutual. With neither a secret nor mutual TLS the worker would listen on loopback only: the
    pod then opts out explicitly (its NetworkPolicy still admits only the coordinator)."""
    args = ["--worker-secret-file", _worker_secret_file()] if worker_auth else []
    if not worker_auth and not (tls is not None and tls.mutual):
        args.append("--allow-unauthenticated")
    if tls is None:
        return args
    args += ["--tls-cert", _file(naming.TLS_DIR, naming.TLS_CERT_KEY),
            "--tls-key", _file(naming.TLS_DIR, naming.TLS_KEY_KEY)]
    if tls.mutual:
        args += ["--tls-client-ca", _file(naming.TLS_DIR, naming.TLS_CA_KEY)]
    return args


def coordinator_args(coordinator: CoordinatorSpec, tls: InternalTLS | None, worker_auth: str | None = None) -> list[str]:
    """Flags of `specsplit coordinator` (or `target --coordinate`, manifests.colocated_target_command says why the
    same): its public port (TLS, tokens) and its calls to the workers."""
    args: list[str] = ["--worker-secret-file", _worker_secret_file()] if worker_auth else []
    if coordinator.tls_secret_name:
        args += ["--tls-cert", _file(naming.PUBLIC_TLS_DIR, naming.TLS_CERT_KEY),
                 "--tls-key", _file(naming.PUBLIC_TLS_DIR, naming.TLS_KEY_KEY)]
    if coordinator.auth_token_secret_name:
        args += ["--auth-token-file", _file(naming.AUTH_DIR, naming.AUTH_TOKENS_KEY)]
    if tls is not None:
        args += ["--worker-tls-ca", _file(naming.TLS_DIR, naming.TLS_CA_KEY)]
        if tls.mutual:
            args += ["--worker-tls-cert", _file(naming.TLS_DIR, naming.TLS_CERT_KEY),
                     "--worker-tls-key", _file(naming.TLS_DIR, naming.TLS_KEY_KEY)]
        if tls.server_name:
            # The coordinator dials pod IPs of the headless Services; without this it checks the Service's name.
            args += ["--worker-tls-server-name", tls.server_name]
    return args


def _secret_volume(volume: str, secret_name: str, keys: tuple[str, ...], directory: str
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Secret's keys as files of one folder. Keys are listed so a Secret missing one fails the pod's start
    with an event naming the key, rather than the service failing later; the folder (not subPath) lets
    the kubelet refresh renewed certificates."""
    return ({"name": volume, "secret": {"secretName": secret_name, "defaultMode": SECRET_FILE_MODE,
                                        "items": [{"key": key, "path": key} for key in keys]}},
            {"name": volume, "mountPath": directory, "readOnly": True})


def _internal_tls_volume(tls: InternalTLS) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = (naming.TLS_CERT_KEY, naming.TLS_KEY_KEY, naming.TLS_CA_KEY)
    return _secret_volume(INTERNAL_TLS_VOLUME, tls.secret_name, keys, naming.TLS_DIR)


def _worker_auth_volume(secret_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _secret_volume(WORKER_AUTH_VOLUME, secret_name, (naming.WORKER_AUTH_KEY,), naming.WORKER_AUTH_DIR)


def worker_volumes(tls: InternalTLS | None, worker_auth: str | None = None
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) a worker pod needs for internal TLS and the workers' secret."""
    pairs = [_internal_tls_volume(tls)] if tls is not None else []
    if worker_auth:
        pairs.append(_worker_auth_volume(worker_auth))
    return [volume for volume, _ in pairs], [mount for _, mount in pairs]


def coordinator_volumes(coordinator: CoordinatorSpec, tls: InternalTLS | None, worker_auth: str | None = None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) the coordinator pod needs for internal TLS, public TLS, tokens and the workers'
    secret."""
    pairs = []
    if tls is not None:
        pairs.append(_internal_tls_volume(tls))
    if worker_auth:
        pairs.append(_worker_auth_volume(worker_auth))
    if coordinator.tls_secret_name:
        pairs.append(_secret_volume(PUBLIC_TLS_VOLUME, coordinator.tls_secret_name,
                                    (naming.TLS_CERT_KEY, naming.TLS_KEY_KEY), naming.PUBLIC_TLS_DIR))
    if coordinator.auth_token_secret_name:
        pairs.append(_secret_volume(AUTH_VOLUME, coordinator.auth_token_secret_name, (naming.AUTH_TOKENS_KEY,),
                                    naming.AUTH_DIR))
    return [volume for volume, _ in pairs], [mount for _, mount in pairs]


def health_check(tls_served: bool, port: int = naming.GRPC_PORT) -> dict[str, Any]:
    """The probe handler of a pod's gRPC port. Kubernetes' `grpc` probe speaks plaintext only, so it cannot
    pass a TLS port: there a `tcpSocket` probe on the same port is used instead. It still means "up": the
    services open the port only once the model is loaded. Bearer tokens need no change: the services leave
    the health service open to callers without one."""
    if tls_served:
        return {"tcpSocket": {"port": port}}
    return {"grpc": {"port": port}}
