"""NOTES.txt, what `helm install` prints: the first request it shows must work against the real API."""

import json
import re
import shlex

from chart_render import notes
from chart_values import VALUE_SETS
from google.protobuf import json_format


def _command(text: str, prefix: str) -> list[str]:
    """The first command in the notes that starts with `prefix`, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return shlex.split(next(line.strip() for line in joined.splitlines() if line.strip().startswith(prefix)))


def test_notes_show_port_forward_and_a_cli_request():
    text = notes()
    assert "kubectl -n ml port-forward svc/coder-specsplit 50051:50051" in text
    command = _command(text, "specsplit generate")
    from specsplit.cli import build_parser

    args = build_parser().parse_args(command[1:])  # the real CLI accepts it (exits on an unknown flag)
    assert args.server == "localhost:50051" and args.prompt == "def fibonacci(n):"


def test_notes_grpcurl_request_matches_the_public_api():
    from specsplit.proto.v1 import generation_pb2

    command = _command(notes(), "grpcurl -plaintext -d")
    body = command[command.index("-d") + 1]
    service, method = command[-1].rsplit("/", 1)
    package, service_name = service.rsplit(".", 1)
    assert package == generation_pb2.DESCRIPTOR.package
    rpc = generation_pb2.DESCRIPTOR.services_by_name[service_name].methods_by_name[method]
    request = json_format.Parse(body, generation_pb2.GenerateRequest())  # raises on an unknown field
    assert rpc.input_type.full_name == request.DESCRIPTOR.full_name
    assert request.text and request.stopping.max_tokens == json.loads(body)["stopping"]["max_tokens"]


def test_notes_follow_the_values():
    assert "port-forward svc/coder-specsplit 50051:8443" in notes({"coordinator": {"port": 8443}})
    assert "canary  qwen2.5-coder-1.5b-instruct" in notes(VALUE_SETS["canary-on"])
    without = notes(VALUE_SETS["no-speculative-deployment"])
    assert "port-forward" not in without and "speculativeDeployment.enabled=false" in without


def test_notes_follow_tls_and_tokens_on_the_public_port():
    from specsplit.cli import build_parser

    secured = {"coordinator": {"tls": {"enabled": True, "secretName": "public-tls"},
                               "auth": {"enabled": True, "tokenSecretName": "api-tokens"}}}
    text = notes(secured)
    assert "kubectl -n ml get secret public-tls -o jsonpath='{.data.ca\\.crt}' | base64 -d > ca.crt" in text
    assert "export SPECSPLIT_TOKEN=$(kubectl -n ml get secret api-tokens -o jsonpath='{.data.tokens}'" in text
    args = build_parser().parse_args(_command(text, "specsplit generate")[1:])
    assert args.server == "localhost:50051" and args.tls_ca == "ca.crt"  # the token comes from $SPECSPLIT_TOKEN
    grpcurl = _command(text, "grpcurl -cacert")
    assert "-plaintext" not in grpcurl
    assert grpcurl[grpcurl.index("-servername") + 1] == "coder-specsplit"
    assert grpcurl[grpcurl.index("-H") + 1] == "authorization: Bearer $SPECSPLIT_TOKEN"
    tokens_only = notes({"coordinator": {"auth": {"enabled": True, "tokenSecretName": "api-tokens"}}})
    assert "ca.crt" not in tokens_only
    assert _command(tokens_only, "grpcurl -plaintext -H")[3] == "authorization: Bearer $SPECSPLIT_TOKEN"
