"""Engine settings: one dataclass; its fields with a ``help`` are the engine flags of
``flashserve serve``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from engine.spec_decode.config import SpeculativeConfig

# The names of the torch dtypes. float64: exact comparisons (tests): FP4 rounding and
# top-k ties then never depend on GEMM shapes, so two processes that chunk a prompt
# differently agree bit for bit.
_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(slots=True)
class EngineConfig:
    """How the engine schedules, stores KV and runs the model (docs/design/engine.md).

    A field with a ``help`` is a flag of ``flashserve serve`` (flashserve/config_args.py
    reads the metadata); ``group`` places it in ``--help``.
    """

    max_num_seqs: int = field(default=64, metadata={"help": "sequences running at once"})
    # One row per decode, a chunk's rows per prefill.
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "rows per engine step"})
    # Encoder rows of one sequence's prefill per step.
    prefill_chunk_tokens: int = field(
        default=512, metadata={"help": "prefill rows per sequence per step"}
    )
    # A multiple of every compress ratio.
    page_tokens: int = field(default=64, metadata={"help": "tokens per KV page"})
    kv_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "device KV tier budget in bytes"}
    )
    kv_dir: str | Path | None = field(
        default=None, metadata={"help": "SSD KV tier directory (default: none)"}
    )
    kv_dir_bytes: int | None = field(
        default=None, metadata={"help": "SSD tier budget (default: unbounded)"}
    )
    # W of bounded replay; None = the model's sliding_window.
    replay_tokens: int | None = field(
        default=None, metadata={"help": "bounded-replay window (default: SWA)"}
    )
    enable_ced: bool = field(
        default=True,
        metadata={"flag": "--disable-ced", "help": "full-depth prefill instead of CED"},
    )
    kv_dtype: Literal["fp4", "bf16"] = field(
        default="fp4",
        metadata={
            "help": "global KV as stored: fp4, or bf16 for the ablation (default %(default)s)"
        },
    )
    device: str = field(default="cpu", metadata={"help": "torch device (default %(default)s)"})
    dtype: str = field(
        default="float32",
        metadata={
            "choices": _DTYPES,
            "help": "dtype of unquantised weights and of activations (float64: exact "
            "comparisons in tests)",
        },
    )
    # auto: FP8-block weights stored packed stay packed (engine/model/deepseek_v41/fp8_linear.py).
    quantization: Literal["auto", "none"] = field(
        default="auto",
        metadata={
            "help": "auto: keep the checkpoint's FP8/FP4 weights packed, activations quantised "
            "per block of 32 (the release's numerics); none: dequantise at load to --dtype"
        },
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "prompt + output cap (default: model's)"}
    )
    runner: Literal["paged", "reference"] = field(
        default="paged",
        metadata={
            "help": "reference: the dense oracle instead, for debugging (default %(default)s)"
        },
    )
    # CUDA graphs of decode steps (docs/design/cuda-graphs.md); never on CPU.
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "CUDA: run every decode step eagerly instead of replaying CUDA graphs "
            "captured at start-up for the bucketed batch sizes (docs/design/cuda-graphs.md); "
            "on cpu graphs are never used"
        },
    )
    cuda_graph_sizes: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "nargs": "+",
            "metavar": "N",
            "help": "CUDA: decode batch sizes to capture (default 1 2 4 8 16 24 ... up to "
            "--max-num-seqs); a larger batch runs eagerly; ignored on cpu",
        },
    )
    seed: int = field(
        default=0,
        metadata={"help": "tiny model weights and the sampling RNG (default %(default)s)"},
    )
    # Speculative decoding (docs/design/engine.md, "How a verify step runs and rolls
    # back"): vLLM's JSON, parsed by engine.spec_decode.config.SpeculativeConfig.
    speculative_config: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding as vLLM's JSON, e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 3}\' (methods: ngram, dspark; '
            "max_batch_size: above this many running sequences a step decodes plainly); "
            "default: off"
        },
    )
    # Parallel serving (docs/design/parallelism.md, "Workers"): T x D ranks, one
    # worker process each; the scheduler stays in the engine core. Under torchrun the
    # flags of the node fields default to its environment (flashserve/parallel_args.py).
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "group": "parallel",
            "help": "T: ranks that split each layer's query heads, o-groups and shared expert "
            "(default %(default)s)",
        },
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "group": "parallel",
            "help": "D: data-parallel attention; each sequence lives on one of D rank groups, "
            "whose KV pools add up (default %(default)s). T x D ranks in all, one worker "
            "process each",
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={
            "group": "parallel",
            "help": "shard the routed experts over all T x D ranks (EP) instead of keeping all "
            "on each",
        },
    )
    nnodes: int = field(
        default=1,
        metadata={
            "group": "parallel",
            "help": "nodes the T x D ranks spread over (default 1; torchrun's NNODES / WORLD_SIZE)",
        },
    )
    node_rank: int = field(
        default=0,
        metadata={
            "group": "parallel",
            "help": "this node (0 serves the API; default 0; torchrun's NODE_RANK / RANK)",
        },
    )
    # Node 0: torch.distributed and the step channel.
    master_addr: str = field(
        default="127.0.0.1",
        metadata={
            "group": "parallel",
            "help": "node 0's address (default MASTER_ADDR, else 127.0.0.1)",
        },
    )
    # The step channel is one above; 0 = any free port.
    master_port: int = field(
        default=0,
        metadata={
            "group": "parallel",
            "help": "torch.distributed's port on node 0; the engine core's step channel uses "
            "the next one (default MASTER_PORT, else any free port; several nodes need it)",
        },
    )
    worker_timeout_s: float = field(
        default=120.0,
        metadata={
            "group": "parallel",
            "flag": "--worker-timeout",
            "help": "seconds one step (or collective) may take on the worker ranks before "
            "serving fails (default %(default)s)",
        },
    )
    worker_threads: int | None = field(
        default=None,
        metadata={
            "group": "parallel",
            "help": "torch intra-op threads per worker rank (default: torch's, OMP_NUM_THREADS)",
        },
    )
    # Structured output (engine/structured_output/): one compilation's wall time
    # (queueing included), compiled grammars kept (LRU bytes), compilations at once.
    grammar_timeout_s: float = field(
        default=10.0,
        metadata={
            "group": "limits",
            "flag": "--grammar-timeout",
            "help": "seconds one grammar compilation may take; longer: 400 (default %(default)s)",
        },
    )
    grammar_cache_bytes: int = field(
        default=256 << 20,
        metadata={
            "group": "limits",
            "help": "compiled grammars kept, LRU, in bytes (default %(default)s)",
        },
    )
    encoder_cache_bytes: int = field(
        default=256 << 20,
        metadata={
            "group": "limits",
            "help": "vision-tower outputs kept per image content, LRU, in bytes; an image "
            "is encoded once per request across chunks and preemption (default %(default)s)",
        },
    )
    grammar_workers: int = field(
        default=2,
        metadata={"group": "limits", "help": "grammar compilations at once (default %(default)s)"},
    )
    # The issue-sized heavy schema (61 counted-repetition patterns) compiles to 34.5 MB,
    # 200 of them to 113 MB; the default admits the first with room and refuses the second.
    max_grammar_bytes: int = field(
        default=64 << 20,
        metadata={
            "group": "limits",
            "help": "bytes one compiled grammar may take; larger: 400 (default %(default)s)",
        },
    )

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_tokens",
            "page_tokens",
            "kv_cache_bytes",
            "grammar_cache_bytes",
            "encoder_cache_bytes",
            "grammar_workers",
            "max_grammar_bytes",
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
        if self.speculative_config is not None:
            self.speculative()  # a malformed JSON fails at start, not at the first step

    @property
    def world_size(self) -> int:
        """Ranks of parallel serving, T x D (1: the model runs in the engine core)."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        # Imported here: ``flashserve serve --help`` reads this module for its flags.
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: speculation off)."""
        if self.speculative_config is None:
            return None
        from engine.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config)

    def replay_window(self, sliding_window: int) -> int:
        """W: the configured replay window, or the model's sliding window."""
        return self.replay_tokens or sliding_window
