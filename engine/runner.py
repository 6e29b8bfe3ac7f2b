"""Temporary alias of ``engine.step`` (the step types moved there); delete once no
module imports ``engine.runner``."""

from engine.step import ModelRunner, PrefillChunk, StepBatch

__all__ = ["ModelRunner", "PrefillChunk", "StepBatch"]
