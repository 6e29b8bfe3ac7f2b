"""Fixtures of the live-API tests: one ``flashserve serve --model tiny`` for the session
(how it is started and configured: api_helpers.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from api_helpers import LiveServer, checkpoint_cache, start_server, stop_server
from tokenizers import Tokenizer


@pytest.fixture(scope="session")
def tiny_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``FLASHSERVE_CACHE`` of the test server: pytest's cache (kept between runs), or a
    temporary directory when the cache plugin is off."""
    cache = getattr(request.config, "cache", None)
    root = cache.mkdir("flashserve") if cache is not None else tmp_path_factory.mktemp("cache")
    current = checkpoint_cache(root)
    for stale in root.glob("flashserve-tiny-*"):  # checkpoints of older checkpoint code
        if stale != current:
            shutil.rmtree(stale, ignore_errors=True)
    return current


@pytest.fixture(scope="session")
def live_server(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tiny_cache, tmp_path_factory.mktemp("live-server"))
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def client(live_server: LiveServer) -> openai.OpenAI:
    return live_server.client()


@pytest.fixture(scope="session")
def vision_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """The tiny checkpoint's tokenizer and vision facts, without a server (image tests)."""
    from image_helpers import tiny_vision_tokenizer

    return tiny_vision_tokenizer(tmp_path_factory.mktemp("vision-tokenizer"))


@pytest.fixture(scope="session")
def served_tokenizer(live_server: LiveServer, tiny_cache: Path) -> Tokenizer:
    """The served checkpoint's own tokenizer (the packaged one lacks ``<｜System｜>``)."""
    from engine.loader.tokenizer import load_tokenizer

    return load_tokenizer(tiny_cache / "tiny-seed0")
