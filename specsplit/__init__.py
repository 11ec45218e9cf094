"""specsplit: speculative decoding split into a draft-proposer service and a target-verifier service."""

__version__ = "0.1.0"
