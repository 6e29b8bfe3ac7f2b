"""``load_drafter``: the engine core's drafter under parallel serving (the DSpark
stages, the target's embedding and head, nothing else). Oracle: the same tensors
as ``load_checkpoint`` gives the whole model, packed and dequantised alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader.checkpoint import load_checkpoint, load_drafter
from engine.loader.checkpoint_writer import make_tiny
from engine.loader.files import SINGLE_FILE


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-drafter"))


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_the_drafter_holds_the_whole_models_drafter_tensors(
    tiny_dir: Path, quantization: str
) -> None:
    _, model = load_checkpoint(tiny_dir, quantization=quantization)
    host = load_drafter(tiny_dir, quantization=quantization)
    assert host is not None and host.mtp is not None
    whole = model.state_dict()
    own = host.state_dict()
    assert {n.split(".")[0] for n in own} == {"embed", "head", "mtp"}
    assert set(own) <= set(whole)
    for name, value in own.items():
        assert value.dtype == whole[name].dtype, name
        assert torch.equal(value.view(torch.uint8), whole[name].view(torch.uint8)), name


def test_a_checkpoint_without_a_drafter_gives_none(tiny_dir: Path, tmp_path: Path) -> None:
    with safe_open(str(tiny_dir / SINGLE_FILE), "pt") as f:
        kept = {n: f.get_tensor(n) for n in f.keys() if not n.startswith("mtp.")}  # noqa: SIM118
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_dir / name).exists():
            (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    save_file(kept, str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})
    assert load_drafter(tmp_path) is None
