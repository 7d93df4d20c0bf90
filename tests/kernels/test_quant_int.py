"""int8 / int4 / int2 cache formats without a model: packing, error bounds, bytes per token,
the residual area, copy-on-write, compaction, and the attention backends reading packed pages."""

import pytest
import torch

from kvlab.engine.attention import leaving_window
from kvlab.cache.block_manager import LayerGroup
from kvlab.kernels.reference.paged_attention import paged_attention_ref
from kvlab.cache.kv_cache import KVCache, bytes_per_block
from kvlab.cache.quant.packing import pack, unpack
from kvlab.registry import QUANT_FORMATS, build

HKV, D, BS = 2, 64, 32


def make_cache(quant, num_blocks=8, residual_rows=None, block_size=BS, head_dim=D, layers=(0,), lessor=None):
    return KVCache([LayerGroup(tuple(layers))], num_blocks, block_size, HKV, head_dim, quant, torch.float32, "cpu",
                   residual_rows=residual_rows, lessor=lessor)


class ListLessor:
    """Leases pages from a fixed list (never a table's), scattered: the engine's is kvlab.cache.quant.lease."""

    def __init__(self, pages, held=()):
        self.free, self.leases, self.held_pages, self._n = list(pages), {}, set(held), 0

    def lease(self, n):
        if len(self.free) < n:
            return None
        self._n += 1
        self.leases[-self._n] = [self.free.pop(0) for _ in range(n)][::-1]  # out of order on purpose
        return -self._n, self.leases[-self._n]

    def give_back(self, key):
        self.free.extend(self.leases.pop(key))

    def held(self):
        return self.held_pages.__contains__


def elem_scale(cache: KVCache, side: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The quantisation step of every element at `slots` [N] -> [N, Hkv, D] (0 in open pages)."""
    return (cache.k if side == "k" else cache.v)(layer).steps_at(slots)


def write(cache, key, value, slots, seal=None, layers=(0,)):
    """One step: every layer of the group stores key/value [T, Hkv, D] at slots [T]."""
    slots = torch.as_tensor(slots)
    cache.begin_step([slots], None if cache.residual is None else [set() if seal is None else set(seal)])
    for layer in layers:
        cache.store(layer, key, value, slots)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip(bits):
    q = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
    p = pack(q, bits)
    assert p.dtype == torch.uint8 and p.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(p, bits), q)
    assert int(pack(torch.tensor([[1, 2]], dtype=torch.uint8), 4)) == 1 | 2 << 4  # low nibble first


def test_registered_and_parameters_checked():
    assert {"int8", "int4", "int2"} <= set(QUANT_FORMATS.names())
    fmt = build("quant", "int4")
    assert (fmt.group_size, fmt.residual) == (None, 32)
    with pytest.raises(ValueError, match="residual must be an integer >= 0"):
        build("quant", "int2", residual=-1)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        build("quant", "int4", group_size=0)
    with pytest.raises(ValueError, match="group_size must divide head_dim 48"):
        build("quant", "int4", group_size=32).check_shape(2, 48, 32)
    with pytest.raises(ValueError, match="group_size must divide block_size 16"):
        build("quant", "int4", group_size=32).check_shape(2, 64, 16)


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_default_groups_follow_the_block_size_and_head_dim(name):
    """group_size=None: key groups of gcd(32, block_size) tokens, value groups of gcd(32, head_dim) channels,
    so every block size from 4 up runs (the engine's default 16 included); smaller pages are refused."""
    fmt = build("quant", name)
    for bs, d, (gk, gv) in ((16, 64, (16, 32)), (32, 64, (32, 32)), (128, 16, (32, 16)), (4, 48, (4, 16))):
        fmt.check_shape(2, d, bs)
        k, v = fmt.codecs(bs, d)
        assert (k.group_size, v.group_size) == (gk, gv)
        assert fmt.storage(bs, 2, d, torch.float32)[0]["scale"].shape == (bs // gk, 2, d)
    with pytest.raises(ValueError, match="block_size 2 would leave key groups of 2 token"):
        fmt.check_shape(2, 64, 2)
    build("quant", name, group_size=2).check_shape(2, 64, 2)  # an explicit group is the user's choice


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_round_trip_within_half_a_step(name):
    """Random K/V through the cache: every element within scale / 2 of the input (sealed pages),
    exactly the input in open (residual) pages."""
    torch.manual_seed(0)
    quant = build("quant", name, **({} if name == "int8" else {"residual": 0}))
    cache = make_cache(quant)
    T = 3 * BS + 5
    key = torch.randn(T, HKV, D) * torch.linspace(0.1, 20, D)  # channel outliers, as real keys have
    value = torch.randn(T, HKV, D)
    slots = torch.arange(T) + BS  # pages 1..4
    write(cache, key, value, slots, seal={1, 2, 3})
    for side, x in (("k", key), ("v", value)):
        store = (cache.k if side == "k" else cache.v)(0)
        back = store.read_slots(slots, torch.float32)
        step = elem_scale(cache, side, 0, slots)
        assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()), side
        if name != "int8":  # the partly filled page stays in full precision
            assert torch.equal(back[3 * BS:], x[3 * BS:])
            assert bool((step[: 3 * BS] > 0).all())
    assert name == "int8" or cache.area.open_pages().keys() == {4}


@pytest.mark.parametrize("name,ratio", [("fp8_e4m3", (64 + 2) / 128), ("int8", (64 + 2) / 128),
                                        ("int4", 1 / 4 + 1 / 16), ("int2", 1 / 8 + 1 / 16)])
def test_bytes_per_token_from_the_pool(name, ratio):
    """Bytes per token counted from the pool tensors, scales and zero points included, against bf16
    (fp8 and int8: a float16 scale per token per head beside the codes).
    int4 (G = 32, D = 64): K 32 codes + 64 channels x 2 x 2 B / 32 tokens = 8; V 32 + 2 groups x 4 B = 8."""
    caches = {n: make_cache(build("quant", n)) for n in ("bf16", name)}
    per_token = {n: c.pool_nbytes() / ((c.null_page + 1) * BS) for n, c in caches.items()}
    assert per_token["bf16"] == 2 * HKV * D * 2
    assert per_token[name] == per_token["bf16"] * ratio
    fmt = caches[name].quant
    assert bytes_per_block([LayerGroup((0,))], BS, HKV, D, fmt, torch.float32) == per_token[name] * BS


def test_residual_window_seals_pages_as_they_leave():
    """A sequence grows token by token: a page is quantised once all its tokens are older than
    the newest `residual`, the others read back exactly."""
    torch.manual_seed(1)
    quant = build("quant", "int4", residual=BS)
    cache = make_cache(quant)
    table = [3, 1, 5, 0]
    key, value = torch.randn(4 * BS, HKV, D), torch.randn(4 * BS, HKV, D)
    n = 0
    for chunk in (40, 1, 1, 30, 20):  # a prefill chunk then decodes and more chunks
        index = torch.arange(n, n + chunk)
        slots = torch.tensor(table)[index // BS] * BS + index % BS
        seal = leaving_window([table], [n + chunk], [chunk], quant.residual, BS)
        write(cache, key[index], value[index], slots, seal)
        n += chunk
        sealed = {table[j] for j in range(max(0, n - quant.residual) // BS)}
        assert set(cache.area.open_pages()) == {table[j] for j in range(-(-n // BS))} - sealed
    all_slots = torch.tensor(table)[torch.arange(n) // BS] * BS + torch.arange(n) % BS
    back = cache.k(0).read_slots(all_slots, torch.float32)
    recent = torch.arange(n) >= (n - quant.residual) // BS * BS
    assert torch.equal(back[recent], key[:n][recent])
    step = elem_scale(cache, "k", 0, all_slots)
    assert bool(((back - key[:n]).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all())
    assert cache.residual_nbytes() == 2 * cache.area.rows * BS * HKV * D * 4


def test_full_residual_area_seals_early():
    quant = build("quant", "int2", residual=64)
    cache = make_cache(quant, residual_rows=1)
    x = torch.randn(BS, HKV, D)
    write(cache, x, x, torch.arange(BS) + BS)  # page 1 takes the only row
    write(cache, x, x, torch.arange(BS) + 2 * BS)  # page 2: page 1 is sealed early
    assert cache.area.open_pages().keys() == {2} and cache.area.early_seals == 1
    back = cache.v(0).read_slots(torch.arange(BS) + BS, torch.float32)
    assert bool(((back - x).abs() <= elem_scale(cache, "v", 0, torch.arange(BS) + BS) / 2 + 1e-6).all())


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_copy_on_write_copies_scales_and_residual(name):
    quant = build("quant", name, **({} if name == "int8" else {"residual": 0}))
    cache = make_cache(quant)
    x = torch.randn(BS + 4, HKV, D)
    write(cache, x, x * 2, torch.arange(BS + 4) + BS, seal={1})  # page 1 sealed, page 2 open
    cache.copy_blocks([(1, 5), (2, 6)])
    for src, dst in ((1, 5), (2, 6)):
        for store in (cache.k(0), cache.v(0)):
            a = store.read_pages(torch.tensor([src]), torch.float32)
            b = store.read_pages(torch.tensor([dst]), torch.float32)
            assert torch.equal(a, b)
    if name == "int4":
        assert cache.area.row(6) >= 0 and cache.area.row(6) != cache.area.row(2)


@pytest.mark.parametrize("name", ["int4", "int2", "int8"])
def test_compaction_keeps_the_fp32_survivors_within_the_bound(name):
    """Evicting the same tokens from an fp32 pool and from a quantised one keeps the same K/V,
    within the two quantisations' half steps (compaction re-quantises the pages it writes)."""
    torch.manual_seed(2)
    quant = build("quant", name, **({} if name == "int8" else {"residual": 0}))
    caches = {"fp32": make_cache(build("quant", "fp32")), name: make_cache(quant)}
    T = 3 * BS
    key, value = torch.randn(T, HKV, D) * 3, torch.randn(T, HKV, D)
    slots = torch.arange(T)
    for c in caches.values():
        write(c, key, value, slots, seal={0, 1, 2})
    keep = torch.randperm(T)[: T // 2].sort().values
    moves = [(int(s), d) for d, s in enumerate(keep.tolist()) if int(s) != d]
    before = {side: elem_scale(caches[name], side, 0, keep) for side in "kv"}
    for c in caches.values():
        c.move_slots(moves)
    kept = torch.arange(len(keep))
    want_k, want_v = caches["fp32"].read_slots(0, kept, torch.float32)
    torch.testing.assert_close(want_k, key[keep])
    got_k, got_v = caches[name].read_slots(0, kept, torch.float32)
    for side, got, want in (("k", got_k, want_k), ("v", got_v, want_v)):
        bound = (before[side] + elem_scale(caches[name], side, 0, kept)) / 2 * (1 + 1e-5) + 1e-6
        assert bool(((got - want).abs() <= bound).all()), side


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_reference_attention_reads_packed_pages(name):
    """The torch backend on packed pages equals attention over the dequantised K/V."""
    torch.manual_seed(3)
    quant = build("quant", name, **({} if name == "int8" else {"residual": BS}))
    cache = make_cache(quant)
    lens, tables = [50, 70], [[1, 2], [3, 4, 5]]
    for table, n in zip(tables, lens):
        index = torch.arange(n)
        slots = torch.tensor(table)[index // BS] * BS + index % BS
        seal = leaving_window([table], [n], [n], quant.residual or 0, BS)
        x = torch.randn(n, HKV, D)
        write(cache, x, x.flip(-1), slots, seal)
    q = torch.randn(2, 4, D)  # one decode query per sequence, 2 query heads per KV head
    bt = torch.tensor([[1, 2, -1], [3, 4, 5]])
    cu, sl = torch.tensor([0, 1, 2]), torch.tensor(lens)
    out = paged_attention_ref(q, cache.k(0), cache.v(0), bt, cu, sl, 0.125)
    dense_k = cache.k(0).read_pages(torch.arange(9), torch.float32)  # [pages, bs, Hkv, D]
    dense_v = cache.v(0).read_pages(torch.arange(9), torch.float32)
    want = paged_attention_ref(q, dense_k, dense_v, bt, cu, sl, 0.125)
    torch.testing.assert_close(out, want)


def _filled_cache(name, residual=BS, lessor=None, **qargs):
    torch.manual_seed(4)
    quant = build("quant", name, **({} if name == "int8" else {"residual": residual, **qargs}))
    cache = make_cache(quant, num_blocks=8 if lessor is None else 100, lessor=lessor)
    lens, tables = [50, 70, 3], [[1, 2], [3, 4, 5], [6]]
    for table, n in zip(tables, lens):
        index = torch.arange(n)
        slots = torch.tensor(table)[index // BS] * BS + index % BS
        seal = leaving_window([table], [n], [n], quant.residual or 0, BS)
        x = torch.randn(n, HKV, D)
        write(cache, x * 2, x.flip(-1), slots, seal)
    bt = torch.tensor([[1, 2, -1], [3, 4, 5], [6, -1, -1]])
    return cache, bt, torch.tensor(lens)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_triton_attention_dequantises_packed_pages(name):
    """The Triton kernels (fused dequantisation, residual rows included) against the torch reference,
    decode and extend rows, with the attention statistics."""
    from kvlab.kernels.paged_attention import paged_attention

    cache, bt, lens = _filled_cache(name)
    assert name == "int8" or cache.area.open_pages()  # some pages are read from the residual area
    cu = torch.tensor([0, 1, 4, 5])  # one query, three queries (extend), one query
    q = torch.randn(5, 4, D)
    got, stats = paged_attention(q, cache.k(0), cache.v(0), bt, cu, lens, 0.125, return_stats=True)
    want, want_stats = paged_attention_ref(q, cache.k(0), cache.v(0), bt, cu, lens, 0.125, return_stats=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stats, want_stats, atol=1e-4, rtol=1e-4)


TABLE_PAGES = (1, 2, 3, 4, 5, 6)  # _filled_cache's tables


@pytest.mark.parametrize("name,residual_dtype,k", [("int4", "compute", 8), ("int2", "compute", 16),
                                                   ("int4", "bfloat16", 4)])
def test_leased_rows_hold_what_an_own_area_holds(name, residual_dtype, k):
    """Rows leased from pool pages (k pages of codes a row, scattered) read back exactly what rows of an
    area of their own hold, never touch a table's page, and go back when their pages are sealed."""
    own, bt, lens = _filled_cache(name, residual_dtype=residual_dtype)
    lessor = ListLessor(range(10, 100), held=TABLE_PAGES)
    leased, _, _ = _filled_cache(name, lessor=lessor, residual_dtype=residual_dtype)
    assert leased.area.k == k and leased.residual_nbytes() == 0 and own.residual_nbytes() > 0
    assert leased.area.open_pages().keys() == own.area.open_pages().keys() != set()
    assert leased.leased_pages() == k * len(own.area.open_pages())
    assert not {p for pages in lessor.leases.values() for p in pages} & set(TABLE_PAGES)
    pages = torch.tensor(TABLE_PAGES)
    for a, b in ((own.k(0), leased.k(0)), (own.v(0), leased.v(0))):
        assert torch.equal(a.read_pages(pages, torch.float32), b.read_pages(pages, torch.float32))
    open_pages = sorted(leased.area.open_pages())
    slots = torch.tensor([p * BS + i for p in open_pages for i in range(BS)])
    x = torch.randn(len(slots), HKV, D)
    write(leased, x, x, slots, seal=set(open_pages))  # every open page leaves the window
    leased.begin_step([torch.tensor([-1])], [set()])  # the next step: their rows go back
    assert leased.area.num_leased == 0 and len(lessor.free) == 90 and not leased.area.open_pages()


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_triton_attention_reads_leased_rows(name):
    """The Triton kernels read residual rows through the lease table (chunks in scattered pages' codes)."""
    from kvlab.kernels.paged_attention import paged_attention

    cache, bt, lens = _filled_cache(name, lessor=ListLessor(range(10, 100), held=TABLE_PAGES))
    assert cache.area.num_leased > 0
    cu = torch.tensor([0, 1, 4, 5])
    q = torch.randn(5, 4, D)
    got, stats = paged_attention(q, cache.k(0), cache.v(0), bt, cu, lens, 0.125, return_stats=True)
    want, want_stats = paged_attention_ref(q, cache.k(0), cache.v(0), bt, cu, lens, 0.125, return_stats=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stats, want_stats, atol=1e-4, rtol=1e-4)


def test_open_pages_nobody_holds_are_sealed_and_give_their_rows_back():
    """A finished sequence's open pages: encoded from their rows (within half a step of what was written)
    and their leased pages returned; pages still held stay open."""
    lessor = ListLessor(range(10, 100), held=TABLE_PAGES)
    cache, _, _ = _filled_cache("int4", lessor=lessor)
    before = {p: cache.k(0).read_pages(torch.tensor([p]), torch.float32) for p in cache.area.open_pages()}
    held_open = set(before) & {3, 4, 5}
    lessor.held_pages -= {1, 2, 6}  # the first and last sequences finished
    cache.release_unheld()
    assert set(cache.area.open_pages()) == held_open and cache.area.num_leased == len(held_open)
    for p, x in before.items():
        back = cache.k(0).read_pages(torch.tensor([p]), torch.float32)
        if p in held_open:
            assert torch.equal(back, x)
        else:
            step = cache.k(0).codec.steps({n: t[p:p + 1] for n, t in cache.k(0).parts.items()})
            assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all())


def test_triton_store_and_block_kernels_refuse_packed_pages():
    from kvlab.kernels.block_ops import copy_blocks
    from kvlab.kernels.store_kv import store_kv

    cache = make_cache(build("quant", "int4"))
    x = torch.randn(1, HKV, D)
    with pytest.raises(ValueError, match="packed cache format.*reads element-wise pools only"):
        store_kv(x, x, cache.k(0), cache.v(0), torch.tensor([0]))
    with pytest.raises(ValueError, match="packed cache format"):
        copy_blocks(cache.k(0), cache.v(0), torch.tensor([0]), torch.tensor([1]))
