"""TLS and mutual TLS on the internal gRPC, TLS and bearer tokens on the public API, with real processes:
callers without the right certificate or token are refused, and the token never shows in the logs."""

import asyncio
import datetime
import ipaddress
import json

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.client import Client
from specsplit.services.errors import Unavailable
from specsplit.services.rpc.round_channel import RoundChannelClient, client_ssl_context
from specsplit.services.rpc.security import ChannelSecurity
from specsplit.proto.v1 import worker_pb2, worker_pb2_grpc
from specsplit.services.service_commands import printed, spawn_service, stop_processes

TOKEN = "s3cret-token-for-tests-7f1c"


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject, issuer_name, key, signing_key, ca=False, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _write(path, key, cert):
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key = _key(), _key()
    ca = _cert("specsplit-test-ca", "specsplit-test-ca", ca_key, ca_key, ca=True)
    rogue_ca = _cert("rogue-ca", "rogue-ca", rogue_key, rogue_key, ca=True)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, client_key, rogue_client_key = _key(), _key(), _key()
    files = {
        "ca": _write(root / "ca", ca_key, ca)[0],
        "server": _write(root / "server", server_key, _cert("localhost", "specsplit-test-ca", server_key, ca_key, sans=sans)),
        "client": _write(root / "client", client_key, _cert("coordinator", "specsplit-test-ca", client_key, ca_key)),
        "rogue": _write(root / "rogue", rogue_client_key, _cert("intruder", "rogue-ca", rogue_client_key, rogue_key)),
    }
    _write(root / "rogue-ca", rogue_key, rogue_ca)
    (root / "tokens").write_text(f"# tokens, one per line\n{TOKEN}\n")
    files["tokens"] = str(root / "tokens")
    files["log"] = root / "coordinator.log"
    return files


@pytest.fixture(scope="module")
def secure_cluster(tiny_pair, pki):
    server_cert, server_key = pki["server"]
    client_cert, client_key = pki["client"]
    mtls = ["--tls-cert", server_cert, "--tls-key", server_key, "--tls-client-ca", pki["ca"], "--num-kv-blocks", "256"]
    processes = []
    try:
        target, target_addr = spawn_service(["target", "--model", str(tiny_pair["target"]), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", *mtls])
        processes.append(target)
        draft, draft_addr = spawn_service(["draft", "--model", str(tiny_pair["close"]), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", *mtls])
        processes.append(draft)
        log = open(pki["log"], "w")
        coordinator, address = spawn_service(
            ["--log-level", "DEBUG", "coordinator", "--target", target_addr, "--draft", draft_addr, "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", "-1", "--tls-cert", server_cert, "--tls-key", server_key, "--auth-token-file", pki["tokens"],
             "--worker-tls-ca", pki["ca"], "--worker-tls-cert", client_cert, "--worker-tls-key", client_key,
             "--worker-tls-server-name", "localhost", "--http-port", "0"],
            stderr=log,
        )
        processes.append(coordinator)
        http = printed(coordinator.startup_lines, " OpenAI API on ")
        yield {"coordinator": address, "target": target_addr, "http": http}
    finally:
        stop_processes(processes)


def _code(call):
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


def test_tls_and_token_let_the_right_client_in(secure_cluster, pki):
    with Client(secure_cluster["coordinator"], timeout=60, token=TOKEN, tls_ca=pki["ca"]) as client:
        result = client.generate("hello", max_tokens=6, ignore_eos=True)
        assert len(result.token_ids) == 6 and result.stats.draft_tokens > 0  # the coordinator reached both workers over mTLS
        streamed = [t for c in client.generate_stream("hello", max_tokens=6, ignore_eos=True) for t in c.token_ids]
        assert streamed == result.token_ids


def test_missing_or_wrong_token_is_unauthenticated(secure_cluster, pki):
    for token in (None, "wrong-token"):
        with Client(secure_cluster["coordinator"], timeout=30, token=token, tls_ca=pki["ca"]) as client:
            assert _code(lambda: client.generate("hello", max_tokens=2)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: list(client.generate_stream("hello", max_tokens=2))) == grpc.StatusCode.UNAUTHENTICATED
    # Health checking stays open for probes (over TLS, without a token).
    channel = grpc.secure_channel(secure_cluster["coordinator"], grpc.ssl_channel_credentials(open(pki["ca"], "rb").read()))
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_or_untrusting_clients_are_refused(secure_cluster, pki):
    with Client(secure_cluster["coordinator"], timeout=10, token=TOKEN) as plaintext:
        assert _code(lambda: plaintext.generate("hello", max_tokens=2)) == grpc.StatusCode.UNAVAILABLE


def test_workers_require_a_client_certificate_from_the_ca(secure_cluster, pki):
    ca = open(pki["ca"], "rb").read()

    def describe(credentials):
        channel = grpc.secure_channel(secure_cluster["target"], credentials, options=[("grpc.ssl_target_name_override", "localhost")])
        return worker_pb2_grpc.TargetWorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)

    def verify_stream(credentials):  # the coordinator's round transport: a stream, refused at the handshake too
        channel = grpc.secure_channel(secure_cluster["target"], credentials, options=[("grpc.ssl_target_name_override", "localhost")])
        return list(worker_pb2_grpc.TargetWorkerStub(channel).VerifyStream(iter([worker_pb2.VerifyRequest()]), timeout=10))

    assert _code(lambda: describe(grpc.ssl_channel_credentials(ca))) == grpc.StatusCode.UNAVAILABLE
    assert _code(lambda: verify_stream(grpc.ssl_channel_credentials(ca))) == grpc.StatusCode.UNAVAILABLE
    rogue_cert, rogue_key = pki["rogue"]
    rogue = grpc.ssl_channel_credentials(ca, open(rogue_key, "rb").read(), open(rogue_cert, "rb").read())
    assert _code(lambda: describe(rogue)) == grpc.StatusCode.UNAVAILABLE
    assert _code(lambda: verify_stream(rogue)) == grpc.StatusCode.UNAVAILABLE
    good_cert, good_key = pki["client"]
    good = grpc.ssl_channel_credentials(ca, open(good_key, "rb").read(), open(good_cert, "rb").read())
    assert describe(good).role == "target"
    assert len(verify_stream(good)) == 1
    # The round channel (rpc/round_channel.py) takes the same mutual TLS on its own socket.
    round_port = describe(good).round_port
    host = secure_cluster["target"].rpartition(":")[0]

    def verify_on_channel(cert_and_key, tls=True):
        security = ChannelSecurity(pki["ca"] if tls else None, *(cert_and_key or (None, None)), "localhost")
        client = RoundChannelClient(host, round_port, "tls-test", None, client_ssl_context(security), "localhost")

        async def ask():
            try:
                return await client.request(worker_pb2.VerifyRequest(), worker_pb2.VerifyResponse)
            finally:
                client.close()

        return asyncio.run(ask())

    for refused in ((None, True), (pki["rogue"], True), (None, False)):  # no client certificate, a rogue one, plain TCP
        with pytest.raises(Unavailable):
            verify_on_channel(*refused)
    assert len(verify_on_channel(pki["client"]).counts) == 0  # an empty batch, answered
    with grpc.insecure_channel(secure_cluster["target"]) as plain:
        assert _code(lambda: worker_pb2_grpc.TargetWorkerStub(plain).Describe(worker_pb2.DescribeRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE


def test_no_secret_in_the_logs(secure_cluster, pki):
    with Client(secure_cluster["coordinator"], timeout=60, token=TOKEN, tls_ca=pki["ca"]) as client:
        client.generate("log me", max_tokens=3)
    log = open(pki["log"]).read()
    assert "admitted" in log  # debug logging of requests is on, and still:
    assert TOKEN not in log
    key_body = open(pki["server"][1]).read().splitlines()[1]
    assert key_body not in log


def test_the_http_api_takes_the_same_tls_and_tokens(secure_cluster, pki):
    """The OpenAI-compatible API serves HTTPS with the gRPC API's certificate and admits the same bearer tokens."""
    import json
    import ssl
    import urllib.error
    import urllib.request

    url = secure_cluster["http"]
    assert url.startswith("https://")
    trusting = ssl.create_default_context(cafile=pki["ca"])

    def post(token, context=trusting, base=url):
        body = json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        request = urllib.request.Request(base + "/completions", data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return json.load(response)

    assert post(TOKEN)["usage"]["completion_tokens"] == 3
    for token in (None, "wrong-token"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(token)
        assert refused.value.code == 401 and json.load(refused.value)["error"]["type"] == "authentication_error"
    with pytest.raises(urllib.error.URLError):  # a client that does not trust the CA
        post(TOKEN, context=ssl.create_default_context())
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the TLS port
        post(TOKEN, context=None, base=url.replace("https://", "http://"))
    assert TOKEN not in open(pki["log"]).read()  # nor do HTTP requests put the token in the (debug) log


def test_bench_serve_over_grpc_takes_the_same_tls_and_token(secure_cluster, pki, tiny_pair, tmp_path):
    from specsplit.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--grpc", secure_cluster["coordinator"], "--tls-ca", pki["ca"], "--token", TOKEN,
                 "--tokenizer", str(tiny_pair["target"]), "--input-len", "4", "--output-len", "3", "--num-prompts", "2",
                 "--num-warmups", "0", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 2 and result["failed"] == 0
