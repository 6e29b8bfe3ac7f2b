"""The exactness identity of verification, at the sampler level (no engine, no model).

The engine verifies a point-mass draft ``d`` by sampling the target's row as a
plain step would and accepting when the sample equals ``d``
(engine/spec_decode/proposer.py). Standard rejection sampling with a draft
distribution ``q`` accepts ``d ~ q`` with probability ``min(1, p(d) / q(d))``
and otherwise draws from the residual ``(p - q)+``, normalised. For ``q``
the point mass on ``d`` the two are the same: acceptance ``p(d)``, and a
rejected sample is ``p`` without ``d``, renormalised, which is the residual.

Oracles: chi-square goodness of fit against ``p`` (and against the residual)
over many seeded draws, at a fixed threshold; a wrong scheme (resample from
``p`` on rejection) must fail the same test.
"""

from __future__ import annotations

import torch

from engine.sample.sampler import exponential_race

P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05], dtype=torch.float64)
DRAFT = 1  # the proposer's token, p(DRAFT) = 0.25
DRAWS = 200_000
# Upper 1e-4 quantiles of the chi-square distribution (5 and 4 degrees of freedom):
# a correct sampler fails with probability 1e-4 per check, before seeding fixes it.
CHI2_DF5 = 25.74
CHI2_DF4 = 23.51


def chi_square(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic of ``samples`` (token ids) against the probabilities ``expected``
    (categories of zero probability must never occur and are left out)."""
    counts = torch.bincount(samples, minlength=len(expected)).to(torch.float64)
    support = expected > 0
    assert counts[~support].sum() == 0, "a token of zero probability was drawn"
    want = expected[support] * len(samples)
    return float(((counts[support] - want) ** 2 / want).sum())


def target_samples(n: int, seed: int) -> torch.Tensor:
    """``n`` draws from ``P`` through the engine sampler's own draw (the exponential race)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return exponential_race(P.expand(n, -1).clone(), [None] * n)


def test_the_sampler_draws_the_target() -> None:
    assert chi_square(target_samples(DRAWS, seed=1), P) < CHI2_DF5


def test_sample_and_compare_is_rejection_sampling_for_a_point_mass() -> None:
    # The engine's rule: sample p, accept when equal; the output is the sample either way.
    x = target_samples(DRAWS, seed=2)
    accepted = x == DRAFT
    out_engine = x

    # Standard rejection sampling with q = delta_DRAFT, written from its definition.
    q = torch.zeros_like(P)
    q[DRAFT] = 1.0
    g = torch.Generator().manual_seed(3)
    u = torch.rand(DRAWS, generator=g, dtype=torch.float64)
    keep = u < torch.clamp(P[DRAFT] / q[DRAFT], max=1.0)
    residual = torch.clamp(P - q, min=0.0)
    residual = residual / residual.sum()
    fallback = torch.multinomial(residual, DRAWS, replacement=True, generator=g)
    out_standard = torch.where(keep, torch.full_like(fallback, DRAFT), fallback)

    # Both output p.
    assert chi_square(out_engine, P) < CHI2_DF5
    assert chi_square(out_standard, P) < CHI2_DF5
    # Both accept with probability p(d): 4.5 standard deviations of a binomial proportion.
    sd = (0.25 * 0.75 / DRAWS) ** 0.5
    for rate in (accepted.double().mean(), keep.double().mean()):
        assert abs(float(rate) - 0.25) < 4.5 * sd
    # The engine's rejected samples are the residual (p - q)+, normalised: p without d.
    expected_residual = P.clone()
    expected_residual[DRAFT] = 0.0
    expected_residual /= expected_residual.sum()
    assert torch.allclose(residual, expected_residual)
    assert chi_square(x[~accepted], residual) < CHI2_DF4


def test_a_wrong_scheme_fails_the_same_check() -> None:
    """Accept with p(d), else resample from p itself (not the residual): d comes out
    with 0.25 + 0.75 * 0.25 = 0.44 instead of 0.25, and the test sees it."""
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(DRAWS, generator=g, dtype=torch.float64) < P[DRAFT]
    resampled = target_samples(DRAWS, seed=5)
    wrong = torch.where(keep, torch.full_like(resampled, DRAFT), resampled)
    assert chi_square(wrong, P) > 100 * CHI2_DF5
    # And the engine's rejected samples do not look like p (d is missing from them).
    x = target_samples(DRAWS, seed=6)
    rejected = x[x != DRAFT]
    counts = torch.bincount(rejected, minlength=len(P)).double()
    assert counts[DRAFT] == 0
    assert ((counts - P * len(rejected)) ** 2 / (P * len(rejected))).sum() > 100 * CHI2_DF5


def test_general_draft_distribution_rejection_sampling_keeps_p() -> None:
    """The identity the point mass is a case of: for any q, accepting d ~ q with
    min(1, p/q) and else drawing (p - q)+ normalised outputs p."""
    q = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10], dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    d = torch.multinomial(q, DRAWS, replacement=True, generator=g)
    u = torch.rand(DRAWS, generator=g, dtype=torch.float64)
    keep = u < torch.clamp(P[d] / q[d], max=1.0)
    residual = torch.clamp(P - q, min=0.0)
    fallback = torch.multinomial(residual / residual.sum(), DRAWS, replacement=True, generator=g)
    assert chi_square(torch.where(keep, d, fallback), P) < CHI2_DF5
