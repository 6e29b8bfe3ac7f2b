"""The demo tokenizer's image placeholder: ``<｜deepseek_image｜>`` inside its 4,864 ids.

The demo vocabulary has no free id (every id is a special token or a BPE token),
so the placeholder takes the id of a byte that UTF-8 text never contains: the
byte-level alphabet holds all 256 bytes, but 0xC0, 0xC1 and 0xF5-0xFF never
occur in valid UTF-8, so their ids are never produced by encoding a string.
The placeholder takes 0xFF's id (the alphabet's ``ÿ``), renamed in the BPE
vocabulary and listed as an added token, as make-tiny renames a placeholder of
the real tokenizer. The embedding, head and Engram class of the id are
unchanged; text tokenises exactly as before, and the text model's tensors stay
as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from engine.model.deepseek_v41.vision.config import IMAGE_TOKEN

# The byte-level alphabet's character for byte 0xFF (printable Latin-1 maps to itself).
NEVER_ENCODED_BYTE = "ÿ"


def with_image_token(tokenizer: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A copy of a ``tokenizer.json`` dict with the placeholder, and its id.

    Idempotent: a tokenizer that already has the placeholder is returned as it is.
    """
    data = json.loads(json.dumps(tokenizer))
    vocab: dict[str, int] = data["model"]["vocab"]
    for entry in data["added_tokens"]:
        if entry["content"] == IMAGE_TOKEN:
            return data, int(entry["id"])
    token_id = vocab.pop(NEVER_ENCODED_BYTE)
    vocab[IMAGE_TOKEN] = token_id
    data["added_tokens"].append(
        {
            "id": token_id,
            "content": IMAGE_TOKEN,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    )
    return data, token_id


def add_image_token(tokenizer_file: Path) -> int:
    """Rewrite ``tokenizer_file`` with the placeholder; its id."""
    data, token_id = with_image_token(json.loads(tokenizer_file.read_text(encoding="utf-8")))
    # Saved by the tokenizers library, as the text stage saved it (same layout).
    Tokenizer.from_str(json.dumps(data)).save(str(tokenizer_file))
    return token_id
