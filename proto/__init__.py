"""Generated protobuf and gRPC code for specsplit/v1 (see proto/generate.py)."""
