"""The roofline ceiling (kvlab/speculation/roofline.py): on a machine with arithmetic to spare it is the byte
model's prediction; with bytes to spare it is the arithmetic's; a verification pays for its k + 1 rows and
queries; a draft's view and format are priced as declared. Torch-free."""

from __future__ import annotations

import math

import pytest

from kvlab.speculation.cost_model import Traffic, run_speedup
from kvlab.speculation.roofline import DraftReads, Machine, ModelShape, ceiling_speedup

# SmolLM2-135M in fp32: 30 layers, 9 query / 3 KV heads of 64, 134.5 M multiplied parameters
LAYERS, PARAMS, KV, FLOPS_PER_KEY = 30, 134.5e6, 30 * 2 * 3 * 64 * 4, 4.0 * 64 * 9 * 30
SHAPE = ModelShape(PARAMS * 4, PARAMS, KV, FLOPS_PER_KEY)
BYTES_ONLY = Machine(40e9, math.inf, math.inf)
ARITHMETIC_ONLY = Machine(math.inf, 150e9, 150e9)


def test_with_arithmetic_to_spare_it_is_the_byte_model():
    traffic = Traffic((PARAMS * 4 / LAYERS,) * LAYERS, 0.0, (KV / LAYERS,) * LAYERS)
    batch, c, k, e = 16, 4096.0, 4, 3.5
    view = DraftReads(view_tokens=256)
    expected = run_speedup(traffic.pass_bytes(batch, c), traffic.pass_bytes(batch, c + k),
                           traffic.pass_bytes(batch, c, view=256), k, e, 0.9)
    assert ceiling_speedup(SHAPE, BYTES_ONLY, view, batch, c, k, e, 0.9) == pytest.approx(expected)
    free = run_speedup(traffic.pass_bytes(batch, c), traffic.pass_bytes(batch, c + k), 0.0, k, e)
    assert ceiling_speedup(SHAPE, BYTES_ONLY, DraftReads(free=True), batch, c, k, e) == pytest.approx(free)


def test_with_bytes_to_spare_a_verification_costs_its_rows_and_queries():
    batch, c, k = 16, 4096.0, 4
    plain = 2 * PARAMS * batch + batch * c * FLOPS_PER_KEY  # FLOPs of one decode pass
    verify = 2 * PARAMS * batch * (k + 1) + batch * (c + k) * (k + 1) * FLOPS_PER_KEY
    # prompt lookup with every draft accepted: k + 1 tokens for one verification's arithmetic
    got = ceiling_speedup(SHAPE, ARITHMETIC_ONLY, DraftReads(free=True), batch, c, k, k + 1.0)
    assert got == pytest.approx((k + 1) * plain / verify) and got < 1.0


def test_a_memory_bound_batch_1_verification_is_nearly_free_and_a_compute_bound_one_is_not():
    m = Machine(40e9, 150e9, 150e9)
    assert m.ridge() == pytest.approx(3.75)
    lookup = DraftReads(free=True)
    assert ceiling_speedup(SHAPE, m, lookup, 1, 512, 4, 5.0) > 4.0  # 5 rows: under the ridge
    assert ceiling_speedup(SHAPE, m, lookup, 16, 4096, 4, 5.0) < 2.0  # 80 rows, 5 queries a sequence: over it


def test_a_view_reads_its_tokens_in_its_own_format_with_the_same_arithmetic():
    batch, c = 16, 4096.0
    full, view = DraftReads(), DraftReads(view_tokens=1024)
    packed = DraftReads(view_tokens=1024, kv_bytes_per_token=KV / 7)
    assert view.pass_s(SHAPE, BYTES_ONLY, batch, c) < full.pass_s(SHAPE, BYTES_ONLY, batch, c)
    assert packed.pass_s(SHAPE, BYTES_ONLY, batch, c) < view.pass_s(SHAPE, BYTES_ONLY, batch, c)
    # fewer bytes, the same multiply-adds: with bytes to spare the int4 copy costs what the fp32 view does
    assert packed.pass_s(SHAPE, ARITHMETIC_ONLY, batch, c) == pytest.approx(view.pass_s(SHAPE, ARITHMETIC_ONLY, batch, c))
    assert DraftReads(view_tokens=8192).pass_s(SHAPE, BYTES_ONLY, batch, c) == full.pass_s(SHAPE, BYTES_ONLY, batch, c)


def test_an_early_exit_reads_its_share_of_weights_and_layers():
    batch, c = 4, 2048.0
    half = DraftReads(weight_share=0.5, layer_share=0.5)
    for m in (BYTES_ONLY, ARITHMETIC_ONLY):
        assert half.pass_s(SHAPE, m, batch, c) == pytest.approx(0.5 * DraftReads().pass_s(SHAPE, m, batch, c))
    assert DraftReads(free=True).pass_s(SHAPE, BYTES_ONLY, batch, c) == 0.0
