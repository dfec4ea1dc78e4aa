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
    """Fit one softmax head per value of ``Cs`` on ``X [n, D]`` (float32, any device).

    ``theta0`` ([1, (D+1)K]) starts the heads (default zeros). ``block`` limits how many
    heads iterate at once: heads are activated in increasing-C order and each newly
    activated head starts from the solution of the largest C already finished (a warm
    start along the regularisation path). ``None`` = all heads at once.
    """
    dev, dt = X.device, X.dtype
    n, D = X.shape
    K = n_classes
    P = (D + 1) * K
    Cs_t = torch.as_tensor(list(Cs), dtype=torch.float64)
    H = Cs_t.numel()
    lam_all = (1.0 / (Cs_t * n)).to(device=dev, dtype=dt)
    Y1h = torch.zeros(n, K, device=dev, dtype=dt)
    yidx = y.to(dev).long()
    Y1h[torch.arange(n, device=dev), yidx] = 1.0

    base = (torch.zeros(1, P, device=dev, dtype=dt) if theta0 is None
            else theta0.to(device=dev, dtype=dt).reshape(1, P))
    theta_all = base.expand(H, P).clone()
    n_iter_all = torch.zeros(H, dtype=torch.long)
    conv_all = torch.zeros(H, dtype=torch.bool)
    loss_all = torch.zeros(H, dtype=dt)
    gmax_all = torch.zeros(H, dtype=dt)
    finished = torch.zeros(H, dtype=torch.bool)

    queue = torch.argsort(Cs_t).tolist()  # activation order: increasing C
    block = H if block is None else max(1, int(block))
    act = torch.zeros(0, dtype=torch.long)  # global indices of active heads
    theta = torch.zeros(0, P, device=dev, dtype=dt)
    lam = torch.zeros(0, device=dev, dtype=dt)
    f = torch.zeros(0, device=dev, dtype=dt)
    g = torch.zeros(0, P, device=dev, dtype=dt)
    S = torch.zeros(0, history, P, device=dev, dtype=dt)
    Yh = torch.zeros(0, history, P, device=dev, dtype=dt)
    rho = torch.zeros(0, history, device=dev, dtype=dt)  # 0 = empty / skipped pair
    gamma = torch.zeros(0, device=dev, dtype=dt)
    first = torch.zeros(0, dtype=torch.bool, device=dev)
    k_ring = 0

    def activate():
        nonlocal act, theta, lam, f, g, S, Yh, rho, gamma, first
        room = block - act.numel()
        if room <= 0 or not queue:
            return
        new = torch.tensor([queue.pop(0) for _ in range(min(room, len(queue)))], dtype=torch.long)
        done_idx = torch.nonzero(finished).flatten()
        if done_idx.numel():  # warm start from the largest finished C
            src = done_idx[torch.argmax(Cs_t[done_idx])]
            th = theta_all[src.to(dev)].reshape(1, P).expand(new.numel(), P).clone()
        else:
            th = theta_all[new.to(dev)].clone()
        la = lam_all[new.to(dev)]
        fn, gn = _loss_grad(X, Y1h, yidx, th, la, D, K)
        h = new.numel()
        act = torch.cat([act, new])
        theta, lam = torch.cat([theta, th]), torch.cat([lam, la])
        f, g = torch.cat([f, fn]), torch.cat([g, gn])
        S = torch.cat([S, torch.zeros(h, history, P, device=dev, dtype=dt)])
        Yh = torch.cat([Yh, torch.zeros(h, history, P, device=dev, dtype=dt)])
        rho = torch.cat([rho, torch.zeros(h, history, device=dev, dtype=dt)])
        gamma = torch.cat([gamma, torch.ones(h, device=dev, dtype=dt)])
        first = torch.cat([first, torch.ones(h, dtype=torch.bool, device=dev)])

    def retire(mask_done: torch.Tensor, converged: torch.Tensor):
        nonlocal act, theta, lam, f, g, S, Yh, rho, gamma, first
        idx = act[mask_done.cpu()]
        theta_all[idx.to(dev)] = theta[mask_done]
        conv_all[idx] = converged[mask_done].cpu()
        loss_all[idx] = f[mask_done].detach().cpu()
        gmax_all[idx] = g[mask_done].abs().amax(dim=1).cpu()
        finished[idx] = True
        keep = ~mask_done
        act = act[keep.cpu()]
        theta, lam, f, g = theta[keep], lam[keep], f[keep], g[keep]
        S, Yh, rho, gamma, first = S[keep], Yh[keep], rho[keep], gamma[keep], first[keep]
        activate()

    activate()
    while act.numel():
        gmax = g.abs().amax(dim=1)
        done = gmax <= tol
        capped = n_iter_all[act].to(dev) >= max_iter
        if (done | capped).any():
            retire(done | capped, done)
            continue
        # two-loop recursion, batched over heads; empty/skipped pairs have rho == 0
        q = -g
        alpha = torch.zeros_like(rho)
        order = [(k_ring - 1 - j) % history for j in range(history)]  # newest first
        for j in order:
            a = rho[:, j] * (S[:, j] * q).sum(dim=1)
            alpha[:, j] = a
            q = q - a.unsqueeze(1) * Yh[:, j]
        # first step of a head: scale like torch.optim.LBFGS (min(1, 1/|g|_1))
        init_scale = torch.where(
            first, torch.clamp(1.0 / g.abs().sum(dim=1), max=1.0), gamma
        )
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
        # backtracking Armijo line search, per head, only unresolved heads re-evaluated
        h = act.numel()
        t = torch.ones(h, device=dev, dtype=dt)
        f_new = torch.empty_like(f)
        g_new = torch.empty_like(g)
        pending = torch.arange(h, device=dev)
        for _ls in range(max_ls):
            th = theta[pending] + t[pending].unsqueeze(1) * d[pending]
            fp, gp = _loss_grad(X, Y1h, yidx, th, lam[pending], D, K)
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
        stalled = torch.zeros(h, dtype=torch.bool, device=dev)
        if pending.numel():
            stalled[pending] = True
            t[pending] = 0.0
            f_new[pending] = f[pending]
            g_new[pending] = g[pending]
        s = t.unsqueeze(1) * d
        yv = g_new - g
        sy = (s * yv).sum(dim=1)
        yy = (yv * yv).sum(dim=1)
        good = (sy > 1e-10 * yy.sqrt() * s.norm(dim=1)) & ~stalled
        S[:, k_ring] = s
        Yh[:, k_ring] = yv
        rho[:, k_ring] = torch.where(good, 1.0 / torch.where(good, sy, torch.ones_like(sy)), 0.0)
        gamma = torch.where(good, sy / torch.clamp(yy, min=1e-30), gamma)
        first = first & ~good
        k_ring = (k_ring + 1) % history
        theta = theta + s
        f_prev = f
        f, g = f_new, g_new
        n_iter_all[act] += 1
        # float32 floor: no further decrease possible -> stop the head
        tiny = (f_prev - f).abs() <= 1e-7 * torch.clamp(f.abs(), min=1.0)
        stop = stalled | (tiny & (t > 0) & (g.abs().amax(dim=1) <= 10 * tol))
        if stop.any():
            retire(stop, g.abs().amax(dim=1) <= 10 * tol)
    W = theta_all[:, : D * K].view(H, D, K)
    b = theta_all[:, D * K :]
    return SolverResult(W=W, b=b, n_iter=n_iter_all, converged=conv_all, loss=loss_all,
                        grad_max=gmax_all)
