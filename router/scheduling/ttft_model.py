"""Prefill time as a function of uncached tokens, calibrated from what the router observes.

    prefill(x) = a + b*x + c*x^2          x = prompt tokens the prefill pod must compute

One fit per ModelServer (`TTFTModels`), seeded by the config (`costModel.prefillOverhead`,
`costModel.prefillSecondsPerToken`, c = 0) and refitted from the prefill phase durations
the proxy measures (sequential PD: the prefill call's time until the KV handle is back).

Only clean samples feed the fit: the prefill pod had nothing else in flight from this
router when the request was dispatched, so the duration is prefill (plus the pool pull
the router planned, subtracted with the server's bandwidth), not queueing. Every sample,
clean or not, is compared with the full prediction (queue + prefill + pull) for the
prediction-error metrics.

Robustness: a sliding window of the last `window` clean samples, refitted every
`refit_every` samples by iteratively reweighted least squares on relative residuals: Huber
weights first (beyond `huber_k` x 1.4826 x MAD a residual counts linearly), then Tukey's
bisquare (a stalled request, several times its prefill, gets no weight at all),
then bounded: every coefficient >= 0 (a negative one is dropped and the rest refitted), a <=
`max_overhead_s`, and the curve within `max_ratio` of the seed at the window's largest x
(a fit far from the seed is more likely a broken measurement than a new GPU). Fewer than
`min_samples` samples, or a single distinct x: the seed stays; two distinct x (say, full
hits and misses of one prompt length) fit a line. Cost: O(window) per
refit, nothing per request but one append.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

#: Bound of the per-server fit table (ModelServers; a fit is a few hundred floats).
MAX_FITS: Final = 1024
#: IRLS iterations per refit.
_IRLS_ROUNDS: Final = 6


@dataclass(frozen=True, slots=True)
class FitSettings:
    """`ttftModel` in the scheduler config."""

    enabled: bool = True
    window: int = 256
    min_samples: int = 16
    refit_every: int = 8
    huber_k: float = 1.5
    max_overhead_s: float = 10.0
    max_ratio: float = 20.0
    #: Weight of the newest sample in the running mean absolute prediction error.
    error_alpha: float = 0.05


@dataclass(frozen=True, slots=True)
class Coefficients:
    a: float
    b: float
    c: float = 0.0

    def __call__(self, tokens: float) -> float:
        x = max(0.0, tokens)
        return self.a + x * (self.b + x * self.c)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][k] * out[k] for k in range(r + 1, n))) / a[r][r]
    return out


def _weighted_lsq(
    xs: list[float], ys: list[float], ws: list[float], terms: tuple[int, ...]
) -> list[float] | None:
    """Weighted least squares of y on the powers `terms` of x (scaled for conditioning)."""
    scale = max(xs) or 1.0
    n = len(terms)
    m = [[0.0] * n for _ in range(n)]
    v = [0.0] * n
    for x, y, w in zip(xs, ys, ws, strict=True):
        u = x / scale
        feats = [u**t for t in terms]
        for i in range(n):
            fi = w * feats[i]
            v[i] += fi * y
            row = m[i]
            for j in range(n):
                row[j] += fi * feats[j]
    sol = _solve(m, v)
    if sol is None:
        return None
    return [coef / scale**t for coef, t in zip(sol, terms, strict=True)]


def robust_fit(
    xs: list[float], ys: list[float], huber_k: float = 1.5
) -> Coefficients | None:
    """Robust fit of y = a + b x + c x^2 with a, b, c >= 0; None if underdetermined.

    Residuals are taken relative to the prediction (prefill noise is proportional to its
    length), weighted by Huber for the first rounds, then by Tukey's bisquare (which
    drops gross outliers entirely); a negative coefficient drops its term.
    """
    distinct = len(set(xs))
    if len(xs) < 3 or distinct < 2:
        return None
    for terms in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (1,), (0,)):
        if len(terms) > distinct:  # two prompt lengths determine a line, not a parabola
            continue
        ws = [1.0 / max(y, 1e-9) ** 2 for y in ys]
        coef: list[float] | None = None
        for round_index in range(_IRLS_ROUNDS):
            coef = _weighted_lsq(xs, ys, ws, terms)
            if coef is None:
                break
            full = dict(zip(terms, coef, strict=True))
            preds = [
                max(1e-9, full.get(0, 0.0) + full.get(1, 0.0) * x + full.get(2, 0.0) * x * x)
                for x in xs
            ]
            rel = [(y - p) / p for y, p in zip(ys, preds, strict=True)]
            spread = 1.4826 * sorted(abs(r) for r in rel)[len(rel) // 2]
            if spread <= 0:
                break
            if round_index < _IRLS_ROUNDS // 2:
                cut = huber_k * spread
                robust = [1.0 if abs(r) <= cut else cut / abs(r) for r in rel]
            else:
                cut = 4.685 * spread * max(1.0, huber_k / 1.5)
                robust = [(1 - (r / cut) ** 2) ** 2 if abs(r) < cut else 0.0 for r in rel]
            ws = [w / (p * p) for w, p in zip(robust, preds, strict=True)]
        if coef is None or any(c < 0 for c in coef):
            continue
        full = dict(zip(terms, coef, strict=True))
        return Coefficients(full.get(0, 0.0), full.get(1, 0.0), full.get(2, 0.0))
    return None


class PrefillFit:
    """One ModelServer's prefill curve and its prediction error (see the module docstring)."""

    __slots__ = (
        "_pending",
        "_xs",
        "_ys",
        "coefficients",
        "error_abs_s",
        "measured_s",
        "observed",
        "refits",
        "seed",
        "settings",
    )

    def __init__(self, seed: Coefficients, settings: FitSettings) -> None:
        self.seed = seed
        self.settings = settings
        self.coefficients = seed
        self._xs: deque[float] = deque(maxlen=max(3, settings.window))
        self._ys: deque[float] = deque(maxlen=max(3, settings.window))
        self._pending = 0
        self.refits = 0
        self.observed = 0
        self.error_abs_s = 0.0  # running mean |predicted - measured| (every sample)
        self.measured_s = 0.0  # running mean of the measured durations, the same weights

    def predict(self, tokens: float) -> float:
        curve = self.coefficients
        x = tokens if tokens > 0.0 else 0.0  # max(0.0, tokens), inlined: one call less
        return curve.a + x * (curve.b + x * curve.c)

    def observe_error(self, predicted_s: float, measured_s: float) -> None:
        alpha = self.settings.error_alpha
        err = abs(predicted_s - measured_s)
        if self.observed == 0:
            self.error_abs_s, self.measured_s = err, measured_s
        else:
            self.error_abs_s += alpha * (err - self.error_abs_s)
            self.measured_s += alpha * (measured_s - self.measured_s)
        self.observed += 1

    @property
    def error_rel(self) -> float:
        """The running mean error over the running mean duration (a weighted absolute
        percentage error). A mean of each prefill's own ratio is ruled by the short ones,
        where a queue predicted and not met makes the error many times the duration: one
        50 ms prefill predicted at 1 s is a ratio of 19, which adds 0.95 to such a mean at
        `error_alpha` 0.05, a third of it still there twenty prefills later."""
        return self.error_abs_s / self.measured_s if self.measured_s > 0.0 else 0.0

    def add_sample(self, tokens: float, seconds: float) -> None:
        """A clean prefill: `tokens` computed in `seconds` (pull time already subtracted)."""
        if not self.settings.enabled or seconds <= 0 or not math.isfinite(seconds):
            return
        self._xs.append(max(0.0, tokens))
        self._ys.append(seconds)
        self._pending += 1
        if len(self._xs) >= self.settings.min_samples and self._pending >= max(
            1, self.settings.refit_every
        ):
            self._pending = 0
            self.refit()

    def refit(self) -> None:
        fit = robust_fit(list(self._xs), list(self._ys), self.settings.huber_k)
        if fit is None:
            return
        fit = Coefficients(min(fit.a, self.settings.max_overhead_s), fit.b, fit.c)
        top = max(self._xs)
        seeded = self.seed(top)
        if seeded > 0:
            ratio = fit(top) / seeded
            if not 1.0 / self.settings.max_ratio <= ratio <= self.settings.max_ratio:
                return
        self.coefficients = fit
        self.refits += 1

    @property
    def samples(self) -> int:
        return len(self._xs)


class TTFTModels:
    """Per-ModelServer prefill fits, created on first use from the config seed."""

    def __init__(
        self,
        seed: Coefficients,
        settings: FitSettings,
        on_new: Callable[[str, PrefillFit], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.seed = seed
        self.settings = settings
        self._fits: dict[str, PrefillFit] = {}
        self.on_new = on_new
        self.on_drop = on_drop

    def configure(self, seed: Coefficients, settings: FitSettings) -> None:
        """A config reload: a new seed restarts the fits; new settings apply from now."""
        if seed != self.seed:
            for scope in list(self._fits):
                self._drop(scope)
        elif settings != self.settings:
            for fit in self._fits.values():
                fit.settings = settings
        self.seed = seed
        self.settings = settings

    def get(self, scope: str) -> PrefillFit:
        fit = self._fits.get(scope)
        if fit is None:
            if len(self._fits) >= MAX_FITS:
                self._drop(next(iter(self._fits)))
            fit = self._fits[scope] = PrefillFit(self.seed, self.settings)
            if self.on_new is not None:
                self.on_new(scope, fit)
        return fit

    def _drop(self, scope: str) -> None:
        del self._fits[scope]
        if self.on_drop is not None:
            self.on_drop(scope)

    def items(self) -> list[tuple[str, PrefillFit]]:
        return list(self._fits.items())

    def retain_scopes(self, scopes: set[str]) -> None:
        for scope in [s for s in self._fits if s not in scopes]:
            self._drop(scope)
