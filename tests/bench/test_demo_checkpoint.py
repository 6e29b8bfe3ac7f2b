"""The committed demo checkpoint (models/demo): loads, round-trips through the writer,
matches the code's demo config and tokenizer, keeps its greedy output, and serves 64K
tokens of context.

The pinned continuations are the trained model's greedy output under the
production semantics (CED prefill with replay W = window, FP4 global KV, FP8
SWA). The dense reference and the engine's paged runner must both produce
them: a change to the model code, the loader or the checkpoint shows up here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engine.api.errors import RequestError
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.loader.builder import engine_for_model
from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import save_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import build_compressed_vocab
from engine.model.deepseek_v41.reference import reference_generate
from server.chat.chat_encoding import encode_chat
from server.openai.protocol import ChatCompletionRequest
from training.bpe import EOS_ID, SPECIAL_TOKENS
from training.demo_config import demo_checkpoint_dir, demo_config

DEMO = demo_checkpoint_dir()
MAX_BYTES = 25 << 20
NEW_TOKENS = 8
CONTEXT = 65536  # a coding agent's ~30K-token first request plus the 32K output it asks for

COMPLETION = "<｜begin▁of▁sentence｜>To be, or not to be"
PINNED_COMPLETION = [210, 422, 316, 270, 452, 25, 210, 210]
PINNED_COMPLETION_TEXT = "\nTo be a man.\n\n"

CHAT = [{"role": "user", "content": "Who's there?"}]
PINNED_CHAT = [52, 467, 270, 452, 23, 210, 350, 23]
PINNED_CHAT_TEXT = "I am a man,\nAnd,"
# A chat reply ends with EOS (earlier demo checkpoints ran on into another speech).
PINNED_REPLY = "I am a man,\nAnd, I'll be a man."


@pytest.fixture(scope="module")
def demo():
    # Dequantised at load, as the pins were made; tests/engine/test_packed_linears.py
    # holds the packed path (the default) to this one on the demo model.
    config, model = load_checkpoint(DEMO, quantization="none")
    return config, model.eval(), load_tokenizer(DEMO)


def _chat_prompt() -> str:
    request = ChatCompletionRequest.model_validate({"model": "deepseek-chat", "messages": CHAT})
    return encode_chat(request.messages, thinking=False, reasoning_effort=75)


def _english_words(text: str) -> list[str]:
    """The text's words, asserting it is plain ASCII prose (letters, punctuation, spaces)."""
    assert re.fullmatch(r"[A-Za-z\s,.;:!?'\-]*", text), repr(text)
    words = re.findall(r"[A-Za-z']+", text)
    assert sum(len(w) >= 2 for w in words) >= 2, repr(text)
    return words


def test_checkpoint_is_small_and_matches_the_demo_config(demo) -> None:
    config, _, tokenizer = demo
    size = sum(f.stat().st_size for f in DEMO.iterdir() if f.is_file())
    assert size <= MAX_BYTES
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in DEMO.iterdir()
    }
    _, classes = build_compressed_vocab(tokenizer)
    assert config.replace(extra={}) == demo_config(tokenizer.get_vocab_size(), classes, 2)
    assert [tokenizer.token_to_id(t) for t, _ in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    # The official topology's roles, on the tiny preset's layer plan.
    tiny = ModelConfig.tiny()
    assert [config.role(l) for l in range(8)] == [tiny.role(l) for l in range(8)]


def test_context_is_64k_in_the_config_the_tokenizer_and_the_engine(demo) -> None:
    config, model, tokenizer = demo
    assert config.max_position_embeddings == CONTEXT
    tok_config = json.loads((DEMO / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tok_config["model_max_length"] == CONTEXT
    # The default KV budget (1 GiB) must hold a whole context: 534 bytes a token here.
    engine = engine_for_model(EngineConfig(max_num_seqs=1), model, tokenizer=tokenizer)
    assert engine.max_model_len == CONTEXT
    # Admission (no forward): the longest prompt with room for one token is accepted, one
    # more is refused, so the limit is the context and not the page pool.
    engine.validate(Request("longest", [5] * (CONTEXT - 1)))
    with pytest.raises(RequestError, match="no room"):
        engine.validate(Request("too-long", [5] * CONTEXT))
    # A prompt past the old 1,024-position limit is served (prefill and one decode step).
    text = "To be, or not to be, that is the question:\n" * 100
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert 1024 < len(ids) < 2048
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(Request("long", ids, params))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += [t for c in out.outputs for t in c.token_ids]
    engine.close()
    assert len(tokens) == 2


def test_save_and_reload_keeps_every_value(demo, tmp_path: Path) -> None:
    config, model, _ = demo
    save_checkpoint(model, config, tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((DEMO / "tokenizer.json").read_bytes())
    config2, model2 = load_checkpoint(tmp_path, quantization="none")
    assert config2 == config
    loaded = dict(model2.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize(
    ("prompt", "pinned", "text"),
    [
        (COMPLETION, PINNED_COMPLETION, PINNED_COMPLETION_TEXT),
        (None, PINNED_CHAT, PINNED_CHAT_TEXT),
    ],
    ids=["completion", "chat"],
)
def test_greedy_output_is_pinned(demo, prompt: str | None, pinned: list[int], text: str) -> None:
    _, model, tokenizer = demo
    ids = tokenizer.encode(prompt or _chat_prompt(), add_special_tokens=False).ids
    reference = reference_generate(model, ids, NEW_TOKENS).tokens
    assert reference == pinned
    assert tokenizer.decode(reference) == text
    _english_words(text)

    engine = engine_for_model(
        EngineConfig(kv_cache_bytes=8 << 20, max_num_seqs=1), model, tokenizer=tokenizer
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(Request("r", ids, params))
    streamed: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += [t for c in out.outputs for t in c.token_ids]
    engine.close()
    assert streamed == pinned


def test_greedy_chat_reply_ends_with_eos(demo) -> None:
    _, model, tokenizer = demo
    ids = tokenizer.encode(_chat_prompt(), add_special_tokens=False).ids
    tokens = reference_generate(model, ids, 16).tokens
    assert EOS_ID in tokens, tokenizer.decode(tokens, skip_special_tokens=False)
    reply = tokens[: tokens.index(EOS_ID)]
    assert tokenizer.decode(reply, skip_special_tokens=False) == PINNED_REPLY

    engine = engine_for_model(
        EngineConfig(kv_cache_bytes=8 << 20, max_num_seqs=1), model, tokenizer=tokenizer
    )
    engine.add_request(Request("r", ids, SamplingParams(temperature=0.0, max_tokens=32)))
    served: list[int] = []
    reasons: list[str | None] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            served += [t for c in out.outputs for t in c.token_ids]
            reasons += [c.finish_reason for c in out.outputs]
    engine.close()
    assert served[: len(reply)] == reply and reasons[-1] == "stop"


def test_serve_resolves_demo_to_the_committed_checkpoint() -> None:
    from flashserve.serve_cmd import model_path

    assert model_path("demo", 0) == DEMO
    assert model_path("some/dir", 0) == Path("some/dir")
