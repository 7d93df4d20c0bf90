"""kvlab.kernels: GPU and CPU kernels for the paged KV cache, each beside its torch reference.

`kvlab.kernels.ops` is what the engine calls: it picks the Triton path for CUDA
tensors, the CPU decode attention (cpu/, KVLAB_CPU_KERNELS=0 turns it off) and the
torch reference otherwise (`set_backend("torch"|"triton"|"auto")` forces one).

    reference/        torch references (the CPU path): store_kv, paged_attention,
                      attention_stats, block_ops
    triton_kernels/   raw @triton.jit kernels, one file per family, and the cache codecs
    cpu/              C++ / OpenMP decode attention (g++ on first use, ctypes) and its launcher
    store_kv.py, paged_attention.py, block_ops.py
                      launchers: validate shapes / strides / dtypes / constants, then launch;
                      same signatures as the references
    testing.py        random paged batches and tolerances (tests, bench)
    bench.py          `python -m kvlab.kernels.bench [--check-only]`
    compile_check.py  `python -m kvlab.kernels.compile_check`: compile every variant for sm_90 without a GPU
"""
