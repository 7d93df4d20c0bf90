"""The cache room: who owns a page and where a token's KV lives. The block manager (page tables, prefix
hits, residual-row claims), the allocators, the KV pool (`kv_cache`, its page layouts `kv_layout`,
`dense_layout`, `packed_layout`), the cache formats (`quant`) and the prefix index with its eviction orders.
Torch-free except the pool and the formats; it imports nothing of the engine, the policies,
speculation or the study machinery."""
