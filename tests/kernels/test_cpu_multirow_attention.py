"""Short extend chunks (verification of k drafted tokens) on the native CPU kernel, one decode row per query.

A chunk of q_len <= MAX_KERNEL_Q queries with no restricting tree mask runs kvlab_decode_attention as q_len rows,
query j seeing cache indices [first_key_j, seq_len - q_len + j] (its causal prefix and its own sliding window)
through the sequence's table. Checked against the reference for element-wise pools (fp32, bf16, fp16, fp8 with
scales) and packed pages, with windows, q_len 2..MAX_KERNEL_Q, mixed with decode rows and a long chunk (which
stays on the reference); the attention statistics a policy reads, per stats window; each query's output equal to
the bit to the same query decoded alone; a tree whose rows are a chain runs the kernel too.
"""

import pytest
import torch

from kvlab.kernels.attention_plan import plan_paged_attention
from kvlab.kernels.cpu import decode_attention as cpu
from kvlab.kernels.reference import paged_attention as ref_module
from kvlab.kernels.reference.paged_attention import paged_attention_ref
from kvlab.kernels.testing import CACHE_DTYPES, attention_tolerance, make_paged_batch
from test_cpu_decode_attention import D, PACKED, ListLessor, filled_cache

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler: the CPU kernels fall back")

LONG = cpu.MAX_KERNEL_Q + 1  # a prefill chunk: the reference


def mixed(bs: int) -> tuple[list[int], list[int]]:
    """Decode rows, short chains of every length 2..MAX_KERNEL_Q (some past a key chunk), one long chunk."""
    shorts = list(range(2, cpu.MAX_KERNEL_Q + 1))
    q_lens = [1] + shorts[: len(shorts) // 2] + [LONG, 1] + shorts[len(shorts) // 2 :]
    seq_lens = [n + (3 * bs + 1 if i % 2 else cpu.CHUNK_KEYS + bs - 2) for i, n in enumerate(q_lens)]
    seq_lens[0] = 1
    return q_lens, seq_lens


def counting_reference(monkeypatch) -> list[int]:
    """Record how many query tokens each reference call gets."""
    calls, reference = [], ref_module.run_paged_attention
    monkeypatch.setattr(ref_module, "run_paged_attention", lambda q, *a, **k: calls.append(q.shape[0]) or
                        reference(q, *a, **k))
    return calls


CASES = [  # cache, window, softcap, q dtype, stats window
    ("fp32", None, None, torch.float32, None),
    ("fp32", 7, None, torch.float32, 3),
    ("bf16", None, 10.0, torch.bfloat16, 1),
    ("bf16", 20, None, torch.float32, None),
    ("fp16", 5, None, torch.float32, 2),
    ("fp8_e4m3", None, None, torch.float32, 4),
    ("fp8_e5m2", 300, 5.0, torch.float32, 0),
]


@pytest.mark.parametrize("cache,window,softcap,q_dtype,stats_window", CASES,
                         ids=[f"{c[0]}-w{c[1]}-cap{c[2]}-{str(c[3])[6:]}-sw{c[4]}" for c in CASES])
def test_short_chains_match_the_reference(cache, window, softcap, q_dtype, stats_window, monkeypatch):
    """Outputs and statistics of a mixed step; the reference saw the long chunk alone."""
    bs = 4
    q_lens, seq_lens = mixed(bs)
    batch = make_paged_batch(q_lens, seq_lens, 2, 3, 64, bs, CACHE_DTYPES[cache], q_dtype, sliding_window=window)
    args = (*batch.args(), window, softcap, batch.k_scale, batch.v_scale)
    want = paged_attention_ref(*args, return_stats=True, stats_window=stats_window)
    calls = counting_reference(monkeypatch)
    got = cpu.paged_attention(*args, return_stats=True, stats_window=stats_window,
                              out=torch.full_like(batch.q, float("nan")))
    assert calls == [LONG]
    assert not got[0].isnan().any()
    torch.testing.assert_close(got[0].float(), want[0].float(), **attention_tolerance(q_dtype))
    torch.testing.assert_close(got[1], want[1], **attention_tolerance(torch.float32))
    counted = [n if stats_window is None else min(n, stats_window) for n in q_lens]  # queries per sequence counted
    mass = torch.tensor(counted, dtype=torch.float32)[:, None].expand(-1, 2) * 3  # each: 1 per query head, G = 3
    torch.testing.assert_close(got[1].sum(-1), mass, atol=1e-3, rtol=1e-4)


def test_each_query_equals_itself_decoded_alone():
    """Query j of a chain is the decode row with seq_len - q_len + j + 1 keys: the same bits (the kernel's
    reduction order depends on the row alone)."""
    bs, window = 16, 40
    q_lens, seq_lens = [5, 1, cpu.MAX_KERNEL_Q, 3], [cpu.CHUNK_KEYS + 3, 30, 2 * cpu.CHUNK_KEYS + 9, 3]
    batch = make_paged_batch(q_lens, seq_lens, 3, 3, 64, bs, sliding_window=window, seed=2)
    together = cpu.paged_attention(*batch.args(), window)
    cu = batch.cu_seqlens_q.tolist()
    for b, n in enumerate(q_lens):
        for j in range(n):
            t = cu[b] + j
            alone = cpu.paged_attention(batch.q[t : t + 1], batch.k_cache, batch.v_cache, batch.block_tables[b : b + 1],
                                        torch.tensor([0, 1]), torch.tensor([seq_lens[b] - n + 1 + j]), batch.scale,
                                        window)
            assert torch.equal(alone[0], together[t]), (b, j)


@pytest.mark.parametrize("name,args,leased", PACKED[:4], ids=[f"{n}-{i}" for i, (n, a, l) in enumerate(PACKED[:4])])
def test_short_chains_on_packed_pages(name, args, leased, monkeypatch):
    """int8 / int4 / int2 pages (open pages in residual rows, own or leased) read by every query of a chain."""
    cache, tables, lens = filled_cache(name, args, ListLessor(range(10, 100)) if leased else None)
    q_lens = [4, 1, 3]
    q = torch.randn(sum(q_lens), 4, D)
    cu = torch.tensor([0, 4, 5, 8])
    calls = counting_reference(monkeypatch)
    got = cpu.paged_attention(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125, sliding_window=45,
                              return_stats=True)
    assert calls == []
    want = paged_attention_ref(q, cache.k(0), cache.v(0), tables, cu, lens, 0.125, sliding_window=45,
                               return_stats=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **attention_tolerance(torch.float32))


def test_a_tree_whose_rows_are_a_chain_runs_the_kernel(monkeypatch):
    """A tree step: a sequence whose mask is causal over its new tokens runs the kernel, a branching one the
    reference with its mask rows."""
    bs = 4
    q_lens, seq_lens = [4, 5, 1], [2 * bs + 5, 3 * bs + 2, 9]
    batch = make_paged_batch(q_lens, seq_lens, 2, 3, 64, bs, tree=True, seed=5)
    cu, mask = batch.cu_seqlens_q.tolist(), batch.tree_mask
    mask[cu[0] : cu[1], :4] = torch.tril(torch.ones(4, 4, dtype=torch.bool))  # sequence 0: a chain
    mask[cu[1] : cu[2], :5] = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    mask[cu[1] + 3, 2] = False  # sequence 1: node 3 branches off node 1
    mask[cu[2], 0] = True
    plan = plan_paged_attention(cu, seq_lens, batch.block_tables, bs, tree_mask=mask)
    want = ref_module.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
    calls = counting_reference(monkeypatch)
    got = cpu.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
    assert calls == [5]
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))


DRAFTS = {"ngram": {"num_tokens": 4},
          "self_compressed": {"policy": "streaming_llm", "policy_args": {"budget": 32}, "num_tokens": 4}}


@pytest.mark.parametrize("draft", list(DRAFTS))
def test_greedy_with_a_draft_equals_plain_decoding_with_verification_on_the_kernel(draft, monkeypatch):
    """fp32 tiny Llama, the CPU linear kernel too: drafted tokens verified in kernel rows (every chunk of
    k + 1 = 5 queries), the outputs those of plain decoding."""
    from kvlab import LLM, SamplingParams
    from kvlab.testing.policies import prompts as policy_prompts

    batch = policy_prompts(256, lengths=(61, 40, 23))
    engine = dict(block_size=16, kv_cache_memory="4MiB", linear_backend="cpu", dtype="float32")
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM("random:llama-tiny", **engine).generate(batch, sp)]
    chains, build = [], cpu._build_decode_rows
    monkeypatch.setattr(cpu, "_build_decode_rows", lambda plan: chains.append(plan.q_lens) or build(plan))
    llm = LLM("random:llama-tiny", draft=draft, draft_args=DRAFTS[draft], **engine)
    got = [o.token_ids for o in llm.generate(batch, sp)]
    verified = [q for q in chains if max(q) == 5]
    assert verified and llm.stats()["spec_drafted_tokens"] > 0
    assert got == want
