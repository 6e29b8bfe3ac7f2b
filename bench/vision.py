"""What an image costs before its first token: the ViT + aligner per image against the
text prefill of as many tokens, and (``--url``) the TTFT of a chat with one image.

**encode** (the default): for each ``--sizes`` image (synthetic pixels, PNG), the
release's image processor settings give its plan (patches, tokens ``T``); timed, one
intra-op thread, medians of ``--repeats`` after a warm-up:

- ``process_ms``: bytes -> patches (decode, resize plan, pixels, content hash);
- ``tiny`` tower: the tiny vision config (2 blocks, 32 wide) on the tiny text model,
  ``DeepseekV41.encode_image`` (ViT, aligner, span rows), fp32;
- ``demo`` tower: the same for ``models/demo`` when its config has a vision tower;
- ``release`` tower (32 blocks, 1024 wide, 16 heads, random weights) per
  ``--release-dtypes``: too slow here to run whole at every size, so it is timed in
  two parts, one block (``block_ms``) and the tower without its blocks (patch
  embedding, rotary angles, final norm, the aligner to the release's hidden size:
  ``rest_ms``), and reported as ``rest + 32 x block`` (``encode_ms``; the blocks are
  identical, so the sum is the tower's cost but for noise). ``--release-full-sizes``
  also runs all 32 blocks once at those sizes, as a check of that sum;
- text prefill of ``T`` tokens (random ids), one chunk through the paged runner,
  CED on (the served default): the tiny model and ``models/demo``.

Ratios ``encode / prefill`` side by side. On paper, not measured: the release's ViT +
aligner FLOPs against its own text prefill's (2 per active weight per token, CED).
Nothing here is a GPU figure.

**ttft** (``--url``): against a running server, a chat whose user message is a
short question and one ``--ttft-size`` image as a ``data:`` URL ``image_url`` part,
streamed; per round a new image (cold: no cache can hold it), then the same request
again (cached: the prefix cache holds the span). TTFT is send to the first streamed
token, as the client sees it; ``usage`` gives the prompt and cached tokens.

    .venv/bin/python bench/vision.py                  # writes bench/results/vision.json
    .venv/bin/python bench/vision.py --url http://127.0.0.1:8000 --rounds 5
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import io
import json
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.core.sequence import Sequence  # noqa: E402
from engine.core.step import PrefillChunk, StepBatch  # noqa: E402
from engine.model.deepseek_v41.config import ModelConfig  # noqa: E402
from engine.model.deepseek_v41.model import DeepseekV41  # noqa: E402
from engine.model.deepseek_v41.vision.aligner import Aligner  # noqa: E402
from engine.model.deepseek_v41.vision.config import (  # noqa: E402
    VisionConfig,
    vision_config,
    with_vision,
)
from engine.model.deepseek_v41.vision.image_plan import ImagePlan  # noqa: E402
from engine.model.deepseek_v41.vision.image_processor import process_image  # noqa: E402
from engine.model.deepseek_v41.vision.vit import (  # noqa: E402
    VisionBlock,
    VisionTransformer,
    rotary_angles,
)
from engine.model.semantics.replay import ReplayPlan  # noqa: E402
from engine.runner.model_runner import PagedModelRunner  # noqa: E402
from kvstore.device.layout import kv_layout  # noqa: E402
from kvstore.local import open_local_kv  # noqa: E402

DEMO = REPO / "models" / "demo"
PAGE = 64
QUESTION = "What is in this picture?"


def synthetic_png(width: int, height: int, seed: int) -> bytes:
    """Random RGB pixels as PNG: a stand-in whose every pixel differs by seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG", compress_level=1)
    return out.getvalue()


def medians_ms(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median ms per call of each, measured round-robin (one call of each in turn), so
    that a shared machine's changing load weighs on all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


# ---------------------------------------------------------------- the towers


def tiny_with_tower(seed: int = 0) -> DeepseekV41:
    """The tiny text model with the tiny vision tower. The tower's tensors come after
    the text model's, so its text weights are the plain tiny model's of the same seed:
    it serves as the tiny text model too."""
    from engine.loader.tokenizer import load_tokenizer
    from engine.model.deepseek_v41.engram import build_compressed_vocab

    model = DeepseekV41(with_vision(ModelConfig.tiny(), VisionConfig.tiny()))
    model.init_weights(torch.Generator().manual_seed(seed))
    model.set_compressed_vocab(build_compressed_vocab(load_tokenizer())[0])
    return model.eval()


def _random_(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Weights ~ N(0, std), biases 0, norms 1 (as ``DeepseekV41.init_weights``): the
    time does not depend on the values, only on the shapes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module.eval()


class ReleaseTower:
    """The release's ViT + aligner at one dtype, random weights, in the two timed parts."""

    def __init__(
        self,
        text_hidden: int,
        dtype: torch.dtype,
        seed: int = 0,
        vision: VisionConfig | None = None,
    ) -> None:
        self.vision = vision or VisionConfig()
        self.dtype = dtype
        self.block = _random_(VisionBlock(self.vision), seed).to(dtype)
        # The tower's own code with its block list emptied: everything a block is not.
        self.rest = _random_(
            VisionTransformer(dataclasses.replace(self.vision, num_hidden_layers=1)), seed + 1
        )
        self.rest.blocks = nn.ModuleList()
        self.rest.to(dtype)
        self.aligner = _random_(Aligner(self.vision, text_hidden), seed + 2).to(dtype)

    def run_rest(self, patches: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        features = self.rest(patches, plan.n_vit_h, plan.n_vit_w)
        return self.aligner(features, plan.n_vit_h, plan.n_vit_w)

    def block_input(self, plan: ImagePlan) -> torch.Tensor:
        gen = torch.Generator().manual_seed(plan.n_patches)
        x = torch.randn(plan.n_patches, self.vision.hidden_size, generator=gen)
        return x.to(self.dtype)

    def run_block(self, x: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        angles = _angles(plan, self.vision)
        return self.block(x, angles.cos(), angles.sin())

    def run_full(self, patches: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """All ``num_hidden_layers`` blocks (the one block's weights each time)."""
        x = self.rest.patch_embed(patches.to(self.dtype))
        angles = _angles(plan, self.vision)
        cos, sin = angles.cos(), angles.sin()
        for _ in range(self.vision.num_hidden_layers):
            x = self.block(x, cos, sin)
        return self.aligner(self.rest.norm(x), plan.n_vit_h, plan.n_vit_w)


def _angles(plan: ImagePlan, vision: VisionConfig) -> torch.Tensor:
    return rotary_angles(plan.n_vit_h, plan.n_vit_w, vision.head_dim, vision.rope_theta)[:, None]


# ---------------------------------------------------------------- on paper


def vit_flops(plan: ImagePlan, vision: VisionConfig, text_hidden: int) -> int:
    """Multiply-add FLOPs (2 per weight per row) of the ViT + aligner on ``plan``, the
    attention's two ``N x N`` products included; norms, rotary and GELU left out."""
    n, d, f = plan.n_patches, vision.hidden_size, vision.intermediate_size
    block = 2 * n * (3 * d * d + d * d + 2 * d * f + f * d) + 4 * n * n * d
    aligner = 2 * plan.n_cells * (d * vision.downsample_ratio**2 + text_hidden) * text_hidden
    return 2 * n * vision.patch_dim * d + vision.num_hidden_layers * block + aligner


def text_prefill_flops(config: ModelConfig, tokens: int) -> int:
    """2 FLOPs per active weight per row of a CED prefill (``engine.planning.accounting``):
    the encoder and boundary layers on every row, the decoder on the last window.
    Attention scores are left out (small next to the weights at a thousand tokens)."""
    from engine.planning.accounting import account

    layers = account(config).layers
    encoder = sum(a.params_active for a in layers if a.stage != "decoder")
    decoder = sum(a.params_active for a in layers if a.stage == "decoder")
    return 2 * (encoder * tokens + decoder * min(tokens, config.sliding_window))


# ---------------------------------------------------------------- text prefill


def prefill(model: DeepseekV41, n_tokens: int) -> Callable[[], None]:
    """One chunk of ``n_tokens`` random ids through the paged runner, CED on; a fresh
    sequence and pool each time (no prefix hit)."""
    config = model.config

    def once() -> None:
        layout = kv_layout(config.kv_source_layer_ids, config.compress_ratios, PAGE)
        kv, pool = open_local_kv(layout, layout.page_bytes * (n_tokens // PAGE + 8))
        runner = PagedModelRunner(model, pool, max_num_seqs=1)
        gen = torch.Generator().manual_seed(n_tokens)
        # Text ids only: below the release's image placeholder (129264).
        top = min(config.vocab_size, 120_000)
        ids = torch.randint(3, top, (n_tokens,), generator=gen).tolist()
        seq = Sequence(seq_id=0, request_id="0", token_ids=ids, num_prompt_tokens=n_tokens)
        plan = ReplayPlan.prefill(config, n_tokens, config.sliding_window, ced=True)
        seq.admit(plan, plan.decoder_start(config))
        seq.block_table = kv.allocate(0, n_tokens + 1)
        runner.execute(StepBatch(prefills=[PrefillChunk(seq, 0, n_tokens, True)]))

    return once


def load_demo() -> DeepseekV41:
    from engine.loader.checkpoint import load_checkpoint

    demo = load_checkpoint(DEMO, progress=False)[1]
    assert isinstance(demo, DeepseekV41)
    return demo.eval()


# ---------------------------------------------------------------- encode mode


def parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def measure_release(
    tower: ReleaseTower, patches: torch.Tensor, plan: ImagePlan, repeats: int, full: bool
) -> dict[str, float]:
    """``rest``, ``block`` and their sum ``encode = rest + 32 x block`` (ms); with
    ``full``, ``full``: all 32 blocks run once, the check of that sum."""
    x = tower.block_input(plan)
    parts = medians_ms(
        {"rest": lambda: tower.run_rest(patches, plan), "block": lambda: tower.run_block(x, plan)},
        repeats,
    )
    parts["encode"] = parts["rest"] + tower.vision.num_hidden_layers * parts["block"]
    if full:
        parts |= medians_ms({"full": lambda: tower.run_full(patches, plan)}, 1, warmup=0)
    return parts


def measure_size(
    size: str,
    args: argparse.Namespace,
    texts: dict[str, DeepseekV41],
    towers: dict[str, DeepseekV41],
) -> dict[str, Any]:
    """One row: an image of ``size``, each tower on it, each text model on ``T`` tokens."""
    release = VisionConfig()
    w, h = parse_size(size)
    data = synthetic_png(w, h, seed=w * 10_000 + h)
    image = process_image(data, release)
    plan, patches = image.plan, image.patches
    row: dict[str, Any] = {"size": f"{w}x{h}", "patches": plan.n_patches, "tokens": plan.tokens}
    fns: dict[str, Callable[[], object]] = {"process": lambda: process_image(data, release)}
    for name, text in texts.items():
        fns[f"prefill_{name}"] = prefill(text, plan.tokens)
    for name, model in towers.items():
        fns[f"{name}_tower"] = lambda m=model: m.encode_image(patches, plan)
    medians = medians_ms(fns, args.repeats, args.warmup)
    row |= {f"{k}_ms": round(v, 2) for k, v in medians.items()}

    def ratios(key: str, ms: float) -> None:
        for text_name in texts:
            row[f"{key}_vs_prefill_{text_name}"] = round(ms / row[f"prefill_{text_name}_ms"], 3)

    for name in towers:
        ratios(f"{name}_tower", row[f"{name}_tower_ms"])
    official = ModelConfig.official()
    official_hidden = official.hidden_size
    # The release on paper: its tower against its own text prefill of T tokens.
    vit, text = vit_flops(plan, release, official_hidden), text_prefill_flops(official, plan.tokens)
    row |= {"release_vit_gflop": round(vit / 1e9, 1), "release_prefill_gflop": round(text / 1e9, 1)}
    row["release_vit_vs_prefill_flops"] = round(vit / text, 3)
    for dtype_name in args.release_dtypes:
        tower = ReleaseTower(official_hidden, getattr(torch, dtype_name))
        key = f"release_{dtype_name}"
        full = size in args.release_full_sizes
        parts = measure_release(tower, patches, plan, args.release_repeats, full)
        row |= {f"{key}_{k}_ms": round(v, 1) for k, v in parts.items()}
        ratios(key, parts["encode"])
    print(json.dumps(row), flush=True)
    return row


def run_encode(args: argparse.Namespace) -> dict[str, Any]:
    tiny = tiny_with_tower()
    texts, towers = {"tiny": tiny}, {"tiny": tiny}
    if "demo" in args.text_models and (DEMO / "config.json").is_file():
        texts["demo"] = load_demo()
        if vision_config(texts["demo"].config) is not None:
            towers["demo"] = texts["demo"]
    # no_grad, not inference_mode: the runner's rotary cache reads tensor versions.
    with torch.no_grad():
        rows = [measure_size(size, args, texts, towers) for size in args.sizes]
    return {
        "mode": "encode",
        "towers": sorted(towers) + [f"release_{d}" for d in args.release_dtypes],
        "text_models": sorted(texts),
        "repeats": args.repeats,
        "release_repeats": args.release_repeats,
        "rows": rows,
    }


# ---------------------------------------------------------------- ttft mode


def chat_body(model: str, png: bytes, max_tokens: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def timed_chat(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """TTFT (s) of one streamed chat and its usage; an error status raises."""
    start = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{response.status_code}: {response.text[:500]}")
        for chunk in _sse(response.iter_lines()):
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if first is None and (delta.get("content") or delta.get("reasoning_content")):
                    first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": (first if first is not None else end) - start,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens", 0),
    }


def run_ttft(args: argparse.Namespace, client: httpx.Client | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = client or httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout)
    model = args.model or client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
    w, h = parse_size(args.ttft_size)
    # Seeds new to this run: no earlier run's cache holds a cold round's image.
    base = uuid.uuid4().int % (1 << 31)
    rounds = []
    for r in range(args.rounds):
        body = chat_body(model, synthetic_png(w, h, base + r), args.max_tokens)
        cold = timed_chat(client, body)
        cached = timed_chat(client, body)
        rounds.append({"cold": cold, "cached": cached})
        print(json.dumps({"round": r, **rounds[-1]}), flush=True)
    cold_s = statistics.median(x["cold"]["ttft_s"] for x in rounds)
    cached_s = statistics.median(x["cached"]["ttft_s"] for x in rounds)
    return {
        "mode": "ttft",
        "url": args.url,
        "model": model,
        "image": f"{w}x{h}",
        "rounds": rounds,
        "cold_ttft_ms": round(cold_s * 1e3, 1),
        "cached_ttft_ms": round(cached_s * 1e3, 1),
        "cached_vs_cold": round(cached_s / cold_s, 3),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["640x480", "1920x1080"])
    ap.add_argument("--repeats", type=int, default=5, help="tiny/demo towers and text prefill")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls of each first")
    ap.add_argument(
        "--text-models", nargs="*", default=["demo"], help="besides tiny: demo (models/demo)"
    )
    ap.add_argument("--release-dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--release-repeats", type=int, default=3)
    ap.add_argument(
        "--release-full-sizes", nargs="*", default=[], help="also run all 32 blocks, once"
    )
    ap.add_argument("--url", help="ttft mode: a running server's base URL")
    ap.add_argument("--api-key")
    ap.add_argument("--model", help="ttft mode: default the first of /v1/models")
    ap.add_argument("--ttft-size", default="1024x768")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", type=Path)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run_ttft(args) if args.url else run_encode(args)
    result |= {
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    out = args.out or REPO / "bench" / "results" / f"vision_{result['mode']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
