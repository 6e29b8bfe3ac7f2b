"""Engine settings: one dataclass, one field per command-line flag of ``flashserve serve``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    # Exact comparisons (tests): FP4 rounding and top-k ties then never depend on
    # GEMM shapes, so two processes that chunk a prompt differently agree bit for bit.
    "float64": torch.float64,
}


@dataclass(slots=True)
class EngineConfig:
    """How the engine schedules, stores KV and runs the model (docs/design/engine.md)."""

    max_num_seqs: int = 64  # sequences admitted at once (running)
    max_num_batched_tokens: int = 2048  # rows charged per step: one per decode, chunk rows
    prefill_chunk_tokens: int = 512  # encoder rows of one sequence's prefill per step
    page_tokens: int = 64  # tokens per KV page (a multiple of every compress ratio)
    kv_cache_bytes: int = 1 << 30  # device tier budget
    kv_dir: str | Path | None = None  # SSD tier directory; None = no persistent tier
    kv_dir_bytes: int | None = None  # SSD tier budget; None = unbounded
    replay_tokens: int | None = None  # W of bounded replay; None = the model's sliding_window
    enable_ced: bool = True  # False = full-depth prefill (--disable-ced)
    kv_dtype: Literal["fp4", "bf16"] = "fp4"  # stored global KV; bf16 is the ablation
    device: str = "cpu"
    dtype: str = "float32"  # dtype of unquantised weights and of activations
    # auto: FP8-block weights stored packed stay packed (engine/model/deepseek_v41/fp8_linear.py);
    # none: every weight dequantised at load to ``dtype``.
    quantization: Literal["auto", "none"] = "auto"
    max_model_len: int | None = None  # prompt + output cap; None = the model's max positions
    runner: Literal["paged", "reference"] = "paged"  # reference = dense oracle (debugging)
    seed: int = 0  # weights of the random tiny model; global sampling RNG
    # CUDA graphs of decode steps (docs/design/cuda-graphs.md); never on CPU.
    enforce_eager: bool = False  # True: no graphs (--enforce-eager)
    cuda_graph_sizes: tuple[int, ...] | None = None  # buckets; None = 1, 2, 4, 8, 16, ...
    # Parallel serving (docs/design/parallelism.md, "Workers"): T x D ranks, one
    # worker process each; the scheduler stays in the engine core.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # DP attention: each sequence lives on one DP rank
    enable_expert_parallel: bool = False  # routed experts sharded over all T x D ranks
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # node 0: torch.distributed and the step channel
    master_port: int = 0  # torch.distributed's port, the step channel one above; 0 = any free
    worker_timeout_s: float = 120.0  # one step (and each collective) at most; then it fails
    worker_threads: int | None = None  # torch threads per worker; None = torch's default
    # Structured output (engine/structured_output/): one compilation's wall time
    # (queueing included; longer: a 400), compiled grammars kept (LRU bytes), and
    # compilations at once.
    grammar_timeout_s: float = 10.0
    grammar_cache_bytes: int = 256 << 20
    grammar_workers: int = 2

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_tokens",
            "page_tokens",
            "kv_cache_bytes",
            "grammar_cache_bytes",
            "grammar_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.replay_tokens is not None and self.replay_tokens < 1:
            raise ValueError("EngineConfig.replay_tokens must be >= 1 (or None)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("EngineConfig.max_model_len must be >= 2 (or None)")
        if not self.grammar_timeout_s > 0:
            raise ValueError("EngineConfig.grammar_timeout_s must be > 0")
        if self.kv_dtype not in ("fp4", "bf16"):
            raise ValueError(f"EngineConfig.kv_dtype must be 'fp4' or 'bf16', got {self.kv_dtype}")
        if self.quantization not in ("auto", "none"):
            raise ValueError(
                f"EngineConfig.quantization must be 'auto' or 'none', got {self.quantization}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)}")
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = tuple(self.cuda_graph_sizes)
            if not self.cuda_graph_sizes or any(s < 1 for s in self.cuda_graph_sizes):
                raise ValueError(
                    "EngineConfig.cuda_graph_sizes must be positive integers, "
                    f"got {list(self.cuda_graph_sizes)}"
                )
        if self.runner not in ("paged", "reference"):
            raise ValueError(
                f"EngineConfig.runner must be 'paged' or 'reference', got {self.runner}"
            )

        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"EngineConfig.node_rank {self.node_rank} of {self.nnodes} nodes")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"{self.world_size} ranks (tensor x data parallel) do not split over "
                f"{self.nnodes} nodes"
            )
        if self.enable_expert_parallel and self.world_size == 1:
            raise ValueError("expert parallelism needs more than one rank")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("several nodes need a --master-port they all know")

    @property
    def world_size(self) -> int:
        """Ranks of parallel serving, T x D (1: the model runs in the engine core)."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def replay_window(self, sliding_window: int) -> int:
        """W: the configured replay window, or the model's sliding window."""
        return self.replay_tokens or sliding_window
