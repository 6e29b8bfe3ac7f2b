"""What a stage on top of the demo checkpoint writes: its tensors, its config, its record.

A stage (the vision tower, the DSpark drafter) trains a part beside the frozen
text model, then writes a checkpoint that is the input's other tensors byte for
byte plus the part's own, the config with the part's fields, and ``training.json``
with the stage's record under its name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader.files import SINGLE_FILE
from training.demo import TRAINING_FILE


def replace_tensors(
    in_dir: Path, out_dir: Path, prefixes: tuple[str, ...], tensors: dict[str, torch.Tensor]
) -> None:
    """``out_dir``'s weights: ``in_dir``'s, less the names under ``prefixes``, plus ``tensors``
    (the file's metadata kept)."""
    with safe_open(str(in_dir / SINGLE_FILE), "pt") as f:
        kept = {
            name: f.get_tensor(name)
            for name in f.keys()  # noqa: SIM118 (safe_open is not iterable)
            if not name.startswith(prefixes)
        }
        metadata = f.metadata()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(kept | tensors, str(out_dir / SINGLE_FILE), metadata=metadata)


def record_stage(in_dir: Path, out_dir: Path, stage: str, record: dict[str, Any]) -> None:
    """``out_dir``'s ``training.json``: ``in_dir``'s, with ``record`` under ``stage``."""
    training = json.loads((in_dir / TRAINING_FILE).read_text(encoding="utf-8"))
    training[stage] = record
    with open(out_dir / TRAINING_FILE, "w", encoding="utf-8") as f:
        json.dump(training, f, indent=1)
        f.write("\n")
