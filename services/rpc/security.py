"""Transport security and caller authentication.

- Workers and the coordinator serve TLS with `--tls-cert/--tls-key`; `--tls-client-ca` also requires client
  certificates signed by that CA (mutual TLS), which is how workers admit only coordinators.
- The coordinator dials workers with `--worker-tls-ca` (and a client certificate for mutual TLS); workers behind a
  headless Service are dialled by pod IP, so the name checked in their certificate is set apart from the address.
- The public API can require `authorization: Bearer TOKEN` (tokens from a file, one per line). Tokens are compared
  in constant time and never logged; health checking and reflection stay open for probes.
"""

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

PUBLIC_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


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
    return tokens


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without a valid bearer token with UNAUTHENTICATED (health and reflection stay open)."""

    def __init__(self, tokens: list[str]):
        self._tokens = [t.encode() for t in tokens]

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(PUBLIC_OPEN_SERVICES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        presented = header[7:].encode() if header.lower().startswith("bearer ") else b""
        if presented and any(hmac.compare_digest(presented, t) for t in self._tokens):
            return await continuation(handler_call_details)
        return _deny(await continuation(handler_call_details))


def _deny(handler):
    message = "missing or invalid bearer token"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return None
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


def add_server_tls_args(p) -> None:
    p.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")


def server_security_from_args(args) -> ServerSecurity | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    return ServerSecurity(args.tls_cert, args.tls_key, args.tls_client_ca)
