"""Compute kernels: each Triton kernel sits beside an eager torch reference of the same function.

The services call the dispatchers in `specsplit.kernels.dispatch`, which pick the Triton path on a CUDA device
and the torch reference everywhere else (the CPU, tests).
"""
