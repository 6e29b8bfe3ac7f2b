"""Piecewise graphs of the decode step, one set per bucketed batch size.

docs/design/cuda-graphs.md has the why. In short: a decode step's attention
side (SWA rings, compressor groups, page tables, the indexer's top-k over a
context of any length) is built on the host per step, so it runs eagerly; the
row-wise work between two layers' attentions (mHC, norms, projections, RoPE,
the MoE, the head) depends only on the row count, and is captured once per
bucket. A step of ``n`` decode rows runs on the smallest bucket ``b >= n``:
rows ``n..b`` are padding (token 0 at position 0, zero attention output), and
every captured operation is row-wise, so padding never reaches a real row.
A verify step (decodes carrying speculative drafts) is the same: its ``n`` is
the sum of ``k + 1`` over its sequences, and the eager attention side runs each
verify chunk as the eager forward does (``max_step_rows`` sizes the buckets).
A drafter that reads layer inputs gets them at the piece boundaries, where the
eager side runs (``forward``'s ``layer_input``), since a replay calls no hook.

Pieces (``L`` layers, ``L + 1`` graphs per bucket):

- piece 0: embedding, then layer 0's pre-attention;
- piece ``l`` (1..L-1): layer ``l - 1``'s post-attention (``project_out``,
  mHC mix, FFN mHC, MoE), then layer ``l``'s pre-attention (Engram's gate on
  rows looked up eagerly, mHC coefficients, attention norm, ``project_kv``,
  the compressor projection, ``project_q``, the index queries);
- piece ``L``: the last post-attention, final norm and head.

They talk through ``StaticSlots``: one buffer per named tensor at the largest
bucket's size, each bucket's graphs on its leading rows, so every bucket reads
and writes the same memory and the eager parts copy in and out of it.

The pieces restate ``Block.forward`` split at its attention calls (a thin
wrapper over the blocks' own modules, not a second model); the tests hold the
two to the same outputs, so a change of the block that is not made here too fails.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.base import CausalLM
from engine.model.deepseek_v41.attention import Selections
from engine.model.deepseek_v41.mhc import hc_collapse, hc_initial_pre, hc_mix
from engine.model.deepseek_v41.rope import clear_cos_sin_cache
from engine.model.deepseek_v41.routed_experts import static_expert_shapes
from engine.model.precision import upcast
from engine.runner.graph_capture import CudaGraphBackend, Graph, GraphBackend, HostSyncError
from engine.runner.paged_backend import PagedKV
from kernels import act_memo, cpu_native

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every 8 up to 256, then every 16.
_SMALL = (1, 2, 4)


def max_step_rows(
    max_num_seqs: int,
    num_speculative_tokens: int = 0,
    max_batch_size: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> int:
    """The most rows a decode-only step can run: one per sequence, and with speculation
    up to ``K + 1`` per sequence while at most ``max_batch_size`` run (above it nobody
    drafts), the drafts' rows within the step's ``max_num_batched_tokens``
    (engine/core/speculation.py shares that budget out). The default buckets go up to
    it, so every verify step the engine can schedule has one, as every decode batch does."""
    if num_speculative_tokens <= 0:
        return max_num_seqs
    drafting = min(max_num_seqs, max_batch_size or max_num_seqs)
    verify = drafting * (num_speculative_tokens + 1)
    if max_num_batched_tokens is not None:
        verify = min(verify, max(max_num_batched_tokens, drafting))
    return max(max_num_seqs, verify)


def default_capture_sizes(max_rows: int) -> list[int]:
    """vLLM-like buckets up to ``max_rows``, which is always one (every step fits)."""
    sizes = [s for s in _SMALL if s <= max_rows]
    sizes += list(range(8, min(max_rows, 256) + 1, 8))
    sizes += list(range(272, max_rows + 1, 16))
    return sorted(set(sizes) | {max_rows})


def capture_sizes(max_rows: int, sizes: Seq[int] | None = None) -> list[int]:
    """The buckets to capture: ``sizes`` (``--cuda-graph-sizes``) or the defaults,
    sorted, without duplicates, none above ``max_rows`` (``max_step_rows``)."""
    if sizes is None:
        return default_capture_sizes(max_rows)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"cuda graph sizes must be positive integers, got {list(sizes)}")
    kept = sorted({s for s in sizes if s <= max_rows})
    if not kept:
        raise ValueError(
            f"no cuda graph size {sorted(sizes)} is <= {max_rows}, the most rows of a decode "
            "step (max_num_seqs, times K + 1 with speculation)"
        )
    return kept


def bucket_for(rows: int, sizes: Seq[int]) -> int | None:
    """The smallest bucket holding ``rows`` (``sizes`` sorted), None when none does."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


@dataclass
class StaticSlots:
    """Named buffers of ``max_rows`` rows; a bucket of ``b`` rows uses ``[:b]`` of each.

    A buffer is made by the first ``put`` of its name (the largest bucket's
    warm-up, outside any capture) and keeps its trailing shape and dtype.
    """

    max_rows: int
    device: torch.device
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, name: str, rows: int) -> torch.Tensor:
        return self.buffers[name][:rows]

    def put(self, name: str, value: torch.Tensor) -> None:
        """Write ``value`` [b, ...] into the leading rows of ``name``'s buffer."""
        buf = self.buffers.get(name)
        if buf is None:
            buf = torch.zeros(
                (self.max_rows, *value.shape[1:]), dtype=value.dtype, device=self.device
            )
            self.buffers[name] = buf
        elif buf.shape[1:] != value.shape[1:] or buf.dtype != value.dtype:
            raise ValueError(
                f"slot {name!r}: {tuple(value.shape[1:])} {value.dtype}, "
                f"holds {tuple(buf.shape[1:])} {buf.dtype}"
            )
        dst = buf[: value.shape[0]]
        if dst.data_ptr() != value.data_ptr():
            dst.copy_(value)

    def fill(self, name: str, bucket: int, value: torch.Tensor) -> None:
        """Eager input: ``value``'s rows first, zeros up to ``bucket`` (no stale row stays)."""
        buf = self.buffers[name]
        n = value.shape[0]
        buf[:n].copy_(value)
        buf[n:bucket].zero_()


class DecodeGraphs:
    """Captured pieces of a decode step for each bucket, and the step that runs them."""

    def __init__(
        self,
        model: CausalLM,
        sizes: Seq[int],
        backend: GraphBackend,
        device: torch.device,
        layer_inputs: bool = False,
    ) -> None:
        if model.encoder_only:
            raise ValueError("an encoder-only model has no decode step to capture")
        self.model = model
        self.config = model.config
        self.sizes = sorted(sizes)
        self.backend = backend
        self.device = torch.device(device)
        self.slots = StaticSlots(max(self.sizes), self.device)
        self.graphs: dict[int, list[Graph]] = {}
        self.capture_seconds = 0.0
        self.steps = 0  # decode steps run through graphs
        self.verify_steps = 0  # those of them with a verify chunk
        self.padded_rows = 0  # padding rows those steps computed
        self._engram_layers = [b.layer_id for b in model.blocks if b.engram is not None]
        # A drafter reads layer inputs (``forward``'s ``layer_input``): then the pieces
        # also keep each Engram layer's input from before its gate; otherwise no step
        # pays for that copy.
        self.layer_inputs = layer_inputs

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    # ------------------------------------------------------------ capture
    def capture(self) -> float:
        """Capture every bucket, largest first (its warm-up makes the slots); seconds taken."""
        t0 = time.perf_counter()
        rows, dtype, device = self.max_rows, self.model.embed.weight.dtype, self.device
        # The eager inputs' slots; the pieces' own outputs get theirs in the first warm-up.
        self.slots.put("ids", torch.zeros(rows, dtype=torch.long, device=device))
        self.slots.put("pos", torch.zeros(rows, dtype=torch.long, device=device))
        for l in self._engram_layers:
            engram = self.model.block(l).engram
            assert engram is not None
            shape = (rows, engram.n_columns, self.config.engram_head_dim)
            self.slots.put(f"engram{l}", torch.zeros(shape, dtype=dtype, device=device))
        attn = self.model.block(0).attn
        shape = (rows, attn.n_heads, self.config.head_dim)
        self.slots.put("o", torch.zeros(shape, dtype=dtype, device=device))
        # A captured GEMM quantises its own replay's input (no memo entry from the
        # warm-up), and a piece holds tensor ops only (no C call on raw pointers).
        with act_memo.suspended(), cpu_native.suspended():
            self._capture_buckets()
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def _capture_buckets(self) -> None:
        for b in sorted(self.sizes, reverse=True):
            graphs = []
            for piece in range(len(self.model.layers) + 1):
                fn = _Piece(self, piece, b)
                clear_cos_sin_cache()  # no piece may read another's (or the warm-up's) angles
                self.backend.warmup(fn)
                clear_cos_sin_cache()
                graphs.append(self.backend.capture(fn, self._static_memory()))
                clear_cos_sin_cache()
            self.graphs[b] = graphs

    def _static_memory(self) -> list[torch.Tensor]:
        """What a piece may read besides its own results and the model's tensors: the
        slots, and the kernels' lookup tables (made once per device, never evicted)."""
        from kernels import kv_formats, moe_ops

        tables = list(kv_formats._INDEX_KEY_TABLES.values())
        tables += [t for pair in moe_ops._TABLES.values() for t in pair]
        return [*self.slots.buffers.values(), *tables]

    # ------------------------------------------------------------ pieces
    def pre_attention(self, layer_id: int, b: int, R: torch.Tensor, pre: torch.Tensor) -> None:
        """Layer ``layer_id`` up to its attention's backend calls; results into the slots."""
        s = self.slots
        block = self.model.block(layer_id)
        attn = block.attn
        pos = s.get("pos", b)
        if block.engram is not None:
            if self.layer_inputs:
                # The block's input before Engram's gate, which the slot ``R`` no longer
                # holds: what a drafter reading this layer gets (``block_input``).
                s.put("R_in", R)
            image = self._image_rows(b)
            live = None if image is None else ~image
            R = block.engram.apply_rows(R, s.get(f"engram{layer_id}", b), live)
        pre_a, post_a, comb_a = block.hc_attn(R)
        x = block.attn_norm(hc_collapse(R, pre))
        s.put("R", R)
        s.put("pre_a", pre_a)
        s.put("post_a", post_a)
        s.put("comb_a", comb_a)
        s.put("x", x)
        s.put("kv", attn.project_kv(x, pos))
        if attn.compressor is not None:
            s.put(f"raw{attn.compressor.ratio}", attn.compressor.project(x))
        q, qr = attn.project_q(x, pos)
        s.put("q", q)
        if attn.picks_own:
            assert attn.indexer is not None
            qi, w = attn.indexer.queries(qr, x, pos)
            s.put("qi", qi)
            s.put("w", w)

    def post_attention(self, layer_id: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id`` from its attention output (slot ``o``) on: (R, pre) of the next."""
        s = self.slots
        block = self.model.block(layer_id)
        R = s.get("R", b)
        y = block.attn.project_out(s.get("o", b), s.get("pos", b))
        R = hc_mix(R, y, s.get("post_a", b), s.get("comb_a", b))
        pre_f, post_f, comb_f = block.hc_ffn(R)
        x = block.ffn_norm(hc_collapse(R, s.get("pre_a", b)))
        return hc_mix(R, block.ffn(x, self._image_rows(b)), post_f, comb_f), pre_f

    def _image_rows(self, b: int) -> torch.Tensor | None:
        """Rows whose token is the image placeholder (as the eager forward decides them),
        from the captured ids slot: a mask op in the graph, no host sync."""
        image_id = self.model.image_token_id
        return None if image_id is None else self.slots.get("ids", b) == image_id

    def run_piece(self, piece: int, b: int) -> None:
        model, hc = self.model, self.config.hc_mult
        with torch.no_grad(), static_expert_shapes():
            if piece == 0:
                ids = self.slots.get("ids", b)
                R = model.embed(ids).unsqueeze(1).expand(-1, hc, -1).contiguous()
                pre = hc_initial_pre(b, hc, R.device)
            else:
                R, pre = self.post_attention(piece - 1, b)
            if piece < len(model.layers):
                self.pre_attention(piece, b, R, pre)
                return
            h = model.norm(hc_collapse(R, pre))
            self.slots.put("logits", F.linear(upcast(h), upcast(model.head.weight, h)))

    def block_input(self, layer_id: int, n: int) -> torch.Tensor:
        """Layer ``layer_id``'s input ``R`` [n, hc, D] (what ``Block.forward`` receives),
        between its pre-attention piece and the next: a view of a slot, valid until the
        next replay."""
        if not self.layer_inputs:
            raise ValueError("decode graphs captured without layer_inputs keep no layer input")
        engram = self.model.block(layer_id).engram is not None
        return self.slots.get("R_in" if engram else "R", n)

    # ------------------------------------------------------------ a step
    def fits(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows and bool(self.graphs)

    @torch.no_grad()
    def forward(
        self, kv: PagedKV, layer_input: Callable[[int, torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """fp32 logits [n, vocab] of a decode-only step's ``n`` rows: one per plain decode,
        ``k + 1`` per verify chunk (the eager forward's ``logit_rows`` of such a step are
        all its rows, in order). The pieces are row-wise, so a verify chunk's rows need
        only their own ids, positions and Engram rows, filled below from ``kv`` as for a
        decode; the eager attention side reads its windows, groups and undo from ``kv``'s
        segments exactly as the eager forward does.

        ``layer_input(l, R)``: called with each layer's input rows (``block_input``)
        before its attention, for a drafter that reads them (a replay calls no hook)."""
        n = kv.positions.shape[0]
        b = bucket_for(n, self.sizes)
        if b is None or b not in self.graphs:
            raise ValueError(f"{n} decode rows: no captured bucket (sizes {self.sizes})")
        model, s = self.model, self.slots
        s.fill("ids", b, kv.input_ids())
        s.fill("pos", b, kv.positions)
        if self._engram_layers:
            windows = kv.token_windows(self.config.engram_max_ngram_size)
            for l in self._engram_layers:
                engram = model.block(l).engram
                assert engram is not None
                rows = engram.lookup(model.engram_window_rows(windows, l))
                s.fill(f"engram{l}", b, rows.to(s.buffers[f"engram{l}"].dtype))
        graphs = self.graphs[b]
        graphs[0].replay()
        sel = Selections()
        for l in range(len(model.layers)):
            if layer_input is not None:
                layer_input(l, self.block_input(l, n))
            s.fill("o", b, self._attention(l, n, kv, sel))
            graphs[l + 1].replay()
        self.steps += 1
        self.verify_steps += any(seg.verify for seg in kv.segments)
        self.padded_rows += b - n
        return s.get("logits", n).clone()

    def _attention(self, layer_id: int, n: int, kv: PagedKV, sel: Selections) -> torch.Tensor:
        """Layer ``layer_id``'s eager part on the real rows: KV writes, selection, attention."""
        s = self.slots
        attn = self.model.block(layer_id).attn
        x = s.get("x", n)
        raw = s.get(f"raw{attn.compressor.ratio}", n) if attn.compressor is not None else None
        attn.store_projected(s.get("kv", n), raw, x.dtype, kv)
        if kv.keep_rows(layer_id) is not None:
            raise RuntimeError("a decode step cut rows: graphs hold decode-only steps")
        queries = (s.get("qi", n), s.get("w", n)) if attn.picks_own else None
        return attn.attend_projected(s.get("q", n), queries, kv, sel)


class _Piece:
    """``DecodeGraphs.run_piece(piece, b)`` as the zero-argument callable a backend captures."""

    def __init__(self, graphs: DecodeGraphs, piece: int, b: int) -> None:
        self.graphs, self.piece, self.b = graphs, piece, b

    def __call__(self) -> None:
        self.graphs.run_piece(self.piece, self.b)


def decode_graphs_for(
    model: CausalLM,
    device: str | torch.device,
    max_rows: int,
    *,
    enforce_eager: bool,
    sizes: Seq[int] | None = None,
    layer_inputs: bool = False,
) -> DecodeGraphs | None:
    """Captured decode graphs when they apply: a CUDA device, not ``--enforce-eager``,
    a decoder model on one rank. None otherwise (the eager forward runs every step).
    ``max_rows``: the most rows of a decode-only step (``max_step_rows``), the buckets' cap;
    ``layer_inputs``: a drafter will read layer inputs (``DecodeGraphs.layer_inputs``)."""
    device = torch.device(device)
    if enforce_eager or device.type != "cuda" or model.encoder_only:
        return None
    p = model.parallel
    if p.tp_size > 1 or p.ep_size > 1:
        logger.info("CUDA graphs: not captured under tensor/expert parallelism; decode is eager")
        return None
    buckets = capture_sizes(max_rows, sizes)
    graphs = DecodeGraphs(model, buckets, CudaGraphBackend(device), device, layer_inputs)
    try:
        seconds = graphs.capture()
    except (HostSyncError, RuntimeError) as exc:
        # A piece that cannot be captured (a sync inside a kernel wrapper, an
        # unsupported op) must not stop the server: it serves eagerly, and says why.
        logger.error("CUDA graphs: capture failed, every decode step runs eagerly: %s", exc)
        torch.cuda.synchronize(device)
        return None
    logger.warning(
        "CUDA graphs: captured %d decode pieces for %d batch sizes (%s) in %.1f s; "
        "--enforce-eager turns them off",
        len(model.layers) + 1,
        len(buckets),
        ", ".join(map(str, buckets)),
        seconds,
    )
    return graphs
