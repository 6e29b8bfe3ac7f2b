"""The C Sinkhorn passes against the eager tensor passes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v41.mhc import hc_coefficients, sinkhorn
from kernels import cpu_native, cpu_sinkhorn


def reference_sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The out-of-place passes as the release writes them (the oracle kept here)."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


needs_c = pytest.mark.skipif(
    cpu_native.library() is None, reason="no C compiler: the eager passes are used"
)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hc", [2, 3, 4])
def test_c_passes_equal_the_reference_bitwise(dtype: torch.dtype, hc: int) -> None:
    gen = torch.Generator().manual_seed(hc)
    for rows in (1, 5, 32, 100):
        logits = torch.randn(rows, hc, hc, generator=gen, dtype=dtype) * 6.0
        c = torch.softmax(logits, -1)
        assert cpu_sinkhorn.usable(c)
        for iters, eps in ((20, 1e-6), (2, 1e-3), (1, 1e-6)):
            got = cpu_sinkhorn.passes_(c.clone(), iters, eps)
            assert torch.equal(got, reference_sinkhorn(logits, iters, eps))


@needs_c
def test_sinkhorn_serves_from_c_and_equals_eager_and_training(monkeypatch) -> None:
    logits = torch.randn(7, 2, 4, 4, generator=torch.Generator().manual_seed(3)) * 4.0
    served = sinkhorn(logits, 20, 1e-6)
    monkeypatch.setenv(cpu_sinkhorn.ENV_VAR, "0")
    eager = sinkhorn(logits, 20, 1e-6)
    trained = sinkhorn(logits.clone().requires_grad_(), 20, 1e-6)
    assert torch.equal(served, eager)
    assert torch.equal(served, trained.detach())
    assert torch.equal(served, reference_sinkhorn(logits, 20, 1e-6))
    # Columns sum to 1 up to eps: a real normalisation, not a copy of the input.
    torch.testing.assert_close(served.sum(-2), torch.ones(7, 2, 4), atol=1e-5, rtol=0)


@needs_c
def test_hc_coefficients_equal_with_and_without_the_c_passes(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(5)
    R = torch.randn(9, 4, 16, generator=gen)
    fn = torch.randn(24, 64, generator=gen) * 0.1
    base, scale = torch.randn(24, generator=gen), torch.rand(3, generator=gen) + 0.5
    kw = dict(hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-6)
    fast = hc_coefficients(R, fn, base, scale, **kw)
    monkeypatch.setenv(cpu_sinkhorn.ENV_VAR, "0")
    slow = hc_coefficients(R, fn, base, scale, **kw)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


def test_not_used_where_the_order_is_not_known_to_match(monkeypatch) -> None:
    assert not cpu_sinkhorn.usable(torch.softmax(torch.randn(2, 5, 5), -1))  # hc > 4
    assert not cpu_sinkhorn.usable(torch.softmax(torch.randn(2, 4, 4), -1).transpose(-1, -2))
    assert not cpu_sinkhorn.usable(torch.rand(2, 4, 4, dtype=torch.bfloat16))
    monkeypatch.setenv(cpu_sinkhorn.ENV_VAR, "0")
    assert not cpu_sinkhorn.usable(torch.softmax(torch.randn(2, 4, 4), -1))
    # The eager fallback still does the work for what the C loop refuses.
    logits = torch.randn(3, 5, 5)
    assert torch.equal(sinkhorn(logits, 20, 1e-6), reference_sinkhorn(logits, 20, 1e-6))


def test_missing_compiler_leaves_the_eager_passes(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: None)
    assert cpu_native.build() is None


@needs_c
def test_suspended_runs_the_eager_passes() -> None:
    """A graph capture records tensor ops: inside ``cpu_native.suspended`` no C call is
    made (the C passes would be missing from the recording), and the result is equal."""
    c = torch.softmax(torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1)), -1)
    assert cpu_sinkhorn.usable(c)
    with cpu_native.suspended():
        assert not cpu_sinkhorn.usable(c) and not cpu_native.available()
        inside = sinkhorn(torch.log(c), 20, 1e-6)
    assert cpu_sinkhorn.usable(c)
    assert torch.equal(inside, sinkhorn(torch.log(c), 20, 1e-6))
