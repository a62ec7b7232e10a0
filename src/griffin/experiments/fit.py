"""Power-law fits of held-out loss against training compute (Section 3.1, Figure 1a).

Figure 1a plots each family's held-out loss against training FLOPs on log-log axes, where it follows a straight
line, loss = a · C^-b. :func:`fit_power_law` fits that law (or loss = e + a · C^-b, with an irreducible loss e) by
least squares on log(loss), with standard errors and bootstrap intervals; :func:`lowest_at` and :func:`crossover`
compare the fitted laws of several families. numpy only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_E_MARGIN = 1e-9  # e stays below min(loss) * (1 - _E_MARGIN), where log(loss - e) is finite


@dataclass(frozen=True)
class PowerLawFit:
    """A fitted loss = e + a · C^-b (Section 3.1), e = 0 unless ``irreducible``; errors are in log(loss).

    ``b_stderr`` / ``log_a_stderr``: from the least-squares covariance, nan when there are as many points as
    parameters (the fit is exact). ``b_ci68``, ``b_ci95``, ``a_ci95``, ``e_ci95``: bootstrap percentile intervals
    over the points (nan without usable resamples; ``e_ci95`` is (0, 0) when e is not fitted). ``n_bootstrap``:
    the resamples used. ``residual_std``: of log(loss), over n minus the parameter count.
    """

    a: float
    b: float
    e: float
    b_stderr: float
    log_a_stderr: float
    r2: float
    n: int
    b_ci68: tuple[float, float]
    b_ci95: tuple[float, float]
    a_ci95: tuple[float, float]
    e_ci95: tuple[float, float]
    residual_std: float
    irreducible: bool = False
    n_bootstrap: int = 0

    def predict(self, compute: ArrayLike) -> np.ndarray:
        """The fitted loss at each training compute (FLOPs, positive)."""
        c = _positive("compute", compute, allow_scalar=True)
        return self.e + self.a * np.exp(-self.b * np.log(c))

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-safe values: tuples as lists, nan and inf as None."""

        def clean(v: Any) -> Any:
            if isinstance(v, (tuple, list)):
                return [clean(x) for x in v]
            if isinstance(v, float):
                return float(v) if math.isfinite(v) else None
            return v

        return {k: clean(v) for k, v in asdict(self).items()}

    def describe(self) -> str:
        """One line: the law, b with its standard error and 95% interval, and R² in log space."""
        head = f"{self.e:.4g} + " if self.irreducible else ""
        lo, hi = self.b_ci95
        return (f"loss = {head}{self.a:.4g} · C^{-self.b:.4g} (b = {self.b:.4g} ± {self.b_stderr:.2g}, "
                f"95% CI {lo:.3g}–{hi:.3g}, R² {self.r2:.3f})")


def _positive(name: str, values: ArrayLike, allow_scalar: bool = False) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1 and not (allow_scalar and arr.ndim == 0):
        raise ValueError(f"{name} must be a 1-D sequence of numbers, got shape {arr.shape}")
    bad = ~(np.isfinite(arr) & (arr > 0))
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        raise ValueError(f"{name}[{i}] = {float(arr.reshape(-1)[i])!r}: every {name} value must be positive and "
                         "finite")
    return arr


def _ols(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Weighted least squares of y on x along the last axis (broadcast): slope, intercept, residual SS, Sxx."""
    w = np.ones_like(y) if w is None else w
    sw = w.sum(-1, keepdims=True)
    xm, ym = (w * x).sum(-1, keepdims=True) / sw, (w * y).sum(-1, keepdims=True) / sw
    dx = x - xm
    sxx = (w * dx * dx).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = (w * dx * (y - ym)).sum(-1) / sxx
    intercept = ym[..., 0] - slope * xm[..., 0]
    resid = y - intercept[..., None] - slope[..., None] * x
    return slope, intercept, (w * resid * resid).sum(-1), sxx


def _given_e(x: np.ndarray, loss: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each e (broadcast on a leading axis): (slope, intercept) of log(loss - e) on log(C), weighted by
    ((loss - e) / loss)^2 so that its residuals approximate those of log(loss), and the squared error of log(loss)."""
    e = np.asarray(e, dtype=float)[..., None]
    w = ((loss - e) / loss) ** 2
    slope, intercept, _, _ = _ols(x, np.log(loss - e), w)
    pred = np.log(e + np.exp(intercept[..., None] + slope[..., None] * x))
    return slope, intercept, ((np.log(loss) - pred) ** 2).sum(-1)


def _profile_e(x: np.ndarray, loss: np.ndarray) -> float:
    """The e in [0, min(loss)) minimising :func:`_given_e`'s squared error: a grid, then golden section."""
    emax = loss.min() * (1.0 - _E_MARGIN)
    grid = np.unique(np.concatenate([np.linspace(0.0, emax, 256), loss.min() * (1.0 - np.geomspace(1e-2, 1e-9, 64))]))
    sse = _given_e(x, loss, grid)[2]
    k = int(np.nanargmin(sse))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]

    def f(e: float) -> float:
        return float(_given_e(x, loss, np.array(e))[2])

    c, d = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fc, fd = f(c), f(d)
    while hi - lo > 1e-9 * max(emax, 1e-300):  # Levenberg-Marquardt below polishes
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - _GOLDEN * (hi - lo)
            fc = f(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + _GOLDEN * (hi - lo)
            fd = f(d)
    e = 0.5 * (lo + hi)
    return e if f(e) <= sse[k] else float(grid[k])


def _fit(x: np.ndarray, loss: np.ndarray, irreducible: bool) -> tuple[float, float, float, float, np.ndarray | None]:
    """(log a, b, e, residual sum of squares in log(loss), covariance of (log a, b) per unit residual variance)."""
    y = np.log(loss)
    if not irreducible:
        slope, intercept, ssr, sxx = _ols(x, y)
        xm = x.mean()
        unit = np.array([[1.0 / len(x) + xm * xm / sxx, xm / sxx], [xm / sxx, 1.0 / sxx]])
        return float(intercept), float(-slope), 0.0, float(ssr), unit
    e = _profile_e(x, loss)
    slope, intercept, _ = _given_e(x, loss, np.array(e))
    # Polish (c, b, e) on the squared error of log(loss) itself (Levenberg-Marquardt), c = log a - b * mean(x).
    xm, emax = x.mean(), loss.min() * (1.0 - _E_MARGIN)
    xc = x - xm
    p = np.array([float(intercept) + float(slope) * xm, -float(slope), e])

    def model(p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        g = np.exp(p[0] - p[1] * xc)
        d = p[2] + g
        return y - np.log(d), g, d

    r, g, d = model(p)
    s, lam = float(r @ r), 1e-3
    for _ in range(200):
        jac = np.stack([g / d, -xc * g / d, 1.0 / d], axis=1)
        a_mat = jac.T @ jac
        try:
            step = np.linalg.solve(a_mat + lam * np.diag(np.diag(a_mat)), jac.T @ r)
        except np.linalg.LinAlgError:
            break
        q = p + step
        q[2] = min(max(q[2], 0.0), emax)
        rq, gq, dq = model(q)
        sq = float(rq @ rq)
        if sq < s:
            done = s - sq <= 1e-12 * s
            p, r, g, d, s, lam = q, rq, gq, dq, sq, max(lam / 10.0, 1e-12)
            if done:
                break
        else:
            lam *= 10.0
            if lam > 1e12:
                break
    jac = np.stack([g / d, -xc * g / d, 1.0 / d], axis=1)
    try:
        cov = np.linalg.inv(jac.T @ jac)
        t = np.array([[1.0, xm, 0.0], [0.0, 1.0, 0.0]])  # (c, b, e) -> (log a, b)
        unit = t @ cov @ t.T
    except np.linalg.LinAlgError:
        unit = None
    return float(p[0] + p[1] * xm), float(p[1]), float(p[2]), s, unit


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    if len(samples) == 0:
        return (math.nan, math.nan)
    lo, hi = np.percentile(samples, [50.0 - level / 2.0, 50.0 + level / 2.0])
    return (float(lo), float(hi))


def fit_power_law(compute: ArrayLike, loss: ArrayLike, *, irreducible: bool = False, bootstrap: int = 1000,
                  seed: int = 0) -> PowerLawFit:
    """Fit loss = a · C^-b (or e + a · C^-b with ``irreducible``) to held-out loss against compute (Figure 1a).

    Without e: ordinary least squares of log(loss) on log(C); needs 2 points, and with exactly 2 the fit is exact and
    the standard errors are nan. With e (0 <= e < min(loss)): least squares of log(loss) over (log a, b, e), found by a
    1-D search over e (for a fixed e the rest is OLS of log(loss - e) on log(C)) and polished on all three; needs 4
    points and 3 distinct C. ``bootstrap`` resamples of the points (seeded by ``seed``) give the percentile
    intervals, skipping resamples with fewer distinct C than the fit needs.
    """
    c, lv = _positive("compute", compute), _positive("loss", loss)
    if len(c) != len(lv):
        raise ValueError(f"compute has {len(c)} values but loss has {len(lv)}; they must pair up")
    need_n, need_distinct, params = (4, 3, 3) if irreducible else (2, 2, 2)
    if len(c) < need_n:
        raise ValueError(f"the {'irreducible ' if irreducible else ''}power-law fit needs at least {need_n} points, "
                         f"got {len(c)}")
    distinct = len(np.unique(c))
    if distinct == 1:
        raise ValueError(f"all compute values are equal ({float(c[0])!r}); a power law needs distinct budgets")
    if distinct < need_distinct:
        raise ValueError(f"{distinct} distinct compute values; the irreducible fit needs at least {need_distinct}")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise ValueError(f"bootstrap = {bootstrap!r}: must be a non-negative number of resamples")
    x, n = np.log(c), len(c)
    log_a, b, e, ssr, unit = _fit(x, lv, irreducible)
    ly = np.log(lv)
    sst = float(((ly - ly.mean()) ** 2).sum())
    df = n - params
    s2 = ssr / df if df > 0 else math.nan
    cov = unit * s2 if unit is not None else np.full((2, 2), math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(bootstrap, n))
    xs, ys = x[idx], lv[idx]
    keep = 1 + (np.diff(np.sort(xs, axis=1), axis=1) > 0).sum(axis=1) >= need_distinct
    xs, ys = xs[keep], ys[keep]
    if irreducible:
        boot = np.array([_fit(xr, yr, True)[:3] for xr, yr in zip(xs, ys, strict=True)]).reshape(-1, 3)
        la_s, b_s, e_s = boot[:, 0], boot[:, 1], boot[:, 2]
    else:
        slope, intercept, _, _ = _ols(xs, np.log(ys))
        la_s, b_s, e_s = intercept, -slope, np.zeros(len(xs))
    return PowerLawFit(
        a=math.exp(log_a), b=b, e=e, b_stderr=math.sqrt(cov[1, 1]), log_a_stderr=math.sqrt(cov[0, 0]),
        r2=1.0 - ssr / sst if sst > 0 else math.nan, n=n,
        b_ci68=_interval(b_s, 68.0), b_ci95=_interval(b_s, 95.0), a_ci95=_interval(np.exp(la_s), 95.0),
        e_ci95=_interval(e_s, 95.0), residual_std=math.sqrt(s2), irreducible=irreducible, n_bootstrap=len(xs))


def lowest_at(fits: dict[str, PowerLawFit], budgets: ArrayLike) -> list[str]:
    """The family whose fitted law is lowest at each compute budget (Figure 1a); ties go to the first name."""
    if not fits:
        raise ValueError("lowest_at needs at least one fitted law, got none")
    c = _positive("budgets", budgets)
    pred = {name: fit.predict(c) for name, fit in fits.items()}
    return [min(fits, key=lambda name, j=j: (float(pred[name][j]), name)) for j in range(len(c))]


def crossover(fit1: PowerLawFit, fit2: PowerLawFit) -> float | None:
    """The compute where two fitted laws a · C^-b (no irreducible term) cross; None if parallel or not finite."""
    for name, fit in (("fit1", fit1), ("fit2", fit2)):
        if fit.e != 0.0:
            raise ValueError(f"{name} has an irreducible term e = {fit.e!r}; crossover takes laws without one")
    db = fit1.b - fit2.b
    if db == 0.0 or abs(db) <= 1e-12 * max(abs(fit1.b), abs(fit2.b)):
        return None
    log_c = (math.log(fit1.a) - math.log(fit2.a)) / db
    if not -745.0 < log_c < 709.0:  # exp would underflow to 0 or overflow: no finite positive crossing
        return None
    return math.exp(log_c)
