"""Linear layers at small batch (issue 27, item 3): which CPU path streams SmolLM2's weights fastest.

For each of SmolLM2-135M's linear shapes (N x K weights) at batch 1-32, fp32 and bf16 weights (the
activations in the same dtype), the time of one y = x @ W.T by:

    torch         F.linear (fp32: MKL sgemm / sgemv; bf16: oneDNN through torch's matmul)
    mkl_packed    torch.ops.mkl._mkl_linear over a weight packed for the batch (cblas_sgemm_pack; fp32 only)
    onednn_packed torch.ops.mkldnn._linear_pointwise over a weight reordered for the batch (what inductor
                  emits for a frozen linear layer)
    onednn_dense  torch._C._nn.mkldnn_linear over mkldnn tensors (torch.utils.mkldnn.MkldnnLinear;
                  the input converted to and from the mkldnn layout each call)
    cpu           kvlab's kernel (kernels/cpu/linear.cpp: the weight packed in 64-row blocks, each read once
                  for the whole batch; bf16 x bf16 through VDPBF16PS)

Decode streams weights from memory (SmolLM2's 540 MB fp32 do not fit the 32 MiB L3): each call here reads
a weight the previous --copies calls did not, from a rotation of copies totalling >= --pool-mib MiB, so no
weight is in cache. GB/s = weight bytes / time; the roof is `torch.sum` over --roof-mib MiB of random fp32,
in the same process and threads. Methods take turns within each cell (load drifts hit each alike); a
figure is the median over --repeats rounds of one rotation's mean call time.

    nice -n 10 python experiments/bench_linear_small_batch.py --threads 2
    python experiments/bench_linear_small_batch.py --shapes 576x576 --batches 1 --repeats 2 --pool-mib 16 --out /tmp/l
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvlab.kernels.cpu import linear as cpu_linear
from kvlab.study.bench_io import REPO, log, metadata, provenance, save, table

SHAPES = {"576x576": (576, 576), "192x576": (192, 576), "1536x576": (1536, 576), "3072x576": (3072, 576),
          "576x1536": (576, 1536), "49152x576": (49152, 576)}  # name: (N out, K in); q/o, k/v, gate|up, fused, down, lm_head
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METHODS = ("torch", "mkl_packed", "onednn_packed", "onednn_dense", "cpu")
COLUMNS = [("dtype", "dtype"), ("shape", "N x K"), ("batch", "batch"), ("method", "method"), ("us", "us (median)"),
           ("gb_s", "GB/s"), ("roof_fraction", "of roof"), ("vs_torch", "vs torch")]


def roof_gb_s(mib: int, repeats: int) -> float:
    x = torch.rand(mib * (1 << 20) // 4, generator=torch.Generator().manual_seed(0))
    x.sum()
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def prepare(method: str, w: torch.Tensor, batch: int):
    """The weight as `method` reads it and the call y = f(x), or None where the method does not take it."""
    if method == "torch":
        return lambda x: F.linear(x, w)
    if method == "cpu":
        if not cpu_linear.available():
            return None
        packed = cpu_linear.pack(w)
        return lambda x: cpu_linear.linear(x, w, None, packed)
    if method == "mkl_packed":
        if w.dtype != torch.float32:
            return None
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, batch)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, batch)
    if method == "onednn_packed":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if method == "onednn_dense":
        wm = w.to_mkldnn()
        return lambda x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), wm, None).to_dense()
    raise ValueError(method)


def cell(shape, dtype, batch: int, args) -> list[dict]:
    n, k = shape
    nbytes = n * k * dtype.itemsize
    copies = max(2, -(-args.pool_mib * (1 << 20) // nbytes))
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for _ in range(copies)]
    x = torch.randn(batch, k, generator=g).to(dtype)
    calls = {m: [prepare(m, w, batch) for w in weights] for m in args.methods}
    calls = {m: fs for m, fs in calls.items() if fs[0] is not None}
    want = F.linear(x.float(), weights[0].float())
    for m, fs in calls.items():  # each method computes the product (a wrong fast path would show here)
        torch.testing.assert_close(fs[0](x).float(), want, atol=0.05, rtol=0.02)
    times = {m: [] for m in calls}
    for _ in range(args.repeats):
        for m, fs in calls.items():
            for f in fs:  # warm the code path, not the data: the next rotation reads each weight again cold
                f(x)
                break
            t0 = time.perf_counter()
            for f in fs:
                f(x)
            times[m].append((time.perf_counter() - t0) / len(fs))
    return [{"method": m, "us": statistics.median(t) * 1e6, "gb_s": nbytes / statistics.median(t) / 1e9}
            for m, t in times.items()]


def run(args) -> tuple[list[dict], dict]:
    roofs, rows = [], []
    for dtype_name in args.dtypes:
        for shape_name in args.shapes:
            for b in args.batches:
                roofs.append(roof_gb_s(args.roof_mib, args.repeats))
                found = cell(SHAPES[shape_name], DTYPES[dtype_name], b, args)
                base = next((r["us"] for r in found if r["method"] == "torch"), None)
                for r in found:
                    r.update(dtype=dtype_name, shape=shape_name, batch=b, roof_gb_s=roofs[-1],
                             roof_fraction=r["gb_s"] / roofs[-1], vs_torch=base / r["us"] if base else None)
                    rows.append(r)
                log(f"{dtype_name} {shape_name} b={b}: " + ", ".join(f"{r['method']} {r['gb_s']:.1f}" for r in found)
                    + f" GB/s (roof {roofs[-1]:.1f})")
    return rows, {"roof_gb_s_median": statistics.median(roofs), "roof_gb_s_min": min(roofs),
                  "roof_gb_s_max": max(roofs)}


def report(rows, roof, meta, args) -> str:
    return "\n".join([
        "# Linear layers at small batch (issue 27, item 3)", "", *provenance(meta),
        f"Threads {args.threads}; weights rotated over >= {args.pool_mib} MiB of copies (cold in cache); "
        f"median of {args.repeats} rounds, methods interleaved. Roof (torch.sum over {args.roof_mib} MiB random fp32, "
        f"before each cell): median {roof['roof_gb_s_median']:.1f} GB/s "
        f"({roof['roof_gb_s_min']:.1f}-{roof['roof_gb_s_max']:.1f}).", "",
        table(rows, COLUMNS), ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pool-mib", type=int, default=128, help="weight copies per cell, in MiB (> L3)")
    p.add_argument("--roof-mib", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="recorded only: the data's seed is fixed")
    p.add_argument("--model", default="smollm2-135m", help="recorded only: whose shapes these are")
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "linear_small_batch_smollm2"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # before the metadata, which quotes it
    meta = metadata(args)
    rows, roof = run(args)
    meta["roof"] = roof
    save(args.out, report(rows, roof, meta, args), meta, rows)
    return rows


if __name__ == "__main__":
    main()
