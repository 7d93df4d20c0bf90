"""Raw Triton kernels (`@triton.jit`), one file per kernel family.

Call them through the launchers one level up (kvlab.kernels.store_kv,
.paged_attention, .block_ops), which validate inputs first. The environment
variable TRITON_INTERPRET=1 must be set before this package is imported to run
the kernels on CPU tensors (Triton reads it when the kernels are decorated).
"""
