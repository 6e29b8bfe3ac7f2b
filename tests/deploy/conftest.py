"""Fixtures of the packaging tests (helpers live in deploy_helpers.py)."""

from __future__ import annotations

import pytest
from deploy_helpers import scrape_text


@pytest.fixture(scope="session")
def scrape() -> str:
    """The /metrics text every name check reads (see ``scrape_text``)."""
    return scrape_text()
