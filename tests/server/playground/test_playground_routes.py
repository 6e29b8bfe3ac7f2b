"""``GET /`` and the playground's assets, without a browser (server/playground/routes.py).

What a browser does with the page is tested in test_playground_browser.py; here: which
client gets the page and which the JSON index, the security headers, that the page has
no inline script or style for its policy to refuse, that ``--no-playground`` leaves no
page behind, that the keys still guard the API, and that the files ship in the package.
"""

from __future__ import annotations

import fnmatch
import math
import re
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from stub_engine import stub_client

from engine.model.deepseek_v41.vision.image_decode import ALLOWED_FORMATS, DEFAULT_MAX_IMAGE_BYTES
from server.playground import routes

REPO = Path(__file__).resolve().parents[3]
STATIC = REPO / "server" / "playground" / "static"
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
# The page's size as docs/playground.md states it ("under 28 KiB").
SIZE_BUDGET = 28 << 10
KEY = "sk-playground-routes"


class _Tags(HTMLParser):
    """Every start tag of a page with its attributes, and the text inside <script>/<style>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline: list[str] = []
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._open = tag if tag in ("script", "style") else None

    def handle_endtag(self, tag: str) -> None:
        self._open = None

    def handle_data(self, data: str) -> None:
        if self._open and data.strip():
            self.inline.append(f"<{self._open}>{data.strip()[:40]}")


def _tags(html: str) -> _Tags:
    parser = _Tags()
    parser.feed(html)
    return parser


@pytest.mark.parametrize(
    ("accept", "html"),
    [
        (BROWSER_ACCEPT, True),  # Chromium's and Firefox's navigation
        ("text/html", True),
        ("application/json", False),
        ("application/json, text/html;q=0.5", False),
        ("text/html;q=0.4, application/json;q=0.9", False),
        ("*/*", False),  # curl
        ("", False),  # no header
        ("text/html;q=0", False),
        ("text/html;q=oops", False),
    ],
)
def test_wants_html(accept: str, html: bool) -> None:
    assert routes.wants_html(accept) is html


def test_a_browser_gets_the_page_with_a_strict_policy() -> None:
    with stub_client() as client:
        r = client.get("/", headers={"Accept": BROWSER_ACCEPT})
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        assert r.content == (STATIC / "index.html").read_bytes()
        policy = dict(
            part.strip().split(" ", 1) for part in r.headers["content-security-policy"].split(";")
        )
        assert policy["default-src"] == "'none'"
        assert policy["script-src"] == policy["style-src"] == policy["connect-src"] == "'self'"
        assert policy["frame-ancestors"] == policy["form-action"] == "'none'"
        assert "unsafe-inline" not in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["vary"] == "Accept"
        for name, kind in routes.ASSETS.items():
            asset = client.get(routes.ASSET_PREFIX + name)
            assert asset.status_code == 200
            assert asset.headers["content-type"] == f"{kind}; charset=utf-8"
            assert asset.content == (STATIC / name).read_bytes()
            assert asset.headers["content-security-policy"] == routes.CONTENT_SECURITY_POLICY


def test_a_json_client_gets_the_index() -> None:
    with stub_client() as client:
        for accept in ("application/json", "*/*", None):
            r = client.get("/", headers={"Accept": accept} if accept else {})
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/json"
            assert r.json()["object"] == "flashserve.index"
            assert r.json()["playground"] == "/"
        # Every endpoint it lists is a route of the app (none a 404).
        paths = {getattr(route, "path", None) for route in client.app.routes}  # type: ignore[attr-defined]
        assert set(r.json()["endpoints"]) <= paths


def test_no_playground_leaves_only_the_index() -> None:
    with stub_client(playground=False) as client:
        r = client.get("/", headers={"Accept": BROWSER_ACCEPT})
        assert r.headers["content-type"] == "application/json"
        assert r.json()["playground"] is None
        for name in routes.ASSETS:
            missing = client.get(routes.ASSET_PREFIX + name)
            assert missing.status_code == 404
            assert set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_the_page_needs_no_key_and_opens_no_way_around_it() -> None:
    with stub_client(api_keys=(KEY,)) as client:
        assert client.get("/", headers={"Accept": BROWSER_ACCEPT}).status_code == 200
        assert client.get(routes.ASSET_PREFIX + "app.js").status_code == 200
        assert client.get("/v1/models").status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=auth).status_code == 200


def test_the_page_has_nothing_inline_and_only_local_assets() -> None:
    page = _tags((STATIC / "index.html").read_text())
    assert page.inline == []
    handlers = [(t, k) for t, a in page.tags for k in a if k.startswith("on") or k == "style"]
    assert handlers == []
    linked = {a.get("src") or a.get("href") for t, a in page.tags if t in ("script", "link")}
    assert linked == {routes.ASSET_PREFIX + n for n in routes.ASSETS} | {"data:,"}
    # The script never writes markup: model output goes through textContent only.
    script = re.sub(r"^\s*//.*$", "", (STATIC / "app.js").read_text(), flags=re.M)
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", script)
    assert "http://" not in script and "https://" not in script


def test_every_control_has_a_label() -> None:
    page = _tags((STATIC / "index.html").read_text())
    labelled = {a["for"] for t, a in page.tags if t == "label" and a.get("for")}
    # A checkbox inside its <label> is labelled by it (the page's check labels).
    text = (STATIC / "index.html").read_text()
    wrapped = set(re.findall(r'<label class="check"><input type="checkbox" id="([\w-]+)"', text))
    controls = [a["id"] for t, a in page.tags if t in ("input", "select", "textarea")]
    assert controls and [c for c in controls if c not in labelled | wrapped] == []


def test_the_files_ship_in_the_package_and_stay_small() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["server"]
    names = sorted(p.name for p in STATIC.iterdir())
    assert names == sorted([routes.PAGE, *routes.ASSETS])
    for name in names:
        assert any(fnmatch.fnmatch(f"playground/static/{name}", p) for p in patterns), name
    assert sum((STATIC / n).stat().st_size for n in names) < SIZE_BUDGET
    assert set(routes.load_static()) == set(names)


def test_the_image_attach_matches_what_the_server_takes() -> None:
    """The page's own checks before it sends an image: the file types the server
    decodes, its default limit per image; the button starts hidden (shown only for a
    model whose card lists images); thumbnails are data: URLs, which the policy allows."""
    page = _tags((STATIC / "index.html").read_text())
    attrs = {a["id"]: a for t, a in page.tags if a.get("id")}
    assert "hidden" in attrs["attach"] and "hidden" in attrs["attach-hint"]
    picker = attrs["image-files"]
    assert picker["type"] == "file" and "hidden" in picker and "multiple" in picker
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
    assert set(str(picker["accept"]).split(",")) == {mime[f] for f in ALLOWED_FORMATS}
    script = (STATIC / "app.js").read_text()
    types = re.search(r"const IMAGE_TYPES = \[([^\]]*)\]", script)
    assert types and set(re.findall(r'"([^"]+)"', types.group(1))) == set(mime.values())
    limit = re.search(r"const MAX_IMAGE_BYTES = ([\d *]+);", script)
    assert limit and math.prod(map(int, limit.group(1).split("*"))) == DEFAULT_MAX_IMAGE_BYTES
    policy = dict(part.strip().split(" ", 1) for part in routes.CONTENT_SECURITY_POLICY.split(";"))
    assert "data:" in policy["img-src"].split()
