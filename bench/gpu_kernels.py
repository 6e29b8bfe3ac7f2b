"""GPU benchmark of the Triton KV, sparse-attention and indexer kernels.

    python bench/gpu_kernels.py [--json bench/results/gpu_kernels.json]

For each op: build inputs at decode-realistic sizes (batch 64, top-k 512, window
128, 64 heads x 512, 32 indexer heads), check the Triton kernel against its
PyTorch reference on the same GPU, then time both with ``triton.testing.do_bench``
(median, CUDA events). Achieved bandwidth counts each byte the op must move once
(reads of records, queries and windows, writes of outputs) and is compared with
a measured device-to-device copy. For the sparse attention kernel a few tile
shapes are tried and the best is reported. Without a GPU it says so and exits 0.
Exit 1 when a kernel disagrees with its reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from kernels.indexer_ops import block_max_reference, indexer_scores_reference
from kernels.kv_cache_ops import (
    gather_index_keys_reference,
    gather_main_kv_reference,
    store_kv_entries_reference,
)
from kernels.sparse_attention import sparse_attention_reference


@dataclass(slots=True)
class Result:
    op: str
    shape: str
    triton_ms: float
    reference_ms: float
    bytes_moved: int
    gbps: float
    copy_fraction: float
    max_abs_err: float
    config: str = ""


# (block_h, block_n, num_warps) tried for the sparse attention kernel.
# Eight shapes, not the full grid: each compiles anew, and device time is short.
ATTENTION_TILES = [(h, n, w) for h in (16, 64) for n in (32, 64) for w in (4, 8)]


@dataclass(slots=True)
class Sizes:
    rows: int = 64
    heads: int = 64
    topk: int = 512
    window: int = 128
    index_heads: int = 32
    context_entries: int = 32768  # compressed entries per sequence (e.g. 32k tokens at ratio 1)
    entries_per_page: int = 64
    store_entries: int = 4096
    candidate_block_size: int = 8
    linear_n: int = 4096  # packed FP8 linear: output features (ragged N allowed)
    linear_k: int = 4096  # input features, a multiple of 32


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def paged_pool(sz: Sizes, rows: int, device: torch.device):
    """Random FP4 records for ``rows`` sequences with scattered block tables."""
    e = sz.entries_per_page
    pages_per_seq = -(-sz.context_entries // e)
    num_pages = rows * pages_per_seq
    main = torch.randint(0, 256, (num_pages, e, 288), dtype=torch.uint8, device=device)
    # Scale bytes in a sane range: E4M3 2^-3 .. 2^1, UE8M0 2^-7 .. 2^2.
    main[..., 256:] = torch.randint(
        0x20, 0x40, (num_pages, e, 32), dtype=torch.uint8, device=device
    )
    index = torch.randint(0, 256, (num_pages, e, 68), dtype=torch.uint8, device=device)
    index[..., 64:] = torch.randint(120, 130, (num_pages, e, 4), dtype=torch.uint8, device=device)
    tables = torch.randperm(num_pages, device=device).view(rows, pages_per_seq)
    return main[..., :256], main[..., 256:], index[..., :64], index[..., 64:], tables


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (|want| + 1) over entries where want is finite; inf if the rest differ."""
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(got[~finite], want[~finite]):
        return float("inf")
    if not finite.any():
        return 0.0
    return float(((got - want).abs() / (want.abs() + 1))[finite].max())


def record(op, shape, tri_ms, ref_ms, nbytes, copy_bps, err, config="") -> Result:
    bps = nbytes / (tri_ms * 1e-3)
    return Result(op, shape, tri_ms, ref_ms, nbytes, bps / 1e9, bps / copy_bps, err, config)


def bench_store(sz: Sizes, dev: torch.device, copy_bps: float) -> Result:
    from kernels.triton.store_kv import store_kv_entries_triton

    n = sz.store_entries
    md, ms, idd, isc, _ = paged_pool(sz, 1, dev)
    tgt = torch.randperm(md.shape[0] * md.shape[1], device=dev)[:n]
    pages, slots = tgt // md.shape[1], tgt % md.shape[1]
    lat = torch.randn(n, 512, device=dev, dtype=torch.bfloat16)
    keys = torch.randn(n, 128, device=dev, dtype=torch.bfloat16)
    views = (md, ms, idd, isc)
    ref_views = tuple(v.clone() for v in views)
    store_kv_entries_triton(*views, pages, slots, lat, keys)
    store_kv_entries_reference(*ref_views, pages, slots, lat, keys)
    mismatched = sum(int((a != b).sum()) for a, b in zip(views, ref_views, strict=True))
    tri = bench_ms(lambda: store_kv_entries_triton(*views, pages, slots, lat, keys))
    ref = bench_ms(lambda: store_kv_entries_reference(*views, pages, slots, lat, keys))
    nbytes = n * ((512 + 128) * 2 + 288 + 68 + 16)
    return record("store_kv_entries", f"N={n}", tri, ref, nbytes, copy_bps, float(mismatched))


def bench_gathers(sz: Sizes, dev: torch.device, copy_bps: float) -> list[Result]:
    from kernels.triton.gather_kv import gather_index_keys_triton, gather_main_kv_triton

    md, ms, idd, isc, tables = paged_pool(sz, 1, dev)
    bt = tables[0]
    idx = torch.randint(-1, sz.context_entries, (sz.rows, sz.topk), device=dev)
    got = gather_main_kv_triton(md, ms, bt, idx)
    want = gather_main_kv_reference(md, ms, bt, idx)
    err = rel_err(got, want)
    tri = bench_ms(lambda: gather_main_kv_triton(md, ms, bt, idx))
    ref = bench_ms(lambda: gather_main_kv_reference(md, ms, bt, idx))
    out = [
        record(
            "gather_main_kv",
            f"{sz.rows}x{sz.topk}",
            tri,
            ref,
            idx.numel() * (288 + 8 + 512 * 4),
            copy_bps,
            err,
        )
    ]
    n = sz.context_entries
    got = gather_index_keys_triton(idd, isc, bt, n)
    want = gather_index_keys_reference(idd, isc, bt, n)
    err = rel_err(got, want)
    tri = bench_ms(lambda: gather_index_keys_triton(idd, isc, bt, n))
    ref = bench_ms(lambda: gather_index_keys_reference(idd, isc, bt, n))
    out.append(record("gather_index_keys", f"n={n}", tri, ref, n * (68 + 128 * 4), copy_bps, err))
    return out


def bench_attention(
    sz: Sizes, rows: int, dev: torch.device, copy_bps: float, dtype: torch.dtype = torch.bfloat16
) -> Result:
    """bf16 queries take the tf32 products; fp32 ones (the tiny model's dtype) the
    "ieee" ones, with a partly filled window as a short prompt has."""
    from kernels.triton.sparse_attention import sparse_attention_triton

    md, ms, _, _, tables = paged_pool(sz, rows, dev)
    h = sz.heads
    q = torch.randn(rows, h, 512, device=dev, dtype=dtype)
    swa = torch.randn(rows, sz.window, 512, device=dev, dtype=dtype)
    valid = torch.ones(rows, sz.window, dtype=torch.bool, device=dev)
    if dtype == torch.float32:
        valid[:, sz.window // 3 :] = False
    idx = torch.stack(
        [
            torch.randperm(sz.context_entries, device=dev)[: sz.topk].sort().values
            for _ in range(rows)
        ]
    )
    sink = torch.randn(h, device=dev)
    args = (q, swa, valid, md, ms, tables, idx, sink, 512**-0.5)
    # Against fp32 output, so the error seen is the kernel's own (bf16 rounding, tf32).
    want = sparse_attention_reference(q.float(), *args[1:])
    best: tuple[float, str] | None = None
    err = 0.0
    for block_h, block_n, warps in ATTENTION_TILES:
        cfg = dict(block_h=block_h, block_n=block_n, num_warps=warps)
        try:
            got = sparse_attention_triton(*args, **cfg)
            ms_ = bench_ms(lambda cfg=cfg: sparse_attention_triton(*args, **cfg))
        except Exception as exc:  # a tile shape that does not fit (shared memory): skip it
            print(f"  sparse_attention {cfg}: skipped ({type(exc).__name__}: {exc})")
            continue
        cfg_err = rel_err(got, want)
        print(f"  sparse_attention rows={rows} {cfg}: {ms_:.4f} ms, rel err {cfg_err:.2e}")
        err = max(err, cfg_err)
        if best is None or ms_ < best[0]:
            best = (ms_, str(cfg))
    assert best is not None, "no sparse attention configuration ran"
    ref = bench_ms(lambda: sparse_attention_reference(*args))
    per_row = h * 512 * 2 * 2 + sz.window * 512 * 2 + sz.window + sz.topk * (288 + 8)
    shape = f"T={rows} H={h} W={sz.window} K={sz.topk}" + (
        " fp32" if dtype == torch.float32 else ""
    )
    op = "sparse_attention" if dtype == torch.bfloat16 else "sparse_attention_fp32"
    return record(op, shape, best[0], ref, rows * per_row, copy_bps, err, best[1])


def bench_indexer(sz: Sizes, dev: torch.device, copy_bps: float) -> list[Result]:
    from kernels.triton.block_max import block_max_triton
    from kernels.triton.indexer_scores import indexer_scores_triton

    _, _, idd, isc, tables = paged_pool(sz, sz.rows, dev)
    t, h, n = sz.rows, sz.index_heads, sz.context_entries
    qi = torch.randn(t, h, 128, device=dev, dtype=torch.bfloat16)
    w = torch.randn(t, h, device=dev) * h**-0.5
    nvis = torch.randint(n // 2, n + 1, (t,), device=dev)
    args = (qi, w, idd, isc, tables, nvis, n)
    got = indexer_scores_triton(*args)
    err = rel_err(got, indexer_scores_reference(*args))
    tri = bench_ms(lambda: indexer_scores_triton(*args))
    ref = bench_ms(lambda: indexer_scores_reference(*args))
    visible = int(nvis.sum())
    nbytes = visible * 68 + t * n * 4 + t * h * 128 * 2
    out = [record("indexer_scores", f"T={t} h={h} S={n}", tri, ref, nbytes, copy_bps, err)]
    bs = sz.candidate_block_size
    got_b = block_max_triton(got, bs)
    err_b = 0.0 if torch.equal(got_b, block_max_reference(got, bs)) else float("inf")
    tri = bench_ms(lambda: block_max_triton(got, bs))
    ref = bench_ms(lambda: block_max_reference(got, bs))
    nbytes = got.numel() * 4 + got_b.numel() * 4
    out.append(record("block_max", f"T={t} S={n} /{bs}", tri, ref, nbytes, copy_bps, err_b))
    return out


def bench_fp8_linear(sz: Sizes, dev: torch.device, copy_bps: float) -> Result:
    """The packed FP8 linear at decode batch ``rows``: bf16 activations, E4M3 weights."""
    from kernels.fp8_gemm import fp8_linear_cpu
    from kernels.triton.fp8_gemm import fp8_linear_triton
    from kernels.weight_formats import quantize_fp8_block

    t, n, k = sz.rows, sz.linear_n, sz.linear_k
    weight, scale = quantize_fp8_block(torch.randn(n, k, device=dev) * 0.02)
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    err = rel_err(fp8_linear_triton(x, weight, scale), fp8_linear_cpu(x, weight, scale))
    tri = bench_ms(lambda: fp8_linear_triton(x, weight, scale))
    ref = bench_ms(lambda: fp8_linear_cpu(x, weight, scale))
    nbytes = weight.numel() + scale.numel() + x.numel() * 2 + t * n * 2
    return record("fp8_linear", f"T={t} N={n} K={k}", tri, ref, nbytes, copy_bps, err)


# Largest accepted error per op: mismatched bytes for the store, else rel_err.
TOLERANCE = {
    "store_kv_entries": 0.0,  # bytes must match exactly
    "gather_main_kv": 0.0,  # decoding is exact
    "gather_index_keys": 0.0,
    "block_max": 0.0,
    "sparse_attention": 2**-7,  # bf16 output (plus tf32 rounding of the probabilities)
    "sparse_attention_fp32": 1e-4,  # fp32 throughout ("ieee" products)
    "indexer_scores": 1e-4,  # fp32 sums in another order
    "fp8_linear": 2**-7,  # bf16 output; fp32 sums in another order
}


def run_all(sz: Sizes, dev: torch.device, copy_bps: float) -> list[Result]:
    """Every op; one that raises (a kernel that does not compile on this GPU, say) is
    reported with its error and counted as a mismatch, and the others still run, since
    a device run is too short to be repeated for each failure."""
    steps: list[tuple[str, Callable[[], Result | list[Result]]]] = [
        ("store_kv_entries", lambda: bench_store(sz, dev, copy_bps)),
        ("gather_main_kv", lambda: bench_gathers(sz, dev, copy_bps)),
        ("sparse_attention", lambda: bench_attention(sz, sz.rows, dev, copy_bps)),
        ("sparse_attention", lambda: bench_attention(sz, 2, dev, copy_bps)),  # split-K
        (
            "sparse_attention_fp32",
            lambda: bench_attention(sz, 7, dev, copy_bps, torch.float32),
        ),
        ("indexer_scores", lambda: bench_indexer(sz, dev, copy_bps)),
        ("fp8_linear", lambda: bench_fp8_linear(sz, dev, copy_bps)),
    ]
    results: list[Result] = []
    for op, step in steps:
        try:
            got = step()
        except Exception:
            print(f"{op}: FAILED\n{traceback.format_exc()}", flush=True)
            results.append(Result(op, "error", 0.0, 0.0, 0, 0.0, 0.0, float("inf"), "raised"))
            continue
        results += got if isinstance(got, list) else [got]
    return results


def print_table(results: list[Result], copy_bps: float) -> None:
    print(f"\ndevice-to-device copy: {copy_bps / 1e9:.0f} GB/s")
    head = (
        f"{'op':<18} {'shape':<28} {'triton ms':>10} {'ref ms':>9} "
        f"{'GB/s':>8} {'% copy':>7} {'err':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.op:<18} {r.shape:<28} {r.triton_ms:>10.4f} {r.reference_ms:>9.3f} "
            f"{r.gbps:>8.0f} {100 * r.copy_fraction:>6.1f}% {r.max_abs_err:>9.2e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--context-entries", type=int, default=Sizes().context_entries)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU present (torch.cuda.is_available() is False): nothing to benchmark")
        return 0
    dev = torch.device("cuda")
    sz = Sizes(context_entries=args.context_entries)
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name(dev)}")
    copy_bps = copy_bandwidth(dev)
    results = run_all(sz, dev, copy_bps)
    print_table(results, copy_bps)
    for r in results:
        if r.config:
            print(f"best {r.op} ({r.shape}): {r.config}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "device": torch.cuda.get_device_name(dev),
            "copy_gbps": copy_bps / 1e9,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    bad = [r.op for r in results if not r.max_abs_err <= TOLERANCE[r.op]]
    if bad:
        print(f"MISMATCH against the reference: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
