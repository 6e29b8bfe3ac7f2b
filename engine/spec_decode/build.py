"""The proposer ``--speculative-config`` names, built once at engine start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from engine.spec_decode.dspark_proposer import DraftingModel

# The release names its drafter's tensors mtp.*; a model built without them has none.
NO_DRAFTER = "this checkpoint has no DSpark drafter (mtp.*)"


def build_proposer(spec: SpeculativeConfig, model: DraftingModel | None) -> Proposer:
    """``ngram``: prompt lookup over the sequence's own tokens (``model`` unused, may be
    None); ``dspark``: the checkpoint's drafter, which ``model`` must carry (a
    ``CausalLM``, or the core's drafter host under parallel serving). Imported here,
    on demand: each proposer's module pulls in only what its method needs."""
    if spec.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer

        return NgramProposer(spec)
    if spec.method == "dspark":
        if model is None or not has_drafter(model):
            raise ValueError(NO_DRAFTER)
        from engine.spec_decode.dspark_proposer import DSparkProposer

        return DSparkProposer(model, spec, spec.min_confidence)
    raise ValueError(f"unknown speculative method {spec.method!r}")


def has_drafter(model: DraftingModel) -> bool:
    """Whether ``model`` holds DSpark blocks (its ``dspark`` drafter, loaded from mtp.*)."""
    return getattr(model, "dspark", None) is not None
