"""Batched multinomial logistic regression in torch: many L2 strengths in one problem.

Each "head" h solves scikit-learn's problem (featcache's meaning of C)::

    min_{W_h, b_h}  1/n * sum_i CE(x_i W_h + b_h, y_i) + 1/(2 C_h n) * ||W_h||^2

(the same minimiser as ``sum_i CE + 1/(2C) ||W||^2``; the intercept is not penalised).
All heads share one pass over X per iteration: the logits of every head come from one
GEMM ``X @ [W_1 | ... | W_H]`` and the gradients from one GEMM ``X^T @ [P_1 - Y | ...]``.

The optimiser is L-BFGS (history ``m``) with a per-head state: each head keeps its own
curvature pairs, its own step length (backtracking Armijo line search with safeguarded
quadratic interpolation) and its own stopping test, so a well-conditioned head (small C)
stops early while an ill-conditioned one (large C) keeps going. Converged heads leave the
active set and the GEMMs shrink with it. Stopping test per head, as scikit-learn's lbfgs:
``max |grad| <= tol`` on the 1/n-scaled objective; a head whose line search cannot
decrease the objective any more (float32 resolution) stops as well and is reported
converged only if its gradient is within 10 * tol.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

log = logging.getLogger(__name__)


@dataclass
class SolverResult:
    W: torch.Tensor  # [H, D, K]
    b: torch.Tensor  # [H, K]
    n_iter: torch.Tensor  # [H] int
    converged: torch.Tensor  # [H] bool
    loss: torch.Tensor  # [H]
    grad_max: torch.Tensor  # [H]


def _loss_grad(X, Y1h, yidx, theta, lam, D, K, need_grad=True):
    """Objective and gradient for heads ``theta [h, (D+1)K]`` (row h: W flattened, then b)."""
    h = theta.shape[0]
    n = X.shape[0]
    W = theta[:, : D * K].view(h, D, K)
    b = theta[:, D * K :]
    Z = (X @ W.permute(1, 0, 2).reshape(D, h * K)).view(n, h, K)
    Z += b.unsqueeze(0)
    m = Z.amax(dim=2, keepdim=True)
    E = torch.exp(Z - m)
    S = E.sum(dim=2, keepdim=True)
    lse = (m + torch.log(S)).squeeze(2)  # [n, h]
    zy = Z.gather(2, yidx.view(n, 1, 1).expand(n, h, 1)).squeeze(2)  # [n, h]
    wsq = (W * W).sum(dim=(1, 2))
    loss = (lse - zy).mean(dim=0) + 0.5 * lam * wsq
    if not need_grad:
        return loss, None
    E /= S  # softmax probabilities
    E.sub_(Y1h.unsqueeze(1)).div_(n)  # dL/dZ
    gW = (X.T @ E.reshape(n, h * K)).view(D, h, K).permute(1, 0, 2)
    gW = gW + lam.view(h, 1, 1) * W
    gb = E.sum(dim=0)
    grad = torch.cat([gW.reshape(h, D * K), gb], dim=1)
    return loss, grad


def lbfgs_multihead(
    X: torch.Tensor,
    y: torch.Tensor,
    Cs,
    n_classes: int,
    *,
    theta0: torch.Tensor | None = None,
    max_iter: int = 1000,
    tol: float = 1e-4,
    history: int = 10,
    max_ls: int = 25,
    block: int | None = None,
) -> SolverResult:
    """Fit one softmax head per value of ``Cs`` on ``X [n, D]`` (float32, any device), or on
    a :class:`~featcache.probes._stream.RowSource` (row blocks accumulated one at a time).

    ``theta0`` ([1, (D+1)K], or [H, (D+1)K]: one start per head, kept even when
    ``block`` is set) starts the heads (default zeros). ``block`` limits how many
    heads iterate at once: heads are activated in increasing-C order and each newly
    activated head starts from the solution of the largest C already finished (a warm
    start along the regularisation path). ``None`` = all heads at once.
    """
    prob = _Problem.build(X, y, Cs, n_classes, theta0)
    st = _ActiveHeads(prob, history, prob.Cs.numel() if block is None else max(1, int(block)))
    st.activate()
    while st.act.numel():
        gmax = st.g.abs().amax(dim=1)
        done = gmax <= tol
        capped = prob.n_iter[st.act].to(prob.dev) >= max_iter
        if (done | capped).any():
            st.retire(done | capped, done)
            continue
        d, gd = st.direction()
        t, f_new, g_new, stalled = _line_search(prob, st, d, gd, max_ls)
        f_prev = st.update(t, d, f_new, g_new, stalled)
        # float32 floor: no further decrease possible -> stop the head
        tiny = (f_prev - st.f).abs() <= 1e-7 * torch.clamp(st.f.abs(), min=1.0)
        stop = stalled | (tiny & (t > 0) & (st.g.abs().amax(dim=1) <= 10 * tol))
        if stop.any():
            st.retire(stop, st.g.abs().amax(dim=1) <= 10 * tol)
    return prob.result()


@dataclass
class _Problem:
    """The data, per-head penalties and the per-head outcome arrays of one multi-head fit."""

    X: Any  # torch.Tensor [n, D], or a featcache.probes._stream.RowSource when streamed
    Y1h: torch.Tensor | None  # one-hot labels [n, K] (None when streamed)
    yidx: torch.Tensor
    Cs: torch.Tensor  # float64 [H]
    lam: torch.Tensor  # 1 / (C n) [H]
    D: int
    K: int
    theta: torch.Tensor  # [H, P] solutions (start values until a head finishes)
    n_iter: torch.Tensor
    converged: torch.Tensor
    loss: torch.Tensor
    grad_max: torch.Tensor
    finished: torch.Tensor

    streamed: bool = False
    own_start: bool = False  # theta0 gave one start per head: no path warm start

    @property
    def dev(self):
        return self.X.device

    @property
    def dt(self):
        return self.X.dtype

    @classmethod
    def build(cls, X, y, Cs, K: int, theta0) -> _Problem:
        dev, dt = X.device, X.dtype
        n, D = X.shape
        P = (D + 1) * K
        Cs_t = torch.as_tensor(list(Cs), dtype=torch.float64)
        H = Cs_t.numel()
        lam_all = (1.0 / (Cs_t * n)).to(device=dev, dtype=dt)
        streamed = not isinstance(X, torch.Tensor)
        yidx = y.to(dev).long()
        Y1h = None
        if not streamed:  # the streamed loss indexes the labels per block instead
            Y1h = torch.zeros(n, K, device=dev, dtype=dt)
            Y1h[torch.arange(n, device=dev), yidx] = 1.0
        own = theta0 is not None and theta0.reshape(-1, P).shape[0] == H > 1
        base = (
            torch.zeros(1, P, device=dev, dtype=dt)
            if theta0 is None
            else theta0.to(device=dev, dtype=dt).reshape(-1, P)
        )
        return cls(
            X=X,
            Y1h=Y1h,
            yidx=yidx,
            Cs=Cs_t,
            lam=lam_all,
            D=D,
            K=K,
            theta=base.expand(H, P).clone(),
            n_iter=torch.zeros(H, dtype=torch.long),
            converged=torch.zeros(H, dtype=torch.bool),
            loss=torch.zeros(H, dtype=dt),
            grad_max=torch.zeros(H, dtype=dt),
            finished=torch.zeros(H, dtype=torch.bool),
            streamed=streamed,
            own_start=own,
        )

    @overload
    def loss_grad(
        self, theta: torch.Tensor, lam: torch.Tensor, need_grad: Literal[True] = True
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def loss_grad(
        self, theta: torch.Tensor, lam: torch.Tensor, need_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def loss_grad(
        self, theta: torch.Tensor, lam: torch.Tensor, need_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.streamed:
            from featcache.probes._stream import stream_loss_grad

            return stream_loss_grad(self.X, self.yidx, theta, lam, self.D, self.K, need_grad)
        return _loss_grad(self.X, self.Y1h, self.yidx, theta, lam, self.D, self.K, need_grad)

    def result(self) -> SolverResult:
        H, D, K = self.Cs.numel(), self.D, self.K
        W = self.theta[:, : D * K].view(H, D, K)
        b = self.theta[:, D * K :]
        return SolverResult(
            W=W, b=b, n_iter=self.n_iter, converged=self.converged, loss=self.loss, grad_max=self.grad_max
        )


class _ActiveHeads:
    """Per-head L-BFGS state of the heads iterating now (at most ``block`` of them).

    Heads enter in increasing-C order (:meth:`activate`), warm-started from the largest C
    already finished, and leave when they stop (:meth:`retire`), writing their solution
    into the :class:`_Problem`. Curvature pairs live in a ring of ``history`` slots shared
    by all active heads; an empty or skipped pair has ``rho == 0``.
    """

    def __init__(self, prob: _Problem, history: int, block: int):
        dev, dt, P = prob.dev, prob.dt, (prob.D + 1) * prob.K
        self.prob, self.history, self.block, self.P = prob, history, block, P
        self.queue = torch.argsort(prob.Cs).tolist()  # activation order: increasing C
        self.act = torch.zeros(0, dtype=torch.long)  # global indices of active heads
        self.theta = torch.zeros(0, P, device=dev, dtype=dt)
        self.lam = torch.zeros(0, device=dev, dtype=dt)
        self.f = torch.zeros(0, device=dev, dtype=dt)
        self.g = torch.zeros(0, P, device=dev, dtype=dt)
        self.S = torch.zeros(0, history, P, device=dev, dtype=dt)
        self.Yh = torch.zeros(0, history, P, device=dev, dtype=dt)
        self.rho = torch.zeros(0, history, device=dev, dtype=dt)
        self.gamma = torch.zeros(0, device=dev, dtype=dt)
        self.first = torch.zeros(0, dtype=torch.bool, device=dev)
        self.k_ring = 0

    def activate(self) -> None:
        pr, dev, dt, P, hist = self.prob, self.prob.dev, self.prob.dt, self.P, self.history
        room = self.block - self.act.numel()
        if room <= 0 or not self.queue:
            return
        new = torch.tensor([self.queue.pop(0) for _ in range(min(room, len(self.queue)))], dtype=torch.long)
        done_idx = torch.nonzero(pr.finished).flatten()
        if done_idx.numel() and not pr.own_start:  # warm start from the largest finished C
            src = done_idx[torch.argmax(pr.Cs[done_idx])]
            th = pr.theta[src.to(dev)].reshape(1, P).expand(new.numel(), P).clone()
        else:
            th = pr.theta[new.to(dev)].clone()
        la = pr.lam[new.to(dev)]
        fn, gn = pr.loss_grad(th, la)
        h = new.numel()
        self.act = torch.cat([self.act, new])
        self.theta, self.lam = torch.cat([self.theta, th]), torch.cat([self.lam, la])
        self.f, self.g = torch.cat([self.f, fn]), torch.cat([self.g, gn])
        self.S = torch.cat([self.S, torch.zeros(h, hist, P, device=dev, dtype=dt)])
        self.Yh = torch.cat([self.Yh, torch.zeros(h, hist, P, device=dev, dtype=dt)])
        self.rho = torch.cat([self.rho, torch.zeros(h, hist, device=dev, dtype=dt)])
        self.gamma = torch.cat([self.gamma, torch.ones(h, device=dev, dtype=dt)])
        self.first = torch.cat([self.first, torch.ones(h, dtype=torch.bool, device=dev)])

    def retire(self, mask_done: torch.Tensor, converged: torch.Tensor) -> None:
        pr = self.prob
        idx = self.act[mask_done.cpu()]
        pr.theta[idx.to(pr.dev)] = self.theta[mask_done]
        pr.converged[idx] = converged[mask_done].cpu()
        pr.loss[idx] = self.f[mask_done].detach().cpu()
        pr.grad_max[idx] = self.g[mask_done].abs().amax(dim=1).cpu()
        pr.finished[idx] = True
        keep = ~mask_done
        self.act = self.act[keep.cpu()]
        self.theta, self.lam, self.f, self.g = self.theta[keep], self.lam[keep], self.f[keep], self.g[keep]
        self.S, self.Yh, self.rho = self.S[keep], self.Yh[keep], self.rho[keep]
        self.gamma, self.first = self.gamma[keep], self.first[keep]
        self.activate()

    def direction(self) -> tuple[torch.Tensor, torch.Tensor]:
        """L-BFGS two-loop recursion, batched over heads: (direction d, g . d)."""
        g, rho, S, Yh = self.g, self.rho, self.S, self.Yh
        q = -g
        alpha = torch.zeros_like(rho)
        order = [(self.k_ring - 1 - j) % self.history for j in range(self.history)]  # newest first
        for j in order:
            a = rho[:, j] * (S[:, j] * q).sum(dim=1)
            alpha[:, j] = a
            q = q - a.unsqueeze(1) * Yh[:, j]
        # first step of a head: scale like torch.optim.LBFGS (min(1, 1/|g|_1))
        init_scale = torch.where(self.first, torch.clamp(1.0 / g.abs().sum(dim=1), max=1.0), self.gamma)
        d = q * init_scale.unsqueeze(1)
        for j in reversed(order):
            beta = rho[:, j] * (Yh[:, j] * d).sum(dim=1)
            d = d + (alpha[:, j] - beta).unsqueeze(1) * S[:, j]
        gd = (g * d).sum(dim=1)
        bad = gd >= 0  # not a descent direction: restart from steepest descent
        if bad.any():
            d[bad] = -g[bad] * torch.clamp(1.0 / g[bad].abs().sum(dim=1), max=1.0).unsqueeze(1)
            gd = (g * d).sum(dim=1)
            rho[bad] = 0
        return d, gd

    def update(self, t, d, f_new, g_new, stalled) -> torch.Tensor:
        """Take the step ``t * d``, store the curvature pair; returns the previous losses."""
        s = t.unsqueeze(1) * d
        yv = g_new - self.g
        sy = (s * yv).sum(dim=1)
        yy = (yv * yv).sum(dim=1)
        good = (sy > 1e-10 * yy.sqrt() * s.norm(dim=1)) & ~stalled
        k = self.k_ring
        self.S[:, k] = s
        self.Yh[:, k] = yv
        self.rho[:, k] = torch.where(good, 1.0 / torch.where(good, sy, torch.ones_like(sy)), 0.0)
        self.gamma = torch.where(good, sy / torch.clamp(yy, min=1e-30), self.gamma)
        self.first = self.first & ~good
        self.k_ring = (k + 1) % self.history
        self.theta = self.theta + s
        f_prev = self.f
        self.f, self.g = f_new, g_new
        self.prob.n_iter[self.act] += 1
        return f_prev


def _line_search(prob: _Problem, st: _ActiveHeads, d, gd, max_ls: int):
    """Backtracking Armijo line search per head; only unresolved heads are re-evaluated.

    Returns (step t, new loss, new gradient, stalled): a stalled head found no decrease in
    ``max_ls`` tries and keeps its point (t = 0).
    """
    f, g, theta, lam = st.f, st.g, st.theta, st.lam
    h = st.act.numel()
    t = torch.ones(h, device=prob.dev, dtype=prob.dt)
    f_new = torch.empty_like(f)
    g_new = torch.empty_like(g)
    pending = torch.arange(h, device=prob.dev)
    for _ls in range(max_ls):
        th = theta[pending] + t[pending].unsqueeze(1) * d[pending]
        fp, gp = prob.loss_grad(th, lam[pending])
        ok = fp <= f[pending] + 1e-4 * t[pending] * gd[pending]
        ok &= torch.isfinite(fp)
        f_new[pending[ok]] = fp[ok]
        g_new[pending[ok]] = gp[ok]
        if ok.all():
            pending = pending[:0]
            break
        nok = pending[~ok]
        # safeguarded quadratic interpolation of phi(t) = f(theta + t d)
        tn = t[nok]
        denom = 2.0 * (fp[~ok] - f[nok] - tn * gd[nok])
        t_q = -gd[nok] * tn * tn / torch.clamp(denom, min=1e-30)
        t_q = torch.where(torch.isfinite(t_q), t_q, 0.1 * tn)
        t[nok] = torch.minimum(torch.maximum(t_q, 0.1 * tn), 0.5 * tn)
        pending = nok
    stalled = torch.zeros(h, dtype=torch.bool, device=prob.dev)
    if pending.numel():
        stalled[pending] = True
        t[pending] = 0.0
        f_new[pending] = f[pending]
        g_new[pending] = g[pending]
    return t, f_new, g_new, stalled
