"""DSparkProposer fed the target's real block inputs (captured from the dense forward)
drafts the reference's greedy chain over the last window of committed rows."""

from __future__ import annotations

import copy

import dspark_reference as ref
import pytest
import torch

from engine.core.sequence import Sequence
from engine.model.deepseek_v41.model import DeepseekV41
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.dspark_proposer import DSparkProposer

_TARGET32: dict[int, DeepseekV41] = {}


def block_inputs(model: DeepseekV41, ids: list[int]) -> dict[int, torch.Tensor]:
    """Each target layer's input streams R [T, hc, D] over the exact dense forward (of an
    fp32 copy: the features are the drafter's inputs, given to it and the reference
    alike), in float64."""
    if id(model) not in _TARGET32:
        _TARGET32[id(model)] = copy.deepcopy(model).float()
    model = _TARGET32[id(model)]
    got: dict[int, torch.Tensor] = {}
    hooks = [
        model.block(l).register_forward_pre_hook(
            lambda m, args, l=l: got.__setitem__(l, args[0].detach().double())
        )
        for l in model.config.dspark_target_layer_ids
    ]
    try:
        with torch.no_grad():
            model(torch.tensor(ids))
    finally:
        for h in hooks:
            h.remove()
    return got


def reference_chain(
    model: DeepseekV41, ids: list[int], feats: dict[int, torch.Tensor]
) -> list[int]:
    """The reference's drafts after ``ids``: context = rows 0 .. len-2, last window."""
    cfg = model.config
    w = ref.state(model)
    rows = len(ids) - 1
    keep = slice(max(0, rows - cfg.sliding_window), rows)
    mx = ref.main_x(w, [feats[l][:rows][keep] for l in cfg.dspark_target_layer_ids], cfg)
    pos = torch.arange(rows)[keep]
    rings = [ref.ring_kv(w, s, mx, pos, cfg) for s in range(cfg.num_nextn_predict_layers)]
    return ref.draft(w, cfg, ids[-1], len(ids) - 1, rings)[0].tolist()


def seq_of(ids: list[int]) -> Sequence:
    return Sequence(seq_id=0, request_id="r", token_ids=list(ids), num_prompt_tokens=len(ids))


def test_drafts_equal_reference_greedy_chain_and_are_deterministic(model64: DeepseekV41) -> None:
    cfg = model64.config
    ids = torch.randint(3, 4000, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    feats = block_inputs(model64, ids)  # 21 rows > the 16-row window: the ring cuts
    want = reference_chain(model64, ids, feats)
    proposer = DSparkProposer(model64, SpeculativeConfig("dspark", cfg.dspark_block_size))
    assert proposer.hidden_layers == (5, 7)
    seq = seq_of(ids)
    # The rows committed so far, handed over in two steps (a prefill, then a verify).
    first = {l: f[:12] for l, f in feats.items()}
    second = {l: f[12:20] for l, f in feats.items()}
    seq.token_ids = ids[:13]
    proposer.propose(seq, 4, first)
    seq.token_ids = list(ids)
    draft = proposer.propose(seq, 5, second)
    assert draft.token_ids == want
    assert proposer.propose(seq, 5).token_ids == want  # no new rows: the same round
    assert proposer.propose(seq, 2).token_ids == want[:2]
    # One-shot context equals the incremental one.
    other = DSparkProposer(model64, SpeculativeConfig("dspark", 5))
    assert other.propose(seq, 5, {l: f[:20] for l, f in feats.items()}).token_ids == want


def test_replayed_rows_replace_the_ring_tail_and_release_forgets(model64: DeepseekV41) -> None:
    ids = torch.randint(3, 4000, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    feats = block_inputs(model64, ids)
    proposer = DSparkProposer(model64, SpeculativeConfig("dspark", 3))
    seq = seq_of(ids)
    garbage = {l: torch.randn_like(f[:9]) for l, f in feats.items()}
    proposer.propose(seq, 3, garbage)
    # The same positions again (rows rolled back and rerun): they replace the old ones.
    got = proposer.propose(seq, 3, {l: f[:9] for l, f in feats.items()}).token_ids
    assert got == reference_chain(model64, ids, feats)[:3]
    proposer.release(seq)
    proposer.release(seq)  # idempotent
    assert proposer.propose(seq, 3).token_ids == []  # no context: nothing to propose


def test_confidence_cut_and_refusals(model64: DeepseekV41) -> None:
    ids = list(range(5, 14))
    feats = block_inputs(model64, ids)
    hidden = {l: f[:8] for l, f in feats.items()}
    cut = DSparkProposer(model64, SpeculativeConfig("dspark", 5), min_confidence=1.1)
    assert cut.propose(seq_of(ids), 5, hidden).token_ids == []  # every slot below 1.1
    keep = DSparkProposer(model64, SpeculativeConfig("dspark", 5), min_confidence=0.0)
    assert len(keep.propose(seq_of(ids), 5, hidden).token_ids) == 5
    with pytest.raises(ValueError, match=r"1\.\.5"):
        DSparkProposer(model64, SpeculativeConfig("dspark", 6))
    model64_mtp, model64.mtp = model64.mtp, None
    try:
        with pytest.raises(ValueError, match="DSpark drafter"):
            DSparkProposer(model64, SpeculativeConfig("dspark", 2))
    finally:
        model64.mtp = model64_mtp
