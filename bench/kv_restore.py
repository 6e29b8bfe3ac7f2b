"""Restore a prefix from the SSD tier and replay vs recomputing it.

(a) restore: the tiny layout's pages for an 8K-token prefix are written through
    the KV manager, fsynced, and dropped from the OS page cache
    (POSIX_FADV_DONTNEED); a fresh manager then rebuilds its index and
    ``plan_restore`` loads every page into the device pool. Median of --runs.
    Then the exact replay the restore implies on the tiny model: each encoder
    layer over its receptive field below the hit, a triangle
    (docs/design/semantics.md), then the decoder's last window.
(b) recompute: the same prompt prefilled from scratch on the tiny model
    (CED prefill, semantics 2) by the engine's paged runner.
(c) bytes on disk per cached token for the official layout, headers included.

    .venv/bin/python bench/kv_restore.py            # writes bench/results/kv_restore.json
    .venv/bin/python bench/kv_restore.py --tokens 32768 --out bench/results/kv_restore_32k.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstore import PersistentStore, chain_hashes, kv_layout, open_local_kv  # noqa: E402

TINY = dict(kv_source_layer_ids=[2, 4], compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0])
OFFICIAL = dict(
    kv_source_layer_ids=[2, 8, 14, 20], compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
)
SALT = "bench"


def _drop_page_cache(root: Path) -> int:
    """fsync + POSIX_FADV_DONTNEED every page file; returns how many were dropped."""
    n = 0
    for path in root.rglob("*.kvp"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _resident_bytes(root: Path) -> int | None:
    """Bytes of the page files still in the OS page cache (util-linux fincore)."""
    if shutil.which("fincore") is None:
        return None
    files = [str(p) for p in root.rglob("*.kvp")]
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    return sum(int(x) for x in out.stdout.split())


def bench_restore(tokens: list[int], runs: int, kv_dir: Path) -> dict:
    layout = kv_layout(**TINY)
    pool_bytes = (len(tokens) // layout.page_tokens + 8) * layout.page_bytes
    gen = torch.Generator().manual_seed(0)
    with open_local_kv(layout, pool_bytes, kv_dir=kv_dir, kv_dir_bytes=10**11) as (kv, pool):
        kv.plan_restore("writer", tokens, SALT)
        table = kv.allocate("writer", len(tokens))
        # Random bytes: the tier stores payloads raw, so their content does not matter.
        pool.pages[table] = torch.randint(
            0, 256, (len(table), layout.page_bytes), dtype=torch.uint8, generator=gen
        )
        expect = pool.pages[table].clone()
        kv.commit_full_pages("writer", tokens, SALT)
    n_pages = len(chain_hashes(tokens, SALT, layout.page_tokens))
    seconds, scans, resident = [], [], []
    for _ in range(runs):
        _drop_page_cache(kv_dir)
        resident.append(_resident_bytes(kv_dir))
        t0 = time.perf_counter()
        kv, pool = open_local_kv(layout, pool_bytes, kv_dir=kv_dir, kv_dir_bytes=10**11)
        t1 = time.perf_counter()
        plan = kv.plan_restore("reader", tokens, SALT)
        t2 = time.perf_counter()
        assert plan.ssd_hit_tokens == (len(tokens) - 1) // layout.page_tokens * layout.page_tokens
        assert torch.equal(pool.pages[plan.page_ids], expect[: len(plan.page_ids)])
        kv.close()
        scans.append(t1 - t0)
        seconds.append(t2 - t1)
    return {
        "layout": "tiny",
        "prefix_tokens": plan.hit_tokens,
        "pages": n_pages,
        "bytes_restored": n_pages * layout.page_bytes,
        "runs": runs,
        "restore_seconds": seconds,
        "restore_seconds_median": statistics.median(seconds),
        "index_rebuild_seconds_median": statistics.median(scans),
        "page_cache_resident_bytes_before": resident,
    }


def bench_model(tokens: list[int], hit_tokens: int, recompute_runs: int) -> dict:
    """Recompute (CED prefill) and the restore's bounded replay on the tiny model.

    Both run the engine's paged runner: the recompute prefills every token in
    chunks of 512 and commits its pages; the replay is a second request whose
    plan finds those pages (H = hit_tokens) and runs only the replay plan's rows.
    """
    from engine.core.sequence import Sequence
    from engine.core.step import PrefillChunk, StepBatch
    from engine.loader.tokenizer import load_tokenizer
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.model.deepseek_v41.engram import build_compressed_vocab
    from engine.model.deepseek_v41.model import DeepseekV41
    from engine.model.semantics.replay import ReplayPlan
    from engine.runner.model_runner import PagedModelRunner

    cfg = ModelConfig.tiny()
    model = DeepseekV41(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    model.set_compressed_vocab(build_compressed_vocab(load_tokenizer())[0])
    model.eval()
    torch.set_grad_enabled(False)
    n, w = len(tokens), cfg.sliding_window
    layout = kv_layout(**TINY)
    kv, pool = open_local_kv(layout, (2 * n // layout.page_tokens + 8) * layout.page_bytes)
    runner = PagedModelRunner(model, pool, max_num_seqs=2)
    seq_ids = itertools.count()

    def prefill(rid: str, salt: str, chunk: int = 512) -> float:
        plan = kv.plan_restore(rid, tokens, salt)
        seq = Sequence(
            seq_id=next(seq_ids),
            request_id=rid,
            token_ids=list(tokens),
            num_prompt_tokens=n,
            salt=salt,
        )
        replay = ReplayPlan.prefill(cfg, n, w, stored_tokens=plan.hit_tokens)
        seq.admit(replay, replay.decoder_start(cfg))
        seq.block_table = kv.allocate(rid, n)
        t0 = time.perf_counter()
        for c0 in range(seq.encoder_start, n, chunk):
            c1 = min(c0 + chunk, n)
            runner.execute(StepBatch(prefills=[PrefillChunk(seq, c0, c1, c1 == n)]))
        elapsed = time.perf_counter() - t0
        assert plan.hit_tokens in (0, hit_tokens), plan
        kv.commit_full_pages(rid, tokens, salt)
        runner.release(seq)
        kv.free(rid)
        return elapsed

    replay_plan = ReplayPlan.prefill(cfg, n, w, stored_tokens=hit_tokens)
    recompute, replay = [], []
    for i in range(recompute_runs):
        # A fresh salt per run: nothing cached, then the same salt: everything cached.
        recompute.append(prefill(f"cold{i}", f"run{i}"))
        replay.append(prefill(f"warm{i}", f"run{i}"))
    return {
        "available": True,
        "path": "engine.runner.model_runner.PagedModelRunner (tiny, fp32, CPU, chunks of 512)",
        "recompute_seconds": recompute,
        "recompute_seconds_median": statistics.median(recompute),
        "replay_rows": n - replay_plan.encoder_start,
        "replay_rows_per_layer": replay_plan.rows_per_layer(n),
        "replay_seconds": replay,
        "replay_seconds_median": statistics.median(replay),
    }


def bench_disk_bytes(kv_dir: Path, pages: int) -> dict:
    layout = kv_layout(**OFFICIAL)
    store = PersistentStore(kv_dir, layout, budget_bytes=10**11)
    gen = torch.Generator().manual_seed(1)
    for i in range(pages):
        payload = torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8, generator=gen)
        store.put(i.to_bytes(32, "big"), payload)
    store.close()
    files = list(store.root.rglob("*.kvp"))
    logical = sum(p.stat().st_size for p in files)
    allocated = sum(p.stat().st_blocks * 512 for p in files)
    cached_tokens = len(files) * layout.page_tokens
    return {
        "layout": "official",
        "pages": len(files),
        "payload_bytes_per_token": layout.bytes_per_token,
        "file_bytes_per_token": logical / cached_tokens,
        "allocated_bytes_per_token": allocated / cached_tokens,
        "goal_bytes_per_token": 890 * 1.02,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prefix length to restore")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--recompute-runs", type=int, default=1)
    ap.add_argument("--skip-model", action="store_true", help="restore and disk bytes only")
    ap.add_argument("--kv-dir", type=Path, default=None, help="a directory on the SSD to test")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv_restore.json")
    args = ap.parse_args()
    # One intra-op thread: on a shared 2-core VM a second OpenMP worker mostly spins.
    torch.set_num_threads(1)

    load_before = os.getloadavg()
    base = args.kv_dir or REPO / "bench" / "results"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kv_restore.", dir=base))
    # The prefix plus one new token; ids inside the tiny model's Engram vocabulary.
    tokens = [3 + i % 997 for i in range(args.tokens + 1)]
    try:
        restore = bench_restore(tokens, args.runs, work / "tiny")
        print(
            f"restore {restore['prefix_tokens']} tokens from SSD: "
            f"median {restore['restore_seconds_median'] * 1e3:.1f} ms "
            f"(index rebuild {restore['index_rebuild_seconds_median'] * 1e3:.1f} ms)"
        )
        disk = bench_disk_bytes(work / "official", pages=256)
        print(
            f"official layout on disk: {disk['file_bytes_per_token']:.1f} B/token in files, "
            f"{disk['allocated_bytes_per_token']:.1f} B/token allocated"
        )
        if args.skip_model:
            model = {"available": False, "reason": "--skip-model"}
        else:
            model = bench_model(tokens, restore["prefix_tokens"], args.recompute_runs)
        if model["available"]:
            total = restore["restore_seconds_median"] + model["replay_seconds_median"]
            model["restore_plus_replay_seconds"] = total
            model["recompute_over_restore"] = model["recompute_seconds_median"] / total
            model["restore_plus_replay_over_recompute"] = total / model["recompute_seconds_median"]
            model["recompute_over_ssd_load"] = (
                model["recompute_seconds_median"] / restore["restore_seconds_median"]
            )
            print(
                f"recompute {len(tokens)} tokens: {model['recompute_seconds_median']:.2f} s; "
                f"restore + replay of {model['replay_rows']} rows: {total:.3f} s; "
                f"ratio {model['restore_plus_replay_over_recompute']:.4f} of recompute"
            )
        else:
            print(f"recompute half not run: {model['reason']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            # Other work on a shared VM skews timings; recorded so readers can judge.
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "restore": restore,
        "model": model,
        "disk": disk,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
