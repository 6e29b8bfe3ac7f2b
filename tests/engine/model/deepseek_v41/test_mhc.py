"""mHC coefficients, collapse and mix against hand-computed values and a float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.mhc import (
    hc_coefficients,
    hc_collapse,
    hc_initial_pre,
    hc_mix,
    sinkhorn,
)


def _oracle_coefficients(R, fn, base, scale, hc_eps, iters, norm_eps):
    """Spec pseudo-code (architecture.md §1.3) in float64 with explicit per-token loops."""
    T, hc, _ = R.shape
    pre = torch.empty(T, hc, dtype=torch.float64)
    post = torch.empty(T, hc, dtype=torch.float64)
    comb = torch.empty(T, hc, hc, dtype=torch.float64)
    for t in range(T):
        x = R[t].double().reshape(-1)
        m = (fn.double() @ x) / math.sqrt(float((x * x).mean()) + norm_eps)
        for i in range(hc):
            pre[t, i] = 1 / (1 + math.exp(-(m[i] * scale[0] + base[i]))) + hc_eps
            post[t, i] = 2 / (1 + math.exp(-(m[hc + i] * scale[1] + base[hc + i])))
        logits = [
            [
                float(m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j])
                for j in range(hc)
            ]
            for i in range(hc)
        ]
        C = []
        for row in logits:
            e = [math.exp(v - max(row)) for v in row]
            C.append([v / sum(e) + hc_eps for v in e])

        def col_pass(C):
            sums = [sum(C[i][j] for i in range(hc)) + hc_eps for j in range(hc)]
            return [[C[i][j] / sums[j] for j in range(hc)] for i in range(hc)]

        def row_pass(C):
            return [[v / (sum(row) + hc_eps) for v in row] for row in C]

        C = col_pass(C)
        for _ in range(iters - 1):
            C = col_pass(row_pass(C))
        comb[t] = torch.tensor(C, dtype=torch.float64)
    return pre, post, comb


def _random_sublayer(T=5, hc=4, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(T, hc, D, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.5
    base = torch.randn((2 + hc) * hc, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    return R, fn, base, scale


def test_coefficients_match_float64_spec_oracle():
    R, fn, base, scale = _random_sublayer()
    pre, post, comb = hc_coefficients(
        R, fn, base, scale, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20
    )
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert pre.shape == (5, 4) and post.shape == (5, 4) and comb.shape == (5, 4, 4)
    want = _oracle_coefficients(R, fn, base, scale, 1e-6, 20, 1e-20)
    for got, ref in zip((pre, post, comb), want, strict=True):
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)


def test_sinkhorn_single_iteration_is_one_column_pass_hand_computed():
    # softmax rows of log([[1, 3], [1, 1]]) are [1/4, 3/4] and [1/2, 1/2].
    eps = 1e-3
    logits = torch.log(torch.tensor([[1.0, 3.0], [1.0, 1.0]]))
    got = sinkhorn(logits, iters=1, eps=eps)
    c = [[0.25 + eps, 0.75 + eps], [0.5 + eps, 0.5 + eps]]
    col = [c[0][0] + c[1][0] + eps, c[0][1] + c[1][1] + eps]
    want = torch.tensor([[c[i][j] / col[j] for j in range(2)] for i in range(2)])
    torch.testing.assert_close(got, want, atol=1e-7, rtol=0)


def test_sinkhorn_two_iterations_add_one_row_then_one_column_pass():
    eps = 1e-3
    logits = torch.log(torch.tensor([[1.0, 3.0], [1.0, 1.0]]))
    c = [[0.25 + eps, 0.75 + eps], [0.5 + eps, 0.5 + eps]]
    col = [c[0][0] + c[1][0] + eps, c[0][1] + c[1][1] + eps]
    c = [[c[i][j] / col[j] for j in range(2)] for i in range(2)]
    c = [[v / (sum(row) + eps) for v in row] for row in c]
    col = [c[0][0] + c[1][0] + eps, c[0][1] + c[1][1] + eps]
    want = torch.tensor([[c[i][j] / col[j] for j in range(2)] for i in range(2)])
    torch.testing.assert_close(sinkhorn(logits, iters=2, eps=eps), want, atol=1e-7, rtol=0)


def test_comb_is_near_doubly_stochastic_and_ends_on_columns():
    R, fn, base, scale = _random_sublayer(T=7, seed=3)
    fn = fn * 20  # sharp logits: rows are then visibly not exactly normalised
    _, _, comb = hc_coefficients(R, fn, base, scale, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20)
    col_err = (comb.sum(-2) - 1).abs().max()
    row_err = (comb.sum(-1) - 1).abs().max()
    # Columns are exact after the final column pass; 20 rounds leave the rows
    # of such sharp matrices a few percent off.
    assert col_err < 1e-5 < row_err < 0.1
    assert (comb >= 0).all()


def test_pre_and_post_with_zero_projection_are_the_bias_sigmoids():
    hc, D = 4, 8
    R = torch.randn(3, hc, D)
    fn = torch.zeros((2 + hc) * hc, hc * D)
    base = torch.linspace(-2, 2, (2 + hc) * hc)
    scale = torch.ones(3)
    pre, post, comb = hc_coefficients(
        R, fn, base, scale, hc_eps=0.01, sinkhorn_iters=3, norm_eps=1e-20
    )
    for i in range(hc):
        assert pre[0, i].item() == pytest.approx(
            1 / (1 + math.exp(-base[i].item())) + 0.01, abs=1e-6
        )
        assert post[2, i].item() == pytest.approx(
            2 / (1 + math.exp(-base[hc + i].item())), abs=1e-6
        )
    # Every token sees the same logits, so the same matrix.
    torch.testing.assert_close(comb[0], comb[2])


def test_coefficients_are_invariant_to_the_scale_of_R():
    # m is RMS-normalised over all hc * D entries together.
    R, fn, base, scale = _random_sublayer(seed=5)
    a = hc_coefficients(R, fn, base, scale, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20)
    b = hc_coefficients(R * 37.0, fn, base, scale, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_collapse_and_mix_match_explicit_sums():
    T, hc, D = 3, 4, 5
    g = torch.Generator().manual_seed(1)
    R = torch.randn(T, hc, D, generator=g)
    y = torch.randn(T, D, generator=g)
    pre = torch.rand(T, hc, generator=g)
    post = torch.rand(T, hc, generator=g)
    comb = torch.rand(T, hc, hc, generator=g)
    x = hc_collapse(R, pre)
    mixed = hc_mix(R, y, post, comb)
    for t in range(T):
        want_x = sum(pre[t, i].double() * R[t, i].double() for i in range(hc))
        torch.testing.assert_close(x[t].double(), want_x, atol=1e-6, rtol=0)
        for j in range(hc):
            want = sum(comb[t, i, j].double() * R[t, i].double() for i in range(hc))
            want = want + post[t, j].double() * y[t].double()
            torch.testing.assert_close(mixed[t, j].double(), want, atol=1e-6, rtol=0)


def test_mix_reads_comb_as_input_row_output_column():
    # comb[i, j] = 1 iff j = (i + 1) % hc: output copy j receives input copy j - 1.
    hc, D = 4, 3
    R = torch.arange(hc * D, dtype=torch.float32).view(1, hc, D)
    comb = torch.zeros(1, hc, hc)
    for i in range(hc):
        comb[0, i, (i + 1) % hc] = 1.0
    out = hc_mix(R, torch.zeros(1, D), torch.zeros(1, hc), comb)
    torch.testing.assert_close(out[0], torch.roll(R[0], shifts=1, dims=0))


def test_collapse_and_mix_keep_the_stream_dtype():
    R = torch.randn(2, 4, 8).to(torch.bfloat16)
    pre = torch.rand(2, 4)
    assert hc_collapse(R, pre).dtype == torch.bfloat16
    out = hc_mix(R, torch.randn(2, 8).to(torch.bfloat16), pre, torch.rand(2, 4, 4))
    assert out.dtype == torch.bfloat16


def test_initial_pre_takes_copy_zero():
    R = torch.randn(6, 4, 8)
    pre = hc_initial_pre(6, 4)
    assert pre.dtype == torch.float32
    torch.testing.assert_close(hc_collapse(R, pre), R[:, 0])


def test_sinkhorn_with_autograd_equals_the_in_place_passes() -> None:
    """Training takes the out-of-place passes (autograd keeps every step); serving
    divides in place. The same arithmetic in the same order: bitwise equal."""
    logits = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0))
    served = sinkhorn(logits, 20, 1e-6)
    trained = sinkhorn(logits.clone().requires_grad_(), 20, 1e-6)
    assert torch.equal(trained.detach(), served)
    trained.sum().backward()
