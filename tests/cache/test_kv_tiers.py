"""Tiers below the pool in the engine (kvlab/cache/tiers/, docs/design.md "Tiers below the pool").

The contract: offloading changes only speed. Greedy outputs with `offload` equal outputs without it on a
pool small enough that prefix-cache pages are evicted (demoted to a tier) and hit again (restored), with
the hashed and the radix cache, under preemption, with packed formats (int8; int4 with and without its
residual window), on a sliding-window model and over multi-turn conversations; a restored page is bit for
bit the page that was demoted; a tier file that is gone falls back to recomputing with a warning; closing
the engine drains the tiers and removes the disk tier's folder; a stale folder is refused or cleaned.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.cache.tiers.disk import MARKER

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def prompts_with_system(system_len: int, tail_lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 256, (system_len,), generator=g).tolist()
    return [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in tail_lens]


PROMPTS = prompts_with_system(23, [5, 6, 7, 8, 9, 10])
BATCHES = (PROMPTS[:3], PROMPTS[3:], PROMPTS)
ENGINE = dict(block_size=4, max_model_len=128, kv_cache_memory=24 * 1024, max_num_batched_tokens=32,
              enable_prefix_caching=True)


def run(model: str = "random:llama-tiny", batches=BATCHES, max_tokens: int = 10, close: bool = True, **engine):
    llm = LLM(model, **{**ENGINE, **engine})
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = [[o.token_ids for o in llm.generate(b, params)] for b in batches]
    stats = llm.stats()
    if close:
        llm.close()
    return outs, stats, llm


_ref: dict = {}


def reference(**engine):
    key = repr(sorted(engine.items()))
    if key not in _ref:
        _ref[key] = run(**engine)[:2]
    return _ref[key]


@pytest.mark.parametrize("cache", [{}, {"prefix_cache": "radix"}, {"prefix_match": "token"}])
@pytest.mark.parametrize("offload", ["host", "disk"])
def test_outputs_with_tiers_equal_outputs_without(cache, offload):
    want, ref_stats = reference(**cache)
    got, stats, _ = run(offload=offload, **cache)
    assert got == want
    assert stats["preemptions"] > 0 and stats["tier_demoted"] > 0 and stats[f"tier_{offload}_hits"] > 0
    assert stats["prefix_hit_tokens"] > ref_stats["prefix_hit_tokens"]  # the tier's pages were hits, not recomputes
    assert stats["tier_bytes_moved"] > 0 and stats["tier_failed_reads"] == 0


@pytest.mark.parametrize("quant", [  # pools that evict and hit at each format's page size
    {"quant": "int8", "kv_cache_memory": 8 * 1024},
    {"quant": "int4", "quant_args": {"residual": 0}, "kv_cache_memory": 12 * 1024},
    {"quant": "int4", "quant_args": {"residual": 8}, "kv_cache_memory": 20 * 1024}])  # a residual window
def test_packed_pages_move_as_codes_and_scales(quant):
    want, _ = reference(**quant)
    got, stats, _ = run(offload="host", offload_placement="arc", **quant)
    assert got == want
    assert stats["tier_restored"] > 0


def test_a_compressing_policy_with_exact_prefix_hits_is_unchanged_by_tiers():
    """snapkv with prefix_keep_shared=False (a hit's pages copied, compressed as without caching: exact). With the
    default (shared pages kept whole) a request keeps what its hit protects, a declared deviation, so a tier that
    turns recomputes into hits changes outputs as any extra hit does."""
    engine = dict(policy="snapkv", policy_args={"compression_ratio": 0.5, "window_size": 4}, prefix_keep_shared=False,
                  kv_cache_memory=48 * 1024)
    want, _, _ = run(**engine)
    got, stats, _ = run(offload="host", **engine)
    assert got == want
    assert stats["tier_restored"] > 0


def test_a_sliding_window_model_restores_every_group():
    batches = (prompts_with_system(13, [7, 12, 17, 5]), prompts_with_system(13, [9, 14, 1, 3]))
    engine = dict(model="random:gemma3-tiny", batches=batches, max_tokens=16, kv_cache_memory=96 * 1024)
    want, _, _ = run(**engine)
    got, stats, _ = run(offload="host_disk", offload_args={"memory": "8KiB"}, **engine)
    assert got == want
    assert stats["tier_restored"] > 0


def test_multi_turn_conversations_come_back_from_the_tier():
    """Four conversations of three turns, interleaved: each turn's prompt is the previous prompt, its answer
    and a new user message; the pool holds about one conversation's history."""
    g = torch.Generator().manual_seed(3)
    users = [[torch.randint(3, 256, (n,), generator=g).tolist() for n in (20, 9, 11)] for _ in range(4)]

    def conversations(**engine):
        llm = LLM("random:llama-tiny", **{**ENGINE, "kv_cache_memory": 40 * 1024, **engine})
        params, history, outs = SamplingParams(max_tokens=6, ignore_eos=True), [[] for _ in users], []
        for turn in range(3):
            for c, conv in enumerate(users):
                history[c] += conv[turn]
                out = llm.generate([history[c]], params)[0].token_ids
                history[c] += out
                outs.append(out)
        stats = llm.stats()
        llm.close()
        return outs, stats

    want, ref = conversations()
    for prefix_cache in ("hash", "radix"):
        got, stats = conversations(offload="host", prefix_cache=prefix_cache)
        assert got == want
        assert stats["tier_restored"] > 0
    assert stats["prefix_hit_tokens"] > ref["prefix_hit_tokens"]


@pytest.mark.parametrize("offload, quant", [("host", "auto"), ("disk", "auto"), ("disk", "int4")])
def test_a_restored_page_is_bit_identical(offload, quant):
    llm = LLM("random:llama-tiny", offload=offload, quant=quant, **ENGINE)
    kv, g = llm.engine.kv, torch.Generator().manual_seed(0)
    for t in kv.cache.page_tensors():  # random bits in pages 3 and 5
        for p in (3, 5, 6, 7):
            t[p] = torch.randint(0, 255, t[p].shape, generator=g).to(t.dtype) if not t.is_floating_point() \
                else torch.randn(t[p].shape, generator=g).to(t.dtype)
    before = [t[3].clone() for t in kv.cache.page_tensors()]
    kv.demote(3, 0, "a")
    kv.restore("a", 0, 5)
    assert all(torch.equal(t[5], b) for t, b in zip(kv.cache.page_tensors(), before))
    assert len(kv.tiers[0]) == 0
    pages = [t[[6, 3]].clone() for t in kv.cache.page_tensors()]  # a run of two pages moves as one copy per tensor
    kv.demote(3, 0, "a")
    kv.demote(6, 0, "b")
    kv.restore_many([("b", 0, 5), ("a", 0, 7)])
    assert all(torch.equal(t[[5, 7]], b) for t, b in zip(kv.cache.page_tensors(), pages))
    assert len(kv.tiers[0]) == 0
    llm.close()


def test_a_lost_disk_page_is_recomputed_with_a_warning():
    want, _ = reference()
    llm = LLM("random:llama-tiny", offload="disk", **ENGINE)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    got = [[o.token_ids for o in llm.generate(b, params)] for b in BATCHES[:2]]
    tier = llm.engine.kv.tiers[0]
    tier.flush()  # the writes behind have landed: the damage is to written files
    files = sorted(tier.folder.glob("*.page"))
    assert files
    for i, f in enumerate(files):  # every page file deleted or truncated
        f.unlink() if i % 2 else f.write_bytes(f.read_bytes()[:7])
    with pytest.warns(RuntimeWarning, match="recomputed"):
        got.append([o.token_ids for o in llm.generate(BATCHES[2], params)])
    assert got == want
    assert llm.stats()["tier_failed_reads"] > 0
    llm.close()


def test_close_drains_the_tiers_and_removes_the_disk_folder(tmp_path):
    folder = tmp_path / "tier"
    _, stats, llm = run(offload="host_disk", offload_args={"memory": "4KiB", "path": str(folder)})
    assert stats["tier_disk_pages_held"] > 0 and stats["tier_spilled"] > 0
    assert not folder.exists()  # the tier made the folder, so it goes
    assert llm.stats()["tier_pages_held"] == 0
    assert llm.engine.block_manager.prefix_cache.offloaded_nodes == {}
    assert all(not n.offloaded for nodes in llm.engine.block_manager.prefix_cache.index.values() for n in nodes)
    demoted = llm.stats()["tier_demoted"]
    want, _ = reference()
    assert [[o.token_ids for o in llm.generate(b, SamplingParams(max_tokens=10, ignore_eos=True))]
            for b in BATCHES] == want  # still usable, without tiers: evicted pages are dropped again
    assert llm.stats()["tier_demoted"] == demoted


def test_a_stale_folder_is_refused_or_cleaned(tmp_path):
    (tmp_path / MARKER).write_text("999999999")  # a process that is not running
    (tmp_path / "1.page").write_bytes(b"x" * 10)
    with pytest.raises(RuntimeError, match="earlier run.*clean_stale"):
        LLM("random:llama-tiny", offload="disk", offload_args={"path": str(tmp_path)}, **ENGINE)
    with pytest.warns(RuntimeWarning, match="stale page file"):
        llm = LLM("random:llama-tiny", offload="disk", offload_args={"path": str(tmp_path), "clean_stale": True},
                  **ENGINE)
    assert not (tmp_path / "1.page").exists()
    llm.close()
    assert tmp_path.exists() and not list(tmp_path.iterdir())  # a folder it did not make stays, emptied


def test_offloading_without_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        LLM("random:llama-tiny", offload="host", **{**ENGINE, "enable_prefix_caching": False})
    with pytest.raises(ValueError, match="offload_args: no parameter.*memroy.*memory, disk_memory, path"):
        LLM("random:llama-tiny", offload="host", offload_args={"memroy": 1}, **ENGINE)
