"""The one table of refused combinations (kvlab/engine/capabilities.py): each refusal is raised by a real
configuration before the model loads (or when the request is made), each allowed neighbour passes the
table, and the design note lists exactly the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlab import LLM, SamplingParams
from kvlab.engine.capabilities import REFUSED, deviations_markdown, refused_markdown

MISSING = "does-not-exist"  # a model that cannot load: an error about the combination came first

SNAP = dict(policy="snapkv", policy_args={"compression_ratio": 0.5})
# refusal name -> (engine options, a neighbour that the table lets through)
CASES = {
    "offloading without prefix caching": (dict(offload="host"), dict(offload="host", enable_prefix_caching=True)),
    "a compressing policy with an allocator that cannot compact": (
        dict(policy="snapkv", policy_args={"compression_ratio": 0.5}, allocator="test-cannot-compact"),
        dict(policy="full", allocator="test-cannot-compact")),
    "prefix caching with a policy whose select cannot protect shared pages": (
        dict(policy="test-unprotecting", policy_args={"compression_ratio": 0.5}, enable_prefix_caching=True),
        dict(policy="test-unprotecting", policy_args={"compression_ratio": 0.5})),
    "prefix caching with a non-paged allocator": (dict(allocator="contiguous", enable_prefix_caching=True),
                                                  dict(allocator="contiguous")),
    "reusing compressed turns without a compressing policy": (dict(reuse_compressed=True),
                                                               dict(reuse_compressed=True, **SNAP)),
    "reusing compressed turns with a non-paged allocator": (dict(reuse_compressed=True, allocator="contiguous", **SNAP),
                                                            dict(allocator="contiguous", **SNAP)),
}
UNREACHABLE = {  # no built-in plugin has the combination: the predicate is checked directly below, and
    "sparse reading with accumulated attention statistics",
    "a format the kernel backend cannot read",  # through the engine: tests/cache/test_quant_engine.py
}


@pytest.fixture(scope="module", autouse=True)
def plugins():
    from kvlab.cache.allocators.base import Allocator
    from kvlab.cache.allocators.paged import PagedAllocator
    from kvlab.policies.snapkv import SnapKV
    from kvlab.registry import ALLOCATORS, POLICIES

    @ALLOCATORS.register("test-cannot-compact")
    class CannotCompact(PagedAllocator):
        compact = Allocator.compact  # the base's: no compaction

    @POLICIES.register("test-unprotecting")
    class Unprotecting(SnapKV):
        def select(self, scores, budget):  # no `protected`
            return super().select(scores, budget)

    yield
    for registry, name in ((ALLOCATORS, "test-cannot-compact"), (POLICIES, "test-unprotecting")):
        registry._classes.pop(name, None)


def refusal(name: str):
    return next(r for r in REFUSED if r.name == name)


def test_every_refusal_has_a_case():
    assert {r.name for r in REFUSED if r.when == "build"} == set(CASES) | UNREACHABLE


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_combination_is_refused_before_the_model_loads(name):
    r = refusal(name)
    refused, allowed = CASES[name]
    with pytest.raises(r.kind) as info:
        LLM(MISSING, block_size=16, **refused)
    caps = _caps(refused)
    assert r.applies(caps) and str(info.value) == r.message(caps)
    assert not r.applies(_caps(allowed)), "the neighbour should pass this refusal"
    with pytest.raises(Exception) as info:  # the neighbour gets as far as loading the model
        LLM(MISSING, block_size=16, **allowed)
    assert MISSING in str(info.value), info.value


def test_no_row_is_checked_when_the_request_is_made_any_more():
    """A draft with parallel samples runs now (tests/engine/test_composition.py): the request-time rows are gone."""
    assert not [r.name for r in REFUSED if r.when == "request"]
    llm = LLM("random:llama-tiny", draft="ngram", kv_cache_memory="1MiB")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, n=2))[0]
    assert len(out.outputs) == 2


def test_the_design_note_lists_the_deviations():
    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = re.search(r"## Combinations that run outside the contract\n(.*?)\n## ", text, re.S).group(1)
    assert deviations_markdown() in section, "regenerate the list: python -c 'from kvlab.engine.capabilities " \
                                             "import deviations_markdown; print(deviations_markdown())'"


def test_the_sparse_read_with_statistics_refusal_applies_only_to_that_pair():
    import dataclasses

    base = _caps(dict(policy="quest", policy_args={"budget": 64}, draft="ngram"))
    r = refusal("sparse reading with accumulated attention statistics")
    assert not r.applies(base)
    assert r.applies(dataclasses.replace(base, accumulated_attention=True))
    assert not r.applies(dataclasses.replace(base, accumulated_attention=True, sparse_read=False))


@pytest.mark.parametrize("policy, args", [("quest", {"budget": 64}), ("rocketkv", {"budget": 64, "window_size": 8})])
def test_sparse_reading_with_a_token_tree_passes_the_table(policy, args):
    """Once refused (a tree node's ancestors sit in slots plain decoding would place elsewhere): its rows now
    read what plain decoding would (kvlab.policies.sparse_read), so nothing in the table applies."""
    caps = _caps(dict(policy=policy, policy_args=args, draft="tree"))
    assert caps.sparse_read and caps.moves_kv_slots
    assert not [r.name for r in REFUSED if r.applies(caps)]
    with pytest.raises(Exception) as info:  # it gets as far as loading the model
        LLM(MISSING, block_size=16, policy=policy, policy_args=args, draft="tree")
    assert MISSING in str(info.value), info.value


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_kept_turns_with_prefix_caching_pass_the_table(index):
    """Once refused (a kept turn and the prefix cache both claimed a request's leading pages): a kept turn wins the
    lookup, else the prefix index (tests/engine/test_compressed_turns_prefix.py), so nothing in the table applies."""
    options = dict(reuse_compressed=True, enable_prefix_caching=True, prefix_cache=index, **SNAP)
    caps = _caps(options)
    assert caps.reuses_compressed_turns and caps.prefix_caching
    assert not [r.name for r in REFUSED if r.applies(caps)]
    with pytest.raises(Exception) as info:  # it gets as far as loading the model
        LLM(MISSING, block_size=16, **options)
    assert MISSING in str(info.value), info.value


def test_a_format_only_the_torch_backend_reads_is_refused_on_triton_only():
    import dataclasses

    base = _caps({})
    r = refusal("a format the kernel backend cannot read")
    assert not r.applies(base) and not r.applies(dataclasses.replace(base, backends=("torch",)))
    assert r.applies(dataclasses.replace(base, backends=("torch",), backend="triton"))


def test_the_design_note_lists_the_table():
    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = re.search(r"## Combinations not supported yet\n(.*?)\n## ", text, re.S).group(1)
    assert refused_markdown() in section, "regenerate the list: python -c 'from kvlab.engine.capabilities " \
                                          "import refused_markdown; print(refused_markdown())'"


def _caps(options: dict):
    from kvlab.engine.capabilities import capabilities
    from kvlab.engine_config import EngineConfig
    from kvlab.registry import ALLOCATORS, DRAFTS, POLICIES, QUANT_FORMATS, load_plugins

    load_plugins()
    config = EngineConfig(model=MISSING, block_size=16, **options)
    draft = DRAFTS.build(config.draft, **config.draft_args) if config.draft else None
    return capabilities(config, POLICIES.build(config.policy, **config.policy_args),
                        QUANT_FORMATS.build(config.quant, **config.quant_args), ALLOCATORS.get(config.allocator),
                        draft)
