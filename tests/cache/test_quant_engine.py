"""int8 / int4 / int2 cache formats in the engine: generation, the byte budget, composition with a
compressing policy, and bad input (tiny random Llama: 2 layers, 2 KV heads of head_dim 16)."""

import copy

import pytest
import torch

import kvlab.engine.build
from kvlab import LLM, SamplingParams
from kvlab.registry import QUANT_FORMATS, UnknownPluginError

MODEL = "random:llama-tiny"
PROMPTS = [list(range(1, 60)), list(range(5, 30))]
TINY = {"int8": {}, "int4": {"group_size": 8, "residual": 16}, "int2": {"group_size": 8, "residual": 0}}


def run(quant, quant_args=None, max_tokens=12, **kw):
    options = dict(block_size=16, kv_cache_memory="1MiB", max_num_seqs=4, quant=quant, quant_args=quant_args or {})
    llm = LLM(MODEL, **{**options, **kw})
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return llm, [o.token_ids for o in out]


@pytest.mark.parametrize("name", list(TINY))
def test_generate_with_each_format(name):
    _, want = run("fp32")
    llm, got = run(name, TINY[name])
    assert [len(t) for t in got] == [12, 12]
    cache = llm.engine.cache
    if name == "int8":  # 1/127 of a token's range per element: greedy tokens unchanged here
        assert got == want
    else:  # pages older than the residual window are quantised, the newest stay open
        sealed = llm.engine.block_manager.num_blocks - len(cache.area.open_pages())
        assert cache.area.early_seals == 0 and sealed > 0
        assert cache.k(0).parts["data"].dtype == torch.uint8


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_sliding_window_model_with_packed_pages(name):
    """gemma3-tiny (sliding-window and global layer groups, soft-capped attention) on KIVI pages."""
    llm = LLM("random:gemma3-tiny", block_size=16, kv_cache_memory="1MiB", max_num_seqs=4, quant=name,
              quant_args={"group_size": 8, "residual": 8})
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    assert [len(o.token_ids) for o in out] == [6, 6]
    assert llm.engine.cache.area.early_seals == 0


def test_budget_buys_proportionally_more_pages():
    """Same byte budget: pages scale with 1 / bytes per token (the residual area is paid for first)."""
    blocks, per_token, residual = {}, {}, {}
    for name, args in (("fp32", {}), ("bf16", {}), *TINY.items()):
        llm = LLM(MODEL, block_size=16, kv_cache_memory="1MiB", max_num_seqs=4, quant=name, quant_args=args)
        c = llm.engine.cache
        blocks[name], residual[name] = llm.engine.block_manager.num_blocks, c.residual_nbytes()
        per_token[name] = c.pool_nbytes() / ((c.null_page + 1) * 16)
        assert c.pool_nbytes() + residual[name] <= 2**20 + per_token[name] * 16  # the null page is extra
    for name in blocks:
        expected = (2**20 - residual[name]) // (per_token[name] * 16)
        assert blocks[name] == expected
    assert per_token["bf16"] == per_token["fp32"] / 2
    assert blocks["int8"] > 3 * blocks["fp32"] and blocks["int2"] > blocks["int4"] > blocks["int8"]


def test_residual_rows_in_bfloat16_cost_half_and_buy_pages():
    """residual_dtype="bfloat16" on an fp32 model: residual rows are bf16, so a row leases half as many
    pages of codes as an fp32 row (int4 codes: 4 pages a row, not 8), and open pages are read back to
    within bf16's rounding (greedy tokens of the tiny model unchanged)."""
    runs = {}
    for dtype in ("compute", "bfloat16"):
        llm, got = run("int4", {"group_size": 8, "residual": 16, "residual_dtype": dtype})
        c = llm.engine.cache
        runs[dtype] = (got, c.area.k, c.area.leased_peak, c.k(0).residual.dtype)
    (want, full_k, full_rows, full_dt), (got, half_k, half_rows, half_dt) = runs.values()
    assert (full_dt, half_dt) == (torch.float32, torch.bfloat16)
    assert (full_k, half_k) == (8, 4) and full_rows > 0 and half_rows > 0
    assert got == want


def test_int4_composes_with_a_compressing_policy():
    """SnapKV keeps 32 tokens per layer, then the survivors are stored quantised: the same pages are
    freed as on fp32 (the kept set is chosen on the dequantised keys)."""
    prompts = [list(range(1, 100)), list(range(3, 90))]
    freed = {}
    for name, args in (("fp32", {}), ("int4", {"group_size": 8, "residual": 8})):
        llm = LLM(MODEL, block_size=16, kv_cache_memory="4MiB", max_num_seqs=4, quant=name, quant_args=args,
                  policy="snapkv", policy_args={"budget": 32})
        out = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
        assert [len(o.token_ids) for o in out] == [12, 12]
        freed[name] = llm.stats()["policy_pages_freed"]
    assert freed["int4"] == freed["fp32"] > 0


@pytest.mark.parametrize("policy,args", [("snapkv", {"budget": 32, "per_head": True}), ("adakv", {"budget": 32})])
def test_packed_pages_with_per_head_policies(policy, args):
    """Per-KV-head selection (survivors moved head by head, pages re-quantised) and AdaKV (a table and
    one-head pages per (layer, KV head)) on int4 pages: same pages freed as on fp32."""
    prompts = [list(range(1, 100)), list(range(3, 90))]
    freed = {}
    for name, qargs in (("fp32", {}), ("int4", {"group_size": 8, "residual": 8})):
        llm = LLM(MODEL, block_size=16, kv_cache_memory="4MiB", max_num_seqs=4, quant=name, quant_args=qargs,
                  policy=policy, policy_args=args)
        out = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
        assert [len(o.token_ids) for o in out] == [8, 8]
        freed[name] = llm.stats()["policy_pages_freed"]
    assert freed["int4"] == freed["fp32"] > 0


def test_unknown_format_lists_the_registered_ones(monkeypatch):
    monkeypatch.setattr(kvlab.engine.build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UnknownPluginError, match="registered .*int2, int4, int8"):
        LLM(MODEL, quant="int3")
    assert {"int8", "int4", "int2"} <= set(QUANT_FORMATS.names())


def test_bad_format_parameters():
    with pytest.raises(ValueError, match="group_size must divide head_dim 16"):
        LLM(MODEL, quant="int4", quant_args={"group_size": 32})
    with pytest.raises(ValueError, match="block_size 2 would leave key groups of 2 token"):
        LLM(MODEL, quant="int4", block_size=2)  # the derived group (group_size=None)
    with pytest.raises(ValueError, match="group_size must divide block_size 4"):
        LLM(MODEL, quant="int2", quant_args={"group_size": 8}, block_size=4)
    with pytest.raises(ValueError, match="residual must be an integer >= 0"):
        LLM(MODEL, quant="int4", quant_args={"group_size": 8, "residual": -1})
    with pytest.raises(ValueError, match="residual_dtype must be one of compute, float32, bfloat16, float16"):
        LLM(MODEL, quant="int4", quant_args={"group_size": 8, "residual_dtype": "int8"})


def test_a_backend_that_cannot_read_the_format_fails_before_the_model_loads(monkeypatch):
    """Every built-in format is read by both backends; a format that lists only the torch one is
    refused on the Triton backend before the model loads."""
    from kvlab.cache.quant.kivi import Int4

    assert all(set(QUANT_FORMATS.get(n).backends) == {"torch", "triton"} for n in ("int8", "int4", "int2"))
    monkeypatch.setattr(Int4, "backends", ("torch",))
    monkeypatch.setattr(kvlab.engine.build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton on CPU is accepted under its interpreter only
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton on a CPU device: the interpreter (else refused first)
    with pytest.raises(ValueError, match=r"quant='int4': the triton kernel backend cannot read this cache format "
                                         r"\(it is read by: torch\); set kernel_backend='torch'"):
        LLM(MODEL, quant="int4", quant_args={"group_size": 8}, kernel_backend="triton")


@pytest.mark.heavy
def test_smollm2_generates_with_each_format(load_reference):
    """SmolLM2-135M, a few greedy tokens per format on a 100-token prompt (residual 0: every full page of
    the prompt is quantised)."""
    loaded = load_reference("smollm2-135m")
    prompt = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is "
              "Madrid. The capital of Portugal is Lisbon. The capital of Austria is Vienna. ") * 2 + \
        "The capital of Italy is"
    texts = {}
    for name, args in (("fp32", {}), ("int8", {}), ("int4", {"residual": 0}), ("int2", {"residual": 0})):
        llm = LLM("smollm2-135m", loaded=copy.deepcopy(loaded), block_size=32, kv_cache_memory="32MiB",
                  max_num_seqs=2, quant=name, quant_args=args)
        engine, area = llm.engine, llm.engine.cache.area
        engine.add_request(llm.tokenizer(prompt)["input_ids"], SamplingParams(max_tokens=4, temperature=0.0))
        outputs, open_while_running = [], []
        while engine.has_unfinished():
            outputs += engine.step()
            open_while_running.append(area is None or area.any_open)
        (out,) = outputs
        assert len(out.token_ids) == 4
        texts[name] = out.text
        if name != "fp32":  # the tail page stays open while the request runs (its rows go back when it ends)
            assert all(open_while_running[:-1]) and (area is None or not area.any_open)
    assert texts["int8"] == texts["fp32"]
    assert texts["int4"].split()[:1] == texts["fp32"].split()[:1]


def test_sparse_reading_runs_on_packed_pages():
    """Packed pages keep the page key summaries sparse reading needs (kvlab.policies.sparse_read; its combination
    checks: tests/policies/test_sparse_read.py)."""
    llm = LLM("random:llama-tiny", policy="quest", policy_args={"budget": 64, "dense_layers": 0}, quant="int4",
              quant_args={"group_size": 8}, block_size=16, kv_cache_memory="1MiB")
    llm.generate([list(range(5, 105))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert llm.stats()["sparse_reads"] > 0


@pytest.mark.parametrize("qargs", [{"group_size": 8, "residual": 16}, {"group_size": 8, "residual": 0}])
def test_speculative_rollback_on_packed_pages(qargs):
    """ngram speculation on int4 pages: rejected tokens are rolled back (a page sealed with tentative tokens
    is re-encoded on its next write), and the greedy output equals plain decoding on the same format, with
    no page left held."""
    prompts = [list(range(5, 25)) * 4, list(range(30, 50)) * 3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    opts = dict(block_size=8, kv_cache_memory="1MiB", max_num_seqs=4, quant="int4", quant_args=qargs)
    want = [o.token_ids for o in LLM(MODEL, **opts).generate(prompts, params)]
    llm = LLM(MODEL, **opts, draft="ngram", draft_args={"num_tokens": 4})
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert 0 < llm.stats()["spec_acceptance_rate"] < 1  # some drafts were rejected and rolled back
    assert llm.engine.block_manager.num_used_blocks() == 0
