"""The paged KV cache's write. The cache is `[2, num_layers, num_blocks, block_size, Hkv, D]`: keys, then
values. Token i's k and v go to flat slot `slot_mapping[i]` of its layer, which is block
`slot // block_size`, offset `slot % block_size` (batch.py builds slot_mapping). Every attention backend
writes this way before it attends."""
from torch import Tensor


def store_kvcache(k: Tensor, v: Tensor, k_cache: Tensor,
                  v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write token i's k, v (`[N, num_kv_heads, head_dim]`) into flat slot `slot_mapping[i]`."""
    for new, cache in (k, k_cache), (v, v_cache):
        # [num_blocks * block_size, num_kv_heads, head_dim]: one row per slot, a view, so writes land in the cache
        cache.view(-1, *new.shape[1:]).index_copy_(0, slot_mapping, new)
