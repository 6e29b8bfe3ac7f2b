"""The playground in a real browser: headless Debian ``chromium`` driven by Playwright,
against ``flashserve serve --model tiny`` with an API key and prices.

One server and one browser for the module; each test opens a fresh page. Oracles
are outside the page: the server's own non-streamed answer to the same greedy
request, its /metrics (running sequences, aborts, prefix-cache hits), the cost
computed by hand from the prices, and the DOM itself (no element the model's
markup would have made). Every page must request nothing from another origin and
violate nothing of its Content-Security-Policy. A screenshot of each state lands in
build/test-artifacts/playground/ (gitignored).

Skipped, saying why, where the Python ``playwright`` package or Debian's chromium
is missing (``make setup`` as root installs both; Playwright's own browser
downloads are never used).
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

try:
    from playwright.sync_api import Browser, Page, Route, sync_playwright
except ImportError:
    pytest.skip(
        "playground browser tests skipped: the Python package playwright is not installed "
        "(it is in the test extra: make setup)",
        allow_module_level=True,
    )

from api_helpers import LiveServer, spawn_server, stop_server, wait_ready

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(
        "playground browser tests skipped: Debian's chromium is not installed "
        "(scripts/install_tools.sh installs it when run as root; make setup runs it)",
        allow_module_level=True,
    )

REPO = Path(__file__).resolve().parents[3]
ARTIFACTS = REPO / "build" / "test-artifacts" / "playground"
KEY = "sk-playground-browser"
PRICES = (0.07, 0.27, 1.10)  # cache hit, cache miss, output; per million tokens
PAGE_TOKENS = 64
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def server(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("playground")
    args = ["--model", "tiny", "--api-key", KEY, "--max-model-len", "1024"]
    args += ["--page-tokens", str(PAGE_TOKENS), "--kv-cache-bytes", str(12 << 20)]
    args += ["--quantization", "none", "--prices", ",".join(map(str, PRICES))]
    # The engine core in the API process: it starts in a few seconds where a core process
    # of its own takes several times that on a busy two-core machine. The page reaches it
    # through the same HTTP routes and the same abort-on-disconnect either way.
    args += ["--in-process-engine"]
    live = spawn_server(tiny_cache, tmp / "server.log", args)
    wait_ready(live)
    try:
        yield live
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Tab:
    """A fresh page on the server, and what it asked of the network and the policy."""

    page: Page
    base_url: str
    requests: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def sign_in(self, key: str = KEY) -> None:
        """Type the key (Tab leaves the field: the page stores it, reloads the models)."""
        self.page.get_by_label("API key").fill(key)
        self.page.get_by_label("API key").press("Tab")

    def settings(self, values: dict[str, str]) -> None:
        """Fill settings fields, each found by its label."""
        for label, value in values.items():
            self.page.get_by_label(label, exact=True).fill(value)

    def send(self, text: str) -> None:
        self.page.get_by_label("Message").fill(text)
        self.page.get_by_label("Message").press("Enter")

    def answer(self, n: int = -1):  # the n-th assistant block
        return self.page.locator("article.assistant").nth(n)

    def finished(self, n: int = -1) -> None:
        """Wait until the n-th answer has its statistics line (written when it ends)."""
        self.answer(n).locator(".stats, .error").first.wait_for(timeout=WAIT_MS)

    def stat(self, name: str, n: int = -1) -> str:
        text = self.answer(n).locator(f'[data-stat="{name}"]').inner_text()
        return text.split(" ", 1)[1] if " " in text else text


@pytest.fixture
def tab(server: LiveServer, browser: Browser) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    tab = Tab(page, server.base_url)
    origin = urlsplit(server.base_url)
    page.on("request", lambda r: tab.requests.append(r.url))
    page.on("pageerror", lambda e: tab.problems.append(f"page error: {e}"))
    page.on(
        "console",
        lambda m: tab.problems.append(m.text) if "Content Security Policy" in m.text else None,
    )
    page.goto(server.base_url + "/")
    try:
        yield tab
        # data: URLs (the icon, image thumbnails) are in the page, not fetched from anywhere.
        foreign = [u for u in tab.requests if not _same_origin(u, origin) and u[:5] != "data:"]
        assert foreign == [], "requests to another origin"
        assert tab.problems == []
    finally:
        context.close()


def _same_origin(url: str, origin) -> bool:
    parts = urlsplit(url)
    return (parts.scheme, parts.netloc) == (origin.scheme, origin.netloc)


def _api(server: LiveServer, body: dict) -> dict:
    """The server's own non-streamed answer: the oracle of what the page shows."""
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _sample(server: LiveServer, name: str, **labels: str) -> float:
    """One sample of /metrics (labels other than model_name given)."""
    total = 0.0
    for key, value in server.metrics().items():
        if key[0] == name and dict(key[1]).items() >= labels.items():
            total += value
    return total


def _eventually(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def _count_updates(page: Page) -> None:
    """Count, in the page, how often the last answer's text changes (streaming shows)."""
    page.evaluate(
        """() => {
        window.__updates = 0;
        new MutationObserver(() => { window.__updates += 1; })
          .observe(document.getElementById('log'),
                   {subtree: true, childList: true, characterData: true});
    }"""
    )


def _watch_reasoning(page: Page) -> None:
    """Record, in the page, how the reasoning block's state changed. Its streaming state
    is transient (a short answer can arrive in one read, and the block is live and
    folded within one task), so it is read from the mutation records' old values, not
    polled: ``window.__liveEnded`` when its ``live`` class went, ``__openWhenLiveEnded``
    whether it was still open then (an ``open`` change after it had an old value)."""
    page.evaluate(
        """() => {
        window.__liveEnded = false;
        window.__openWhenLiveEnded = null;
        new MutationObserver((records) => {
          for (const r of records) {
            if (!r.target.matches || !r.target.matches('details.reasoning')) continue;
            if (r.attributeName === 'class' && (r.oldValue || '').includes('live')) {
              window.__liveEnded = true;
              window.__openWhenLiveEnded = r.target.open;
            } else if (r.attributeName === 'open' && window.__liveEnded) {
              window.__openWhenLiveEnded = r.oldValue !== null;
            }
          }
        }).observe(document.getElementById('log'),
                   {subtree: true, attributes: true, attributeOldValue: true,
                    attributeFilter: ['class', 'open']});
    }"""
    )


def test_page_loads_from_this_server_only(tab: Tab, server: LiveServer) -> None:
    page = tab.page
    assert page.title() == "flashserve playground"
    # No key yet: the model list's 401 is explained, not a blank picker.
    page.get_by_role("status").filter(has_text="401").wait_for(timeout=WAIT_MS)
    assert "API key" in page.get_by_role("status").inner_text()
    assert page.evaluate("document.activeElement.id") == "prompt"  # focus starts at Message
    tab.sign_in()
    models = httpx.get(
        server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    ids = [m["id"] for m in models["data"]]
    # The attach button only where the selected (first) model's card lists images.
    takes_images = "image" in models["data"][0].get("input_modalities", [])
    # (Locator waits: wait_for_function's string predicate is an eval the policy refuses.)
    page.locator("#model option").nth(len(ids) - 1).wait_for(state="attached")
    assert page.locator("#model option").all_inner_texts() == ids
    # The key lives in this tab's session storage only: no cookie, no local storage.
    assert page.evaluate("sessionStorage.getItem('flashserve.apiKey')") == KEY
    assert page.evaluate("localStorage.length") == 0
    assert page.context.cookies() == []
    # Tab walks the controls in reading order: the message, its buttons (Stop is off
    # while nothing runs), then the settings top to bottom.
    assert page.get_by_role("button", name="Attach image").is_visible() is takes_images
    page.get_by_label("Message").focus()
    order = []
    for _ in range(13 + takes_images):
        order.append(page.evaluate("document.activeElement.id"))
        page.keyboard.press("Tab")
    assert order == [
        "prompt",
        "send",
        "clear",
        *(["attach"] if takes_images else []),
        "model",
        "api-key",
        "thinking",
        "temperature",
        "top-p",
        "max-tokens",
        "system",
        "json-mode",
        "json-schema",
        "tools",
    ]
    paths = sorted({urlsplit(u).path for u in tab.requests})
    assert paths == ["/", "/playground/app.js", "/playground/style.css", "/v1/models"]
    tab.shot("loaded")


def test_wrong_key_is_explained(tab: Tab) -> None:
    tab.sign_in("sk-wrong")
    tab.send("Hello")
    tab.finished()
    error = tab.answer().get_by_role("alert").inner_text()
    assert error.startswith("401: the server did not accept this API key")
    assert "--api-key" in error
    tab.shot("wrong-key")


def test_streamed_answer_is_the_servers_answer(tab: Tab, server: LiveServer) -> None:
    tab.sign_in()
    tab.settings({"Temperature": "0", "Max tokens": "8"})
    _count_updates(tab.page)
    tab.send("Hello there")
    tab.finished()
    shown = tab.answer().locator(".content").inner_text()
    expected = _api(
        server,
        {
            "model": tab.page.locator("#model").input_value(),
            "messages": [{"role": "user", "content": "Hello there"}],
            "temperature": 0,
            "max_tokens": 8,
            "thinking": {"type": "disabled"},
        },
    )
    assert shown == expected["choices"][0]["message"]["content"]
    usage = expected["usage"]
    assert tab.stat("prompt") == str(usage["prompt_tokens"])
    assert tab.stat("completion") == str(usage["completion_tokens"])
    assert float(tab.stat("ttft").removesuffix(" s")) > 0
    # The text arrived in pieces: more page updates than the blocks written at the end.
    assert tab.page.evaluate("window.__updates") > usage["completion_tokens"]
    # Enter sent it and emptied the field; the user's message is shown as sent.
    assert tab.page.get_by_label("Message").input_value() == ""
    assert tab.page.locator("article.user .text").inner_text() == "Hello there"
    tab.shot("answer")


def test_stop_aborts_the_request_on_the_server(tab: Tab, server: LiveServer) -> None:
    tab.sign_in()
    tab.settings({"Max tokens": "900"})
    aborts = _sample(server, "flashserve:request_success_total", finished_reason="abort")
    tab.send("Tell me a long story")
    tab.answer().locator(".content").filter(has_text=re.compile(".")).wait_for(timeout=WAIT_MS)
    assert _sample(server, "flashserve:num_requests_running") == 1
    # The button's own click event, at once: Playwright's click() first waits for the
    # button to stop moving, and a page growing with every streamed chunk on a loaded
    # machine can keep it moving until the answer has ended by itself (seen in CI).
    tab.page.get_by_role("button", name="Stop").dispatch_event("click")
    tab.finished()
    stats = tab.answer().locator(".stats, .error").first.inner_text()
    assert tab.answer().locator('[data-stat="stopped"]').count() == 1, stats
    assert _eventually(
        lambda: (
            _sample(server, "flashserve:num_requests_running") == 0
            and _sample(server, "flashserve:request_success_total", finished_reason="abort")
            == aborts + 1
        )
    ), server.metrics_text()
    assert tab.page.get_by_role("button", name="Send").is_enabled()
    tab.shot("stopped")


def test_thinking_streams_a_collapsible_reasoning_block(tab: Tab, server: LiveServer) -> None:
    tab.sign_in()
    tab.settings({"Temperature": "0", "Max tokens": "16"})
    tab.page.get_by_label("Thinking").check()
    _watch_reasoning(tab.page)
    tab.send("Think first")
    tab.finished()
    # Shown, and open, while it streamed.
    assert tab.page.evaluate("window.__liveEnded") is True
    assert tab.page.evaluate("window.__openWhenLiveEnded") is True
    expected = _api(
        server,
        {
            "model": tab.page.locator("#model").input_value(),
            "messages": [{"role": "user", "content": "Think first"}],
            "temperature": 0,
            "max_tokens": 16,
            "thinking": {"type": "enabled"},
        },
    )["choices"][0]["message"]
    reasoning = tab.answer().locator("details.reasoning")
    assert reasoning.locator(".text").text_content() == expected["reasoning_content"]
    assert tab.answer().locator(".content").inner_text() == (expected["content"] or "")
    summary = reasoning.locator("summary")
    was_open = reasoning.get_attribute("open") is not None
    summary.click()  # the reader folds or unfolds it
    assert (reasoning.get_attribute("open") is not None) is not was_open
    tab.shot("thinking-done")


def test_cached_tokens_and_cost_on_a_repeated_prompt(tab: Tab, server: LiveServer) -> None:
    tab.sign_in()
    tab.settings({"Max tokens": "2"})
    # Unique, and longer than two pages: the repeat can hit whole cached pages.
    prompt = uuid.uuid4().hex + " " + "the quick brown fox " * 40
    tab.send(prompt)
    tab.finished(0)
    assert tab.stat("cached", 0) == "0"
    hits = _sample(server, "flashserve:prefix_cache_hits_total", tier="device")
    tab.page.get_by_role("button", name="New chat").click()
    tab.send(prompt)
    tab.finished(0)
    cached = int(tab.stat("cached", 0))
    prompt_tokens = int(tab.stat("prompt", 0))
    assert cached >= 2 * PAGE_TOKENS and cached % PAGE_TOKENS == 0
    assert cached == _sample(server, "flashserve:prefix_cache_hits_total", tier="device") - hits
    completion = int(tab.stat("completion", 0))
    hit, miss, output = PRICES
    cost = (cached * hit + (prompt_tokens - cached) * miss + completion * output) / 1e6
    amount, currency = tab.stat("cost", 0).split()
    assert currency == "USD" and float(amount) == pytest.approx(cost, rel=5e-3)
    tab.shot("cached")


def _event(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
    chunk = {
        "id": "chatcmpl-crafted",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "deepseek-chat",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta else [],
        "usage": usage,
    }
    return "data: " + json.dumps(chunk) + "\n\n"


MARKUP = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> & <b>x</b>'
ARGUMENTS = '{"city": "<img src=y onerror=alert(1)>"}'
USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 5,
    "total_tokens": 15,
    "prompt_tokens_details": {"cached_tokens": 0},
    "cost": {"currency": "EUR", "total": 0.00123, "off_peak": True},
}


def test_output_is_text_and_tool_calls_are_blocks(tab: Tab) -> None:
    """Crafted SSE (the tiny model cannot be made to write markup or call a tool): the
    page shows markup as characters, a tool call as a block whose result goes back as a
    tool message, and sends the settings' options in the request."""
    bodies: list[dict] = []

    def reply(route: Route) -> None:
        bodies.append(route.request.post_data_json)
        if len(bodies) == 1:
            events = [
                _event({"role": "assistant", "content": ""}),
                _event({"reasoning_content": "<i>hmm</i>"}),
                _event({"content": MARKUP[:20]}),
                _event({"content": MARKUP[20:]}),
                _event(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            }
                        ]
                    }
                ),
                _event({"tool_calls": [{"index": 0, "function": {"arguments": ARGUMENTS}}]}),
                _event({}, usage=USAGE),
            ]
        else:
            events = [_event({"content": "Sunny."}), _event({}, usage=USAGE)]
        body = "".join(events) + "data: [DONE]\n\n"
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page = tab.page
    page.route("**/v1/chat/completions", reply)
    tab.sign_in()
    tab.settings({"Temperature": "0.5", "Top-p": "0.9", "Max tokens": "64"})
    page.get_by_label("JSON-schema mode").check()
    page.get_by_label("Tools (a JSON list of functions)").fill(
        '[{"name": "get_weather", "parameters": {"type": "object"}}]'
    )
    page.get_by_label("Message").fill("line one")
    page.get_by_label("Message").press("Shift+Enter")  # a new line, not a send
    page.get_by_label("Message").type("line two")
    assert bodies == []
    page.get_by_label("Message").press("Enter")
    tab.finished()
    answer = tab.answer()
    assert answer.locator(".content").inner_text() == MARKUP
    # Folded once the answer began (text_content: the text of a closed <details> too).
    reasoning = answer.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None
    assert reasoning.locator(".text").text_content() == "<i>hmm</i>"
    assert page.locator("#log img, #log script, #log b, #log i").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert answer.locator(".tool-head").inner_text() == "Tool call: get_weather (call_1)"
    assert answer.locator(".tool-call pre").inner_text() == ARGUMENTS
    assert tab.stat("cost") == "0.00123 EUR (off-peak)"
    first = bodies[0]
    assert first["messages"] == [{"role": "user", "content": "line one\nline two"}]
    assert (first["temperature"], first["top_p"], first["max_tokens"]) == (0.5, 0.9, 64)
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["response_format"]["type"] == "json_schema"
    assert first["response_format"]["json_schema"]["schema"]["required"] == ["answer"]
    assert first["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    tab.shot("markup-and-tool-call")
    # The call's result, typed under it, goes back as a tool message; Send continues.
    answer.get_by_label("Result of get_weather").fill("<b>22 C</b>")
    answer.get_by_role("button", name="Add result").click()
    assert page.locator("article.tool .text").inner_text() == "<b>22 C</b>"
    page.get_by_role("button", name="Send").click()
    tab.finished()
    assert tab.answer().locator(".content").inner_text() == "Sunny."
    second = bodies[1]["messages"]
    assert second[1] == {
        "role": "assistant",
        "content": MARKUP,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ARGUMENTS},
            }
        ],
    }
    assert second[2] == {"role": "tool", "tool_call_id": "call_1", "content": "<b>22 C</b>"}
    assert page.locator("#log b").count() == 0
    tab.shot("tool-result")


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def _images_for(page: Page, ids: set[str] | None = None) -> None:
    """Answer /v1/models with the server's own cards, images in the ``input_modalities``
    of those in ``ids`` (all when None) and text only in the others': the page's
    switch, whatever the engine takes."""

    def reply(route: Route) -> None:
        cards = route.fetch().json()
        for card in cards["data"]:
            takes = ids is None or card["id"] in ids
            card["input_modalities"] = ["text", "image"] if takes else ["text"]
        route.fulfill(json=cards)

    page.route("**/v1/models", reply)


# Hands files to the page as a paste or a drop would (the test cannot reach the OS's
# clipboard or drag a file in from outside the browser): [name, type, base64 bytes].
_GIVE_FILES = """([kind, files]) => {
    const dt = new DataTransfer();
    for (const [name, type, b64] of files) {
      const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
      dt.items.add(new File([bytes], name, {type}));
    }
    const target = document.getElementById(kind === 'paste' ? 'prompt' : 'composer');
    const init = {bubbles: true, cancelable: true};
    target.dispatchEvent(kind === 'paste'
      ? new ClipboardEvent('paste', {...init, clipboardData: dt})
      : new DragEvent('drop', {...init, dataTransfer: dt}));
}"""


def _give(page: Page, kind: str, *files: tuple[str, str, bytes]) -> None:
    payload = [[name, mime, base64.b64encode(data).decode()] for name, mime, data in files]
    page.evaluate(_GIVE_FILES, [kind, payload])


def test_attached_images_go_as_data_url_parts_in_order(tab: Tab) -> None:
    """An image from the button, one pasted, one dropped: thumbnails in the composer,
    then one user message whose content is the text and the three image_url parts in
    the order they were added, each the file's bytes as a data: URL (the oracle: the
    bytes base64-encoded here); the images stay in the history of the next turn."""
    bodies: list[dict] = []

    def reply(route: Route) -> None:
        bodies.append(route.request.post_data_json)
        body = _event({"content": "A red square."}) + _event({}, usage=USAGE) + "data: [DONE]\n\n"
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page = tab.page
    _images_for(page)
    page.route("**/v1/chat/completions", reply)
    tab.sign_in()
    attach = page.get_by_role("button", name="Attach image")
    attach.wait_for()
    red, green, blue = _png(6, 4, (255, 0, 0)), _png(3, 5, (0, 255, 0)), _png(2, 2, (0, 0, 255))
    with page.expect_file_chooser() as chooser:
        attach.click()
    chooser.value.set_files([{"name": "red.png", "mimeType": "image/png", "buffer": red}])
    thumbs = page.locator("#attachments img.thumb")
    thumbs.nth(0).wait_for()
    _give(page, "paste", ("green.png", "image/png", green))
    thumbs.nth(1).wait_for()
    _give(page, "drop", ("blue.png", "image/png", blue), ("extra.png", "image/png", blue))
    thumbs.nth(3).wait_for()
    page.get_by_role("button", name="Remove extra.png").click()  # changed my mind
    assert thumbs.count() == 3
    # Rendered, not broken: each decoded to its pixel size (the policy let data: in).
    sizes = thumbs.evaluate_all("(imgs) => imgs.map((i) => [i.naturalWidth, i.naturalHeight])")
    assert sizes == [[6, 4], [3, 5], [2, 2]]
    assert thumbs.evaluate_all("(imgs) => imgs.map((i) => i.alt)") == [
        "red.png",
        "green.png",
        "blue.png",
    ]
    tab.shot("images-attached")
    tab.send("What colour is it?")
    tab.finished()
    url = "data:image/png;base64,{}".format
    parts = [
        {"type": "image_url", "image_url": {"url": url(base64.b64encode(b).decode())}}
        for b in (red, green, blue)
    ]
    user = {"role": "user", "content": [{"type": "text", "text": "What colour is it?"}, *parts]}
    assert bodies[0]["messages"] == [user]
    # Sent: the composer is empty again, and the message shows the images it carried.
    assert thumbs.count() == 0
    shown = page.locator("article.user img.thumb")
    assert shown.evaluate_all("(imgs) => imgs.map((i) => i.naturalWidth)") == [6, 3, 2]
    assert page.locator("article.user .text").inner_text() == "What colour is it?"
    tab.shot("images-sent")
    # An image alone is a message too; the first turn's images stay in the history.
    _give(page, "paste", ("green.png", "image/png", green))
    thumbs.nth(0).wait_for()
    page.get_by_role("button", name="Send").click()
    tab.finished()
    second = bodies[1]["messages"]
    assert second[0] == user
    assert second[1] == {"role": "assistant", "content": "A red square."}
    assert second[2] == {"role": "user", "content": [parts[1]]}


def test_images_the_page_refuses(tab: Tab, server: LiveServer) -> None:
    """Checked in the page before anything is sent, each with a visible message: a
    file over the server's limit per image, a file that is not an image it decodes,
    and any image for a model whose card does not list images (no button either)."""
    page = tab.page
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url) if "chat/completions" in r.url else None)
    cards = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    names = [card["id"] for card in cards.json()["data"]]
    _images_for(page, {names[0]})  # the first name (the page's pick) takes images
    tab.sign_in()
    attach = page.get_by_role("button", name="Attach image")
    attach.wait_for()
    status = page.get_by_role("status")
    # One byte over 20 MiB, made in the page (no need to move 20 MiB through the driver).
    page.evaluate(
        """() => {
        const dt = new DataTransfer();
        dt.items.add(new File([new Uint8Array(20 * 1048576 + 1)], 'big.png', {type: 'image/png'}));
        document.getElementById('composer').dispatchEvent(
          new DragEvent('drop', {bubbles: true, cancelable: true, dataTransfer: dt}));
    }"""
    )
    assert status.inner_text() == (
        "big.png is 20.0 MiB, over the server's limit of 20.0 MiB per image."
    )
    assert "error" in (status.get_attribute("class") or "")
    _give(page, "drop", ("notes.txt", "text/plain", b"hello"))
    assert status.inner_text() == "notes.txt: not a PNG, JPEG, WebP or GIF image."
    assert page.locator("#attachments img").count() == 0
    tab.shot("image-refused")
    # The other names' cards do not list images: the button goes, a paste is refused.
    page.locator("#model").select_option(names[1])
    assert attach.is_hidden()
    _give(page, "paste", ("red.png", "image/png", _png(2, 2, (255, 0, 0))))
    assert status.inner_text() == f"{names[1]} does not take images."
    assert page.locator("#attachments img").count() == 0
    assert requests == []
