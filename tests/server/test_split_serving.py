"""Disaggregated serving with real processes on loopback: router, prefill and decode
workers sharing one SSD-tier directory, next to a colocated server.

Every server computes in float64 (``--dtype float64``) so that FP4 rounding and
top-k choices cannot depend on how each process chunks a prompt: outputs of
the same plan then agree token for token. A restore equals the cold prefill
(docs/design/semantics.md), so the colocated server's answer, cold or from its
cache, is the oracle of a split request and of a fallback alike.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from api_helpers import API_KEY, LiveServer, Samples, spawn_server, stop_server, wait_ready

from engine.model.deepseek_v41.config import ModelConfig
from kvstore.device.layout import kv_layout
from kvstore.ssd.page_file import CHECKSUM_BYTES, HEADER_BYTES
from server.disagg.handover import HANDOVER_HEADER, Handover

PAGE_TOKENS = 64
COMMON = ["--model", "tiny", "--dtype", "float64", "--api-key", API_KEY, "--max-model-len", "1024"]
COMMON += ["--page-tokens", str(PAGE_TOKENS), "--kv-cache-bytes", str(24 << 20)]
# Four engines on two cores: one thread each keeps them from fighting over both.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass(slots=True)
class Split:
    router: LiveServer
    prefill: LiveServer
    decode: LiveServer
    colocated: LiveServer
    kv_dir: Path


def _router_args(prefill: LiveServer, decode: LiveServer) -> list[str]:
    urls = ["--prefill-url", prefill.base_url, "--decode-url", decode.base_url]
    return ["--role", "router", "--api-key", API_KEY, *urls]


def _worker_args(role: str, kv_dir: Path, *extra: str) -> list[str]:
    return [*COMMON, "--role", role, "--kv-dir", str(kv_dir), *extra]


def _start(cache: Path, tmp: Path, name: str, args: list[str], env=None) -> LiveServer:
    return spawn_server(cache, tmp / f"{name}.log", args, env)


@pytest.fixture(scope="module")
def split(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    tmp = tmp_path_factory.mktemp("split")
    kv = tmp / "kv"
    workers = [
        _start(tiny_cache, tmp, "prefill", _worker_args("prefill", kv), ONE_THREAD),
        _start(tiny_cache, tmp, "decode", _worker_args("decode", kv), ONE_THREAD),
        _start(tiny_cache, tmp, "colocated", [*COMMON, "--kv-dir", str(tmp / "kv-co")], ONE_THREAD),
    ]
    router = None
    try:
        for w in workers:
            wait_ready(w)
        prefill, decode, colocated = workers
        router = _start(tiny_cache, tmp, "router", _router_args(prefill, decode))
        wait_ready(router)
        yield Split(router, prefill, decode, colocated, kv)
    finally:
        for w in [*workers, router]:
            if w is not None:
                stop_server(w)


def _text(n_words: int, seed: int) -> str:
    words = ["river", "stone", "lantern", "orbit", "meadow", "copper", "signal", "harbor"]
    return " ".join(words[(i * 7 + seed * 3 + i // 5) % len(words)] for i in range(n_words))


def _chat_body(text: str, **kw) -> dict:
    return {
        "model": "deepseek-flash",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "thinking": {"type": "disabled"},
        **kw,
    }


def _chat(server: LiveServer, text: str, **kw) -> tuple[str, int]:
    reply = server.post("/v1/chat/completions", _chat_body(text, **kw))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_cache_hit_tokens"]


def _delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _expected_handover_bytes_per_token() -> float:
    """Global KV bytes per token of the tiny layout, plus each page file's header and checksum."""
    c = ModelConfig.tiny()
    layout = kv_layout(c.kv_source_layer_ids, c.compress_ratios, PAGE_TOKENS, "fp4")
    return (layout.page_bytes + HEADER_BYTES + CHECKSUM_BYTES) / PAGE_TOKENS


def test_split_answers_equal_the_colocated_answers_from_cache(split: Split) -> None:
    for n_words, seed in ((120, 1), (260, 2)):
        text = _text(n_words, seed)
        cold = _chat(split.colocated, text)  # its pages go into the colocated cache
        warm = _chat(split.colocated, text)
        first = _chat(split.router, text)
        again = _chat(split.router, text)
        assert warm[1] > 0 and first[0] == warm[0] == cold[0]
        # Usage is the topology's no more than the answer is: pages the prefill
        # worker computed for this request are no cache hit, pages cached anywhere are.
        assert first[1] == cold[1] == 0
        assert again == warm


def test_a_streamed_split_answer_is_the_same_answer(split: Split) -> None:
    text = _text(150, 3)
    _chat(split.colocated, text)
    expected, _ = _chat(split.colocated, text)
    body = _chat_body(text, stream=True)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    content = ""
    with httpx.stream(
        "POST",
        split.router.base_url + "/v1/chat/completions",
        json=body,
        headers=headers,
        timeout=120,
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content += choice["delta"].get("content") or ""
    assert content == expected


def test_split_completions_with_two_prompts(split: Split) -> None:
    body = {
        "model": "deepseek-flash",
        "prompt": [_text(100, 4), _text(140, 5)],
        "max_tokens": 6,
        "temperature": 0,
    }
    split.colocated.post("/v1/completions", body)
    expected = split.colocated.post("/v1/completions", body).json()
    got = split.router.post("/v1/completions", body).json()
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in expected["choices"]]
    assert expected["usage"]["prompt_cache_hit_tokens"] > 0
    assert got["usage"]["prompt_cache_hit_tokens"] == 0  # the prefill worker computed them
    again = split.router.post("/v1/completions", body).json()
    assert again["usage"] == expected["usage"]


def test_bytes_handed_over_are_the_global_kv_bytes_per_token(split: Split) -> None:
    text = _text(300, 6)
    before = {s: getattr(split, s).metrics() for s in ("prefill", "decode", "router")}
    files_before = set(split.kv_dir.rglob("*.kvp"))
    _chat(split.router, text)
    after = {s: getattr(split, s).metrics() for s in ("prefill", "decode", "router")}
    new_files = set(split.kv_dir.rglob("*.kvp")) - files_before

    # Tokens the decode worker restored from the SSD tier: the handed-over pages.
    hit = _delta(
        after["decode"], before["decode"], "flashserve:prefix_cache_hits_total", tier="ssd"
    )
    pages = int(hit) // PAGE_TOKENS
    assert pages >= 4 and hit % PAGE_TOKENS == 0
    published = _delta(
        after["prefill"], before["prefill"], "flashserve:disagg_published_bytes_total"
    )
    handed = _delta(after["decode"], before["decode"], "flashserve:disagg_handover_bytes_sum")
    assert _delta(after["decode"], before["decode"], "flashserve:disagg_handover_bytes_count") == 1
    # Every byte the decode worker read is a page file the prefill worker wrote for it.
    assert len(new_files) == pages and handed == sum(f.stat().st_size for f in new_files)
    assert published == handed
    assert handed / hit == pytest.approx(_expected_handover_bytes_per_token(), abs=1e-9)
    latency = _delta(after["decode"], before["decode"], "flashserve:disagg_handover_seconds_sum")
    assert 0 <= latency < 5
    assert _delta(after["router"], before["router"], "flashserve:disagg_prefill_seconds_count") == 1
    # The decode worker's TTFT counts from the router's arrival: the prefill call is in it.
    ttft = "flashserve:time_to_first_token_seconds_sum"
    prefill_call = _delta(
        after["router"], before["router"], "flashserve:disagg_prefill_seconds_sum"
    )
    assert _delta(after["decode"], before["decode"], ttft) > prefill_call > 0
    for reason in ("prefill_timeout", "prefill_error", "missing_pages"):
        for name in ("router", "decode"):
            assert (
                _delta(
                    after[name], before[name], "flashserve:disagg_fallbacks_total", reason=reason
                )
                == 0
            )


def test_a_corrupted_published_page_falls_back_to_a_full_prefill(split: Split) -> None:
    text = _text(200, 7)
    cold, _ = _chat(split.colocated, text)
    files_before = set(split.kv_dir.rglob("*.kvp"))
    reply = split.prefill.post("/internal/prefill/chat", _chat_body(text))
    assert reply.status_code == 200, reply.text
    (prompt,) = reply.json()["prompts"]
    new_files = sorted(set(split.kv_dir.rglob("*.kvp")) - files_before)
    assert len(new_files) == prompt["published_pages"] >= 3
    for path in new_files:  # a flipped payload byte in every page of the chain
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + 100] ^= 0x10
        path.write_bytes(raw)

    before = split.decode.metrics()
    handover = Handover((prompt["published_pages"],), reply.json()["published_at"])
    answer = httpx.post(
        split.decode.base_url + "/v1/chat/completions",
        json=_chat_body(text),
        headers={"Authorization": f"Bearer {API_KEY}", HANDOVER_HEADER: handover.header()},
        timeout=120,
    )
    after = split.decode.metrics()
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_cache_hit_tokens"] == 0
    assert answer.json()["choices"][0]["message"]["content"] == cold
    assert _delta(after, before, "flashserve:disagg_fallbacks_total", reason="missing_pages") == 1
    assert _delta(after, before, "flashserve:kv_ssd_checksum_failures_total") >= 1


def test_a_prefill_worker_killed_mid_request_falls_back(
    split: Split, tiny_cache: Path, tmp_path: Path
) -> None:
    # A prefill worker of its own, slowed down by small chunks, and a router to it.
    slow = _worker_args("prefill", split.kv_dir, "--prefill-chunk-tokens", "8")
    victim = _start(tiny_cache, tmp_path, "victim", slow, ONE_THREAD)
    router = None
    try:
        wait_ready(victim)
        router = _start(tiny_cache, tmp_path, "router2", _router_args(victim, split.decode))
        wait_ready(router)
        _a_router_that_gives_up_aborts_the_prefill(victim, split.kv_dir)
        text = _text(600, 8)
        cold, _ = _chat(split.colocated, text)

        result: dict = {}
        request = threading.Thread(target=lambda: result.update(answer=_chat(router, text)))
        request.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the victim's engine has started the prefill
            running = victim.metrics().get(("flashserve:num_requests_running", ()), 0)
            if running >= 1:
                break
            time.sleep(0.02)
        assert victim.proc is not None
        os.killpg(victim.proc.pid, signal.SIGKILL)
        request.join(120)
        assert not request.is_alive(), "the request hung after its prefill worker died"
        content, hit = result["answer"]
        assert hit == 0 and content == cold  # nothing was published: a full prefill
        fallbacks = router.metrics()
        assert fallbacks[("flashserve:disagg_fallbacks_total", (("reason", "prefill_error"),))] == 1
    finally:
        stop_server(victim)
        if router is not None:
            stop_server(router)


def _a_router_that_gives_up_aborts_the_prefill(victim: LiveServer, kv_dir: Path) -> None:
    """A caller that stops waiting (a router's timeout) aborts the worker's prefill:
    it is counted as an abort, stops running, and publishes nothing."""
    abort = ("flashserve:request_success_total", (("finished_reason", "abort"),))
    running = ("flashserve:num_requests_running", ())
    before, files = victim.metrics(), set(kv_dir.rglob("*.kvp"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            victim.base_url + "/internal/prefill/chat",
            json=_chat_body(_text(600, 9)),
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(60, read=0.5),
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = victim.metrics()
        if now.get(abort, 0) - before.get(abort, 0) == 1 and now.get(running, 0) == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the prefill worker did not abort the abandoned prefill")
    assert set(kv_dir.rglob("*.kvp")) == files


def test_split_fill_in_the_middle(split: Split) -> None:
    body = {"model": "deepseek-flash", "prompt": _text(120, 10), "suffix": " end", "max_tokens": 5}
    body["temperature"] = 0
    split.colocated.post("/beta/completions", body)
    expected = split.colocated.post("/beta/completions", body).json()
    before = split.decode.metrics()
    got = split.router.post("/beta/completions", body).json()
    after = split.decode.metrics()
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]
    # Handed over through the prefill worker's FIM route, not computed as a fallback.
    assert _delta(after, before, "flashserve:disagg_handover_bytes_count") == 1
    assert _delta(after, before, "flashserve:disagg_handover_bytes_sum") > 0
    assert got["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"] > 64
