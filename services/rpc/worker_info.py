"""A worker's self-description (model, context, KV use), served by Describe and read by the coordinator."""

from specsplit.kernels.dispatch import batch_invariant
from specsplit.proto.v1 import worker_pb2


def worker_info(role, model_name, runner, sequences, batcher, proposer: str = "", max_model_len: int = 0,
                with_path: bool = True, round_port: int = 0,
                synthetic_acceptance: float | None = None) -> worker_pb2.WorkerInfo:
    """`runner` None: a draft without a model (the n-gram proposer), which holds no KV and takes any vocabulary.
    `with_path`: name where the model was loaded from (for a coordinator loading its tokenizer from the same
    storage) only to callers that proved who they are, or on loopback; others get its name alone."""
    if runner is None:
        return worker_pb2.WorkerInfo(role=role, model=model_name, vocab_size=0, max_model_len=max_model_len,
                                     sequences=len(sequences), queue_depth=batcher.queue_depth,
                                     sequences_prefilled=sequences.created_total, proposer=proposer,
                                     batch_invariant=batch_invariant(), round_port=round_port,
                                     round_channel_prefills=round_port > 0)
    manager = runner.block_manager
    return worker_pb2.WorkerInfo(
        role=role,
        model=model_name,
        vocab_size=runner.vocab_size,
        max_model_len=runner.max_model_len,
        kv_blocks_total=manager.num_blocks,
        kv_blocks_used=manager.num_used_blocks,
        block_size=manager.block_size,
        sequences=len(sequences),
        queue_depth=batcher.queue_depth,
        eos_token_ids=list(runner.config.eos_token_ids),
        model_path=runner.loaded.path if with_path else "",
        sequences_prefilled=sequences.created_total,
        proposer=proposer,
        batch_invariant=batch_invariant(),
        tensor_parallel_size=getattr(runner, "tensor_parallel_size", 1),  # GPUs (processes) the model is sharded over
        round_port=round_port,
        round_channel_prefills=round_port > 0,  # the channel takes PREFILL frames too (rpc/round_channel.py)
        synthetic_acceptance=synthetic_acceptance,  # benchmark only (target/synthetic_acceptance.py); None: unset
    )
