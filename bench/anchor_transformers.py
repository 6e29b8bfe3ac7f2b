"""flashserve against transformers eager at the same dimensions (the CPU decode anchor).

    .venv/bin/python bench/anchor_transformers.py [--streams 1 8 32] [--prefill 4096]

Optional: needs ``transformers`` (installed only as a test extra; never a
runtime dependency). Both sides run on this CPU with one intra-op thread, fp32,
random weights, at the anchor's dimensions: hidden 256, 8 layers, the 512-d latent,
8 routed experts top-2 plus one shared, sliding window 16, the 129,280-token
vocabulary. transformers runs ``DeepseekV4ForCausalLM`` (it has no V4.1; its
default V4 attention schedule, the ``eager`` attention and experts
implementations); flashserve runs its tiny model (``ModelConfig.tiny()``)
through ``LLMEngine``.

Measured, side by side in one run:

- prefill of ``--prefill`` tokens (transformers: one forward keeping the last
  logits; flashserve: one request with ``max_tokens=1``);
- generation of 32 tokens after a 64-token prompt for each ``--streams`` count
  (greedy; tokens/s = generated tokens / wall time, prompt processing included);
- the compute limit: this machine's fp32 GEMM FLOP/s (a 1024^3 ``torch.mm``,
  one thread) divided by the tiny model's FLOPs per decoded token (counted by
  ``torch.utils.flop_counter`` over a batch-32 decode step), and the fraction
  of it that batch-32 generation reaches.

JSON in ``bench/results/anchor_transformers.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.engine_bench import tiny_model  # noqa: E402
from engine.api.request import Request  # noqa: E402
from engine.api.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.loader.builder import engine_for_model  # noqa: E402

PROMPT, NEW = 64, 32


def hf_model():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    config = DeepseekV4Config(
        vocab_size=129280,
        hidden_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        head_dim=512,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        mlp_layer_types=["moe"] * 8,
        sliding_window=16,
        index_n_heads=4,
        index_head_dim=128,
        index_topk=16,
        rms_norm_eps=1e-20,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(config).eval()


def _prompts(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 120000, (n, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- transformers
def hf_prefill_s(model, tokens: int) -> float:
    ids = _prompts(1, tokens, 1)
    t0 = time.perf_counter()
    model(input_ids=ids, logits_to_keep=1, use_cache=True)
    return time.perf_counter() - t0


def hf_generate_tok_s(model, streams: int) -> float:
    ids = _prompts(streams, PROMPT, 2)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
    )
    wall = time.perf_counter() - t0
    assert out.shape[1] == PROMPT + NEW
    return streams * NEW / wall


# ---------------------------------------------------------------- flashserve
def _engine(model, streams: int) -> LLMEngine:
    return engine_for_model(EngineConfig(max_num_seqs=streams, kv_cache_bytes=256 << 20), model)


def fs_prefill_s(model, tokens: int) -> float:
    engine = _engine(model, 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(Request("p", _prompts(1, tokens, 1)[0].tolist(), params))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def fs_generate_tok_s(model, streams: int) -> float:
    engine = _engine(model, streams)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for i, p in enumerate(_prompts(streams, PROMPT, 2)):
        engine.add_request(Request(f"r{i}", p.tolist(), params))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    assert engine.counters.generation_tokens == streams * NEW
    return streams * NEW / wall


def fs_flops_per_token(model, batch: int = 32) -> float:
    """FLOPs of one decode step at ``batch`` (matmuls, einsums, attention) / batch."""
    from torch.utils.flop_counter import FlopCounterMode

    engine = _engine(model, batch)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, PROMPT, 3)):
        engine.add_request(Request(f"f{i}", p.tolist(), params))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    counter = FlopCounterMode(display=False)
    with counter:
        engine.step()
    return counter.get_total_flops() / batch


def gemm_flops_per_s(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)


# ---------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats (medians)")
    ap.add_argument(
        "--json", type=Path, default=REPO / "bench" / "results" / "anchor_transformers.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    hf, fs = hf_model(), tiny_model()
    rows: list[tuple[str, list[float], list[float]]] = []
    if args.prefill:
        rows.append((f"prefill {args.prefill} tokens (s)", [], []))
    rows += [(f"generate {NEW} after {PROMPT}, {n} streams (tok/s)", [], []) for n in args.streams]
    for _ in range(args.repeats):
        i = 0
        if args.prefill:
            rows[0][1].append(hf_prefill_s(hf, args.prefill))
            rows[0][2].append(fs_prefill_s(fs, args.prefill))
            i = 1
        for n, row in zip(args.streams, rows[i:], strict=True):
            row[1].append(hf_generate_tok_s(hf, n))
            row[2].append(fs_generate_tok_s(fs, n))
    result: dict[str, object] = {
        "date": datetime.now(UTC).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, 1 torch thread, CPU",
        "rows": {},
    }
    print(f"{'':<44}{'transformers':>14}{'flashserve':>12}{'ratio':>8}")
    for name, hf_v, fs_v in rows:
        h, f = statistics.median(hf_v), statistics.median(fs_v)
        ratio = h / f if name.startswith("prefill") else f / h  # > 1: flashserve faster
        result["rows"][name] = {"transformers": h, "flashserve": f, "ratio": ratio}
        print(f"{name:<44}{h:>14.2f}{f:>12.2f}{ratio:>7.2f}x")
    flops = fs_flops_per_token(fs)
    gemm = gemm_flops_per_s()
    limit = gemm / flops
    result["compute_limit"] = {
        "gemm_flop_per_s": gemm,
        "model_flop_per_token": flops,
        "limit_tok_per_s": limit,
    }
    print(
        f"compute limit: fp32 GEMM {gemm / 1e9:.1f} GFLOP/s / {flops / 1e6:.1f} MFLOP per token "
        f"= {limit:.0f} tok/s"
    )
    if 32 in args.streams:
        fs32 = result["rows"][f"generate {NEW} after {PROMPT}, 32 streams (tok/s)"]["flashserve"]
        result["compute_limit"]["batch32_fraction"] = fs32 / limit
        print(f"flashserve at 32 streams: {fs32:.1f} tok/s = {fs32 / limit:.1%} of the limit")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
