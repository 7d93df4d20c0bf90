"""Launcher input validation (clear ValueErrors before any launch) and ops backend dispatch."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

import pytest  # noqa: E402

import kvlab.kernels.block_ops as triton_blocks  # noqa: E402
import kvlab.kernels.paged_attention as triton_attn  # noqa: E402
import kvlab.kernels.store_kv as triton_store  # noqa: E402
from kvlab.kernels import ops  # noqa: E402
from kvlab.kernels.paged_attention import paged_attention  # noqa: E402
from kvlab.kernels.reference import paged_attention as ref_attn  # noqa: E402
from kvlab.kernels.store_kv import store_kv  # noqa: E402
from kvlab.kernels.testing import make_paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _store_args(**change):
    args = dict(
        key=torch.randn(3, 2, 64, device=DEVICE),
        value=torch.randn(3, 2, 64, device=DEVICE),
        k_cache=torch.randn(4, 16, 2, 64, device=DEVICE),
        v_cache=torch.randn(4, 16, 2, 64, device=DEVICE),
        slot_mapping=torch.tensor([0, 5, -1], device=DEVICE),
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(k_cache=torch.randn(4, 12, 2, 64), v_cache=torch.randn(4, 12, 2, 64)), "power of two"),
        (dict(k_cache=torch.randn(4, 16, 2, 64)[..., ::2]), "contiguous in head_dim"),
        (dict(v_cache=torch.randn(4, 16, 2, 32)), "same shape"),
        (dict(key=torch.randn(3, 3, 64)), r"key must be \[T, 2, 64\]"),
        (dict(key=torch.randn(3, 2, 64).to(torch.float64)), "float16, bfloat16 or float32"),
        (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "int32 or int64"),
        (dict(slot_mapping=torch.tensor([0, 1])), "one row per token"),
        (dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8), v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8)),
         "storage dtype"),
        (dict(k_cache=torch.zeros(4, 16, 2, 64).to(torch.float8_e4m3fn),
              v_cache=torch.zeros(4, 16, 2, 64).to(torch.float8_e4m3fn)), "scale must be passed"),
        (dict(k_scale=torch.ones(3)), r"k_scale must be a contiguous float32 tensor of shape \[2\]"),
        (dict(k_cache=torch.randn(4, 16, 2, 8), v_cache=torch.randn(4, 16, 2, 8), key=torch.randn(3, 2, 8),
              value=torch.randn(3, 2, 8)), "head_dim must be in"),
    ],
)
def test_store_kv_rejects_bad_inputs(change, message):
    change = {k: v.to(DEVICE) for k, v in change.items()}
    with pytest.raises(ValueError, match=message):
        store_kv(**_store_args(**change))


def test_attention_rejects_bad_inputs():
    b = make_paged_batch([1, 2], [5, 9], 2, 2, 64, 4, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(b.q[:, :3], *b.args()[1:])
    with pytest.raises(ValueError, match="tokens but the plan"):
        paged_attention(b.q[:2], *b.args()[1:])
    with pytest.raises(ValueError, match="block_tables must be int32 or int64"):
        paged_attention(*b.args()[:3], b.block_tables.float(), *b.args()[4:])
    with pytest.raises(ValueError, match="softcap must be > 0"):
        paged_attention(*b.args(), None, -1.0)
    with pytest.raises(ValueError, match="stats_window must be >= 1"):
        paged_attention(*b.args(), return_stats=True, stats_window=0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_attention(*b.args(), 0)


def test_ops_dispatch(monkeypatch):
    """auto: Triton for CUDA tensors; for CPU tensors the CPU kernels' attention launcher (reference without
    it: KVLAB_CPU_KERNELS=0) and the reference for the rest; `triton`/`torch` force one."""
    from kvlab.kernels.cpu import decode_attention as cpu_attn

    calls = []
    monkeypatch.setattr(triton_store, "store_kv", lambda *a: calls.append("triton"))
    monkeypatch.setattr(ops, "store_kv_ref", lambda *a: calls.append("torch"))
    monkeypatch.setattr(triton_attn, "run_paged_attention", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(ref_attn, "run_paged_attention", lambda *a, **k: calls.append("torch"))
    monkeypatch.setattr(cpu_attn, "run_paged_attention", lambda *a, **k: calls.append("cpu"))
    monkeypatch.setattr(triton_blocks, "copy_blocks", lambda *a: calls.append("triton"))
    monkeypatch.setattr(triton_blocks, "compact_slots", lambda *a: calls.append("triton"))
    cpu = torch.zeros(1)

    def run_all():
        calls.clear()
        ops.store_kv(cpu, cpu, cpu, cpu, cpu)
        ops.run_paged_attention(cpu, cpu, cpu, None, 1.0)
        return list(calls)

    with ops.backend("auto"):
        assert run_all() == ["torch", "cpu"]
        assert ops.use_triton(cpu) is False
        monkeypatch.setenv("KVLAB_CPU_KERNELS", "0")
        assert run_all() == ["torch", "torch"]
        monkeypatch.delenv("KVLAB_CPU_KERNELS")
    with ops.backend("triton"):
        assert run_all() == ["triton", "triton"]
        calls.clear()
        ops.copy_blocks(cpu, cpu, cpu, cpu)
        ops.compact_slots(cpu, cpu, cpu, cpu)
        assert calls == ["triton", "triton"]
    with ops.backend("torch"):
        assert run_all() == ["torch", "torch"]
    with pytest.raises(ValueError, match="unknown kernel backend"):
        ops.set_backend("cuda")


def test_ops_torch_block_ops_on_cpu():
    k, v = torch.randn(3, 4, 1, 16), torch.randn(3, 4, 1, 16)
    want = k[0].clone()
    with ops.backend("auto"):
        ops.copy_blocks(k, v, torch.tensor([0]), torch.tensor([2]))
        ops.compact_slots(k, v, torch.tensor([8, 9]), torch.tensor([0, 1]))
    assert torch.equal(k[2], want) and torch.equal(k[0, :2], want[:2])
