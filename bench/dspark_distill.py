"""Distil a DSpark drafter for the demo model and measure its acceptance (K = 4).

    PYTHONPATH=. python bench/dspark_distill.py [--steps 600] [--out DIR]

The demo model (models/demo) is the frozen target; its greedy continuations of
the training prompts below, decoded by the engine (training/dspark_rollouts.py),
are the data (training/dspark_distill.py), the
held-out prompts measure acceptance: rounds of K greedy drafts against the
target's greedy continuation. ``--out``: also write the drafter's ``mtp.*``
tensors there (the demo checkpoint itself is left as it is). The demo's own
drafter is made by ``flashserve train-demo --stage dspark`` (more prompts, a budget).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from engine.loader.checkpoint import load_checkpoint
from engine.model.deepseek_v41.model import DeepseekV41
from training.dspark_distill import (
    DistillConfig,
    acceptance,
    attach_drafter,
    distill,
)
from training.dspark_rollouts import engine_rollouts

TRAIN = [
    "To be, or not to be, that is the question:",
    "Now is the winter of our discontent",
    "Friends, Romans, countrymen, lend me your ears;",
    "All the world's a stage, and all the men and women merely players;",
    "O Romeo, Romeo! wherefore art thou Romeo?",
    "If music be the food of love, play on;",
    "Is this a dagger which I see before me,",
    "The quality of mercy is not strain'd;",
    "What's in a name? That which we call a rose",
    "Once more unto the breach, dear friends, once more;",
    "Shall I compare thee to a summer's day?",
    "Cry 'Havoc!', and let slip the dogs of war;",
    "KING HENRY: Then call we this the field of Agincourt,",
    "HAMLET: Alas, poor Yorick! I knew him, Horatio:",
    "MACBETH: Tomorrow, and tomorrow, and tomorrow,",
    "LEAR: Blow, winds, and crack your cheeks! rage! blow!",
    "OTHELLO: Keep up your bright swords, for the dew will rust them.",
    "PORTIA: You see me, Lord Bassanio, where I stand,",
    "ROSALIND: Come, woo me, woo me, for now I am in a holiday humour",
    "PROSPERO: Our revels now are ended. These our actors,",
    "First Citizen: Before we proceed any further, hear me speak.",
    "GLOUCESTER: As flies to wanton boys are we to the gods;",
    "JULIET: Good night, good night! parting is such sweet sorrow,",
    "BRUTUS: There is a tide in the affairs of men,",
]
HELDOUT = [
    "ANTONY: I come to bury Caesar, not to praise him.",
    "VIOLA: I left no ring with her: what means this lady?",
    "PUCK: Lord, what fools these mortals be!",
    "CORDELIA: Nothing, my lord.",
    "HAMLET: How weary, stale, flat and unprofitable",
    "MERCUTIO: A plague o' both your houses!",
    "IAGO: O, beware, my lord, of jealousy;",
    "BEATRICE: I had rather hear my dog bark at a crow",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--train-prompts", type=int, default=len(TRAIN))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    _, model = load_checkpoint(args.model, quantization="none")
    assert isinstance(model, DeepseekV41)
    model.eval()
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    t0 = time.monotonic()
    train = engine_rollouts(
        model, [tok.encode(s).ids for s in TRAIN[: args.train_prompts]], args.new_tokens
    ).rollouts
    held = engine_rollouts(model, [tok.encode(s).ids for s in HELDOUT], args.new_tokens).rollouts
    t_data = time.monotonic() - t0
    attach_drafter(model)
    before = acceptance(model, held, args.k)
    t1 = time.monotonic()
    losses = distill(model, train, DistillConfig(steps=args.steps))
    t_train = time.monotonic() - t1
    after = acceptance(model, held, args.k)
    seen = acceptance(model, train, args.k)
    report = {
        "k": args.k,
        "steps": args.steps,
        "rollout_s": round(t_data, 1),
        "train_s": round(t_train, 1),
        "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)],
        "heldout_mean_acceptance_length_before": round(before[0], 3),
        "heldout_mean_acceptance_length": round(after[0], 3),
        "heldout_acceptance_per_position": [round(x, 3) for x in after[1]],
        "train_mean_acceptance_length": round(seen[0], 3),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        assert model.mtp is not None
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"mtp.{n}": t.contiguous() for n, t in model.mtp.state_dict().items()}
        save_file(tensors, out / "dspark.safetensors")


if __name__ == "__main__":
    main()
