"""kvlab.kernels.cpu: native CPU kernels (C++ / OpenMP, built with g++ on first use, loaded with ctypes).

    decode_attention.cpp  paged decode attention: K/V read once from the pool through the block table
    decode_attention.py   its launcher (same signature as the torch reference; falls back to it)
    linear.cpp            small-batch linear layer: packed 64-row weight blocks, each read once for the batch
    linear.py             its launcher and weight packing (falls back to F.linear)
    layer_ops.cpp         RMSNorm (+ residual add) and RoPE of the lean forward, torch's bits in one call each
    layer_ops.py          its launcher and the torch references (falls back to them)
    build.py              compile into ~/.cache/kvlab/cpu_kernels (keyed by source hash), load, or warn once

`kvlab.kernels.ops` runs it for CPU tensors under the `auto` backend; KVLAB_CPU_KERNELS=0 or the `torch`
backend (EngineConfig.kernel_backend='torch') runs the reference instead. The linear kernel runs where
EngineConfig.linear_backend='cpu' puts it (kvlab/engine/linear_backend.py).
"""
