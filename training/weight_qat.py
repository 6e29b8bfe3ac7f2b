"""Quantisation-aware training of the weights the checkpoint stores quantised.

``save_checkpoint`` writes block FP8, MXFP4 experts, FP8 Engram rows and BF16;
the served model is the dequantised result. Inside ``quantised_weights`` each
such parameter holds exactly what the loader will give back (the writer's
encoder, then the loader's decoder), so the forward and backward see the
served weights; on exit the full-precision master weights return and the
optimizer applies the gradients to them (a straight-through estimator).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from engine.loader.checkpoint_writer import encode_tensor
from engine.loader.formats import dequantize
from engine.model.deepseek_v41.weight_names import WEIGHTS
from engine.model.weights import WeightFormat, scale_name


def served_value(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` after a trip through the checkpoint: what ``load_checkpoint`` returns for it."""
    fmt = WEIGHTS.format_of(name)
    stored = encode_tensor(name, value, WEIGHTS)
    if fmt is None or not fmt.quantised:
        return stored[name].to(value.dtype)
    return dequantize(fmt, stored[name], stored[scale_name(name)], value.dtype)


def lossy(name: str) -> bool:
    """Parameters whose stored form is not their fp32 value."""
    fmt = WEIGHTS.format_of(name)
    return fmt is not None and fmt is not WeightFormat.FP32


@contextmanager
def quantised_weights(model: nn.Module) -> Iterator[None]:
    """Swap every lossy parameter for its served value; restore the masters on exit."""
    masters: dict[str, torch.Tensor] = {}
    # state_dict: the checkpoint's names, one routed expert at a time (views of
    # the stacked expert parameters), so each is quantised as it is stored.
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, p in params.items():
            if lossy(name):
                masters[name] = p.detach().clone()
                p.copy_(served_value(name, p))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, master in masters.items():
                params[name].copy_(master)
