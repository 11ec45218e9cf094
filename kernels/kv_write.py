"""Write new keys and values into the paged KV cache, eager torch reference.

    key, value:   [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (written in place)
    slot_mapping: [num_tokens] int64, `block_id * block_size + offset`; a negative slot means "do not write"
"""

import torch


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_keys = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_values = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    flat_keys[slots] = key[valid].to(key_cache.dtype)
    flat_values[slots] = value[valid].to(value_cache.dtype)
