"""What the batch-invariant mode (kernels/dispatch.py) asks of a deployment, checked where models are set up.

The mode makes every kernel of one model's forward give a row the same bits whatever its batch. A model sharded
over several ranks adds one step it does not control: the all-reduce of the shards' partial products, whose
algorithm (ring or tree, and how it chunks) NCCL and gloo choose by message size, i.e. by the batch. So the mode
needs tensor-parallel size 1 for both models; anything else is refused before a model is loaded.
"""

from specsplit.kernels.dispatch import batch_invariant
from specsplit.services.errors import InvalidArgument


def check_tensor_parallel_sizes(sizes: dict[str, int]) -> None:
    """sizes: role -> tensor-parallel size. Raises InvalidArgument if the process's mode is on and any size is
    above 1."""
    sharded = {role: size for role, size in sizes.items() if size > 1}
    if batch_invariant() and sharded:
        shown = ", ".join(f"{role} {size}" for role, size in sharded.items())
        raise InvalidArgument(f"--batch-invariant needs tensor-parallel size 1 (got {shown}): the all-reduce between "
                              "shards sums in an order chosen by the batch's size")
