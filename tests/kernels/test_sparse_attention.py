"""Sparse sink attention: the reference against a float64 loop oracle and the model's
dense ``sink_attention``; the Triton kernel (interpreted, in a child process) against
the reference. Seeds are fresh each run and printed (``FLASHSERVE_TEST_SEED`` replays one).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from interpreter import INTERPRETED, interpreted, run_triton_tests_in_child

from engine.model.deepseek_v41.sink_attention import sink_attention as dense_sink_attention
from kernels import dispatch
from kernels import sparse_attention as sparse_attention_module
from kernels.kv_cache_ops import store_kv_entries_reference
from kernels.kv_formats import dequantize_main_kv
from kernels.sparse_attention import sparse_attention, sparse_attention_reference


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("FLASHSERVE_TEST_SEED", secrets.randbits(31)))
    print(f"seed={value}")
    return value


# ----------------------------------------------------------------- inputs


@dataclass(slots=True)
class Case:
    q: torch.Tensor
    swa_k: torch.Tensor
    swa_valid: torch.Tensor
    main_data: torch.Tensor
    main_scales: torch.Tensor
    block_tables: torch.Tensor
    topk_idx: torch.Tensor
    sink: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.swa_k,
            self.swa_valid,
            self.main_data,
            self.main_scales,
            self.block_tables,
            self.topk_idx,
            self.sink,
            self.scale,
        )


def make_case(
    g: torch.Generator,
    rows: int,
    heads: int,
    window: int,
    topk: int,
    num_pages: int,
    entries: int,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Random rows, each its own sequence with a scattered block table and ragged lengths.

    Row 0 is at the start of its sequence (one valid SWA key, at most one entry);
    the last row (when there are several) has no key at all. Invalid SWA slots
    hold NaN: they must never be read.
    """
    # A page row wider than the source's pages, so the views are strided like the pool's.
    pool = torch.zeros(num_pages, entries * 288 + 40, dtype=torch.uint8)
    main_data = pool[:, : entries * 256].unflatten(1, (entries, 256))
    main_scales = pool[:, entries * 256 : entries * 288].unflatten(1, (entries, 32))
    index = torch.zeros(num_pages, entries, 68, dtype=torch.uint8)
    n = num_pages * entries
    j = torch.arange(n)
    latents = torch.randn(n, 512, generator=g) * torch.rand(n, 1, generator=g).add(0.2)
    store_kv_entries_reference(
        main_data,
        main_scales,
        index[..., :64],
        index[..., 64:],
        j // entries,
        j % entries,
        latents,
        torch.randn(n, 128, generator=g),
    )

    max_pages = num_pages + 2  # padded with 0 past each row's pages
    block_tables = torch.zeros(rows, max_pages, dtype=torch.long)
    topk_idx = torch.full((rows, topk), -1, dtype=torch.long)
    swa_valid = torch.zeros(rows, window, dtype=torch.bool)
    for t in range(rows):
        used = int(torch.randint(1, num_pages + 1, (1,), generator=g))
        block_tables[t, :used] = torch.randperm(num_pages, generator=g)[:used]
        visible = int(torch.randint(0, used * entries + 1, (1,), generator=g))
        n_valid = int(torch.randint(0, window + 1, (1,), generator=g))
        if t == 0:
            visible, n_valid = min(visible, 1), min(window, 1)
        if t == rows - 1 and rows > 1:
            visible, n_valid = 0, 0
        picks = torch.randperm(visible, generator=g)[: min(topk, visible)].sort().values
        topk_idx[t, : picks.numel()] = picks
        if t % 2:  # a window at the start of a sequence: the first n_valid slots
            swa_valid[t, :n_valid] = True
        else:
            swa_valid[t, torch.randperm(window, generator=g)[:n_valid]] = True
    swa_k = torch.randn(rows, window, 512, generator=g)
    swa_k[~swa_valid] = float("nan")
    return Case(
        q=torch.randn(rows, heads, 512, generator=g).to(dtype),
        swa_k=swa_k.to(dtype),
        swa_valid=swa_valid,
        main_data=main_data,
        main_scales=main_scales,
        block_tables=block_tables,
        topk_idx=topk_idx,
        sink=torch.randn(heads, generator=g),
        scale=512**-0.5,
    )


def oracle(case: Case) -> torch.Tensor:
    """float64 by plain loops: gather each row's keys, softmax with the sink column, drop it."""
    rows, heads, _ = case.q.shape
    entries = case.main_data.shape[1]
    out = torch.zeros(rows, heads, 512, dtype=torch.float64)
    for t in range(rows):
        keys = [
            case.swa_k[t, w].double() for w in range(case.swa_k.shape[1]) if case.swa_valid[t, w]
        ]
        for j in case.topk_idx[t].tolist():
            if j >= 0:
                page, slot = int(case.block_tables[t, j // entries]), j % entries
                rec = torch.cat((case.main_data[page, slot], case.main_scales[page, slot]))
                keys.append(dequantize_main_kv(rec).double())
        if not keys:
            continue  # only the sink: zeros
        k = torch.stack(keys)
        logits = case.q[t].double() @ k.T * case.scale
        z = torch.cat((logits, case.sink.double()[:, None]), dim=1)
        p = torch.softmax(z, dim=1)[:, :-1]
        out[t] = p @ k
    return out


# ----------------------------------------------------------------- reference


@pytest.mark.parametrize(
    ("rows", "heads", "window", "topk", "num_pages", "entries"),
    [(5, 4, 6, 7, 5, 4), (3, 3, 4, 0, 2, 4), (4, 2, 1, 12, 3, 8)],
)
def test_reference_matches_float64_oracle(
    seed, monkeypatch, rows, heads, window, topk, num_pages, entries
):
    monkeypatch.setattr(sparse_attention_module, "_REFERENCE_ROWS", 2)  # exercise row chunking
    case = make_case(
        torch.Generator().manual_seed(seed), rows, heads, window, topk, num_pages, entries
    )
    got = sparse_attention_reference(*case.args())
    assert got.dtype == torch.float32 and got.shape == case.q.shape
    torch.testing.assert_close(got.double(), oracle(case), rtol=1e-5, atol=1e-6)
    assert (got[-1] == 0).all()  # the last row has no key: the sink takes everything


def test_reference_equals_dense_sink_attention_per_row(seed):
    """A second code path: the model's dense oracle, one row at a time, over the same keys."""
    case = make_case(torch.Generator().manual_seed(seed), 3, 4, 5, 6, 4, 4)
    got = sparse_attention_reference(*case.args())
    entries = case.main_data.shape[1]
    for t in range(3):
        j = case.topk_idx[t][case.topk_idx[t] >= 0]
        pages = case.block_tables[t, j // entries]
        recs = torch.cat(
            (case.main_data[pages, j % entries], case.main_scales[pages, j % entries]), dim=1
        )
        keys = torch.cat((case.swa_k[t][case.swa_valid[t]], dequantize_main_kv(recs)))
        mask = torch.ones(1, keys.shape[0], dtype=torch.bool)
        want = dense_sink_attention(case.q[t : t + 1], keys, mask, case.sink, case.scale)
        torch.testing.assert_close(got[t : t + 1], want, rtol=1e-5, atol=1e-6)


def test_reference_bf16_query_returns_bf16(seed):
    case = make_case(torch.Generator().manual_seed(seed), 2, 4, 4, 4, 2, 4, torch.bfloat16)
    got = sparse_attention_reference(*case.args())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), oracle(case), rtol=2**-7, atol=1e-3)


def test_reference_float64_query_stays_float64(seed):
    """The engine's float64 test mode: keys widen to float64 and the result is exact."""
    case = make_case(torch.Generator().manual_seed(seed), 3, 4, 5, 6, 3, 4, torch.float64)
    got = sparse_attention_reference(*case.args())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, oracle(case), rtol=1e-12, atol=1e-13)


# ----------------------------------------------------------------- Triton (interpreted)


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter child")
def test_triton_kernels_interpreted():
    """This file's Triton tests, run in a TRITON_INTERPRET=1 child (triton is a dependency)."""
    run_triton_tests_in_child(__file__)


TRITON_CASES = [
    # rows, heads, window, topk, pages, entries, dtype, splits
    (3, 5, 7, 9, 6, 4, torch.float32, 1),
    (2, 20, 16, 40, 8, 8, torch.float32, 3),  # two head blocks (ragged), split-K
    (4, 4, 5, 0, 2, 4, torch.float32, 1),  # SWA-only layer
    (3, 8, 5, 0, 2, 4, torch.float32, 2),  # SWA-only, split inside the window
    (2, 8, 0, 33, 6, 8, torch.float32, 2),  # no window
    (3, 6, 12, 20, 5, 8, torch.bfloat16, 2),
    (3, 6, 12, 20, 5, 8, torch.bfloat16, None),
]


@interpreted
@pytest.mark.parametrize(
    ("rows", "heads", "window", "topk", "num_pages", "entries", "dtype", "splits"), TRITON_CASES
)
def test_triton_equals_reference(
    seed, rows, heads, window, topk, num_pages, entries, dtype, splits
):
    from kernels.triton.sparse_attention import sparse_attention_triton

    case = make_case(
        torch.Generator().manual_seed(seed), rows, heads, window, topk, num_pages, entries, dtype
    )
    out = torch.full_like(case.q, float("nan"))
    got = sparse_attention_triton(*case.args(), out=out, num_splits=splits, block_n=16)
    assert got is out and not torch.isnan(out).any()  # every element written
    if dtype == torch.float32:
        torch.testing.assert_close(
            out, sparse_attention_reference(*case.args()), rtol=1e-5, atol=1e-5
        )
    else:
        # fp32 maths on bf16 loads; the interpreter's bf16 store truncates: one bf16 ulp.
        want = sparse_attention_reference(*replace(case, q=case.q.float()).args())
        torch.testing.assert_close(out.float(), want, rtol=2**-7, atol=1e-3)


@interpreted
def test_triton_split_counts_agree(seed):
    """One case, every split count from 1 to more splits than key blocks: same result."""
    from kernels.triton.sparse_attention import sparse_attention_triton

    case = make_case(torch.Generator().manual_seed(seed), 2, 4, 9, 23, 4, 8)
    base = sparse_attention_triton(*case.args(), num_splits=1, block_n=16)
    for splits in (2, 3, 7):
        got = sparse_attention_triton(*case.args(), num_splits=splits, block_n=16)
        torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-6)


@interpreted
def test_public_op_dispatches_to_triton(seed, monkeypatch):
    from kernels.triton import sparse_attention as triton_module

    calls: list[int] = []
    kernel = triton_module.sparse_attention_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_module, "sparse_attention_triton", spy)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    case = make_case(torch.Generator().manual_seed(seed), 2, 4, 4, 5, 3, 4)
    got = sparse_attention(*case.args())
    assert calls == [1]
    torch.testing.assert_close(got, sparse_attention_reference(*case.args()), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- the GPU benchmark script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_kernels.py"


def test_gpu_bench_exits_cleanly_without_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.run(
        [sys.executable, str(BENCH)], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    assert "no GPU present" in child.stdout


@interpreted
def test_triton_gpu_bench_dry_run_on_cpu(monkeypatch):
    """The benchmark's build-and-check code, on tiny sizes, with the interpreted kernels."""
    spec = importlib.util.spec_from_file_location("gpu_kernels_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_kernels_bench", bench)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "bench_ms", lambda fn: (fn(), 1.0)[1])  # no CUDA events on CPU
    monkeypatch.setattr(bench, "ATTENTION_TILES", [(16, 16, 4), (32, 32, 4)])
    sizes = bench.Sizes(
        rows=3,
        heads=20,
        topk=8,
        window=5,
        index_heads=4,
        context_entries=48,
        entries_per_page=8,
        store_entries=10,
        linear_n=40,
        linear_k=64,
    )
    results = bench.run_all(sizes, torch.device("cpu"), copy_bps=1e9)
    assert [r.op for r in results] == [
        "store_kv_entries",
        "gather_main_kv",
        "gather_index_keys",
        "sparse_attention",
        "sparse_attention",
        "sparse_attention_fp32",
        "indexer_scores",
        "block_max",
        "fp8_linear",
    ]
    for r in results:
        assert r.max_abs_err <= bench.TOLERANCE[r.op], r
        assert r.bytes_moved > 0


# ----------------------------------------------------------------- compiled for a real GPU


def _hopper_compile(fn, pointers: dict[str, str], constexprs: dict, fp_fusion: bool):
    """Compile a kernel to a Hopper (sm_90) binary without a GPU: what the interpreter skips
    (types, layouts, shared memory, ptxas) is checked here. Other int args are i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    signature = {name: pointers.get(name, "i32") for name in fn.arg_names}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": 4, "enable_fp_fusion": fp_fusion}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.skipif(INTERPRETED, reason="compiles real kernels; the child interprets them")
def test_kernels_compile_for_hopper():
    from kernels.triton import block_max, gather_kv, indexer_scores, store_kv
    from kernels.triton import sparse_attention as attention

    u8, i64, f32, bf16 = "*u8", "*i64", "*fp32", "*bf16"
    pages = {"md_ptr": u8, "ms_ptr": u8, "id_ptr": u8, "is_ptr": u8, "bt_ptr": i64}
    kernels = [
        (
            store_kv._store_kv_kernel,
            {**pages, "lat_ptr": bf16, "key_ptr": bf16, "page_ptr": i64, "slot_ptr": i64},
            {},
        ),
        (gather_kv._gather_main_kernel, {**pages, "idx_ptr": i64, "out_ptr": f32}, {}),
        (gather_kv._gather_index_kernel, {**pages, "out_ptr": f32}, {}),
        (
            attention._sparse_attention_kernel,
            {
                **pages,
                "q_ptr": bf16,
                "swa_ptr": bf16,
                "valid_ptr": u8,
                "idx_ptr": i64,
                "sink_ptr": f32,
                "out_ptr": bf16,
                "part_ptr": f32,
                "ml_ptr": f32,
                "qk_scale": "fp32",
            },
            {"BLOCK_H": 16, "BLOCK_N": 32, "SPLIT": True, "PRECISION": "tf32"},
        ),
        (
            attention._combine_kernel,
            {"part_ptr": f32, "ml_ptr": f32, "sink_ptr": f32, "out_ptr": bf16},
            {"BLOCK_H": 16},
        ),
        (
            indexer_scores._indexer_scores_kernel,
            {**pages, "qi_ptr": bf16, "w_ptr": f32, "nvis_ptr": i64, "out_ptr": f32},
            {"BLOCK_HEADS": 32, "BLOCK_S": 64, "PRECISION": "tf32"},
        ),
        (block_max._block_max_kernel, {"s_ptr": f32, "out_ptr": f32}, {"BLOCK_B": 128, "WIDTH": 8}),
    ]
    fused = {attention._sparse_attention_kernel, attention._combine_kernel}
    fused.add(indexer_scores._indexer_scores_kernel)
    for fn, pointers, constexprs in kernels:
        compiled = _hopper_compile(fn, pointers, constexprs, fp_fusion=fn in fused)
        assert compiled.asm.get("cubin"), fn.__name__
        assert compiled.metadata.shared <= 227 * 1024, (fn.__name__, compiled.metadata.shared)
