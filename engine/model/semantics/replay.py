"""Which rows run which layers: the one prefill rule (docs/design/semantics.md).

A forward over the rows ``[e0, L)`` of a sequence does not run every layer on
every row. ``ReplayPlan.starts[l]`` is the first row that enters layer ``l``:
that row and every later one get layer ``l``'s SWA KV (and, at a kv source,
its compressed entries); layer ``l``'s query side, output projection and FFN
run only on rows ``>= starts[l + 1]``, the rows the next layer needs. So each
layer's rows are cut once, between its KV writes and its query side.
``starts[N]`` is the first row whose logits are computed. SWA reads of layer
``l`` start at ``starts[l]``.

Three cases, all the same rule:

- **exact** (training forward): every start is 0.
- **CED prefill, cold** (no stored prefix): the encoder (layers ``< B``) and
  layer ``B``'s KV writes on every row; layer ``B``'s query side and the
  decoder on the last ``W`` rows, ``d0 = max(0, L - W)``.
- **restore** after a prefix hit of ``H`` tokens: global KV of ``[0, H)``
  comes from the store, and the result must equal the cold prefill. A row's
  output at layer ``l`` depends on layer ``l``'s keys ``sliding_window - 1``
  rows back, so layer ``l`` must see exact inputs from
  ``starts[l + 1] - (sliding_window - 1)``: walking down from the decoder, the
  start moves back one window per layer (a triangle), never above ``H``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.deepseek_v41.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """``stored_tokens`` (H) come from the store; ``starts`` as in the module doc."""

    stored_tokens: int
    starts: tuple[int, ...]  # num_hidden_layers + 1 entries, non-decreasing

    @classmethod
    def exact(cls, config: ModelConfig) -> ReplayPlan:
        return cls(0, (0,) * (config.num_hidden_layers + 1))

    @classmethod
    def prefill(
        cls,
        config: ModelConfig,
        num_tokens: int,
        replay_tokens: int,
        *,
        stored_tokens: int = 0,
        ced: bool = True,
        need_logits: bool = True,
    ) -> ReplayPlan:
        """The plan of a prefill of ``num_tokens`` rows with ``stored_tokens`` cached.

        ``replay_tokens`` (W) is the decoder's bounded replay. ``ced=False`` is
        full depth (``--disable-ced``): cold, every layer on every row.
        ``need_logits=False`` (a prefill-only request) runs no row past layer
        B's KV writes.
        """
        L, H, W = num_tokens, stored_tokens, replay_tokens
        N, B = config.num_hidden_layers, config.ced_boundary
        assert 0 <= H <= L and W >= 1, (L, H, W)
        reach = config.sliding_window - 1  # rows an SWA read reaches back
        starts = [0] * (N + 1)
        if not need_logits:
            top, first_cut = B, H  # only layer B's global KV (rows >= H) is needed
            starts[B + 1 :] = [L] * (N - B)
        elif ced:
            d0 = max(0, L - W)
            starts[B + 1 :] = [d0] * (N - B)
            top, first_cut = B, max(0, d0 - reach)
        else:
            starts[N] = min(H, L - 1)  # the last row's logits; cold: every row's
            top, first_cut = N - 1, max(0, starts[N] - reach)
        starts[top] = min(H, first_cut)
        for l in range(top - 1, -1, -1):
            starts[l] = max(0, min(H, starts[l + 1] - reach))
        if H == L:  # every token hit (prefill-only): nothing to run
            starts = [L] * (N + 1)
        return cls(H, tuple(starts))

    @classmethod
    def every_row(cls, config: ModelConfig, stored_tokens: int = 0) -> ReplayPlan:
        """Every layer on every row (a request scoring its prompt needs every row's
        logits); global KV of ``[0, stored_tokens)`` still comes from the store."""
        return cls(stored_tokens, (0,) * (config.num_hidden_layers + 1))

    # ------------------------------------------------------------ views
    @property
    def encoder_start(self) -> int:
        """e0: the first row of the pass (where the prefill's chunks begin)."""
        return self.starts[0]

    @property
    def logits_start(self) -> int:
        return self.starts[-1]

    def decoder_start(self, config: ModelConfig) -> int:
        """d0: the first row through layer B's query side and the layers above."""
        return self.starts[config.ced_boundary + 1]

    def rows_per_layer(self, num_tokens: int) -> list[int]:
        """Rows each layer's KV writes run on (what the plan costs, layer by layer)."""
        return [num_tokens - s for s in self.starts[:-1]]
