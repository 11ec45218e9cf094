"""The acceptance method between its protobuf enum (common.proto) and the names the services use
("" = not chosen, "rejection", "typical"; services/target/acceptance_method.py)."""

from specsplit.proto.v1 import common_pb2

_TO_PB = {
    "": common_pb2.ACCEPTANCE_METHOD_DEFAULT,
    "rejection": common_pb2.ACCEPTANCE_METHOD_REJECTION,
    "typical": common_pb2.ACCEPTANCE_METHOD_TYPICAL,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}


def acceptance_method_pb(name: str | None) -> int:
    return _TO_PB[name or ""]


def acceptance_method_from_pb(value: int) -> str:
    """"" for DEFAULT; an unknown number (a newer peer) stays visible as a name the checks refuse."""
    return _FROM_PB.get(value, f"unknown({value})")
