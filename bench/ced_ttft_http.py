"""Time to first token of a long prompt through HTTP, CED vs full depth, SSD tier on.

The goal (docs/BENCHMARKS.md): with ``--kv-dir`` set, a 4K prompt's TTFT with CED (the
default) is <= 0.55x that of full-depth prefill (``--disable-ced``). This starts
``flashserve serve --model tiny --kv-dir <fresh tmp>`` once per mode
(``OMP_NUM_THREADS=1``), and sends one streamed ``/v1/completions``
request at a time: a random token-id prompt of ``--prompt-len`` (no two alike:
no prefix-cache hits), ``max_tokens`` 1. TTFT is the time from sending the
request to its first streamed token. Both servers stay up and the modes
alternate round by round, so the shared machine's drift hits both alike.

    python bench/ced_ttft_http.py --rounds 3 --json out.json
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

MODES = {"ced": [], "full-depth": ["--disable-ced"]}
VOCAB = 129_280


async def ttft(base_url: str, prompt: list[int] | str) -> float:
    body = {
        "model": "deepseek-flash",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as http:
        started = time.perf_counter()
        async with http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    return time.perf_counter() - started
    raise RuntimeError("stream ended without a token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [0] + [rng.randrange(3, VOCAB) for _ in range(args.prompt_len - 1)]

    servers = {}
    results: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for mode, extra in MODES.items():
            spec = ServerSpec(
                model="tiny",
                args=[
                    *extra,
                    "--max-model-len",
                    str(args.prompt_len + 64),
                    "--log-level",
                    "warning",
                ],
                ssd=True,
                env={"OMP_NUM_THREADS": "1"},
            )
            log = Path(tempfile.gettempdir()) / f"flashserve-ced-ttft-{mode}.log"
            servers[mode] = LaunchedServer(spec, log).__enter__()
            asyncio.run(ttft(servers[mode].base_url, prompt()[:256]))  # warm-up
        for r in range(args.rounds):  # alternate: the machine's drift hits both alike
            for mode, server in servers.items():
                t = asyncio.run(ttft(server.base_url, prompt()))
                results[mode].append(t)
                print(f"  round {r + 1} {mode:10s} TTFT {t:6.2f} s", flush=True)
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)
    med = {m: statistics.median(v) for m, v in results.items()}
    ratios = [c / f for c, f in zip(results["ced"], results["full-depth"], strict=True)]
    out = {
        "prompt_len": args.prompt_len,
        "ttft_s": results,
        "median_ttft_s": med,
        "ratio_median": med["ced"] / med["full-depth"],
        "ratio_per_round": ratios,
    }
    print(
        f"CED {med['ced']:.2f} s vs full depth {med['full-depth']:.2f} s: "
        f"ratio {out['ratio_median']:.3f} (per round {', '.join(f'{x:.3f}' for x in ratios)}; "
        "goal <= 0.55)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
