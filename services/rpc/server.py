"""Server bootstrap shared by the three services: an asyncio gRPC server with health checking and reflection."""

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit.services.rpc.malformed_requests import MalformedRequestInterceptor

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Coordinators keep idle channels alive with pings; accept them instead of answering "too many pings".
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


async def start_server(add_servicers, service_names: list[str], host: str, port: int, interceptors=(), security=None):
    """Start a server with the given servicers plus health and reflection; returns (server, bound port, health).
    `security` (a ServerSecurity) serves TLS, or mutual TLS when it names a client CA."""
    # Innermost: requests that do not parse are refused (INVALID_ARGUMENT) before any servicer sees them.
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*interceptors, MalformedRequestInterceptor()])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names) + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    credentials = security.credentials() if security is not None else None
    if credentials is not None:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in [""] + list(service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer
