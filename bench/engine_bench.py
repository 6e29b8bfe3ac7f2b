"""The engine's performance goals (docs/BENCHMARKS.md), measured side by side in one run.

P1  prefill time of a long prompt, CED vs full depth (``--disable-ced``); goal <= 0.55.
P3  decode step time at a long context vs 1K (top-k sparse + candidate blocks), and the
    same for dense attention over every entry, for contrast; goal <= 1.3.
P4  aggregate decode tokens/s with 32 concurrent requests vs 1; goal >= 10.
    Engine overhead: share of step time outside the runner's forward at batch 32.

Everything runs the paged runner on the tiny model in fp32 on this machine's CPU.
Timings are medians of interleaved repeats (the machine is shared and noisy).
P3's long context is synthetic: the pages hold real FP4 records of random
latents written by the store kernel, which is all a decode step reads.

    .venv/bin/python bench/engine_bench.py --out bench/results/engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sequence import Sequence
from engine.core.step import PrefillChunk, StepBatch
from engine.loader.builder import engine_for_model
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.semantics.replay import ReplayPlan
from engine.runner.model_runner import PagedModelRunner
from kernels.kv_cache_ops import store_kv_entries
from kvstore.device.layout import kv_layout
from kvstore.local import LocalKV, open_local_kv
from kvstore.manager import KVCacheManager

PAGE = 64


def tiny_model(config: ModelConfig | None = None, seed: int = 0) -> DeepseekV41:
    from engine.loader.tokenizer import load_tokenizer
    from engine.model.deepseek_v41.engram import build_compressed_vocab

    model = DeepseekV41(config or ModelConfig.tiny())
    model.init_weights(torch.Generator().manual_seed(seed))
    model.set_compressed_vocab(build_compressed_vocab(load_tokenizer())[0])
    return model.eval()


def _manager(config: ModelConfig, tokens: int) -> LocalKV:
    layout = kv_layout(config.kv_source_layer_ids, config.compress_ratios, PAGE)
    return open_local_kv(layout, layout.page_bytes * (tokens // PAGE + 8))


def _sequence(
    kv: KVCacheManager, config: ModelConfig, tokens: list[int], W: int, ced: bool
) -> Sequence:
    seq = Sequence(seq_id=0, request_id="0", token_ids=list(tokens), num_prompt_tokens=len(tokens))
    plan = ReplayPlan.prefill(config, len(tokens), W, ced=ced)
    seq.admit(plan, plan.decoder_start(config))
    seq.block_table = kv.allocate(0, len(tokens) + 1)
    return seq


def _median_pair(
    a: Callable[[], float], b: Callable[[], float], repeats: int
) -> tuple[float, float]:
    """Interleaved repeats: a, b, a, b, ... so drift hits both alike."""
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(a())
        tb.append(b())
    return statistics.median(ta), statistics.median(tb)


# ---------------------------------------------------------------- P1
def prefill_seconds(model: DeepseekV41, n_tokens: int, ced: bool, chunk: int) -> float:
    config = model.config
    kv, pool = _manager(config, n_tokens)
    runner = PagedModelRunner(model, pool, max_num_seqs=1)
    tokens = torch.randint(3, 120000, (n_tokens,), generator=torch.Generator().manual_seed(1))
    seq = _sequence(kv, config, tokens.tolist(), config.sliding_window, ced)
    start = time.perf_counter()
    for c0 in range(0, n_tokens, chunk):
        c1 = min(c0 + chunk, n_tokens)
        runner.execute(StepBatch(prefills=[PrefillChunk(seq, c0, c1, c1 == n_tokens)]))
    return time.perf_counter() - start


# ---------------------------------------------------------------- P3
def synthetic_context(
    model: DeepseekV41, context: int, extra: int
) -> tuple[KVCacheManager, PagedModelRunner, Sequence]:
    """One sequence at ``context`` tokens whose global KV is random entries written
    straight into its pages (no prefill), with room for ``extra`` more tokens."""
    config = model.config
    kv, pool = _manager(config, context + extra)
    runner = PagedModelRunner(model, pool, max_num_seqs=1)
    tokens = torch.randint(3, 120000, (context,), generator=torch.Generator().manual_seed(2))
    seq = _sequence(kv, config, tokens.tolist(), config.sliding_window, ced=True)
    table = torch.tensor(seq.block_table)
    gen = torch.Generator().manual_seed(3)
    for layer in config.kv_source_layer_ids:
        pages = pool.source(layer)
        n = context // config.compress_ratios[layer]
        for e0 in range(0, n, 4096):
            entries = torch.arange(e0, min(e0 + 4096, n))
            store_kv_entries(
                pages.main_data,
                pages.main_scales,
                pages.index_data,
                pages.index_scales,
                table[entries // pages.entries_per_page],
                entries % pages.entries_per_page,
                torch.randn(entries.numel(), config.head_dim, generator=gen),
                torch.randn(entries.numel(), config.index_head_dim, generator=gen),
            )
    return kv, runner, seq


def decode_step_seconds(model: DeepseekV41, context: int, steps: int) -> float:
    """Median decode step at ``context`` tokens of synthetic global KV."""
    kv, runner, seq = synthetic_context(model, context, steps)
    times = []
    for step in range(steps):
        seq.token_ids.append(5 + step)
        seq.block_table = kv.allocate(0, seq.num_tokens)
        start = time.perf_counter()
        runner.execute(StepBatch(decodes=[seq]))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


# ---------------------------------------------------------------- P4
def decode_throughput(model: DeepseekV41, concurrency: int, new_tokens: int) -> dict[str, float]:
    """Decode tokens/s with ``concurrency`` requests decoding together, and engine overhead."""
    config = EngineConfig(max_num_seqs=max(concurrency, 1), kv_cache_bytes=256 << 20)
    engine = engine_for_model(config, model)
    gen = torch.Generator().manual_seed(4)
    for i in range(concurrency):
        prompt = torch.randint(3, 120000, (48,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.add_request(Request(f"r{i}", prompt, params))
    # Prefill everything first so only decode steps are timed.
    while any(s.num_output_tokens == 0 for s in _running(engine)) or engine.scheduler.waiting:
        engine.step()
    c = engine.counters
    steps0, step_s0, exec_s0, gen0 = c.steps, c.step_seconds, c.execute_seconds, c.generation_tokens
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    tokens = c.generation_tokens - gen0
    step_s = c.step_seconds - step_s0
    return {
        "tokens_per_s": tokens / wall,
        "steps": c.steps - steps0,
        "overhead_share": 1.0 - (c.execute_seconds - exec_s0) / step_s,
    }


def _running(engine: LLMEngine) -> list[Sequence]:
    return list(engine.scheduler.running)


# ---------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--long-context", type=int, default=32768)
    ap.add_argument("--short-context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    # One thread by default: on a shared 2-core VM a second OpenMP worker mostly spins.
    torch.set_num_threads(args.threads)
    model = tiny_model()
    results: dict[str, object] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, CPU",
        "model": "tiny (fp32)",
    }

    ced, full = _median_pair(
        lambda: prefill_seconds(model, args.prefill_tokens, True, args.prefill_chunk),
        lambda: prefill_seconds(model, args.prefill_tokens, False, args.prefill_chunk),
        args.repeats,
    )
    results["P1"] = {
        "tokens": args.prefill_tokens,
        "ced_s": ced,
        "full_depth_s": full,
        "ratio": ced / full,
        "goal": "<= 0.55",
    }
    print(
        f"P1 prefill {args.prefill_tokens}: CED {ced:.2f}s, full depth {full:.2f}s, "
        f"ratio {ced / full:.3f}"
    )

    long_n, short_n = args.long_context, args.short_context

    def dense_model(context: int) -> DeepseekV41:
        """The same weights with top-k and candidate blocks covering every entry."""
        cfg = model.config.replace(index_topk=context, candidate_topk_blocks=context)
        dense = DeepseekV41(cfg)
        dense.load_state_dict(model.state_dict())
        dense.set_compressed_vocab(model.engram_vocab_map)
        return dense.eval()

    p3 = {}
    for name, short_m, long_m in (
        ("sparse", model, model),
        ("dense", dense_model(short_n), dense_model(long_n)),
    ):
        lo, hi = _median_pair(
            lambda m=short_m: decode_step_seconds(m, short_n, args.decode_steps),
            lambda m=long_m: decode_step_seconds(m, long_n, args.decode_steps),
            max(1, args.repeats - 1),
        )
        p3[name] = {"short_s": lo, "long_s": hi, "ratio": hi / lo}
        print(
            f"P3 {name}: decode step {short_n}: {lo * 1e3:.1f} ms, {long_n}: {hi * 1e3:.1f} ms, "
            f"ratio {hi / lo:.2f}"
        )
    results["P3"] = {"short_context": short_n, "long_context": long_n, **p3, "goal": "<= 1.3"}

    one = decode_throughput(model, 1, args.new_tokens)
    many = decode_throughput(model, args.concurrency, args.new_tokens)
    results["P4"] = {
        "concurrency": args.concurrency,
        "tokens_per_s_1": one["tokens_per_s"],
        "tokens_per_s_n": many["tokens_per_s"],
        "ratio": many["tokens_per_s"] / one["tokens_per_s"],
        "overhead_share_at_n": many["overhead_share"],
        "goal": ">= 10",
    }
    print(
        f"P4 decode tok/s: 1 -> {one['tokens_per_s']:.1f}, {args.concurrency} -> "
        f"{many['tokens_per_s']:.1f}, ratio {many['tokens_per_s'] / one['tokens_per_s']:.2f}; "
        f"engine overhead at {args.concurrency}: {many['overhead_share']:.1%}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
