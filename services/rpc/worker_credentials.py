"""Who may call a worker, and whose sequences a call may touch.

- A worker given a shared secret (`--worker-secret-file`, or $SPECSPLIT_WORKER_SECRET) refuses every call that
  does not carry it (metadata `x-specsplit-worker-secret`), on every method, streams included, with
  UNAUTHENTICATED before reading a request message (failures are slowed per address, auth_throttle.py).
  `specsplit serve` and the Helm chart generate one and hand it to the workers and the coordinator through the
  environment or a mounted Secret, never on a command line (where `ps` shows it). Mutual TLS (`--tls-client-ca`) admits callers the same way.
- A worker with neither listens on 127.0.0.1 only, whatever `--host` says, and logs so (`--allow-unauthenticated`
  opens it anyway, for a network that is itself private).
- Sequence handles are bound to the coordinator that created them: each coordinator process sends a random id
  (metadata `x-specsplit-coordinator`) and a worker keys sequences by (that id, handle). Handles are random too
  (coordinator/admission.py), and neither is ever shown to users.
"""

import ipaddress
import logging
import os
import secrets
from pathlib import Path

from specsplit.services.errors import InvalidArgument
from specsplit.services.request_limits import check_string
from specsplit.services.rpc.caller_auth import SecretCheck, SecretCheckInterceptor, metadata_value

log = logging.getLogger(__name__)

WORKER_SECRET_ENV = "SPECSPLIT_WORKER_SECRET"
WORKER_SECRET_HEADER = "x-specsplit-worker-secret"
COORDINATOR_ID_HEADER = "x-specsplit-coordinator"
MIN_SECRET_CHARS = 16
MAX_OWNER_BYTES = 64

COORDINATOR_ID = secrets.token_hex(16)  # this process's, when it coordinates


def new_worker_secret() -> str:
    return secrets.token_urlsafe(32)


def load_worker_secret(path: str | None = None) -> str | None:
    """The secret from a file (first line), else from the environment; None when neither is set."""
    value = Path(path).read_text().strip() if path else os.environ.get(WORKER_SECRET_ENV, "").strip()
    if not value:
        if path:
            raise ValueError(f"{path} holds no worker secret")
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"a worker secret needs at least {MIN_SECRET_CHARS} characters")
    return value


def worker_secret_interceptor(check: SecretCheck) -> SecretCheckInterceptor:
    """Every worker method, unary or streaming, present or added later, checks the secret (caller_auth.py); `check`
    is shared with the round channel (one failure throttle)."""
    return SecretCheckInterceptor(check, presented_worker_secret, "missing or invalid worker secret")


def presented_worker_secret(metadata) -> bytes:
    return metadata_value(metadata, WORKER_SECRET_HEADER).encode()


def worker_call_metadata(secret: str | None) -> tuple:
    """What every call of this process to a worker carries."""
    pairs = ((COORDINATOR_ID_HEADER, COORDINATOR_ID),)
    return pairs + ((WORKER_SECRET_HEADER, secret),) if secret else pairs


def listen_host(host: str, secret: str | None, mutual_tls: bool, allow_unauthenticated: bool) -> str:
    """Where a worker may listen: anywhere when callers must prove who they are, else loopback only."""
    if secret or mutual_tls or allow_unauthenticated or is_loopback(host):
        return host
    log.warning("no worker credentials (--worker-secret-file, $%s or --tls-client-ca): listening on 127.0.0.1 only, "
                "not %s; anyone reaching an open worker could read and alter other users' sequences",
                WORKER_SECRET_ENV, host)
    return "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def caller_owner(context) -> str | None:
    """The calling coordinator's id ("" for a caller that sends none); None when it is not a bounded string."""
    return checked_owner(next((v for k, v in context.invocation_metadata() or () if k == COORDINATOR_ID_HEADER), ""))


def checked_owner(value) -> str | None:
    """A coordinator id as given (gRPC metadata, the round channel's hello); None unless a string of at most
    MAX_OWNER_BYTES bytes."""
    try:
        check_string("coordinator id", value if isinstance(value, str) else "\0" * (MAX_OWNER_BYTES + 1), MAX_OWNER_BYTES)
    except InvalidArgument:
        return None
    return value


def bind_handles(items: list, owner: str | None) -> list:
    """Key each decoded item's handle by its caller, so no caller reaches another coordinator's sequences."""
    for i, item in enumerate(items):
        if owner is None:
            items[i] = InvalidArgument(f"{COORDINATOR_ID_HEADER} must be at most {MAX_OWNER_BYTES} bytes")
        elif not isinstance(item, Exception):
            item.handle = f"{owner}/{item.handle}"
    return items


def owned_handles(handles, owner: str | None) -> list[str]:
    return [] if owner is None else [f"{owner}/{h}" for h in handles]
