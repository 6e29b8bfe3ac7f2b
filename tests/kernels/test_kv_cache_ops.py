"""KV store / gather ops: references against byte-level and float64 oracles, Triton against them.

The Triton tests run the kernels on CPU tensors under ``TRITON_INTERPRET=1``,
in a child process (see ``test_triton_kernels_interpreted``). Seeds are fresh each
run and printed; set ``FLASHSERVE_TEST_SEED`` to replay one.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from interpreter import INTERPRETED, interpreted, run_triton_tests_in_child

from kernels import dispatch
from kernels.kv_cache_ops import (
    gather_index_keys,
    gather_index_keys_reference,
    gather_main_kv,
    gather_main_kv_reference,
    store_kv_entries,
    store_kv_entries_reference,
)
from kernels.kv_formats import (
    dequantize_index_key,
    dequantize_main_kv,
    quantize_index_key,
    quantize_main_kv,
)
from kvstore.device.device_pool import DevicePool
from kvstore.device.layout import kv_layout

SOURCE = 1  # the second kv source of the test layout: its pages sit mid-row, strided


# ----------------------------------------------------------------- fixtures and builders


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("FLASHSERVE_TEST_SEED", secrets.randbits(31)))
    print(f"seed={value}")
    return value


# ----------------------------------------------------------------- the interpreter child
# Triton must be imported with TRITON_INTERPRET=1 already set, so the Triton tests run
# in a child pytest of this file that has it; in the parent they are skipped, and the
# driver below fails if the child does.


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter child")
def test_triton_kernels_interpreted():
    run_triton_tests_in_child(__file__)


def make_pool(num_pages: int, entries: int, poison: int) -> tuple[DevicePool, object]:
    """A real device pool (two sources) filled with ``poison``; returns it and source 1's views."""
    layout = kv_layout([0, SOURCE], [2, 1], page_tokens=entries)
    pool = DevicePool(layout, num_pages)
    pool.pages.fill_(poison)
    return pool, pool.source(SOURCE)


def views(src) -> tuple[torch.Tensor, ...]:
    return src.main_data, src.main_scales, src.index_data, src.index_scales


def random_entries(g: torch.Generator, n: int, scale_spread: float = 6.0) -> torch.Tensor:
    """Rows of random values whose magnitudes span many binades (subnormal scales included)."""
    x = torch.randn(n, 512, generator=g)
    tile_scale = 10.0 ** (torch.rand(n, 32, 1, generator=g) * 2 * scale_spread - scale_spread)
    return (x.view(n, 32, 16) * tile_scale).view(n, 512)


def random_keys(g: torch.Generator, n: int) -> torch.Tensor:
    x = torch.randn(n, 128, generator=g)
    block_scale = 2.0 ** (torch.randint(-60, 60, (n, 4, 1), generator=g).float())
    return (x.view(n, 4, 32) * block_scale).view(n, 128)


def filled_pool(g: torch.Generator, num_pages: int, entries: int):
    pool, src = make_pool(num_pages, entries, 0)
    n = num_pages * entries
    j = torch.arange(n)
    store_kv_entries_reference(
        *views(src), j // entries, j % entries, random_entries(g, n, 2.0), random_keys(g, n)
    )
    return pool, src


# ----------------------------------------------------------------- references


def test_store_reference_places_records_by_page_and_slot(seed):
    g = torch.Generator().manual_seed(seed)
    num_pages, entries, n = 5, 8, 13
    pool, src = make_pool(num_pages, entries, 0xAB)
    before = pool.pages.clone()
    targets = torch.randperm(num_pages * entries, generator=g)[:n]
    pages, slots = targets // entries, targets % entries
    latents, keys = random_entries(g, n), random_keys(g, n)
    store_kv_entries_reference(*views(src), pages, slots, latents, keys)

    # Independent byte arithmetic: a row holds source 0's main and index pages
    # (4 entries each), then source 1's main page (data block, scale block) and index page.
    main_off = 4 * 288 + 4 * 68
    index_off = main_off + entries * 288
    expected = before.clone()
    main, index = quantize_main_kv(latents), quantize_index_key(keys)
    for i in range(n):
        row, s = int(pages[i]), int(slots[i])
        expected[row, main_off + 256 * s : main_off + 256 * (s + 1)] = main[i, :256]
        scale_at = main_off + entries * 256 + 32 * s
        expected[row, scale_at : scale_at + 32] = main[i, 256:]
        expected[row, index_off + 64 * s : index_off + 64 * (s + 1)] = index[i, :64]
        scale_at = index_off + entries * 64 + 4 * s
        expected[row, scale_at : scale_at + 4] = index[i, 64:]
    assert torch.equal(pool.pages, expected)


def test_store_then_gather_round_trips_within_fp4_error(seed):
    g = torch.Generator().manual_seed(seed)
    num_pages, entries = 4, 8
    _, src = make_pool(num_pages, entries, 0)
    block_table = torch.randperm(num_pages, generator=g)
    n = num_pages * entries - 3
    latents = random_entries(g, n)
    j = torch.arange(n)
    store_kv_entries_reference(
        *views(src), block_table[j // entries], j % entries, latents, random_keys(g, n)
    )
    back = gather_main_kv_reference(src.main_data, src.main_scales, block_table, j)
    # With a normal E4M3 scale, scale = e4m3(amax / 6) >= amax / 6.4 and E2M1 steps
    # are at most 2, so |err| <= amax / 5; outside that range the scale saturates.
    amax = latents.view(n, 32, 16).abs().amax(-1, keepdim=True)
    err = (back - latents).view(n, 32, 16).abs()
    normal = ((amax / 6 >= 2.0**-6) & (amax / 6 <= 448)).expand_as(err)
    assert normal.sum() > err.numel() // 4
    assert (err[normal] <= (amax.expand_as(err) / 5)[normal]).all()
    assert err.max() > 0  # quantisation did happen


def oracle_main(src, block_table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """float64 [..., 512] by plain loops: page, slot, record bytes, kv_formats decode."""
    entries = src.main_data.shape[1]
    out = torch.zeros(idx.numel(), 512, dtype=torch.float64)
    for i, j in enumerate(idx.reshape(-1).tolist()):
        if j < 0:
            continue
        page, slot = int(block_table[j // entries]), j % entries
        rec = torch.cat((src.main_data[page, slot], src.main_scales[page, slot]))
        out[i] = dequantize_main_kv(rec).double()
    return out.view(*idx.shape, 512)


def oracle_index(src, block_table: torch.Tensor, n_entries: int) -> torch.Tensor:
    entries = src.index_data.shape[1]
    out = torch.zeros(n_entries, 128, dtype=torch.float64)
    for j in range(n_entries):
        page, slot = int(block_table[j // entries]), j % entries
        rec = torch.cat((src.index_data[page, slot], src.index_scales[page, slot]))
        out[j] = dequantize_index_key(rec).double()
    return out


def test_gather_references_match_float64_loops(seed):
    g = torch.Generator().manual_seed(seed)
    _, src = filled_pool(g, 6, 8)
    block_table = torch.randperm(6, generator=g)[:4]
    idx = torch.randint(-1, 4 * 8, (3, 7), generator=g)
    idx[0, 0] = -1
    got = gather_main_kv_reference(src.main_data, src.main_scales, block_table, idx)
    assert got.dtype == torch.float32 and got.shape == (3, 7, 512)
    assert torch.equal(got.double(), oracle_main(src, block_table, idx))
    assert (got[0, 0] == 0).all()
    keys = gather_index_keys_reference(src.index_data, src.index_scales, block_table, 29)
    assert torch.equal(keys.double(), oracle_index(src, block_table, 29))


# ----------------------------------------------------------------- dispatch


def test_dispatch_modes(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv(dispatch.OPS_VAR, raising=False)
    assert not dispatch.use_triton(cpu, op="store_kv")  # CPU tensors run the reference
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert not dispatch.use_triton(cpu, op="store_kv")
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.use_triton(cpu, op="store_kv")
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="FLASHSERVE_KERNELS"):
        dispatch.use_triton(cpu, op="store_kv")


def test_triton_ops_narrows_triton_to_the_ops_named(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.setenv(dispatch.OPS_VAR, "sparse_attention, fp8_linear")
    assert dispatch.use_triton(cpu, op="sparse_attention")
    assert dispatch.use_triton(cpu, op="fp8_linear")
    assert not dispatch.use_triton(cpu, op="store_kv")
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")  # reference still wins
    assert not dispatch.use_triton(cpu, op="sparse_attention")
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.setenv(dispatch.OPS_VAR, "sparse_attn")
    with pytest.raises(ValueError, match="sparse_attn"):
        dispatch.use_triton(cpu, op="sparse_attention")


def test_every_call_site_names_a_known_op() -> None:
    """A misspelt op at a call site would never run Triton under FLASHSERVE_TRITON_OPS."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    named = set()
    for path in [*root.glob("kernels/*.py"), *root.glob("engine/**/*.py")]:
        named |= set(re.findall(r'use_triton\([^)]*op="(\w+)"', path.read_text()))
    assert named == set(dispatch.OPS)


# ----------------------------------------------------------------- Triton (interpreted)


def special_rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents and keys with NaN tiles, infinities, zeros and exact rounding ties."""
    latents = torch.randn(n, 512)
    keys = torch.randn(n, 128)
    latents[0, 5] = float("nan")
    keys[0, 40] = float("nan")
    latents[1, 16:32] = 0.0
    latents[1, 32:48] = -0.0
    keys[1, :32] = 0.0
    latents[2, :16] = float("inf")
    keys[2, 100] = float("-inf")
    # amax 6 gives scale 1: every E2M1 midpoint is an exact tie (half to even).
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    latents[3, 48:64] = torch.cat((ties, -ties))
    keys[3, 32:64] = torch.cat((ties, -ties, ties * 0.5, -ties * 3.0))
    # amax / 6 on E4M3 midpoints: the scale itself rounds half to even (normal and subnormal).
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    picks = mids[torch.linspace(0, len(mids) - 1, 32).long()].clamp(min=2.0**-9)
    latents[4] = (picks[:, None] * 6.0 * torch.linspace(-1, 1, 16)[None, :]).flatten()
    return latents, keys


@pytest.mark.parametrize(
    ("num_pages", "entries", "n", "dtype"),
    [(3, 4, 7, torch.float32), (5, 8, 21, torch.bfloat16), (2, 16, 9, torch.float16)],
)
@interpreted
def test_store_triton_bit_exact(seed, num_pages, entries, n, dtype):
    from kernels.triton import store_kv as store_mod

    g = torch.Generator().manual_seed(seed)
    latents = random_entries(g, n, 3.0)
    keys = random_keys(g, n)
    special_latents, special_keys = special_rows(5)
    latents[:5], keys[:5] = special_latents, special_keys
    latents, keys = latents.to(dtype), keys.to(dtype)
    targets = torch.randperm(num_pages * entries, generator=g)[:n]  # scattered, distinct
    pages, slots = targets // entries, targets % entries
    for poison in (0xAB, 0x00):  # two poisons: every target byte is written, nothing else is
        ref_pool, ref_src = make_pool(num_pages, entries, poison)
        store_kv_entries_reference(*views(ref_src), pages, slots, latents, keys)
        pool, src = make_pool(num_pages, entries, poison)
        store_mod.store_kv_entries_triton(*views(src), pages, slots, latents, keys)
        assert torch.equal(pool.pages, ref_pool.pages)


@pytest.mark.parametrize(("num_pages", "entries", "idx_shape"), [(4, 8, (3, 5)), (7, 4, (19,))])
@interpreted
def test_gather_main_triton_equals_reference(seed, num_pages, entries, idx_shape):
    from kernels.triton import gather_kv as gather_mod

    g = torch.Generator().manual_seed(seed)
    _, src = filled_pool(g, num_pages, entries)
    block_table = torch.randperm(num_pages, generator=g)
    idx = torch.randint(-1, num_pages * entries, idx_shape, generator=g)
    idx.view(-1)[0] = -1
    out = torch.full((*idx_shape, 512), float("nan"))
    got = gather_mod.gather_main_kv_triton(
        src.main_data, src.main_scales, block_table, idx, out=out
    )
    assert got is out and not torch.isnan(out).any()
    assert torch.equal(
        out, gather_main_kv_reference(src.main_data, src.main_scales, block_table, idx)
    )


@interpreted
def test_gather_index_triton_equals_reference(seed):
    from kernels.triton import gather_kv as gather_mod

    g = torch.Generator().manual_seed(seed)
    _, src = filled_pool(g, 5, 8)
    block_table = torch.randperm(5, generator=g)[:3]
    for n_entries in (1, 17, 24):
        out = torch.full((n_entries, 128), float("nan"))
        gather_mod.gather_index_keys_triton(
            src.index_data, src.index_scales, block_table, n_entries, out=out
        )
        assert not torch.isnan(out).any()
        ref = gather_index_keys_reference(src.index_data, src.index_scales, block_table, n_entries)
        assert torch.equal(out, ref)


def spy(monkeypatch, module, name: str, calls: list[str]) -> None:
    fn = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@interpreted
def test_public_ops_dispatch_to_triton(seed, monkeypatch):
    from kernels.triton import gather_kv as gather_mod
    from kernels.triton import store_kv as store_mod

    calls: list[str] = []
    spy(monkeypatch, store_mod, "store_kv_entries_triton", calls)
    spy(monkeypatch, gather_mod, "gather_main_kv_triton", calls)
    spy(monkeypatch, gather_mod, "gather_index_keys_triton", calls)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    g = torch.Generator().manual_seed(seed)
    n, entries = 6, 4
    latents, keys = random_entries(g, n), random_keys(g, n)
    j = torch.arange(n)
    pool, src = make_pool(2, entries, 0xAB)
    ref_pool, ref_src = make_pool(2, entries, 0xAB)
    store_kv_entries(*views(src), j // entries, j % entries, latents, keys)
    store_kv_entries_reference(*views(ref_src), j // entries, j % entries, latents, keys)
    assert torch.equal(pool.pages, ref_pool.pages)
    bt = torch.tensor([1, 0])
    main = gather_main_kv(src.main_data, src.main_scales, bt, j)
    index = gather_index_keys(src.index_data, src.index_scales, bt, n)
    assert calls == ["store_kv_entries_triton", "gather_main_kv_triton", "gather_index_keys_triton"]
    assert torch.equal(main, gather_main_kv_reference(src.main_data, src.main_scales, bt, j))
    assert torch.equal(index, gather_index_keys_reference(src.index_data, src.index_scales, bt, n))


def test_bf16_ablation_pages_hold_raw_bf16_values():
    """Records without scale bytes (--kv-dtype bf16) store and read back bf16 values."""
    from kernels.kv_cache_ops import gather_index_keys, gather_main_kv, store_kv_entries

    g = torch.Generator().manual_seed(0)
    pages, per_page = 3, 4
    main = torch.zeros(pages, per_page * 1024, dtype=torch.uint8)
    index = torch.zeros(pages, per_page * 256, dtype=torch.uint8)
    main_data = main.unflatten(1, (per_page, 1024))
    main_scales = main_data[..., :0]
    index_data = index.unflatten(1, (per_page, 256))
    index_scales = index_data[..., :0]
    latents = torch.randn(6, 512, generator=g)
    keys = torch.randn(6, 128, generator=g)
    table = torch.tensor([2, 0])  # entries 0-3 on page 2, 4-5 on page 0
    entries = torch.arange(6)
    store_kv_entries(
        main_data,
        main_scales,
        index_data,
        index_scales,
        table[entries // per_page],
        entries % per_page,
        latents,
        keys,
    )
    got = gather_main_kv(main_data, main_scales, table, torch.tensor([5, -1, 0]))
    assert torch.equal(got[0], latents[5].bfloat16().float())
    assert torch.equal(got[1], torch.zeros(512))
    assert torch.equal(got[2], latents[0].bfloat16().float())
    got_keys = gather_index_keys(index_data, index_scales, table, 6)
    assert torch.equal(got_keys, keys.bfloat16().float())
    assert torch.equal(main[1], torch.zeros_like(main[1]))  # page 1 untouched


# ----------------------------------------------------------------- bf16 ablation pages


def test_bf16_ablation_pages_store_raw_values(seed, monkeypatch):
    """``--kv-dtype bf16`` pages have no scale bytes: values are stored as raw bf16, and the
    public ops use the references for them even when Triton is forced (it decodes FP4 only)."""
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    g = torch.Generator().manual_seed(seed)
    entries = 4
    layout = kv_layout([0, SOURCE], [2, 1], page_tokens=entries, kv_dtype="bf16")
    pool = DevicePool(layout, 3)
    src = pool.source(SOURCE)
    assert src.main_scales.shape[-1] == 0 and src.index_scales.shape[-1] == 0
    n = 9
    latents, keys = torch.randn(n, 512, generator=g), torch.randn(n, 128, generator=g)
    block_table = torch.tensor([2, 0, 1])
    j = torch.arange(n)
    store_kv_entries(*views(src), block_table[j // entries], j % entries, latents, keys)
    # The page bytes are the bf16 values themselves, at slot offsets computed by hand.
    main_off = (entries // 2) * 1024 + (entries // 2) * 256  # source 0's two pages first
    row, slot = int(block_table[1]), 1  # entry 5
    raw = pool.pages[row, main_off + slot * 1024 : main_off + (slot + 1) * 1024]
    assert torch.equal(raw.view(torch.bfloat16), latents[5].to(torch.bfloat16))
    idx = torch.tensor([[3, -1, 8]])
    got = gather_main_kv(src.main_data, src.main_scales, block_table, idx)
    assert torch.equal(got[0, 0], latents[3].to(torch.bfloat16).float())
    assert (got[0, 1] == 0).all()
    assert torch.equal(got[0, 2], latents[8].to(torch.bfloat16).float())
    back = gather_index_keys(src.index_data, src.index_scales, block_table, n)
    assert torch.equal(back, keys.to(torch.bfloat16).float())
