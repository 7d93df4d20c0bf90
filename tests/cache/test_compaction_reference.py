"""Compaction checked against a gather reference: K and V of every layer and every KV head.

Around every compression the engine runs, each full-attention table of the sequence is read straight
from the pool through its block table (`table[j // block_size]`, `j % block_size`), before and after;
the policy's kept indices are recorded as `select` returns them. After the compaction the cache must
hold exactly `torch.gather` of what it held before at those indices, head by head (per-head selection:
each KV head its own list; AdaKV: one table and one-head pages per (layer, KV head)), for K and V of
every layer, on fp32 pages (exact) and int8 pages (within a quantisation step). Tiny random models.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams

PROMPT_LENGTHS = (100, 77)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def read_tables(llm: LLM, seq) -> dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, KV head of a per-head table or None) -> (K, V) [cached, heads, D] float32, read through the
    sequence's block table in every full-attention group."""
    engine = llm.engine
    bm, cache = engine.block_manager, engine.cache
    bs = bm.block_size
    out = {}
    for g, group in enumerate(bm.groups):
        if group.sliding_window is not None:  # never compacted
            continue
        n = bm.cached_lens([seq], g)[0]
        table = bm.block_tables([seq], g)[0]
        pages = [table[j // bs] for j in range(n)]
        assert min(pages, default=0) >= 0, "a live cache index points at a released page"
        for layer in group.layers:
            if cache.quant.packed:  # dequantised, slot by slot
                slots = torch.tensor([p * bs + j % bs for j, p in enumerate(pages)], dtype=torch.long)
                k, v = cache.read_slots(layer, slots, torch.float32)
            else:
                index, offset = torch.tensor(pages, dtype=torch.long), torch.arange(n) % bs
                k, v = cache.k(layer)[index, offset].float(), cache.v(layer)[index, offset].float()
            out[(layer, group.head)] = (k.clone(), v.clone())
    return out


def record_compressions(llm: LLM) -> list[dict]:
    """Wrap the engine's compressor: for each compression, the tables before and after and what `select` kept."""
    compressor = llm.engine.compressor
    policy = compressor.policy
    compress, records = compressor.compress, []

    def recording(seq, *args, **kwargs):
        chosen = {}
        select = policy.select

        def selecting(layer, *a, **k):
            chosen[layer] = select(layer, *a, **k)
            return chosen[layer]

        before = read_tables(llm, seq)
        policy.select = selecting
        try:
            out = compress(seq, *args, **kwargs)
        finally:
            del policy.select
        records.append({"seq": seq.seq_id, "computed": seq.num_computed_tokens, "before": before,
                        "kept": chosen, "after": read_tables(llm, seq)})
        return out

    compressor.compress = recording
    return records


def heads_of(kept, num_heads: int) -> list[list[int]]:
    return kept if kept and isinstance(kept[0], list) else [kept] * num_heads


def check_against_gather(records: list[dict], num_kv_heads: int, atol: float = 0.0) -> None:
    assert records, "nothing was compressed"
    for r in records:
        assert r["kept"] and set(r["after"]) == set(r["before"])
        assert {layer for layer, _ in r["before"]} == set(r["kept"]), "a full-attention layer was not asked"
        for (layer, head), (k0, v0) in r["before"].items():
            k1, v1 = r["after"][(layer, head)]
            kept = r["kept"][layer]
            if kept is None:  # the policy kept everything: nothing moved
                ref_k, ref_v = k0, v0
            else:
                heads = heads_of(kept, num_kv_heads)
                heads = [heads[head]] if head is not None else heads  # a per-head table holds its own head
                index = torch.tensor(heads, dtype=torch.long).T[..., None].expand(-1, -1, k0.shape[-1])  # [m, H, D]
                ref_k, ref_v = k0.gather(0, index), v0.gather(0, index)
            where = f"seq {r['seq']} at {r['computed']} tokens, layer {layer}" + (f" head {head}" if head is not None
                                                                                  else "")
            assert k1.shape == ref_k.shape, f"{where}: K holds {tuple(k1.shape)}, the kept set {tuple(ref_k.shape)}"
            torch.testing.assert_close(k1, ref_k, atol=atol, rtol=0, msg=lambda m: f"{where}, K: {m}")
            torch.testing.assert_close(v1, ref_v, atol=atol, rtol=0, msg=lambda m: f"{where}, V: {m}")


CASES = [  # (model, policy, policy_args): per-head lists, one list per layer, per-head tables, several compressions
    ("random:llama-tiny", "snapkv", {"budget": 24, "window_size": 8}),
    ("random:llama-tiny", "snapkv", {"budget": 24, "window_size": 8, "per_head": False}),
    ("random:llama-tiny", "pyramidkv", {"budget": 24, "window_size": 4}),
    ("random:llama-tiny", "adakv", {"budget": 24, "scorer_args": {"window_size": 8}}),
    ("random:llama-tiny", "h2o", {"budget": 24, "recent": 4, "when": "decode", "every": 4}),
    ("random:llama-tiny", "knorm", {"compression_ratio": 0.5, "when": "chunk"}),
    ("random:llama-tiny", "streaming_llm", {"budget": 24}),
    ("random:gemma3-tiny", "snapkv", {"budget": 24, "window_size": 8}),
]


@pytest.mark.parametrize("model, name, args", CASES, ids=[f"{m.split(':')[1]}-{n}-{i}" for i, (m, n, _) in
                                                          enumerate(CASES)])
def test_compaction_holds_the_gather_of_the_kept_indices(model, name, args):
    chunk = {"max_prefill_chunk": 32} if args.get("when") == "chunk" else {}  # chunks in token time
    llm = LLM(model, policy=name, policy_args=args, max_num_batched_tokens=32, block_size=8, **chunk)
    records = record_compressions(llm)
    llm.generate(prompts(), SamplingParams(max_tokens=12, ignore_eos=True))
    check_against_gather(records, llm.model_config.num_key_value_heads)
    per_head = any(k is not None and isinstance(k[0], list) for r in records for k in r["kept"].values())
    assert per_head == (model == "random:llama-tiny" and name in ("snapkv", "pyramidkv", "adakv", "knorm")
                        and args.get("per_head", True))  # each KV head its own tokens where the heads disagree
    if args.get("when") in ("decode", "chunk"):
        assert len(records) > len(PROMPT_LENGTHS)  # compacted again after the first compaction


def test_streaming_llm_in_the_engine_keeps_the_sinks_and_the_recent_tokens():
    llm = LLM("random:llama-tiny", policy="streaming_llm", policy_args={"budget": 24, "n_sink": 4}, block_size=8)
    records = record_compressions(llm)
    llm.generate(prompts(), SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(records) == 2
    for r in records:  # the first compression: cache index = position
        n = r["computed"]
        assert all(k == list(range(4)) + list(range(n - 20, n)) for k in r["kept"].values()), r["kept"]


def test_compaction_on_int8_pages_holds_the_gather_within_a_step():
    llm = LLM("random:llama-tiny", policy="snapkv", policy_args={"budget": 24, "window_size": 8},
              quant="int8", max_num_batched_tokens=32, block_size=8)
    records = record_compressions(llm)
    llm.generate(prompts(), SamplingParams(max_tokens=6, ignore_eos=True))
    scale = max(float(t.abs().max()) for r in records for kv in r["before"].values() for t in kv)
    check_against_gather(records, 2, atol=scale / 127)
