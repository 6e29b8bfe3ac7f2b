"""One rank of parallel serving: its share of the model, its KV pages, one forward per step.

Started by the engine core (``engine/parallel/executor.py``) or, on the other nodes of a
multi-node deployment, by ``flashserve serve --node-rank N``, as
``python -m engine.parallel.worker SPEC`` (a msgpack ``WorkerSpec``, hex). It joins the
torch.distributed group (gloo on CPU, NCCL on CUDA), loads this rank's TP/EP
share of the checkpoint (``load_checkpoint(parallel=)``), holds a page tensor
of the core's layout and its own SWA rings, and connects to the core's step
socket. Per ``StepWork`` it mirrors the step's sequences, runs
``PagedModelRunner.execute`` on them (the same code as one process) and
answers ``StepDone``; a DP rank with no rows of its own joins the MoE layers'
collectives with none (``DeepseekV41.idle_layers``). A verifying decode's drafts
are appended to its mirrored tokens for the step and taken off after it: the
mirror holds the committed tokens only, as the core's sampler decides them.

A worker exits when the core says ``Stop``, when its connection to the core
drops (the core died), when its parent process is gone, or when a step fails
(a peer died: the collective raised or timed out).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import zmq

from engine.parallel import worker_protocol as wire

logger = logging.getLogger(__name__)

_POLL_MS = 200


def _device(spec: wire.WorkerSpec) -> str:
    if spec.device.startswith("cuda") and ":" not in spec.device:
        return f"cuda:{spec.local_rank}"
    return spec.device


def _load(spec: wire.WorkerSpec, device: str):
    import torch

    from engine.loader.checkpoint import load_checkpoint, set_engram_vocab
    from engine.loader.tokenizer import TOKENIZER_FILE, packaged_tokenizer_path
    from engine.model.parallel import world_parallel

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(spec.dtype)
    dtype = dtype or {"float16": torch.float16, "float64": torch.float64}[spec.dtype]
    parallel = world_parallel(spec.tensor_parallel_size, spec.expert_parallel)
    path = Path(spec.model)
    _, net = load_checkpoint(
        path,
        dtype=dtype,
        device=device,
        quantization=spec.quantization,
        parallel=parallel,
    )
    if dtype == torch.float64:
        net = net.double()
    if not (path / TOKENIZER_FILE).is_file():
        set_engram_vocab(net, net.config, packaged_tokenizer_path())
    return net.eval()


TIME_COLLECTIVES_ENV = "FLASHSERVE_TIME_COLLECTIVES"
_COMM = [0.0]  # seconds inside torch.distributed collectives, when timed


def _time_collectives() -> None:
    """Wrap the collectives the model calls with a wall-clock timer (benchmarks: the
    communication share of a step, waiting for the slower rank included)."""
    import torch.distributed as dist

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _COMM[0] += time.perf_counter() - t0

        return call

    for name in ("all_reduce", "all_gather", "all_to_all_single"):
        setattr(dist, name, timed(getattr(dist, name)))


class _Rank:
    """The model, the runner and the mirrored sequences of one rank."""

    def __init__(self, spec: wire.WorkerSpec, device: str) -> None:
        from engine.runner.model_runner import PagedModelRunner
        from kvstore.device.device_pool import DevicePool, require_pages
        from kvstore.device.layout import kv_layout

        self.spec = spec
        self.model = _load(spec, device)
        mc = self.model.config
        layout = kv_layout(
            mc.kv_source_layer_ids,
            mc.compress_ratios,
            spec.page_tokens,
            spec.kv_dtype,  # type: ignore[arg-type]
            spec.model_id,
        )
        # The rank's page bytes; which page holds what is the core's bookkeeping.
        self.pages = DevicePool(layout, require_pages(layout, spec.kv_cache_bytes), device)
        self.runner = PagedModelRunner(
            self.model,
            self.pages,
            spec.max_num_seqs,
            encoder_cache_bytes=spec.encoder_cache_bytes,
        )
        self.seqs: dict = {}
        self.leader = spec.rank % spec.tensor_parallel_size == 0

    def step(self, work: wire.StepWork) -> wire.StepDone:
        import torch

        from engine.api.image_wire import image_of
        from engine.core.sequence import Sequence
        from engine.core.step import PrefillChunk, StepBatch

        # Fetch before restoring: a committed page may be evicted and restored into
        # by this step's allocations (docs/design/parallelism.md, "The SSD tier").
        fetched = self.pages.copy_out(work.fetch) if self.leader else []
        self.pages.copy_in(work.restore)
        for seq_id in work.released:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.runner.release(seq)
        for st in work.seqs:
            seq = self.seqs.get(st.seq_id)
            if seq is None:
                seq = Sequence(st.seq_id, "", [], st.num_prompt_tokens)
                seq.images = tuple(image_of(i) for i in st.images)
                self.seqs[st.seq_id] = seq
            if len(seq.token_ids) != st.token_base:
                raise RuntimeError(
                    f"sequence {st.seq_id}: the worker holds {len(seq.token_ids)} tokens, "
                    f"the core sent from {st.token_base}"
                )
            seq.token_ids.extend(st.new_tokens)
            seq.block_table = st.block_table
            seq.stored_tokens = st.stored_tokens
            seq.layer_starts = tuple(st.layer_starts)
            seq.prefill_only = st.prefill_only
            seq.prompt_logprobs = st.prompt_logprobs
            seq.prompt_scored = st.prompt_scored
            seq.num_computed = st.num_computed
        if work.capture and self.leader:
            self.runner.capture_hidden(tuple(work.capture))
        batch = StepBatch(
            prefills=[PrefillChunk(self.seqs[s], a, b, last) for s, a, b, last in work.prefills],
            decodes=[self.seqs[s] for s in work.decodes],
            drafts=dict(work.drafts),
        )
        t0 = time.perf_counter()
        _COMM[0] = 0.0
        runs = any(c.end > c.start for c in batch.prefills) or bool(batch.decodes)
        logits: dict[int, torch.Tensor] = {}
        for seq_id, drafts in work.drafts:  # for this step only: drafts are not committed
            self.seqs[seq_id].token_ids.extend(drafts)
        try:
            if runs:
                logits = self.runner.execute(batch)
            elif work.any_rows:
                self.model.idle_layers()
        finally:
            for seq_id, drafts in work.drafts:
                del self.seqs[seq_id].token_ids[-len(drafts) :]
        scores = self.runner.take_prompt_logprobs()
        seconds = time.perf_counter() - t0
        if not self.leader:
            return wire.StepDone(
                self.spec.rank, work.step, [], [], seconds=seconds, comm_seconds=_COMM[0]
            )
        hidden = [
            wire.hidden_rows(seq_id, layer, first, rows)
            for seq_id, layers in self.runner.take_hidden().items()
            for layer, (first, rows) in layers.items()
        ]
        rows = [(s, t.cpu().numpy().tobytes()) for s, t in logits.items()]
        dtype = str(next(iter(logits.values())).cpu().numpy().dtype) if logits else "float32"
        return wire.StepDone(
            self.spec.rank,
            work.step,
            rows,
            list(scores.items()),
            seconds=seconds,
            logits_dtype=dtype,
            pages=fetched,
            comm_seconds=_COMM[0],
            hidden=hidden,
        )


def run_worker(spec: wire.WorkerSpec) -> int:
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if os.environ.get(TIME_COLLECTIVES_ENV) == "1":
        _time_collectives()
    device = _device(spec)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, str(spec.rank).encode())
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(spec.core_url)
    try:
        dist.init_process_group(
            backend,
            init_method=spec.dist_url,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        rank = _Rank(spec, device)
    except BaseException:
        logger.exception("worker rank %d failed to start", spec.rank)
        ctx.destroy(linger=0)
        return 1
    sock.send(wire.ENCODER.encode(wire.Hello(spec.rank, os.getpid())))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    code = 0
    while True:
        if spec.parent_pid and os.getppid() != spec.parent_pid:
            logger.error("worker rank %d: the process that started it is gone", spec.rank)
            code = 1
            break
        events = dict(poller.poll(_POLL_MS))
        if sock not in events:  # a queued Stop goes before the disconnect that follows it
            if monitor in events:
                logger.error("worker rank %d: the engine core closed the connection", spec.rank)
                code = 1
                break
            continue
        msg = wire.TO_WORKER.decode(sock.recv())
        if isinstance(msg, wire.Stop):
            break
        try:
            done = rank.step(msg)
        except BaseException as exc:  # a peer died (collective error/timeout), or a bug
            logger.exception("worker rank %d: step %d failed", spec.rank, msg.step)
            text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            sock.send(wire.ENCODER.encode(wire.StepDone(spec.rank, msg.step, [], [], text)))
            code = 1
            break
        sock.send(wire.ENCODER.encode(done))
    sock.disable_monitor()
    ctx.destroy(linger=1000)
    if code == 0:
        dist.destroy_process_group()
    # A failed collective can leave gloo's threads blocked: do not wait for them.
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return run_worker(wire.SPEC.decode(bytes.fromhex(args[0])))


if __name__ == "__main__":
    sys.exit(main())
