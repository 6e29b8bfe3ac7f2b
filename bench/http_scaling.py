"""HTTP output tokens/s at 1 and 32 concurrent streams, engine in-process vs its own process.

The HTTP goal (docs/BENCHMARKS.md): 32 concurrent streams give >= 10x the output tokens/s of
one. This starts ``flashserve serve --model tiny`` twice, one after the other
on the same machine, once with ``--in-process-engine`` and once with the
engine core in its own process (the default), each with one intra-op thread
(``OMP_NUM_THREADS=1``: the API process and the engine core each get one), and
drives each with streamed ``/v1/completions`` requests: a random token-id
prompt of ``--prompt-len`` (no two alike, so no prefix-cache hits) and exactly
``--output-len`` tokens (EOS banned). Tokens/s of a round is the completion
tokens of all its requests (``usage``) over the round's wall time.

    python bench/http_scaling.py                # both modes, streams 1 and 32
    python bench/http_scaling.py --streams 1,8,32 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving.launch import LaunchedServer, ServerSpec

MODES = {"in-process": ["--in-process-engine"], "two-process": []}
EOS_ID = 1
VOCAB = 129_280


async def one(http: httpx.AsyncClient, prompt: list[int], output_len: int) -> int:
    body = {
        "model": "deepseek-flash",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "logit_bias": {str(EOS_ID): -100},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


async def round_(base_url: str, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(http, p, output_len) for p in prompts))
        wall = time.perf_counter() - started
    return wall, sum(counts)


def measure(args: argparse.Namespace, mode: str, rng: random.Random) -> dict[int, list[float]]:
    spec = ServerSpec(
        model="tiny",
        args=[
            *MODES[mode],
            "--max-num-seqs",
            str(max(args.streams)),
            "--max-model-len",
            str(args.prompt_len + args.output_len + 64),
            "--log-level",
            "warning",
        ],
        ssd=False,
        env={"OMP_NUM_THREADS": "1"},
    )
    log = Path(tempfile.gettempdir()) / f"flashserve-http-scaling-{mode}.log"
    results: dict[int, list[float]] = {s: [] for s in args.streams}

    def prompts(n: int) -> list[list[int]]:
        return [
            [0] + [rng.randrange(3, VOCAB) for _ in range(args.prompt_len - 1)] for _ in range(n)
        ]

    with LaunchedServer(spec, log) as server:
        asyncio.run(round_(server.base_url, prompts(4), args.output_len))  # warm-up
        for _ in range(args.rounds):
            for streams in args.streams:
                wall, tokens = asyncio.run(
                    round_(server.base_url, prompts(streams), args.output_len)
                )
                assert tokens == streams * args.output_len, (tokens, streams)
                results[streams].append(tokens / wall)
                print(
                    f"  {mode:11s} {streams:3d} streams: {tokens / wall:7.1f} tok/s ({wall:.2f} s)"
                )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,32", help="concurrencies, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per concurrency (median)")
    ap.add_argument("--modes", default="in-process,two-process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    rng = random.Random(args.seed)
    table = {}
    for mode in args.modes.split(","):
        print(f"{mode}:")
        table[mode] = {s: statistics.median(v) for s, v in measure(args, mode, rng).items()}
    low, high = min(args.streams), max(args.streams)
    print(
        "\n| engine | "
        + " | ".join(f"{s} streams tok/s" for s in args.streams)
        + f" | {high}/{low} |"
    )
    print("|---|" + "---|" * (len(args.streams) + 1))
    for mode, row in table.items():
        cells = " | ".join(f"{row[s]:.1f}" for s in args.streams)
        print(f"| {mode} | {cells} | {row[high] / row[low]:.2f}x |")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "tok_s": table}, indent=2)
        )


if __name__ == "__main__":
    main()
