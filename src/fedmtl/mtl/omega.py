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
* ``GraphicalLasso``: the graphical-model regularizer of the paper's eq. (15) (Appendix B.1), a sparse
  precision matrix between tasks: with the W-step's (lam/2) scaling, the Omega-step
  min_Omega (lam/2) [tr(Omega W W^T) - d log|Omega|] + lam_2 ||Omega||_1 is, divided by lam d / 2, the graphical
  lasso min tr(Omega S) - log|Omega| + alpha ||Omega||_1 with S = W W^T / d and alpha = 2 lam_2 / (lam d),
  solved by scikit-learn's ``graphical_lasso`` (Appendix B.3 names this problem and its solvers).  The l1 norm
  is the whole matrix's, diagonal included, as eq. (15) writes it; scikit-learn penalizes only the
  off-diagonal entries, so the diagonal's term alpha tr(Omega) is folded into S + alpha I (exact: Omega's
  diagonal is positive).  Eq. (15)'s (1/sigma^2) ||W||^2 enters the W-step as ``ridge`` (the W-step sees
  Omega + ridge I); its lam_1 ||W||_1 is not implemented (an l1 term on W leaves MOCHA's W-step, whose dual
  needs W(alpha) linear in the duals).

Eq. (14)'s (1/sigma^2) ||W||^2 term is dropped by ``TaskCovariance`` (its W-step sees Omega = Sigma^{-1} alone,
as the reference code's); the fixed and cluster forms carry their own ridge eta.

Every ``step`` returns (Omega, Sigma) with Sigma = Omega^{-1}, Omega being what the W-step sees.
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
        # Eq. (14)'s (1/sigma^2) ||W||^2 is dropped here: the W-step regularizer is tr(W^T Sigma^{-1} W) alone
        # (the reference code's choice; Sigma^{-1} is positive definite through the eigenvalue clamp).
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


@dataclass
class GraphicalLasso(Regularizer):
    """Eq. (15): Omega = argmin tr(Omega S) - log|Omega| + alpha ||Omega||_1 (S = W W^T / d), plus ``ridge`` I."""

    alpha: float = 0.1
    ridge: float = 0.0
    max_iter: int = 500
    tol: float = 1e-6
    learns = True

    def __post_init__(self) -> None:
        if not self.alpha > 0 or not self.ridge >= 0:
            raise ValueError(f"graphical lasso needs alpha > 0 and ridge >= 0, got {self.alpha}, {self.ridge}")

    def init(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        omega = (1.0 + self.ridge) * np.eye(m)  # the precision of independent unit-variance tasks
        return omega, np.eye(m) / (1.0 + self.ridge)

    def precision(self, W: np.ndarray) -> np.ndarray:
        """The graphical lasso's sparse precision (without the ridge)."""
        from sklearn.covariance import graphical_lasso

        m, d = W.shape
        S = W @ W.T / d + self.alpha * np.eye(m)  # + alpha I: the diagonal's share of the full l1 norm
        if m == 1:
            return 1.0 / S
        _, prec = graphical_lasso((S + S.T) / 2, self.alpha, max_iter=self.max_iter, tol=self.tol,
                                  enet_tol=self.tol)
        return (prec + prec.T) / 2

    def step(self, W: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        o = self.precision(W) + self.ridge * np.eye(W.shape[0])
        return o, sym_inv(o)


def sigma_prime(sigma: np.ndarray, gamma: float = 1.0, per_task: bool = False) -> np.ndarray:
    """Lemma 9 (and Remark 5, ``per_task``): sigma'_t = gamma * sum_t' |Sigma_tt'| / Sigma_tt, maximised
    over t unless per task.  Here Sigma (the inverse of Omega) is the block matrix M-bar of the dual's
    quadratic tr(B^T Sigma B) / (2 lam).  Returns an (m,) array."""
    ratio = np.abs(sigma).sum(1) / np.diag(sigma)
    out = gamma * ratio
    return out if per_task else np.full_like(out, out.max())


REGULARIZERS = ("identity", "mean", "task_covariance", "cluster", "graphical")


def build(name: str, m: int, eta: float = 0.1, k: int = 2, eps: float = 1e-6, alpha: float = 0.1) -> Regularizer:
    """``eta`` is the ridge of ``mean``, the relaxation's eta of ``cluster`` and 1/sigma^2 of ``graphical``."""
    if name == "identity":
        return identity(m)
    if name == "mean":
        return mean_regularized(m, eta)
    if name == "task_covariance":
        return TaskCovariance(eps)
    if name == "cluster":
        return ClusterRelaxation(k, eta)
    if name == "graphical":
        return GraphicalLasso(alpha, eta)
    raise ValueError(f"regularizer must be one of {REGULARIZERS}, got {name!r}")
