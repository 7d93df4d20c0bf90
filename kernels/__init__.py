"""kvlab.kernels: GPU kernels for the paged KV cache, each beside its torch reference.

`kvlab.kernels.ops` is what the engine calls: it picks the Triton path for CUDA
tensors and the torch reference otherwise (`set_backend("torch"|"triton"|"auto")`
forces either).
"""
