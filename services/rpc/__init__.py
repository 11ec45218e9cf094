"""gRPC plumbing shared by the three services: status codes, server bootstrap, per-call batching."""
