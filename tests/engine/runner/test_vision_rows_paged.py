"""Image positions through the paged runner: the same logits as the dense oracle.

The rules for image rows (the router's ``bias_vl``, Engram's dead positions) are
decided from the token ids of the rows in flight and their windows, which each
backend supplies its own way; a prompt with an image span, prefilled in chunks
that cut the span, then decoded, must match ``reference.forward`` (float64).
"""

from __future__ import annotations

import pytest
import torch

from engine.core.sequence import Sequence
from engine.core.step import PrefillChunk, StepBatch
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import ReplayPlan, forward
from engine.model.deepseek_v41.vision.config import VisionConfig, with_vision
from engine.runner.model_runner import PagedModelRunner
from kvstore.device.layout import kv_layout
from kvstore.local import open_local_kv

PAGE = 16
IMG = 128_900


@pytest.fixture(scope="module")
def vision_model64(tiny_model) -> DeepseekV41:
    """The session's tiny weights with a vision tower and a random ``bias_vl``."""
    config = with_vision(tiny_model.config, VisionConfig.tiny(), token_id=IMG)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(0))
    missing = model.load_state_dict(tiny_model.state_dict(), strict=False).missing_keys
    assert missing and all(n.startswith(("vision.", "aligner.", "image_")) for n in missing)
    model.set_compressed_vocab(tiny_model.engram_vocab_map)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.gate.bias_vl.copy_(torch.randn(config.n_routed_experts, generator=g))
    return model.double().eval()


def _run_paged(model: DeepseekV41, tokens: list[int], chunk: int, steps: int) -> list[torch.Tensor]:
    config = model.config
    layout = kv_layout(config.kv_source_layer_ids, config.compress_ratios, page_tokens=PAGE)
    kv, pages = open_local_kv(layout, layout.page_bytes * 64)
    runner = PagedModelRunner(model, pages, max_num_seqs=2)
    seq = Sequence(seq_id=1, request_id="1", token_ids=list(tokens), num_prompt_tokens=len(tokens))
    replay = ReplayPlan.prefill(config, len(tokens), config.sliding_window)
    seq.admit(replay, replay.decoder_start(config))
    seq.block_table = kv.allocate(1, len(tokens) + steps + 1)
    start, logits = seq.encoder_start, None
    while start < seq.prefill_end:
        end = min(start + chunk, seq.prefill_end)
        batch = StepBatch(prefills=[PrefillChunk(seq, start, end, end == seq.prefill_end)])
        logits = runner.execute(batch).get(1, logits)
        start = end
    out = []
    for step in range(steps):
        plan = ReplayPlan(seq.stored_tokens, seq.layer_starts)
        ref = forward(model, torch.tensor(seq.token_ids), plan).logits[-1]
        torch.testing.assert_close(logits, ref, atol=1e-6, rtol=0)
        out.append(ref)
        # The last decode step feeds the placeholder id itself: a decode row can be one.
        seq.token_ids.append(IMG if step == steps - 2 else int(torch.argmax(ref)))
        logits = runner.execute(StepBatch(decodes=[seq]))[1]
    return out


def test_image_span_prefill_and_decode_match_the_oracle(vision_model64) -> None:
    tokens = torch.randint(3, 120_000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    tokens[9:27] = [IMG] * 18  # cut by the 7-row chunks at 14, 21
    got = _run_paged(vision_model64, tokens, 7, 3)
    # The image rules matter here: a model that knows no image id answers otherwise.
    text = DeepseekV41(vision_model64.config)
    text.load_state_dict(vision_model64.state_dict())
    text.set_compressed_vocab(vision_model64.engram_vocab_map)
    text = text.double().eval()
    text.image_token_id = None
    plain = forward(text, torch.tensor(tokens), ReplayPlan.prefill(text.config, 40, 16)).logits[-1]
    assert (plain - got[0]).abs().max() > 1e-3
