"""Transport security and caller authentication.

- Workers and the coordinator serve TLS with `--tls-cert/--tls-key`; `--tls-client-ca` also requires client
  certificates signed by that CA (mutual TLS), which is how workers admit only coordinators.
- The coordinator dials workers with `--worker-tls-ca` (and a client certificate for mutual TLS); workers behind a
  headless Service are dialled by pod IP, so the name checked in their certificate is set apart from the address.
- The public API can require `authorization: Bearer TOKEN` (tokens from a file, one per line) on every method.
  Tokens are compared exactly, in constant time, and never logged; a valid token is always served, and failures
  are slowed per address (auth_throttle.py), shared with the HTTP API; health checking and reflection stay open
  for probes.
- Workers require a shared secret on every call (worker_credentials.py) unless mutual TLS admits their callers.
"""

from dataclasses import dataclass
from pathlib import Path

import grpc

from specsplit.services.rpc.caller_auth import OPEN_SERVICES, SecretCheck, SecretCheckInterceptor, bearer_token
from specsplit.services.rpc.worker_credentials import MIN_SECRET_CHARS

PUBLIC_OPEN_SERVICES = OPEN_SERVICES


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass
class ServerSecurity:
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None  # set: clients must present a certificate signed by this CA

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.cert_file:
            if self.client_ca_file:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not self.key_file:
            raise ValueError("--tls-cert needs --tls-key")
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.client_ca_file),
            require_client_auth=bool(self.client_ca_file),
        )


@dataclass
class ChannelSecurity:
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # the name to verify in the server's certificate
    secret: str | None = None  # the workers' shared secret, sent on every call (worker_credentials.py)

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file), private_key=_read(self.key_file), certificate_chain=_read(self.cert_file)
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def read_tokens(path: str) -> list[str]:
    tokens = [line.strip() for line in Path(path).read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not tokens:
        raise ValueError(f"{path} holds no tokens")
    if any(len(token) < MIN_SECRET_CHARS for token in tokens):  # the failure throttle slows answers, not guesses
        raise ValueError(f"{path}: every token needs at least {MIN_SECRET_CHARS} characters")
    return tokens


class BearerTokenInterceptor(SecretCheckInterceptor):
    """Refuse calls without a valid bearer token with UNAUTHENTICATED (health and reflection stay open); the token is
    compared exactly (case-sensitive, scheme `Bearer`), in constant time; failures are slowed per address.
    `tokens`: the SecretCheck of the tokens, shared with the HTTP API (one throttle)."""

    def __init__(self, tokens: SecretCheck):
        super().__init__(tokens, bearer_token, "missing or invalid bearer token")


def add_server_tls_args(p) -> None:
    p.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")


def server_security_from_args(args) -> ServerSecurity | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    return ServerSecurity(args.tls_cert, args.tls_key, args.tls_client_ca)
