"""The KV tensors themselves: per layer a key and a value cache of [num_blocks, block_size, kv_heads, head_dim]."""

import torch

from specsplit.services.models.config import DecoderConfig


class PagedKVCache:
    def __init__(self, config: DecoderConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Perform the copy-on-write copies the block manager asked for."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.layers[0][0].device)
        dst = torch.tensor([d for _, d in copies], device=self.layers[0][0].device)
        for key_cache, value_cache in self.layers:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]
