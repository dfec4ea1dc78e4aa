"""Mini-batch SGD training of a linear head (Salman et al.; VTAB lightweight schedule).

The loss is the mean softmax cross-entropy of the batch; weight decay (torch SGD's, on W
and b) and momentum as given; the learning rate is multiplied by 0.1 at each milestone
step. Shuffling uses a torch generator seeded by ``seed``, so runs repeat bit for bit on
the same device.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def train_sgd_head(
    X: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    *,
    lr: float,
    steps: int,
    batch_size: int,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    milestones: list[int] = (),
    seed: int = 0,
    device: str = "cpu",
    init: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Train ``logits = X @ W + b`` for ``steps`` updates; returns (W [D, K], b [K], finite).

    Batches walk through seeded epoch permutations (the last batch of an epoch may be
    smaller), so ``steps = epochs * ceil(n / batch_size)`` is exactly ``epochs`` epochs.
    ``finite`` is False when the loss diverged (the head is then unusable).
    """
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    X_t = torch.from_numpy(np.ascontiguousarray(X, np.float32)).to(device)
    y_t = torch.from_numpy(np.asarray(y, np.int64)).to(device)
    n, D = X_t.shape
    lin = torch.nn.Linear(D, n_classes).to(device)
    with torch.no_grad():
        if init is None:
            lin.weight.zero_()
            lin.bias.zero_()
        else:
            lin.weight.copy_(torch.as_tensor(np.asarray(init[0]).T, dtype=torch.float32))
            lin.bias.copy_(torch.as_tensor(np.asarray(init[1]), dtype=torch.float32))
    opt = torch.optim.SGD(lin.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=sorted(set(milestones)), gamma=0.1)
    step = 0
    finite = True
    while step < steps:
        perm = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n, batch_size):
            if step >= steps:
                break
            bi = perm[start : start + batch_size]
            loss = torch.nn.functional.cross_entropy(lin(X_t[bi]), y_t[bi])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
        if not torch.isfinite(loss):
            finite = False
            log.warning("SGD head diverged at step %d (lr=%g)", step, lr)
            break
    W = lin.weight.detach().double().cpu().numpy().T
    b = lin.bias.detach().double().cpu().numpy()
    return W, b, finite and bool(np.isfinite(W).all())
