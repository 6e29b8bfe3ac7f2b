"""Tensor and expert parallelism at the model level: 2 gloo ranks vs one process.

The oracle is the same checkpoint run by one process (``SINGLE``). In float64
the ranks' logits agree to rounding (~3e-15 measured, asserted within 1e-10),
not bitwise: the TP all-reduce sums partial wo_b / shared-expert products in
another order than one GEMM does, and EP sums the experts' shares of a token in
another order than ``index_add_``. Each 2-rank run spawns 2 processes once and
runs every topology in them (spawning and importing torch cost more than the
forwards).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parallel_helpers import Job, forward_logits, routed_expert_bytes, run_ranks
from safetensors.torch import load_file, save_file

from engine.loader import weight_stream
from engine.loader.checkpoint import empty_model, load_checkpoint
from engine.loader.checkpoint_writer import make_tiny, save_checkpoint
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.parallel import SINGLE, Parallel, expert_of, expert_range
from engine.planning.memory_plan import weight_bytes

pytestmark = pytest.mark.slow

# Different lengths: some shorter than the 16-token window, one past the
# index top-k (16) so CSA2 selection matters; under EP dispatch rank 0 runs
# prompts 0 and 2, rank 1 prompts 1 and 3 (unequal rows in each MoE gather).
PROMPTS = ((3, 17, 99, 5, 8), tuple(range(100, 112)), tuple(range(7, 16)), tuple(range(200, 219)))
TP2, EP2, TP2_EP2 = (2, False, "none"), (1, True, "none"), (2, True, "none")
EP2_PACKED = (1, True, "auto")  # the routed experts kept as their MXFP4 bytes
TP2_PACKED = (2, False, "auto")  # every FP8 linear packed, the split ones as packed shards
ATOL = 1e-10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def _single(checkpoint, quantization):
    torch.set_num_threads(1)
    _, model = load_checkpoint(checkpoint, quantization=quantization)
    model = model.double().eval()
    return model, [forward_logits(model, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def single(checkpoint):
    """One process: the whole model in float64 and its logits per prompt."""
    return _single(checkpoint, "none")


@pytest.fixture(scope="module")
def single_packed(checkpoint):
    return _single(checkpoint, "auto")


@pytest.fixture(scope="module")
def ranks(checkpoint):
    return run_ranks(Job(checkpoint, (TP2, EP2, TP2_EP2, EP2_PACKED, TP2_PACKED), PROMPTS))


@pytest.mark.parametrize("topology", [TP2, EP2, TP2_EP2], ids=["tp2", "ep2-dp2", "tp2-ep2"])
def test_two_ranks_give_the_logits_of_one_process(ranks, single, topology):
    _, want = single
    results = ranks[topology]
    ran = sorted(i for r in results for i in r.logits)
    if topology == EP2:  # DP attention: each prompt on exactly one rank
        assert ran == list(range(len(PROMPTS)))
    else:  # TP: every rank runs every row and ends with the same output
        assert ran == sorted(list(range(len(PROMPTS))) * 2)
    for r in results:
        for i, got in r.logits.items():
            torch.testing.assert_close(torch.from_numpy(got), want[i], atol=ATOL, rtol=0)


def test_packed_experts_under_ep_give_the_same_logits_bitwise(ranks, single_packed):
    """The CPU MXFP4 path computes each row on its own (exact tile decode), and the
    all-reduce of two ranks' shares adds the two slots as ``index_add_`` does, so
    DP attention with EP over packed experts is bitwise the single process."""
    _, want = single_packed
    for r in ranks[EP2_PACKED]:
        for i, got in r.logits.items():
            assert torch.equal(torch.from_numpy(got), want[i]), i


@pytest.mark.parametrize(
    ("topology", "reference"),
    [(EP2, "single"), (TP2_EP2, "single"), (EP2_PACKED, "single_packed")],
    ids=["ep2-dp2", "tp2-ep2", "ep2-packed"],
)
def test_each_rank_holds_one_ep_th_of_the_expert_bytes(ranks, request, topology, reference):
    model, _ = request.getfixturevalue(reference)
    held, whole = routed_expert_bytes(model)
    assert held == whole > 0
    assert [r.expert_bytes for r in ranks[topology]] == [whole // 2, whole // 2]


def test_tp_alone_keeps_every_expert(ranks, single):
    _, whole = routed_expert_bytes(single[0])
    assert [r.expert_bytes for r in ranks[TP2]] == [whole, whole]


def test_expert_range_follows_the_memory_plan_rule():
    # E / W each, the first E mod W ranks one more, contiguous and covering E.
    assert [expert_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [expert_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    assert expert_of("layers.3.ffn.experts.17.w2.scale") == 17
    assert expert_of("layers.3.ffn.shared_experts.w2.weight") is None


def test_a_rank_reads_only_its_own_experts(checkpoint, tmp_path, single):
    """A checkpoint without rank 0's experts still loads on rank 1, with the
    values of the whole checkpoint; rank 0 then fails on a missing expert."""
    model, _ = single
    stored = load_file(checkpoint / "model.safetensors")
    first, stop = expert_range(model.config.n_routed_experts, 1, 2)
    kept = {n: t for n, t in stored.items() if (e := expert_of(n)) is None or first <= e < stop}
    assert len(kept) < len(stored)
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    save_file(kept, tmp_path / "model.safetensors")

    rank_1, rank_0 = Parallel(ep_rank=1, ep_size=2), Parallel(ep_rank=0, ep_size=2)
    _, rank1 = load_checkpoint(tmp_path, quantization="none", parallel=rank_1)
    got = rank1.state_dict()
    want = model.state_dict()
    expert_names = [n for n in got if expert_of(n) is not None]
    assert expert_names and all(first <= expert_of(n) < stop for n in expert_names)
    for name in expert_names:
        torch.testing.assert_close(got[name].double(), want[name], atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        load_checkpoint(tmp_path, quantization="none", parallel=rank_0)


def test_a_tp_rank_holds_its_slice_of_the_split_tensors(checkpoint, single):
    model, _ = single
    want = model.state_dict()
    tp_rank_1 = Parallel(tp_rank=1, tp_size=2)
    _, rank1 = load_checkpoint(checkpoint, quantization="none", parallel=tp_rank_1)
    got = rank1.state_dict()
    layer = "layers.2."
    heads = model.config.num_attention_heads * model.config.head_dim
    checks = {
        "attn.wq_b.weight": want[layer + "attn.wq_b.weight"][heads // 2 :],
        "attn.attn_sink": want[layer + "attn.attn_sink"][4:],
        "attn.wo_a.weight": want[layer + "attn.wo_a.weight"][64:],
        "attn.wo_b.weight": want[layer + "attn.wo_b.weight"][:, 64:],
        "ffn.shared_experts.w1.weight": want[layer + "ffn.shared_experts.w1.weight"][64:],
        "ffn.shared_experts.w2.weight": want[layer + "ffn.shared_experts.w2.weight"][:, 64:],
        "attn.wkv.weight": want[layer + "attn.wkv.weight"],  # the latent KV: replicated
    }
    for name, expected in checks.items():
        torch.testing.assert_close(got[layer + name].double(), expected, atol=0, rtol=0)


def test_single_is_the_identity():
    x = torch.randn(3, 4)
    assert SINGLE.tp_all_reduce(x) is x and SINGLE.ep_all_reduce(x) is x
    with pytest.raises(ValueError, match="not divisible"):
        Parallel(tp_rank=0, tp_size=3).tp_part(8, "num_attention_heads")
    with pytest.raises(ValueError, match="ep_dispatch"):
        Parallel(ep_dispatch=True)


SPLIT_LINEARS = ("attn.wq_b", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.w1")
SPLIT_LINEARS += ("ffn.shared_experts.w2", "ffn.shared_experts.w3")


def test_tp_packed_shards_keep_the_stored_fp8_bytes(checkpoint, monkeypatch):
    """quantization="auto" under TP: each split linear is packed on each rank, its
    E4M3 bytes and E8M0 scales exactly the stored tensors' slices along the split
    dimension (rows, or columns for wo_b and w2; scales per 32-block), so a rank
    holds half the split linears' stored bytes; replicated FP8 linears whole.
    Rank 1 streams in slices of 8192 elements (every shard read in pieces)."""
    from engine.model.deepseek_v41.fp8_linear import packed_modules

    stored = load_file(checkpoint / "model.safetensors")
    n_layers = ModelConfig.tiny().num_hidden_layers
    split = [f"layers.{l}.{n}" for l in range(n_layers) for n in SPLIT_LINEARS]
    whole_bytes = sum(stored[f"{n}.{p}"].nbytes for n in split for p in ("weight", "scale"))
    plan = weight_bytes(ModelConfig.tiny(), tensor_parallel_size=2).replicated
    for rank in (0, 1):
        if rank == 1:
            monkeypatch.setattr(weight_stream, "CHUNK_ELEMENTS", 8192)
        _, model = load_checkpoint(checkpoint, parallel=Parallel(tp_rank=rank, tp_size=2))
        packed = packed_modules(model)
        assert torch.equal(
            packed["layers.2.attn.wkv"].weight.view(torch.uint8),
            stored["layers.2.attn.wkv.weight"].view(torch.uint8),
        )
        for name in split:
            module = packed[name]
            dim = 1 if name.endswith(("wo_b", "w2")) else 0
            for got, want in (
                (module.weight, stored[name + ".weight"]),
                (module.scale, stored[name + ".scale"]),
            ):
                part = want.shape[dim] // 2
                want = want.narrow(dim, rank * part, part)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        assert sum(packed[n].resident_bytes for n in split) * 2 == whole_bytes
        # The memory plan's per-rank TP-split FP8 bytes are these packed shards.
        assert sum(packed[n].weight.nbytes for n in split) == plan["dense_fp8_tp"]


def test_packed_tp_shards_give_the_logits_of_one_packed_process(ranks, single_packed):
    """TP2 over packed shards vs one process over the same packed bytes, float64.

    A row shard (wq_b, wo_a, w1, w3) decodes its own 32-row blocks and quantises
    the same activations, so its rows are the full GEMM's rows. A column shard
    (wo_b, w2) starts on a 32-block, so each rank quantises exactly the
    activation blocks one process does, and its output is a partial sum over its
    K blocks; the all-reduce adds the two partials in another order than one
    GEMM. Every product is E4M3 x E4M3 x two powers of two (8 significant
    bits), so within a block the float64 sums are exact and only sums across
    blocks whose scales lie far apart round: at most a few float64 ulps per
    layer (measured: bitwise equal on the tiny model). An E4M3 rounding of a
    later layer's activations would flip only for a value within those ulps of
    a rounding boundary, so the unpacked TP test's bound holds.
    """
    _, want = single_packed
    results = ranks[TP2_PACKED]
    assert sorted(i for r in results for i in r.logits) == sorted(list(range(len(PROMPTS))) * 2)
    for r in results:
        for i, got in r.logits.items():
            torch.testing.assert_close(torch.from_numpy(got), want[i], atol=ATOL, rtol=0)


def test_a_packed_tp_shard_off_the_fp8_blocks_is_refused(tmp_path):
    """moe_intermediate_size 96 on TP2: the shared expert's rank part is 48 rows,
    not whole 32-row blocks; the packed load (and the empty model) refuse it,
    naming the tensor."""
    config = dataclasses.replace(ModelConfig.tiny(), moe_intermediate_size=96)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(0))
    save_checkpoint(model, config, tmp_path)
    tp = Parallel(tp_rank=0, tp_size=2)
    message = r"layers\.0\.ffn\.shared_experts\.w1\.weight: TP rank's part is 48 rows"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path, parallel=tp)
    with pytest.raises(ValueError, match=message):
        empty_model(config, device="meta", quantization="auto", parallel=tp)
