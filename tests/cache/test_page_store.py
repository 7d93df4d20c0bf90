"""A packed format's page store (kvlab/cache/quant/page_store.py) on its own, without a KVCache or a
model: writes planned by `plan_write` into sealed pages and open residual rows, reads back within the
format's bound (exactly from an open row), a page appended to after it was sealed, sealing an open
page from its row, a deferred seal's row held until the step ends, and copies of pages and rows that
are exact. (tests/kernels/test_quant_int.py drives the same store through the cache and the
attention backends.)"""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.quant.page_store import PageStore, ResidualArea, plan_write
from kvlab.registry import build

PAGES, BS, HKV, D = 6, 8, 2, 16


def stores(name: str, rows: int | None = PAGES):
    """(key store, value store, area) of one layer, with `rows` residual rows of their own (None: no area)."""
    quant = build("quant", name, **({} if name == "int8" else {"residual": 0}))
    area = None if rows is None else ResidualArea(PAGES, rows, "cpu")
    k, v = quant.codecs(BS, D)
    make = lambda codec: PageStore(codec, PAGES, BS, HKV, D, area, torch.float32, "cpu")  # noqa: E731
    return make(k), make(v), area


def write(ks, vs, area, key, value, slots, seal):
    plan = plan_write(torch.as_tensor(slots), BS, (ks.codec, vs.codec), area, seal)
    ks.write(key, plan)
    vs.write(value, plan)


def within_half_a_step(store, slots, x):
    back = store.read_slots(slots, torch.float32)
    return bool(((back - x).abs() <= store.steps_at(slots) / 2 * (1 + 1e-5) + 1e-6).all())


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_a_sealed_page_reads_back_within_half_a_step_and_an_open_row_exactly(name):
    ks, vs, area = stores(name)
    torch.manual_seed(0)
    key, value = torch.randn(BS + 3, HKV, D) * torch.linspace(0.5, 8, D), torch.randn(BS + 3, HKV, D)
    slots = torch.arange(BS + 3) + 2 * BS  # page 2 full, page 3 partly filled
    write(ks, vs, area, key, value, slots, seal={2})
    assert set(area.open_pages()) == {3}
    for store, x in ((ks, key), (vs, value)):
        assert within_half_a_step(store, slots, x)
        assert bool((store.steps_at(slots[:BS]) > 0).all()) and not store.steps_at(slots[BS:]).any()
        assert torch.equal(store.read_slots(slots[BS:], torch.float32), x[BS:])


def test_sealing_a_partly_filled_page_takes_its_range_from_the_written_slots_only():
    """Keys in [10, 11] in the first three slots of a page: the stale slots after them (zeros) must not
    stretch the per-channel range, or the step grows tenfold."""
    ks, vs, area = stores("int4", rows=None)
    key = 10 + torch.rand(3, HKV, D)
    write(ks, vs, area, key, key, torch.arange(3) + BS, seal=None)
    assert within_half_a_step(ks, torch.arange(3) + BS, key)
    assert float(ks.steps_at(torch.arange(3) + BS).max()) <= 1.0 / 15 * 1.01


def test_appending_to_a_page_of_a_token_local_format_leaves_its_earlier_tokens_as_they_were():
    """int8 encodes every token alone: a decode step writes its slot only."""
    ks, vs, area = stores("int8", rows=None)
    torch.manual_seed(1)
    x = torch.randn(BS, HKV, D)
    write(ks, vs, area, x[:5], x[:5], torch.arange(5) + BS, seal=None)
    first = ks.read_slots(torch.arange(5) + BS, torch.float32)
    write(ks, vs, area, x[5:6], x[5:6], torch.tensor([BS + 5]), seal=None)  # a decode step into the page
    write(ks, vs, area, x[6:], x[6:], torch.arange(6, BS) + BS, seal=None)
    assert torch.equal(ks.read_slots(torch.arange(5) + BS, torch.float32), first)
    slots = torch.arange(BS) + BS
    assert within_half_a_step(ks, slots, x) and within_half_a_step(vs, slots, x)


def test_seal_rows_encodes_an_open_page_from_its_row_and_frees_the_row():
    ks, vs, area = stores("int4", rows=1)
    torch.manual_seed(2)
    x = torch.randn(BS, HKV, D) * 3
    write(ks, vs, area, x, -x, torch.arange(BS) + BS, seal=set())  # page 1 stays open in the only row
    row = area.row(1)
    assert row == 0 and area.take(4) == -1
    for store in (ks, vs):
        store.seal_rows(torch.tensor([1]), torch.tensor([row]))
    area.seal(1)
    assert area.row(1) == -1 and not area.any_open and area.take(4) == 0
    slots = torch.arange(BS) + BS
    assert within_half_a_step(ks, slots, x) and within_half_a_step(vs, slots, -x)
    assert bool((ks.steps_at(slots) > 0).all())  # read from the parts now


def test_a_page_sealed_by_a_write_keeps_its_row_until_the_step_ends():
    """The plan is shared by a group's layers: the row the page was open in is read by the layers still
    to write this step, so it becomes free only at the step's end."""
    ks, vs, area = stores("int4", rows=1)
    x = torch.randn(BS, HKV, D)
    write(ks, vs, area, x[:4], x[:4], torch.arange(4) + BS, seal=set())  # page 1 open in row 0
    write(ks, vs, area, x[4:], x[4:], torch.arange(4, BS) + BS, seal={1})  # page 1 leaves the window
    assert area.row(1) == -1 and area.take(2) == -1
    area.end_step()
    assert area.take(2) == 0
    assert within_half_a_step(ks, torch.arange(BS) + BS, x)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_copy_pages_copies_every_part_exactly_and_nothing_else(name):
    ks, vs, area = stores(name, rows=None)
    torch.manual_seed(3)
    x = torch.randn(3 * BS, HKV, D)
    write(ks, vs, area, x, x * 2, torch.arange(3 * BS), seal=None)  # pages 0, 1, 2
    before = {id(s): {n: t.clone() for n, t in s.parts.items()} for s in (ks, vs)}
    for store in (ks, vs):
        store.copy_pages(torch.tensor([0, 2]), torch.tensor([4, 3]))
    for store in (ks, vs):
        old = before[id(store)]
        for part, t in store.parts.items():
            assert torch.equal(t[4], t[0]) and torch.equal(t[3], t[2]), part
            assert torch.equal(t[:3], old[part][:3]) and torch.equal(t[5], old[part][5]), part
        assert torch.equal(store.read_pages(torch.tensor([4, 3]), torch.float32),
                           store.read_pages(torch.tensor([0, 2]), torch.float32))


def test_copy_rows_copies_an_open_pages_row_exactly():
    ks, vs, area = stores("int4")
    x = torch.randn(5, HKV, D)
    write(ks, vs, area, x, x, torch.arange(5) + BS, seal=set())  # page 1 open
    dst = area.take(3)
    for store in (ks, vs):
        store.copy_rows(torch.tensor([area.row(1)]), torch.tensor([dst]))
    for store in (ks, vs):
        assert torch.equal(store.read_slots(torch.arange(5) + 3 * BS, torch.float32), x)
        assert torch.equal(store.read_rows(torch.tensor([dst])), store.read_rows(torch.tensor([area.row(1)])))


def test_a_reused_page_open_in_a_row_ignores_the_stale_codes_under_it():
    ks, vs, area = stores("int4")
    old, new = torch.randn(BS, HKV, D) * 5, torch.randn(3, HKV, D)
    write(ks, vs, area, old, old, torch.arange(BS) + BS, seal={1})  # page 1 sealed: its parts hold `old`
    write(ks, vs, area, new, new, torch.arange(3) + BS, seal=set())  # page 1 reused, open in a row
    slots = torch.arange(3) + BS
    for store in (ks, vs):
        assert torch.equal(store.read_slots(slots, torch.float32), new)
        assert not store.steps_at(slots).any()  # exact values: no quantisation step
