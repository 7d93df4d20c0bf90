"""The engine on the Triton backend (interpreted on CPU) generates exactly what it does on the torch backend."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.kernels import ops  # noqa: E402
from kvlab.models import load_model  # noqa: E402


def test_engine_triton_backend_matches_torch_backend():
    """gemma3-tiny: sliding-window and global layers, chunked prefill, fp8 cache with calibrated scales."""
    name = "random:gemma3-tiny"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 1)]
    outputs = {}
    previous = ops.get_backend()
    try:
        for backend in ("torch", "triton"):
            llm = LLM(name, loaded=load_model(name), block_size=4, kv_cache_memory="4MiB", quant="fp8_e4m3",
                      kernel_backend=backend, max_num_batched_tokens=16)
            outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
            outputs[backend] = [o.token_ids for o in outs]
    finally:
        ops.set_backend(previous)
    assert outputs["triton"] == outputs["torch"]


def test_engine_triton_backend_reads_packed_formats():
    """llama-tiny with int8 / int4 / int2 pages (residual window on): the Triton attention dequantises
    in the kernel and generates what the torch backend does."""
    name = "random:llama-tiny"
    prompts = [list(range(3, 40)), list(range(7, 12))]
    previous = ops.get_backend()
    try:
        for quant, args in (("int8", {}), ("int4", {"group_size": 8, "residual": 8}), ("int2", {"group_size": 8})):
            outputs = {}
            for backend in ("torch", "triton"):
                llm = LLM(name, loaded=load_model(name), block_size=8, kv_cache_memory="1MiB", quant=quant,
                          quant_args=args, kernel_backend=backend, max_num_seqs=2, max_num_batched_tokens=16)
                outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
                outputs[backend] = [o.token_ids for o in outs]
            assert outputs["triton"] == outputs["torch"], quant
    finally:
        ops.set_backend(previous)
