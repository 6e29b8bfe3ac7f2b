"""bench/vision.py at its smallest: what it times is the tower it names, its rows carry
the plan's token counts, and its TTFT mode sends the chat it says (a mocked server)."""

from __future__ import annotations

import base64
import copy
import io
import json
import statistics
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from bench import vision as bench
from engine.model.deepseek_v41.vision.config import VisionConfig
from engine.model.deepseek_v41.vision.image_processor import process_image
from engine.model.deepseek_v41.vision.vit import VisionTransformer


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float64 rounding (one code path's sums against another's)."""
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-12 * (1 + b.abs().max()))


def test_the_release_tower_in_parts_is_the_tower() -> None:
    """``run_full`` (what ``--release-full-sizes`` times, and what ``rest + 32 x block``
    stands for) is the ViT + aligner: against a ``VisionTransformer`` whose blocks are
    copies of the one block, with the same patch embedding and final norm (a second
    code path: the model's own module), on a small config."""
    # min_pixels 1: the 70x56 image stays 5x4 patches (the release's would upscale it).
    vision = VisionConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, min_pixels=1)
    tower = bench.ReleaseTower(24, torch.float64, seed=3, vision=vision)
    whole = VisionTransformer(vision).double()
    whole.patch_embed.load_state_dict(tower.rest.patch_embed.state_dict())
    whole.norm.load_state_dict(tower.rest.norm.state_dict())
    for block in whole.blocks:
        block.load_state_dict(tower.block.state_dict())
    image = process_image(bench.synthetic_png(70, 56, seed=1), vision)
    patches, plan = image.patches.double(), image.plan
    assert (plan.n_vit_h, plan.n_vit_w) == (4, 5)
    hw = (plan.n_vit_h, plan.n_vit_w)
    with torch.no_grad():
        expected = tower.aligner(whole(patches, *hw), *hw)
        assert _close(tower.run_full(patches, plan), expected)
        # ``rest`` is everything but the blocks: the same with the blocks taken out.
        no_blocks = copy.deepcopy(whole)
        no_blocks.blocks = torch.nn.ModuleList()
        rest = tower.aligner(no_blocks(patches, *hw), *hw)
        assert _close(tower.run_rest(patches, plan), rest)


def test_vit_flops_on_paper_match_torchs_count() -> None:
    """The paper count against torch's own FLOP counter (a second code path) on the
    tower the bench runs, at a small config: every matmul and the attention's two."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    vision = VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, min_pixels=1)
    tower = bench.ReleaseTower(24, torch.float32, vision=vision)
    image = process_image(bench.synthetic_png(70, 56, seed=2), vision)
    counter = FlopCounterMode(display=False)
    # The math kernel: the counter sees its two products (it has no formula for the
    # fused CPU attention kernel the tower takes otherwise).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        tower.run_full(image.patches, image.plan)
    assert counter.get_total_flops() == bench.vit_flops(image.plan, vision, 24)


@pytest.mark.slow  # builds the tiny model and prefills 194 tokens: ~30 s on the busy 2-core VM
def test_encode_rows_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "vision.json"
    argv = ["--sizes", "20x16", "--repeats", "1", "--warmup", "0"]
    argv += ["--text-models", "--release-dtypes"]
    argv += ["--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert bench.main(argv) == 0  # sets one thread, as a benchmark run does
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    # The hand-counted cost of a 20x16 image (upscaled to min_pixels).
    assert (row["size"], row["tokens"]) == ("20x16", 194)
    assert row["process_ms"] > 0 and row["tiny_tower_ms"] > 0
    for text in result["text_models"]:
        ratio = row["tiny_tower_ms"] / row[f"prefill_{text}_ms"]
        assert row[f"tiny_tower_vs_prefill_{text}"] == pytest.approx(ratio, abs=1e-3)
    assert result["text_models"] == ["tiny"] and result["threads"] == 1
    assert row["release_vit_gflop"] > 0 and row["release_prefill_gflop"] > 0


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


def test_ttft_sends_one_image_cold_then_the_same_again() -> None:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "deepseek-flash"}]})
        bodies.append(json.loads(request.content))
        cached = 512 if len(bodies) % 2 == 0 else 0
        usage = {"prompt_tokens": 520, "prompt_tokens_details": {"cached_tokens": cached}}
        delta = {"choices": [{"index": 0, "delta": {"content": "A"}}]}
        body = _sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            delta,
            {
                "choices": [],
                "usage": usage,
            },
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = httpx.Client(base_url="http://bench.test", transport=httpx.MockTransport(handler))
    args = bench.parser().parse_args(["--url", "http://bench.test", "--rounds", "2"])
    result = bench.run_ttft(args, client)
    assert len(bodies) == 4 and bodies[0] == bodies[1] and bodies[2] == bodies[3]
    assert bodies[0] != bodies[2]  # each round's cold request has an image new to the server
    for body in bodies:
        assert body["model"] == "deepseek-flash" and body["stream"] is True
        (message,) = body["messages"]
        text, part = message["content"]
        assert text == {"type": "text", "text": bench.QUESTION}
        url = part["image_url"]["url"]
        assert part["type"] == "image_url" and url.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert (image.format, image.size) == ("PNG", (1024, 768))
    assert [r["cold"]["cached_tokens"] for r in result["rounds"]] == [0, 0]
    assert [r["cached"]["cached_tokens"] for r in result["rounds"]] == [512, 512]
    assert result["rounds"][0]["cold"]["prompt_tokens"] == 520
    assert result["cold_ttft_ms"] > 0
    # The ratio of the unrounded medians (the reported ms are rounded to 0.1 ms,
    # which at a 20 ms TTFT moves their quotient by more than the ratio's rounding).
    cold = statistics.median(r["cold"]["ttft_s"] for r in result["rounds"])
    cached = statistics.median(r["cached"]["ttft_s"] for r in result["rounds"])
    assert result["cached_vs_cold"] == pytest.approx(cached / cold, abs=6e-4)


def test_ttft_reports_a_refused_image() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        error = {"message": "this model does not take images", "type": "invalid_request_error"}
        return httpx.Response(400, json={"error": error})

    client = httpx.Client(base_url="http://bench.test", transport=httpx.MockTransport(handler))
    args = bench.parser().parse_args(["--url", "http://bench.test", "--model", "m"])
    with pytest.raises(RuntimeError, match=r"400: .*does not take images"):
        bench.run_ttft(args, client)
