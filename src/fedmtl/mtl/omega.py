"""Task-relationship regularizers R(W, Omega) = (lam/2) tr(W^T Omega W) and their Omega-steps.

MOCHA (Smith et al. 2017, Section 3.1 and Appendix B) alternates a federated W-step with a central
Omega-step that depends only on W.  Rows of W are tasks here, so the coupling is tr(Omega W W^T).

* ``FixedOmega``: Omega given once (``identity`` = independent tasks; ``mean_regularized`` =
  (I - 11^T/m) + eta I, i.e. sum_t ||w_t - w_bar||^2 + eta ||W||^2).  No Omega-step.
* ``TaskCovariance``: the probabilistic MTL prior of Zhang & Yeung (2010) used in MOCHA's experiments:
  min over Sigma >= 0, tr Sigma = 1 of tr(Sigma^{-1} W W^T) is solved by
  Sigma = (W W^T)^{1/2} / tr((W W^T)^{1/2}); Omega = Sigma^{-1}.  Eigenvalues of W W^T are clamped at
  ``eps`` times the largest (W W^T has rank <= min(d, m) and is 0 at the start); the reference code clamps
  only when an eigenvalue is negative, at the absolute 1e-7.
* ``ClusterRelaxation``: the convex relaxation of clustered MTL (Jacob et al. 2009; Zhou et al. 2011):
  Omega = eta (1 + eta) (eta I + M)^{-1} with M over {0 <= M <= I, tr M = k}.  Closed form: with
  W W^T = U diag(s) U^T, M = U diag(g) U^T, g_i = clip(sqrt(s_i / nu) - eta, 0, 1) and nu > 0 found by
  bisection so that sum g = k.

Every ``step`` returns (Omega, Sigma) with Sigma = Omega^{-1}.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def sym_inv(a: np.ndarray) -> np.ndarray:
    vals, vecs = np.linalg.eigh((a + a.T) / 2)
    return (vecs / vals) @ vecs.T


class Regularizer:
    learns = False

    def init(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def step(self, W: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return omega, sym_inv(omega)


@dataclass
class FixedOmega(Regularizer):
    omega: np.ndarray

    def init(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        if self.omega.shape != (m, m):
            raise ValueError(f"Omega must be {m}x{m}, got {self.omega.shape}")
        return self.omega, sym_inv(self.omega)


def identity(m: int, scale: float = 1.0) -> FixedOmega:
    return FixedOmega(scale * np.eye(m))


def mean_regularized(m: int, eta: float = 0.1) -> FixedOmega:
    return FixedOmega(np.eye(m) - np.ones((m, m)) / m + eta * np.eye(m))


@dataclass
class TaskCovariance(Regularizer):
    eps: float = 1e-6
    learns = True

    def init(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        return m * np.eye(m), np.eye(m) / m

    def step(self, W: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a = W @ W.T
        vals, vecs = np.linalg.eigh((a + a.T) / 2)
        top = max(float(vals.max()), 0.0)
        if top == 0.0:
            return omega, sym_inv(omega)
        root = np.sqrt(np.maximum(vals, self.eps * top))
        root = root / root.sum()
        sigma = (vecs * root) @ vecs.T
        return (vecs / root) @ vecs.T, sigma


@dataclass
class ClusterRelaxation(Regularizer):
    k: int = 2
    eta: float = 0.5
    learns = True

    def init(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        if not 1 <= self.k <= m:
            raise ValueError(f"clusters k must be in [1, {m}], got {self.k}")
        mm = np.eye(m) * self.k / m
        return self._omega(mm)

    def _omega(self, mm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m = mm.shape[0]
        c = self.eta * (1 + self.eta)
        inner = self.eta * np.eye(m) + mm
        return c * sym_inv(inner), inner / c

    def solve_m(self, W: np.ndarray) -> np.ndarray:
        a = W @ W.T
        s, u = np.linalg.eigh((a + a.T) / 2)
        s = np.maximum(s, 0.0)
        k, eta = float(self.k), self.eta

        def g(nu: float) -> np.ndarray:
            return np.clip(np.sqrt(s / nu) - eta, 0.0, 1.0)

        if s.max() == 0:
            gam = np.full(len(s), k / len(s))
        else:
            lo, hi = 1e-300, float(s.max()) / eta**2 + 1.0  # g(hi) = 0; sum g decreases in nu
            for _ in range(200):
                mid = np.sqrt(lo * hi)
                if g(mid).sum() > k:
                    lo = mid
                else:
                    hi = mid
            gam = g(np.sqrt(lo * hi))
            short = k - gam.sum()  # spread any bisection slack over the eigen-directions still below 1
            if abs(short) > 1e-9:
                room = (1.0 - gam) if short > 0 else gam
                gam = gam + short * room / max(room.sum(), 1e-300)
        return (u * gam) @ u.T

    def step(self, W: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._omega(self.solve_m(W))


def sigma_prime(sigma: np.ndarray, gamma: float = 1.0, per_task: bool = False) -> np.ndarray:
    """Lemma 9 (and Remark 5, ``per_task``): sigma'_t = gamma * sum_t' |Sigma_tt'| / Sigma_tt, maximised
    over t unless per task.  Here Sigma (the inverse of Omega) is the block matrix M-bar of the dual's
    quadratic tr(B^T Sigma B) / (2 lam).  Returns an (m,) array."""
    ratio = np.abs(sigma).sum(1) / np.diag(sigma)
    out = gamma * ratio
    return out if per_task else np.full_like(out, out.max())


REGULARIZERS = ("identity", "mean", "task_covariance", "cluster")


def build(name: str, m: int, eta: float = 0.1, k: int = 2, eps: float = 1e-6) -> Regularizer:
    if name == "identity":
        return identity(m)
    if name == "mean":
        return mean_regularized(m, eta)
    if name == "task_covariance":
        return TaskCovariance(eps)
    if name == "cluster":
        return ClusterRelaxation(k, eta)
    raise ValueError(f"regularizer must be one of {REGULARIZERS}, got {name!r}")
