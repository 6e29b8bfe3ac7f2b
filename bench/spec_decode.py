"""Speculative decoding on the demo model: decode tokens/s with and without it, side by side.

    .venv/bin/python bench/spec_decode.py --methods ngram dspark --k 4 --batches 1 8 32
    .venv/bin/python bench/spec_decode.py --simulate-only      # ngram acceptance, no verify step
    .venv/bin/python bench/spec_decode.py --lookup-only        # the ngram proposer's own cost

For each batch size, B greedy requests (``ignore_eos``, ``--max-tokens`` each)
run through ``LLMEngine`` on ``models/demo`` with one intra-op thread: once
without speculation, then once per method with ``--speculative-config``
``{"method": M, "num_speculative_tokens": K}``. Reported per run: decode
tokens/s (output tokens of the steps after every request has its first token,
over their wall time), and from the engine's counters the mean acceptance length
(1 + accepted / drafts), the acceptance rate and the acceptance per draft
position; and whether every request's tokens equal the plain run's (they must).

Workloads (``--workload``): ``json-edit`` (the prompt holds a block of JSON tool
schemas and asks for it again, the kind of copying prompt lookup exploits),
``verse`` (a play's opening, little to copy: the drafter's case) and ``tool-call``
(an agent's turn: tool schemas, a request, the model writes the call; the server's
prompts of training/tool_data.py conversations, from seeds the drafter's stage never
draws).

``--simulate-only`` needs no speculative engine: it replays the ngram proposer over
the plain run's greedy tokens, step by step as a greedy verify would (accept the
longest matching prefix, commit one more), for the earliest-occurrence rule
(vLLM's, the one served) and the most recent one. Greedy verification commits
exactly those tokens, so the acceptance figures are what the engine will count.

``--lookup-only`` times ``NgramProposer.propose`` at 64K tokens of context.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JSON_SAMPLE = REPO / "bench" / "data" / "tool_json_sample.txt"
# The tool-call workload's conversations: seeds apart from the DSpark stage's stream.
TOOL_SEEDS = 9_000_000
TOOL_REPLIES = ["Good my lord, the deed is done.", "I will, my lord."]
VERSE = (
    "ACT I\n\nSCENE I. Verona. A public place.\n\nEnter SAMPSON and GREGORY, armed.\n\n"
    "SAMPSON.\nGregory, on my word, we'll not carry coals.\n\nGREGORY.\n"
)


# ------------------------------------------------------------------- workloads
def workload_texts(name: str, batch: int) -> list[str]:
    """``batch`` prompts of the workload, each a little different (no two share a prefix
    page, so the prefix cache does not serve one from another)."""
    if name == "verse":
        return [f"[{i}]\n{VERSE}" for i in range(batch)]
    if name == "tool-call":
        from training.dspark_prompts import tool_prompt

        return [tool_prompt(random.Random(TOOL_SEEDS + i), TOOL_REPLIES) for i in range(batch)]
    lines = [ln for ln in JSON_SAMPLE.read_text().splitlines() if ln.startswith("{")]
    out = []
    for i in range(batch):
        shown = lines[i % len(lines) :] + lines[: i % len(lines)]
        doc = "\n".join(shown)
        out.append(
            f"### Tool schemas, set {i}\n\n{doc}\n\n### The same schemas again\n\n{shown[0][:40]}"
        )
    return out


# ------------------------------------------------------------------- one run
@dataclass
class RunResult:
    """One engine run: its tokens per request and what it measured."""

    tokens: dict[str, list[int]]
    decode_tokens: int
    decode_seconds: float
    steps: int
    counters: dict[str, object] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def spec_json(
    method: str, k: int, max_batch_size: int | None = None, min_confidence: float | None = None
) -> str:
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": k}
    if max_batch_size is not None:
        spec["max_batch_size"] = max_batch_size
    if min_confidence is not None and method == "dspark":
        spec["min_confidence"] = min_confidence
    return json.dumps(spec)


def make_engine(model: Path, batch: int, speculative: str | None):
    from engine.config import EngineConfig
    from engine.loader.builder import build_engine

    kwargs: dict[str, object] = {"max_num_seqs": batch, "kv_cache_bytes": 512 << 20}
    if speculative is not None:
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        if "speculative_config" not in names:
            raise SystemExit(
                "this engine has no speculative decoding (EngineConfig.speculative_config); "
                "--simulate-only and --lookup-only run without it"
            )
        kwargs["speculative_config"] = speculative
    return build_engine(EngineConfig(**kwargs), model)


def run(engine, prompts: list[list[int]], max_tokens: int) -> RunResult:
    """All prompts at once, greedy; times the steps after every request has a token."""
    from engine.api.request import Request
    from engine.api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))

    def step() -> int:
        n = 0
        for out in engine.step():
            for choice in out.outputs:
                tokens[out.request_id].extend(choice.token_ids)
                n += len(choice.token_ids)
        return n

    while engine.has_unfinished_requests() and not all(tokens.values()):
        step()
    # A copy: the engine may count per position in place in its list.
    before = dataclasses.replace(
        engine.counters, spec_accepted_per_pos=list(engine.counters.spec_accepted_per_pos)
    )
    decoded, steps, t0 = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        decoded += step()
        steps += 1
    seconds = time.perf_counter() - t0
    c = engine.counters
    counters = {
        "drafts": c.spec_drafts - before.spec_drafts,
        "draft_tokens": c.spec_draft_tokens - before.spec_draft_tokens,
        "accepted_tokens": c.spec_accepted_tokens - before.spec_accepted_tokens,
        "accepted_per_pos": [
            n - (before.spec_accepted_per_pos[j] if j < len(before.spec_accepted_per_pos) else 0)
            for j, n in enumerate(c.spec_accepted_per_pos)
        ],
    }
    return RunResult(tokens, decoded, seconds, steps, counters)


def acceptance(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> dict:
    """vLLM's figures: mean acceptance length 1 + accepted / drafts (the bonus token
    counted), acceptance rate accepted / draft tokens, per position over drafts."""
    return {
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "per_position": [n / drafts if drafts else 0.0 for n in per_pos],
        "drafts": drafts,
    }


# ------------------------------------------------------------------- simulation
def simulate_ngram(
    prompt: list[int], output: list[int], k: int, occurrence: str, min_n: int = 1, max_n: int = 3
) -> dict[str, object]:
    """Greedy verification replayed over known greedy tokens: at each step the proposer
    sees the committed tokens, the longest prefix of its draft that equals the true
    continuation is accepted, and one more token is committed. The first output token
    comes from the prefill; K shrinks to the room left (``max_tokens``)."""
    from engine.core.sequence import Sequence
    from engine.spec_decode.config import SpeculativeConfig
    from engine.spec_decode.ngram import NgramProposer

    spec = SpeculativeConfig("ngram", k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    proposer = NgramProposer(spec, occurrence=occurrence)
    full = prompt + output
    seq = Sequence(0, "sim", full[: len(prompt) + 1], num_prompt_tokens=len(prompt))
    drafts = draft_tokens = accepted_total = steps = 0
    per_pos = [0] * k
    while seq.num_tokens < len(full):
        room = len(full) - seq.num_tokens
        draft = proposer.propose(seq, min(k, room - 1)).token_ids
        accepted = 0
        while accepted < len(draft) and draft[accepted] == full[seq.num_tokens + accepted]:
            accepted += 1
        if draft:
            drafts += 1
            draft_tokens += len(draft)
            accepted_total += accepted
            for j in range(accepted):
                per_pos[j] += 1
        seq.token_ids.extend(full[seq.num_tokens : seq.num_tokens + accepted + 1])
        steps += 1
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": accepted_total,
        "per_pos": per_pos,
        "steps": steps,
        "tokens": len(output) - 1,
    }


def simulated_acceptance(results: list[dict[str, object]]) -> dict:
    def total(key: str) -> int:
        return sum(int(r[key]) for r in results)

    per_pos = [sum(r["per_pos"][j] for r in results) for j in range(len(results[0]["per_pos"]))]
    out = acceptance(total("drafts"), total("draft_tokens"), total("accepted"), per_pos)
    # Decode steps without speculation over steps with it: the speed-up at a verify
    # step costing what a plain step costs (an upper bound).
    out["steps_ratio"] = total("tokens") / total("steps") if total("steps") else 1.0
    return out


# ------------------------------------------------------------------- lookup cost
def lookup_cost(context: int = 65_536, steps: int = 200) -> dict[str, dict[str, float]]:
    """Median microseconds of one ``propose`` after one appended token, and of the first
    call (the whole list mirrored), at ``context`` tokens."""
    import random

    from engine.core.sequence import Sequence
    from engine.spec_decode.config import SpeculativeConfig
    from engine.spec_decode.ngram import NgramProposer

    spec = SpeculativeConfig("ngram", 4)
    out = {}
    for name, vocab in (("vocab 129280", 129_280), ("vocab 50", 50), ("one token", 1)):
        rng = random.Random(0)
        seq = Sequence(0, "r", [rng.randrange(vocab) for _ in range(context)], context)
        proposer = NgramProposer(spec)
        t0 = time.perf_counter()
        proposer.propose(seq, 4)
        first = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            seq.token_ids.append(rng.randrange(vocab))
            t0 = time.perf_counter()
            proposer.propose(seq, 4)
            times.append(time.perf_counter() - t0)
        out[name] = {"first_ms": first * 1e3, "step_us": statistics.median(times) * 1e6}
    return out


# ------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / "models" / "demo"), help="checkpoint dir")
    p.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "dspark"])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-batch-size", type=int, help="the pause threshold (default: never pause)")
    p.add_argument(
        "--min-confidence",
        type=float,
        help="dspark: cut drafts at the first slot below this confidence (default: never)",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--workload", choices=["json-edit", "verse", "tool-call"], default="json-edit")
    p.add_argument("--simulate-only", action="store_true", help="plain runs + ngram replay")
    p.add_argument("--lookup-only", action="store_true", help="time the ngram lookup only")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.k < 1 or args.max_tokens < 2 or min(args.batches) < 1:
        p.error("--k >= 1, --max-tokens >= 2 and every batch >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results: dict[str, object] = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if args.lookup_only:
        cost = lookup_cost()
        results["lookup"] = cost
        for name, c in cost.items():
            print(f"{name:>14}: first call {c['first_ms']:.2f} ms, per step {c['step_us']:.0f} us")
        return _write(args, results)

    model = Path(args.model)
    rows = []
    for batch in args.batches:
        plain_engine = make_engine(model, batch, None)
        texts = workload_texts(args.workload, batch)
        prompts = [plain_engine.tokenizer.encode(t).ids for t in texts]
        plain = run(plain_engine, prompts, args.max_tokens)
        plain_engine.close()
        if plain.counters["drafts"]:
            raise SystemExit("the run without --speculative-config speculated (a default?)")
        row: dict[str, object] = {
            "batch": batch,
            "plain_tok_s": plain.tokens_per_s,
            "plain_steps": plain.steps,
        }
        for occurrence in ("earliest", "latest"):
            sims = [
                simulate_ngram(prompts[i], plain.tokens[f"r{i}"], args.k, occurrence)
                for i in range(batch)
            ]
            row[f"simulated_ngram_{occurrence}"] = simulated_acceptance(sims)
        if not args.simulate_only:
            for method in args.methods:
                engine = make_engine(
                    model,
                    batch,
                    spec_json(method, args.k, args.max_batch_size, args.min_confidence),
                )
                spec = run(engine, prompts, args.max_tokens)
                engine.close()
                c = spec.counters
                row[method] = {
                    "tok_s": spec.tokens_per_s,
                    "speedup": spec.tokens_per_s / plain.tokens_per_s,
                    "steps": spec.steps,
                    "greedy_identical": spec.tokens == plain.tokens,
                    **acceptance(
                        int(c["drafts"]),
                        int(c["draft_tokens"]),
                        int(c["accepted_tokens"]),
                        list(c["accepted_per_pos"]),
                    ),
                }
        rows.append(row)
        print(_row_text(row, args.methods if not args.simulate_only else []), flush=True)
    results["rows"] = rows
    _write(args, results)
    identical = all(r[m]["greedy_identical"] for r in rows for m in args.methods if m in r)
    return 0 if identical else 1  # a speculative run that changed greedy tokens fails


def _row_text(row: dict, methods: list[str]) -> str:
    parts = [f"batch {row['batch']:>3}: plain {row['plain_tok_s']:7.1f} tok/s"]
    for m in methods:
        r = row[m]
        pos = " ".join(f"{x:.2f}" for x in r["per_position"])
        parts.append(
            f"{m} {r['tok_s']:7.1f} tok/s ({r['speedup']:.2f}x), accept len "
            f"{r['mean_acceptance_length']:.2f}, per pos [{pos}], "
            f"identical {r['greedy_identical']}"
        )
    for occ in ("earliest", "latest"):
        s = row[f"simulated_ngram_{occ}"]
        pos = " ".join(f"{x:.2f}" for x in s["per_position"])
        parts.append(
            f"sim ngram/{occ}: accept len {s['mean_acceptance_length']:.2f}, "
            f"rate {s['acceptance_rate']:.2f}, per pos [{pos}], steps ratio {s['steps_ratio']:.2f}"
        )
    return "\n  ".join(parts)


def _write(args: argparse.Namespace, results: dict) -> int:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
