"""The power-law fit of the scaling experiment (Section 3.1, Figure 1a) recovers known laws, its uncertainty matches
the spread of repeated noisy fits, and bad input is refused by name."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from griffin.experiments.fit import crossover, fit_power_law, lowest_at

COMPUTE = np.geomspace(1e15, 1e19, 8)


def test_noiseless_points_give_the_law_exactly():
    fit = fit_power_law(COMPUTE, 12.3 * COMPUTE**-0.0512)
    assert fit.a == pytest.approx(12.3, rel=1e-9) and fit.b == pytest.approx(0.0512, rel=1e-9)
    assert fit.e == 0.0 and fit.n == 8 and fit.r2 == pytest.approx(1.0) and fit.residual_std < 1e-12
    assert fit.b_stderr < 1e-12 and fit.b_ci95[0] == pytest.approx(0.0512) and fit.b_ci95[1] == pytest.approx(0.0512)
    np.testing.assert_allclose(fit.predict([3e16, 5e20]), 12.3 * np.array([3e16, 5e20]) ** -0.0512, rtol=1e-9)
    assert re.fullmatch(r"loss = 12\.3 · C\^-0\.0512 \(b = 0\.0512 ± \S+, 95% CI 0\.0512–0\.0512, R² 1\.000\)",
                        fit.describe())


def test_noisy_points_interval_covers_the_truth_and_stderr_matches_the_spread():
    a, b, sigma = 9.0, 0.05, 0.02
    rng = np.random.default_rng(1234)
    noisy = a * COMPUTE**-b * np.exp(rng.normal(0.0, sigma, (200, len(COMPUTE))))
    fit = fit_power_law(COMPUTE, noisy[0], seed=7)
    assert fit.b_ci95[0] < b < fit.b_ci95[1] and fit.a_ci95[0] < a < fit.a_ci95[1]
    assert fit.b_ci95[0] <= fit.b_ci68[0] <= fit.b <= fit.b_ci68[1] <= fit.b_ci95[1]
    assert fit.n_bootstrap == 1000 and fit.residual_std == pytest.approx(sigma, rel=0.6)
    fits = [fit_power_law(COMPUTE, row, bootstrap=200, seed=i) for i, row in enumerate(noisy)]
    b_hat = np.array([f.b for f in fits])
    spread = b_hat.std(ddof=1)
    assert abs(b_hat.mean() - b) < 3 * spread / math.sqrt(len(fits))  # unbiased
    assert 0.85 < np.mean([f.b_stderr for f in fits]) / spread < 1.15  # E[s] / sigma = 0.96 at 6 dof
    la_hat = np.log([f.a for f in fits])
    assert 0.85 < np.mean([f.log_a_stderr for f in fits]) / la_hat.std(ddof=1) < 1.15
    covered = np.mean([f.b_ci95[0] < b < f.b_ci95[1] for f in fits])
    assert 0.85 <= covered <= 1.0  # percentile bootstrap over 8 points covers somewhat under 95%


def test_the_bootstrap_is_seeded():
    loss = 9.0 * COMPUTE**-0.05 * np.exp(np.random.default_rng(3).normal(0.0, 0.02, len(COMPUTE)))
    assert fit_power_law(COMPUTE, loss, seed=5).b_ci95 == fit_power_law(COMPUTE, loss, seed=5).b_ci95
    assert fit_power_law(COMPUTE, loss, seed=5).b_ci95 != fit_power_law(COMPUTE, loss, seed=6).b_ci95
    assert math.isnan(fit_power_law(COMPUTE, loss, bootstrap=0).b_ci95[0])


@pytest.mark.parametrize(("a", "b", "e"), [(40.0, 0.1, 1.7), (2e3, 0.25, 2.0), (5.0, 0.05, 0.0), (30.0, 0.1, 3.0)])
def test_irreducible_fit_recovers_a_b_e_from_noiseless_points(a, b, e):
    fit = fit_power_law(COMPUTE, e + a * COMPUTE**-b, irreducible=True, bootstrap=20)
    assert fit.a == pytest.approx(a, rel=1e-3) and fit.b == pytest.approx(b, rel=1e-3)
    assert fit.e == pytest.approx(e, rel=1e-3, abs=1e-6) and fit.irreducible and fit.r2 == pytest.approx(1.0)
    assert fit.describe().startswith(f"loss = {fit.e:.4g} + {fit.a:.4g} · C^-")


def test_irreducible_fit_on_curved_noisy_points():
    rng = np.random.default_rng(11)
    loss = (1.7 + 40.0 * COMPUTE**-0.1) * np.exp(rng.normal(0.0, 0.003, len(COMPUTE)))
    with_e = fit_power_law(COMPUTE, loss, irreducible=True, bootstrap=200)
    without = fit_power_law(COMPUTE, loss, bootstrap=200)
    assert with_e.e_ci95[0] < 1.7 < with_e.e_ci95[1] and with_e.b_ci95[0] < 0.1 < with_e.b_ci95[1]
    assert with_e.residual_std < without.residual_std / 2  # the curvature a pure power law cannot follow
    assert with_e.n_bootstrap > 150 and 0.0 <= with_e.e < loss.min()


def test_two_points_fit_exactly_with_nan_errors_and_json_safe_output():
    fit = fit_power_law([1e15, 1e17], [3.0, 2.5])
    assert fit.predict([1e15, 1e17]) == pytest.approx([3.0, 2.5])
    assert math.isnan(fit.b_stderr) and math.isnan(fit.log_a_stderr) and math.isnan(fit.residual_std)
    d = json.loads(json.dumps(fit.to_dict(), allow_nan=False))
    assert d["b_stderr"] is None and d["b_ci95"] == pytest.approx([fit.b, fit.b]) and d["n"] == 2
    d = json.loads(json.dumps(fit_power_law(COMPUTE, 1.7 + 40 * COMPUTE**-0.1, irreducible=True,
                                            bootstrap=10).to_dict(), allow_nan=False))
    assert set(d) == {f.name for f in dataclasses.fields(fit)} and d["irreducible"] is True


@pytest.mark.parametrize(("compute", "loss", "kwargs", "message"), [
    ([1e15, 1e16, 1e17], [3.0, 2.0], {}, "compute has 3 values but loss has 2"),
    ([1e15], [3.0], {}, "the power-law fit needs at least 2 points, got 1"),
    ([1e15, 1e16, 1e17], [3.0, 2.5, 2.0], {"irreducible": True}, "irreducible power-law fit needs at least 4 points"),
    ([1e15, 0.0, 1e17], [3.0, 2.5, 2.0], {}, "compute[1] = 0.0"),
    ([1e15, 1e16, math.inf], [3.0, 2.5, 2.0], {}, "compute[2] = inf"),
    ([1e15, 1e16, 1e17], [3.0, -2.5, 2.0], {}, "loss[1] = -2.5"),
    ([1e15, 1e16, 1e17], [math.nan, 2.5, 2.0], {}, "loss[0] = nan"),
    ([1e16, 1e16, 1e16], [3.0, 2.5, 2.0], {}, "all compute values are equal (1e+16)"),
    ([1e15, 1e15, 1e16, 1e16], [3.0, 2.9, 2.5, 2.4], {"irreducible": True}, "2 distinct compute values"),
    ([[1e15, 1e16]], [3.0, 2.5], {}, "compute must be a 1-D sequence of numbers, got shape (1, 2)"),
    ([1e15, 1e16, 1e17], [3.0, 2.5, 2.0], {"bootstrap": -1}, "bootstrap = -1"),
])
def test_bad_input_is_refused_by_name(compute, loss, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fit_power_law(compute, loss, **kwargs)


def _law(a: float, b: float):
    return fit_power_law(COMPUTE, a * COMPUTE**-b, bootstrap=0)


def test_lowest_at_and_crossover_on_laws_with_a_known_crossing():
    # 10 C^-0.05 = 20 C^-0.1  <=>  C^0.05 = 2  <=>  C = 2^20
    mqa, griffin = _law(10.0, 0.05), _law(20.0, 0.1)
    assert crossover(mqa, griffin) == pytest.approx(2.0**20, rel=1e-6)
    assert crossover(griffin, mqa) == pytest.approx(2.0**20, rel=1e-6)
    assert lowest_at({"mqa": mqa, "griffin": griffin}, [1e3, 2.0**19, 2.0**21, 1e9]) == ["mqa", "mqa", "griffin",
                                                                                          "griffin"]
    assert lowest_at({"zeta": mqa, "alpha": _law(10.0, 0.05)}, [1e6]) == ["alpha"]  # a tie goes to the first name
    assert crossover(mqa, _law(5.0, 0.05)) is None  # parallel
    assert crossover(mqa, dataclasses.replace(mqa, a=math.exp(-50.0), b=0.05 + 1e-2)) is None  # C = e^-5230 underflows
    with pytest.raises(ValueError, match=re.escape("fit2 has an irreducible term e = 1.5")):
        crossover(mqa, dataclasses.replace(griffin, e=1.5))
    with pytest.raises(ValueError, match=re.escape("budgets[0] = -1.0")):
        lowest_at({"mqa": mqa}, [-1.0])
    with pytest.raises(ValueError, match="at least one fitted law"):
        lowest_at({}, [1e15])
    with pytest.raises(ValueError, match=re.escape("compute[0] = 0.0")):
        mqa.predict([0.0])
