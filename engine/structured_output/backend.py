"""What the engine asks of a grammar backend, and what the sampler asks of a matcher.

A request carries a ``StructuredOutputSpec`` (plain data); the engine hands it
to its ``GrammarBackend`` when the request arrives and gets a ``GrammarJob``
back at once: the compilation runs in the backend's own threads, never on the
step loop. Each step the engine polls the jobs of requests still waiting;
only those requests wait, every other stream keeps decoding. A job that is
ready gives one ``TokenMaskProvider`` per sequence (its parse state).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.api.sampling_params import StructuredOutputSpec


class TokenMaskProvider(Protocol):
    """Constrains one sequence's next token (a grammar matcher, e.g. xgrammar's).

    One provider per sequence: it holds that sequence's parse state. The sampler
    only calls ``allowed_tokens``; the engine, appending the sampled token to the
    sequence, calls ``accept`` (so rejected or discarded tokens never advance it)
    and finishes the sequence once ``is_terminated``.
    """

    def allowed_tokens(self) -> torch.Tensor | None:
        """Allowed next tokens: bool ``[V']`` or an int32 bitmask ``[ceil(V'/32)]``.

        Bit ``j`` of word ``i`` allows token ``32 i + j`` (xgrammar's layout).
        Tokens at or beyond ``V'`` are disallowed. ``None``: no constraint now.
        """
        ...

    def accept(self, token_id: int) -> None:
        """Advance the parse state past ``token_id``."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete; the sequence must end."""
        ...


class GrammarJob(Protocol):
    """One request's grammar on its way."""

    def ready(self, now: float) -> bool:
        """Compiled (True) or still compiling (False); raises ``GrammarError`` when the
        grammar cannot be built or is late (``now`` on ``time.monotonic``'s clock)."""
        ...

    def matcher(self) -> TokenMaskProvider:
        """A fresh matcher for one sequence, past the spec's prefix (once ``ready``);
        raises ``GrammarError`` if the prefix does not fit."""
        ...

    def cancel(self) -> None:
        """The request left: drop the compilation if it has not started."""
        ...

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds or until the compilation ends."""
        ...


class GrammarBackend(Protocol):
    def submit(self, spec: StructuredOutputSpec) -> GrammarJob:
        """Start compiling ``spec``; returns at once."""
        ...

    def warm(self) -> None:
        """Prepare what every spec needs (the vocabulary view), in the background."""
        ...

    def close(self) -> None: ...
