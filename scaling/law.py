"""Scaling laws fitted to (parameters, tokens, loss) points: the one-budget L(N) = E + A/N^alpha and Chinchilla's
L(N, D) = E + A/N^alpha + B/D^beta, a bootstrap interval for a prediction, the compute-optimal (N, D) at a FLOP
budget, and an expanding-window backtest.

Units everywhere: n is non-embedding parameters, d training tokens, loss nats per token, flops 6 N D.
Sources: Kaplan et al. 2020 (L(N)); Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models"
(L(N, D), its Approach 3 fit and its eq. 4 compute-optimal frontier). Bad input raises ValueError with one
readable sentence; the commands turn it into their one-line error.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

HUBER_DELTA = 1e-3
"""Huber's delta on log-loss residuals (Hoffmann et al. 2022, Approach 3)."""
SAME_RATIO = 1.1
"""Tokens-per-parameter ratios d/n within this factor of their neighbour count as one budget: a ladder rounds
each budget's tokens to whole steps, so one budget's ratio differs a little from rung to rung."""


@dataclass(frozen=True)
class PowerLaw:
    """L(N) = E + A/N^alpha: loss (nats/token) against non-embedding parameters N, at one token budget per size."""
    E: float
    A: float
    alpha: float
    form = "L(N) = E + A/N^alpha"

    def predict(self, n, d=None) -> np.ndarray | float:
        """The loss at n parameters (scalar or array; d is ignored: this form has one budget per size)."""
        out = self.E + self.A * np.asarray(n, dtype=float) ** -self.alpha
        return float(out) if out.ndim == 0 else out

    def as_dict(self) -> dict:
        """{"E", "A", "alpha"} as plain floats (the form is `self.form`)."""
        return {"E": self.E, "A": self.A, "alpha": self.alpha}


@dataclass(frozen=True)
class ChinchillaLaw:
    """L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022, eq. 2): loss in nats/token against non-embedding
    parameters N and training tokens D."""
    E: float
    A: float
    alpha: float
    B: float
    beta: float
    form = "L(N, D) = E + A/N^alpha + B/D^beta"

    def predict(self, n, d) -> np.ndarray | float:
        """The loss at n parameters trained on d tokens (scalars or arrays that broadcast)."""
        out = (self.E + self.A * np.asarray(n, dtype=float) ** -self.alpha
               + self.B * np.asarray(d, dtype=float) ** -self.beta)
        return float(out) if out.ndim == 0 else out

    def as_dict(self) -> dict:
        """{"E", "A", "alpha", "B", "beta"} as plain floats (the form is `self.form`)."""
        return {"E": self.E, "A": self.A, "alpha": self.alpha, "B": self.B, "beta": self.beta}

    def optimal(self, flops: float) -> tuple[float, float, float]:
        """(N, D, predicted loss) minimising L(N, D) subject to 6 N D = flops.

        Hoffmann et al. 2022, eq. 4: G = (alpha A / (beta B))^(1/(alpha+beta)), N = G (C/6)^(beta/(alpha+beta)),
        D = (C/6) / N. Raises ValueError if flops <= 0, or if alpha or beta <= 0 (no finite optimum).
        """
        if not (flops > 0 and math.isfinite(flops)):
            raise ValueError(f"the compute budget must be a positive number of FLOPs, got {flops}")
        if self.alpha <= 0 or self.beta <= 0:
            raise ValueError(f"the fit's exponents alpha={self.alpha:.3g}, beta={self.beta:.3g} are not both "
                             "positive: it has no compute-optimal size")
        k = flops / 6
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        n = g * k ** (self.beta / (self.alpha + self.beta))
        return n, k / n, self.predict(n, k / n)


Law = PowerLaw | ChinchillaLaw


def _points(n, d, loss) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """n, d (or None), loss as 1-D float arrays of one length, finite and positive; ValueError otherwise."""
    arrays = [np.asarray(n, dtype=float).ravel(), None if d is None else np.asarray(d, dtype=float).ravel(),
              np.asarray(loss, dtype=float).ravel()]
    for name, a in zip(("parameters", "tokens", "losses"), arrays):
        if a is None:
            continue
        if a.shape != arrays[0].shape:
            raise ValueError(f"the fit got {arrays[0].size} parameter counts but {a.size} {name}")
        if not (np.all(np.isfinite(a)) and np.all(a > 0)):
            raise ValueError(f"the fit needs finite, positive {name}, got {a.tolist()}")
    return arrays[0], arrays[1], arrays[2]


def ratio_count(n, d) -> int:
    """How many distinct tokens-per-parameter ratios d/n the points hold (ratios within SAME_RATIO count as one)."""
    r = np.sort(np.log(np.asarray(d, dtype=float) / np.asarray(n, dtype=float)))
    return 1 + int(np.sum(np.diff(r) > math.log(SAME_RATIO))) if r.size else 0


# ---- L(N): least squares, alpha on a grid --------------------------------------------------------------------

def _power_grid(n: np.ndarray, loss: np.ndarray, alphas: np.ndarray) -> tuple[np.ndarray, ...]:
    """For each alpha, the least-squares E >= 0, A >= 0 (linear given alpha) and its squared error."""
    x = n[None, :] ** -alphas[:, None]  # [alphas, points]
    xm, ym = x.mean(1), loss.mean()
    a = ((x - xm[:, None]) * (loss - ym)).sum(1) / ((x - xm[:, None]) ** 2).sum(1)
    e = ym - a * xm
    # The constrained optimum of this convex problem is the free one when feasible, else on an edge:
    # E = 0 (the pure power law) or A = 0 (a flat loss).
    cands = [(e, a), (np.zeros_like(a), x @ loss / (x * x).sum(1)), (np.full_like(a, ym), np.zeros_like(a))]
    errs = [np.where((ce >= 0) & (ca >= 0), ((ce[:, None] + ca[:, None] * x - loss) ** 2).sum(1), np.inf)
            for ce, ca in cands]
    pick = np.argmin(np.stack(errs), axis=0)
    rows = np.arange(alphas.size)
    return (np.stack(errs)[pick, rows], np.stack([c[0] for c in cands])[pick, rows],
            np.stack([c[1] for c in cands])[pick, rows])


def _check_power(n: np.ndarray) -> None:
    """ValueError unless the points can tell L(N)'s three parameters apart."""
    if np.unique(n).size < 3:
        raise ValueError(f"the L(N) fit needs points at 3 or more model sizes, got {np.unique(n).size}")


def fit_power(n, loss) -> PowerLaw:
    """L(N) = E + A/N^alpha by least squares on the loss, E >= 0, A >= 0, alpha in [1e-4, 2].

    n: non-embedding parameters, loss: nats/token (1-D, same length). Given alpha, E and A are linear least
    squares; alpha is searched on a grid of 2000 over [0.01, 2], then twice on a 100x finer one around the best
    (Kaplan et al. 2020's form with Hoffmann et al. 2022's E). ValueError below 3 distinct sizes.
    """
    n, _, loss = _points(n, None, loss)
    _check_power(n)
    grid = np.linspace(0.01, 2.0, 2000)
    for _ in range(3):  # the grid, then twice a finer one around its best alpha
        err, e, a = _power_grid(n, loss, grid)
        i = int(np.argmin(err))
        best = (float(e[i]), float(a[i]), float(grid[i]))
        step = grid[1] - grid[0]
        grid = np.linspace(max(1e-4, best[2] - step), best[2] + step, 201)
    return PowerLaw(*best)


# ---- L(N, D): Huber on log L, quasi-Newton from a grid of starts ----------------------------------------------

def _huber_log(theta: np.ndarray, x: np.ndarray, y: np.ndarray, logl: np.ndarray, weight: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Objective and gradient for S starts at once. theta [S, 5] = (a, b, e, alpha, beta) with x, y the centred
    log N, log D [P]: sum over points of weight * Huber(LSE(a - alpha x, b - beta y, e) - log L), weight [S, P]
    (a bootstrap resample's count of each point) or 1. Returns ([S], [S, 5])."""
    t = np.stack([theta[:, 0:1] - theta[:, 3:4] * x, theta[:, 1:2] - theta[:, 4:5] * y,
                  np.broadcast_to(theta[:, 2:3], (theta.shape[0], x.size))])  # [3, S, P]
    m = t.max(0)
    w = np.exp(t - m)
    s = w.sum(0)
    r = m + np.log(s) - logl
    ar = np.abs(r)
    h = np.where(ar <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (ar - 0.5 * HUBER_DELTA))
    dh = np.clip(r, -HUBER_DELTA, HUBER_DELTA)
    if weight is not None:
        h, dh = h * weight, dh * weight
    f = h.sum(1)
    q = dh * w / s  # [3, S, P]: dHuber/dr times dLSE/dt_k
    g = np.stack([q[0].sum(1), q[1].sum(1), q[2].sum(1), -(q[0] * x).sum(1), -(q[1] * y).sum(1)], 1)
    return f, g


def _bfgs(theta: np.ndarray, fg: Callable, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Minimise fg(theta rows, their row numbers) from each row of theta [S, K] at once: BFGS with an Armijo backtracking line search, the
    initial inverse Hessian scaled after the first step (Nocedal & Wright, eq. 6.20), and an update only where the
    curvature s.y is positive. A start stops when its gradient vanishes or no step lowers it. Returns (theta, f)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a trial step may overflow: rejected
        return _bfgs_steps(theta.copy(), fg, iters)


def _bfgs_steps(theta: np.ndarray, fg: Callable, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """_bfgs's loop (on theta in place)."""
    S, K = theta.shape
    f, g = fg(theta, np.arange(S))
    H = np.tile(np.eye(K), (S, 1, 1))
    scaled = np.zeros(S, bool)
    active = np.isfinite(f)
    for _ in range(iters):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        p = -np.einsum("skj,sj->sk", H[idx], g[idx])
        slope = (p * g[idx]).sum(1)
        uphill = slope >= 0  # a stale inverse Hessian: restart it along the gradient
        if uphill.any():
            H[idx[uphill]] = np.eye(K)
            p[uphill] = -g[idx[uphill]]
            slope[uphill] = -(g[idx[uphill]] ** 2).sum(1)
        step = np.ones(idx.size)
        f_new, g_new = f[idx].copy(), g[idx].copy()
        done = np.zeros(idx.size, bool)
        for _ in range(30):  # steps 1, 0.2, 0.04, ... down to 1e-20
            todo = np.flatnonzero(~done)
            if todo.size == 0:
                break
            ft, gt = fg(theta[idx[todo]] + step[todo, None] * p[todo], idx[todo])
            ok = np.isfinite(ft) & (ft <= f[idx[todo]] + 1e-4 * step[todo] * slope[todo])
            f_new[todo[ok]], g_new[todo[ok]] = ft[ok], gt[ok]
            done[todo[ok]] = True
            step[todo[~ok]] *= 0.2
        moved = done & (f_new < f[idx])
        active[idx[~moved]] = False
        i = idx[moved]
        s = step[moved, None] * p[moved]
        yv = g_new[moved] - g[i]
        theta[i] += s
        f[i], g[i] = f_new[moved], g_new[moved]
        sy, yy = (s * yv).sum(1), (yv * yv).sum(1)
        good = (sy > 1e-12 * np.sqrt((s * s).sum(1) * yy)) & (sy > 1e-200)
        first = good & ~scaled[i]
        H[i[first]] = (sy[first] / yy[first])[:, None, None] * np.eye(K)
        scaled[i[first]] = True
        rho = np.where(good, 1 / np.where(good, sy, 1), 0)[:, None, None]
        left = np.eye(K) - rho * s[:, :, None] * yv[:, None, :]
        H[i] = np.where(good[:, None, None], left @ H[i] @ left.transpose(0, 2, 1) + rho * s[:, :, None] * s[:, None, :],
                        H[i])
        active[i[np.abs(g[i]).max(1) < 1e-14]] = False
    return theta, f


def _profile_starts(x: np.ndarray, y: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Starts [G, 5] in centred (a, b, e, alpha, beta): alpha and beta on a 40 x 40 grid over [0.05, 2], and for
    each pair the E, A, B >= 0 that the law is linear in, by least squares on the relative error (every subset
    of the three terms is solved and the best feasible one kept: exact non-negative least squares for three
    unknowns). A term at 0 starts at a thousandth of the mean loss, since the fit works on its logarithm."""
    grid = np.linspace(0.05, 2.0, 40)
    alpha, beta = (g.ravel() for g in np.meshgrid(grid, grid, indexing="ij"))
    cols = np.stack([np.ones((alpha.size, x.size)), np.exp(-alpha[:, None] * x), np.exp(-beta[:, None] * y)],
                    1) / loss  # [G, 3 terms, P]: E, A (N/N0)^-alpha, B (D/D0)^-beta, relative to the loss
    best, err_best = np.zeros((alpha.size, 3)), np.full(alpha.size, np.inf)
    for subset in ([0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2]):
        m = cols[:, subset]
        with np.errstate(all="ignore"):
            gram = m @ m.transpose(0, 2, 1)  # a whisker of ridge: two columns can coincide (alpha x = beta y)
            gram += 1e-12 * np.trace(gram, axis1=1, axis2=2)[:, None, None] * np.eye(len(subset))
            c = np.linalg.solve(gram, m.sum(2)[..., None])[..., 0]
            err = ((np.einsum("gk,gkp->gp", c, m) - 1) ** 2).sum(1)
        better = np.all(c >= 0, 1) & np.isfinite(err) & (err < err_best)
        best[better] = 0.0
        best[np.ix_(better, subset)] = c[better]
        err_best[better] = err[better]
    floor = 1e-3 * loss.mean()
    e, a, b = np.log(np.maximum(best, floor)).T
    return np.stack([a, b, e, alpha, beta], 1)


def _check_chinchilla(n: np.ndarray, d: np.ndarray) -> None:
    """ValueError unless the points can tell the five parameters apart."""
    pairs = np.unique(np.stack([n, d], 1), axis=0).shape[0]
    sizes, budgets, ratios = np.unique(n).size, np.unique(d).size, ratio_count(n, d)
    if pairs < 5:
        raise ValueError(f"the L(N, D) fit has 5 parameters and needs at least 5 distinct points, got {pairs}")
    if sizes < 3:
        raise ValueError(f"the L(N, D) fit needs points at 3 or more model sizes, got {sizes}")
    if budgets < 3:
        raise ValueError(f"the L(N, D) fit needs points at 3 or more token counts, got {budgets}")
    if ratios < 2:
        raise ValueError("the L(N, D) fit needs more than one tokens-per-parameter budget (d/n), got one")
    logn, logd = np.log(n), np.log(d)
    k, c = np.polyfit(logn, logd, 1)
    if np.abs(logd - k * logn - c).max() < math.log(SAME_RATIO) / 2:
        raise ValueError(f"the token counts follow the sizes on one curve (d = {math.exp(c):.3g} n^{k:.3g}), so the "
                         "L(N, D) fit cannot tell the size term from the data term: train some size at 2 or more "
                         "budgets")


def _centred(n: np.ndarray, d: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, ...]:
    """x, y (log N, log D less their means), log L, and the means [2]: A N^-alpha = exp(a - alpha x0) e^(-alpha x)."""
    shift = np.array([np.log(n).mean(), np.log(d).mean()])
    return np.log(n) - shift[0], np.log(d) - shift[1], np.log(loss), shift


def _log_exponents(fg: Callable) -> Callable:
    """fg over rows (a, b, e, log alpha, log beta): the optimiser keeps both exponents > 0, the law's form. Without
    it, early-training points (the loss falling with D alone) fit a negative alpha whose predictions overflow."""
    def wrapped(u: np.ndarray, rows):
        th = _from_log(u)
        f, g = fg(th, rows)
        return f, np.concatenate([g[:, :3], g[:, 3:] * th[:, 3:]], 1)  # d/d log alpha = alpha d/d alpha
    return wrapped


def _to_log(theta: np.ndarray) -> np.ndarray:
    return np.concatenate([theta[:, :3], np.log(theta[:, 3:])], 1)


def _from_log(u: np.ndarray) -> np.ndarray:
    """_to_log's inverse, exponents capped at e^5 (~148: far past any measured law, and no overflow)."""
    return np.concatenate([u[:, :3], np.exp(np.minimum(u[:, 3:], 5.0))], 1)


def _law(theta: np.ndarray, shift: np.ndarray) -> ChinchillaLaw:
    """The law of one centred (a, b, e, alpha, beta) row."""
    a, b, e, alpha, beta = theta
    with np.errstate(over="ignore"):  # a runaway fit is infinite, not a crash: fit_chinchilla refuses it
        return ChinchillaLaw(E=float(np.exp(e)), A=float(np.exp(a + alpha * shift[0])), alpha=float(alpha),
                             B=float(np.exp(b + beta * shift[1])), beta=float(beta))


def _fit_chinchilla(n, d, loss) -> tuple[ChinchillaLaw, np.ndarray]:
    """fit_chinchilla; also returns the distinct local minima it found (at most 8), best first, as uncentred
    (a, b, e, alpha, beta) rows, to warm-start the bootstrap's refits."""
    n, d, loss = _points(n, d, loss)
    _check_chinchilla(n, d)
    x, y, logl, shift = _centred(n, d, loss)

    def fg(th, rows):
        return _huber_log(th, x, y, logl)

    theta = _profile_starts(x, y, loss)
    f, _ = fg(theta, None)
    u, f = _bfgs(_to_log(theta[np.argsort(np.where(np.isfinite(f), f, np.inf))[:16]]), _log_exponents(fg), 500)
    theta = _from_log(u)[np.argsort(f)]
    minima = [theta[0]]
    for th in theta[1:]:
        if len(minima) < 8 and all(np.abs(th - m).max() > 1e-3 for m in minima):
            minima.append(th)
    minima = np.array(minima)
    minima[:, :2] += minima[:, 3:] * shift
    law = _law(theta[0], shift)
    if not all(map(math.isfinite, law.as_dict().values())):
        raise ValueError(f"the L(N, D) fit ran away ({law.as_dict()}): these losses do not follow the law")
    return law, minima


def _refit_chinchilla(n: np.ndarray, d: np.ndarray, loss: np.ndarray, weights: np.ndarray, starts: np.ndarray
                      ) -> list[ChinchillaLaw]:
    """The L(N, D) fit of each bootstrap resample at once: weights [R, P] counts each point's draws in resample
    R; every resample starts from each of `starts` (uncentred rows) and keeps its lowest minimum."""
    x, y, logl, shift = _centred(n, d, loss)
    k = len(starts)
    theta = np.tile(starts, (len(weights), 1))  # row r: resample r // k from start r % k
    theta[:, :2] -= theta[:, 3:] * shift

    def fg(th, rows):
        return _huber_log(th, x, y, logl, weights[rows // k])

    u, f = _bfgs(_to_log(theta), _log_exponents(fg), 500)
    theta = _from_log(u)
    best = np.argmin(np.where(np.isfinite(f), f, np.inf).reshape(-1, k), axis=1) + k * np.arange(len(weights))
    return [_law(th, shift) for th in theta[best]]


def fit_chinchilla(n, d, loss) -> ChinchillaLaw:
    """L(N, D) = E + A/N^alpha + B/D^beta by Hoffmann et al. 2022's Approach 3.

    n: non-embedding parameters, d: training tokens, loss: nats/token (1-D, same length). Minimises the sum over
    points of Huber_delta(LSE(a - alpha log N, b - beta log D, e) - log L), delta = 1e-3, with A = e^a, B = e^b,
    E = e^e (so E >= 0 by construction), by BFGS (in place of L-BFGS: five parameters) from a grid of starts,
    the lowest minimum winning. The grid profiles out the linear parameters: alpha and beta on 40 x 40 values in
    [0.05, 2], and for each pair E, A, B >= 0 by least squares on the relative error; the 16 starts of smallest
    objective run to convergence. (Hoffmann's own grid of 4500 starts in (a, b, e, alpha, beta) reached the
    same minimum on 33 of 40 random synthetic ladders and a lower one by at most 2e-5 relative on the other 7,
    all fits whose E ran to 0 with alpha or beta near 0, at 7x the time.) log N and log D are centred inside
    the optimiser: the same minimum, far better conditioned.
    Raises ValueError unless there are at least 5 distinct points, at 3 or more sizes and 3 or more token counts,
    more than one tokens-per-parameter ratio (see `ratio_count`), and token counts that do not all lie on one
    curve d = c n^k (within 5%): fewer cannot tell the five parameters apart.
    """
    return _fit_chinchilla(n, d, loss)[0]


def fit_for(n, d, loss) -> Law:
    """The law the points can carry: ChinchillaLaw (fit_chinchilla) when they hold more than one tokens-per-
    parameter ratio d/n (ratio_count), else PowerLaw (fit_power, d unused; d may be None). Which one is in the result's `form`.
    Units as in fit_chinchilla; raises the chosen fit's ValueError."""
    n, d, loss = _points(n, d, loss)
    return fit_chinchilla(n, d, loss) if d is not None and ratio_count(n, d) > 1 else fit_power(n, loss)


def check_points(n, d=None) -> None:
    """Raises the ValueError that fit_for would raise for points at these sizes n (parameters) and token counts
    d (or None: one budget), before any loss exists: a ladder checks its plan with it before training a rung."""
    n, d, _ = _points(n, d, np.ones(np.size(n)))
    if d is not None and ratio_count(n, d) > 1:
        _check_chinchilla(n, d)
    else:
        _check_power(n)


def _fit(fitter: Callable, n, d, loss) -> Law:
    """Call any of the fitters with the (n, d, loss) convention (fit_power takes no d)."""
    return fitter(n, loss) if fitter is fit_power else fitter(n, d, loss)


def bootstrap_interval(n, d, loss, at_n, at_d, fitter: Callable = fit_for, samples: int = 200, level: float = 0.9,
                       seed: int = 0) -> tuple[float, float]:
    """The `level` interval of the prediction at (at_n parameters, at_d tokens: scalars) by a bootstrap over the
    points (n, d, loss as in the fitter; d may be None for the L(N) form).

    Each of `samples` resamples draws len(points) points with replacement and refits; the interval is the
    (1-level)/2 and (1+level)/2 quantiles (numpy's linear rule) of the refits' predictions (nats/token).
    The form is fixed by the fit on all points (with fitter=fit_for: that fit's form for every resample, so a
    resample that happens to hold one budget is not fitted with another law). A resample that the form cannot
    fit (the fitter's ValueError: too few distinct sizes, token counts or ratios) is drawn again, up to 100
    times. L(N, D) refits run all at once, as one batch of problems weighted by each point's draw count,
    warm-started from the full fit's distinct local minima (at most 8) instead of the grid of starts: 200 refits
    cost about two full fits. Deterministic for a seed (numpy's default_rng).
    Raises ValueError if the points cannot be fitted, or 100 draws in a row cannot be.
    """
    n, d, loss = _points(n, d, loss)
    if not 0 < level < 1 or samples < 1:
        raise ValueError(f"bootstrap_interval needs 0 < level < 1 and samples >= 1, got {level}, {samples}")
    chinchilla = fitter is fit_chinchilla or (fitter is fit_for and d is not None and ratio_count(n, d) > 1)
    if chinchilla:  # draw every resample first (a check for each), then refit them all in one batch
        _, starts = _fit_chinchilla(n, d, loss)

        def fit(i):
            _check_chinchilla(n[i], d[i])
            return i
    elif fitter is fit_for or fitter is fit_power:
        def fit(i):
            return fit_power(n[i], loss[i])
        fit(np.arange(n.size))
    else:
        def fit(i):
            return _fit(fitter, n[i], None if d is None else d[i], loss[i])
        fit(np.arange(n.size))  # the points themselves must fit
    rng = np.random.default_rng(seed)
    laws = []
    for _ in range(samples):
        for _ in range(100):
            try:
                laws.append(fit(rng.integers(0, n.size, n.size)))
                break
            except ValueError:
                continue
        else:
            raise ValueError("the bootstrap drew 100 resamples in a row that cannot be fitted: give more points")
    if chinchilla:
        weights = np.stack([np.bincount(i, minlength=n.size) for i in laws]).astype(float)
        laws = _refit_chinchilla(n, d, loss, weights, starts)
    preds = np.array([law.predict(at_n, at_d) for law in laws], dtype=float)
    lo, hi = np.quantile(preds, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def backtest(rungs: Sequence[tuple[float, Sequence[tuple[float, float]]]], fitter: Callable = fit_for
             ) -> list[dict]:
    """An expanding-window backtest: fit on the smallest k rungs, predict the next larger one.

    rungs: [(n parameters, [(d tokens, loss nats/token), ...]), ...], in any order (sorted by n here). For each k
    from the smallest number of rungs the fitter accepts (a ValueError for fewer is skipped) to len(rungs) - 1,
    fits every point of the smallest k rungs and predicts rung k (0-based, sorted by n) at each of its own points.
    Returns one dict per predicted point: {"fit_on": k, "predicted_rung": k (its index by size), "params": n,
    "tokens": d, "predicted", "measured", "rel_error": (predicted - measured) / measured}; [] if no window
    can be fitted.
    """
    rungs = sorted(rungs, key=lambda r: r[0])
    out = []
    for k in range(1, len(rungs)):
        pts = np.array([(n, d, loss) for n, budget in rungs[:k] for d, loss in budget], dtype=float).reshape(-1, 3)
        try:
            law = _fit(fitter, pts[:, 0], pts[:, 1], pts[:, 2])
        except ValueError:
            if out:
                raise
            continue
        n_next = float(rungs[k][0])
        for d, measured in rungs[k][1]:
            pred = float(law.predict(n_next, d))
            out.append({"fit_on": k, "predicted_rung": k, "params": n_next, "tokens": float(d), "predicted": pred,
                        "measured": float(measured), "rel_error": (pred - float(measured)) / float(measured)})
    return out
