"""The attentive probes' head grid run by :mod:`featcache.probes.head_grid`: each head its
own module and AdamW (so heads are independent and a head's trajectory does not depend on
which others train beside it: bit for bit), batches cut from blocks of token rows as
:mod:`featcache.probes.attentive` documents, the bf16 check over every head before training,
a progress bar of head-steps with the epoch and the heads still training."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.errors import ProbeError
from featcache.probes.head_grid import (
    GridCallbacks,
    GridPlan,
    grid_rungs,
    head_groups,
    head_steps,
    memory_line,
    run_grid,
)

log = logging.getLogger(__name__)

__all__ = ["attentive_grid", "grid_memory"]

#: bytes per parameter while training: weight, gradient, AdamW's two moments (float32)
ADAMW_BYTES = 16
#: activations kept for one head's backward, in units of one batch of tokens (normed tokens, k, v, slack)
ACT_TOKEN_COPIES = 4


@dataclass
class _Head:
    module: Any
    opt: Any
    finite: bool = True


def head_parameters(variant: str, dim: int, n_classes: int) -> int:
    """Parameters of one ``variant`` head at width ``dim`` (one built aside: torch's stream is
    restored; the meta device would import torch's compiler, seconds)."""
    import torch

    from featcache.probes.attentive_modules import attention_heads, build_attentive_head

    with torch.random.fork_rng(devices=[]):
        h = build_attentive_head(variant, dim, n_classes, attention_heads(dim))
    return int(sum(p.numel() for p in h.parameters()))


def grid_memory(variant: str, T: int, D: int, n_classes: int, batch: int, rows: int) -> dict[str, int]:
    """The grid's memory per head and shared, in bytes: ``params`` of one head, ``state``
    (parameters + gradients + AdamW moments), ``act`` (one head's activations at ``batch`` rows:
    heads step one after the other), ``shared`` (the token block, its prefetch and permuted copy)."""
    p = head_parameters(variant, D, n_classes)
    act = ACT_TOKEN_COPIES * batch * T * D * 4
    return {"params": p, "state": ADAMW_BYTES * p, "act": act, "shared": 3 * rows * T * D * 4 + act}


def _batches(
    ops: Any, X: Any, y_t: Any, rows: int, batch: int, epochs: int, seed: int, device: str, s0: int, s1: int
) -> Iterator:
    """``(step, xb, yb)`` of steps ``s0+1..s1`` of the grid's batch order (blocks holding no
    such step are not read)."""
    import torch

    n = X.shape[0]
    gen = torch.Generator().manual_seed(int(seed))
    step = 0
    for _ in range(epochs):
        if step >= s1:
            return
        todo = []
        for sp in ops._epoch_blocks(n, rows, gen):
            nb = math.ceil((sp[1] - sp[0]) / batch)
            if step < s1 and step + nb > s0:
                todo.append((sp, step))
            step += nb
        for ((a, _, _), first), (block, perm) in zip(todo, ops._blocks(X, [t[0] for t in todo])):
            xblock, yblock = torch.from_numpy(block)[perm].to(device), y_t[a : a + len(block)][perm].to(device)
            for k, i in enumerate(range(0, len(xblock), batch)):
                if s0 < first + k + 1 <= s1:
                    yield first + k + 1, xblock[i : i + batch], yblock[i : i + batch]


def _callbacks(ctx: dict[str, Any]) -> GridCallbacks:
    """The attentive grid's side of :func:`~featcache.probes.head_grid.run_grid`."""
    import torch

    from featcache.probes.attentive_modules import attention_heads, build_attentive_head

    ops, g, D, K, n = ctx["ops"], ctx["grid"], ctx["D"], ctx["K"], len(ctx["combos"])

    def init(idx: list[int]) -> list[_Head]:
        mods = [h.to(ctx["device"]) for h in ops._grid_heads(g.variant, D, K, n, ctx["seed"], keep=idx)]
        return [_Head(m, torch.optim.AdamW(ops.param_groups(m))) for m in mods]

    def dump(st: _Head) -> dict:
        return {"module": st.module.state_dict(), "opt": st.opt.state_dict(), "finite": st.finite}

    def load(i: int, obj: dict) -> _Head:
        with torch.random.fork_rng(devices=[]):
            m = build_attentive_head(g.variant, D, K, attention_heads(D)).to(ctx["device"])
        m.load_state_dict(obj["module"])
        opt = torch.optim.AdamW(ops.param_groups(m))
        opt.load_state_dict(obj["opt"])
        return _Head(m, opt, obj["finite"])

    def alive(k: int) -> None:
        ctx["alive"] = k

    train = lambda st, idx, a, b: _train(ctx, st, idx, a, b)  # noqa: E731
    return GridCallbacks(init, train, lambda st, idx: _score(ctx, st), dump, load, lambda st: st, alive)


def _train(ctx: dict[str, Any], states: list[_Head], idx: list[int], s0: int, s1: int) -> None:
    """Steps ``s0+1..s1`` of the heads ``idx`` (their states ``states``), in place."""
    ops, g, bar = ctx["ops"], ctx["grid"], ctx["bar"]
    combos = [ctx["combos"][i] for i in idx]
    opts = [st.opt for st in states]
    for step, xb, yb in _batches(
        ops, ctx["X"], ctx["y"], ctx["rows"], ctx["batch"], ctx["epochs"], ctx["seed"], ctx["device"], s0, s1
    ):
        for st in states:
            st.module.train()
        ops.set_schedules(opts, combos, g, step, ctx["warm"], ctx["t_max"])
        ok = ops.grid_step([st.module for st in states], opts, xb, yb, g.clip, ctx["dtype"])
        for st, o in zip(states, ok):
            st.finite = st.finite and o
        if bar is not None:
            bar.update(len(states))
            ep = (step - 1) // ctx["per_epoch"] + 1
            bar.set_postfix_str(
                f"epoch {ep}/{ctx['epochs']}, step {step}/{ctx['t_max']}, {ctx['alive']}/{len(ctx['combos'])} heads training",
                refresh=False,
            )
    for st in states:
        st.module.eval()


def _score(ctx: dict[str, Any], states: list[_Head]) -> list[float]:
    """The heads' validation scores (task metric; a head with a non-finite loss: -inf; no
    validation rows given: nan)."""
    from scipy.special import softmax

    ops = ctx["ops"]
    if ctx["val"] is None:
        return [math.nan] * len(states)
    Xva, yva, metric = ctx["val"]
    Z = ops.predict_logits([st.module for st in states], Xva, ctx["device"], ctx["dtype"])
    return [ops.val_score(metric, yva, softmax(z, axis=1)) if st.finite else -math.inf for z, st in zip(Z, states)]


def _amp(ctx: dict[str, Any], amp: str, groups: list[list[int]]) -> tuple[Any, dict[str, Any]]:
    """The bf16 choice over every head of the grid (built group by group) on the first batch."""
    import torch

    from featcache.probes._precision import bf16_choice

    if amp != "auto":
        return None, {"precision": "fp32", "why": "asked"}
    ops = ctx["ops"]
    first = next(_batches(ops, ctx["X"], ctx["y"], ctx["rows"], ctx["batch"], 1, ctx["seed"], ctx["device"], 0, 1))[1]
    g, n = ctx["grid"], len(ctx["combos"])

    def logits() -> Any:
        out = []
        for idx in groups:
            for h in ops._grid_heads(g.variant, ctx["D"], ctx["K"], n, ctx["seed"], keep=idx):
                out.append(h.to(ctx["device"]).eval()(first))
        return torch.stack(out)

    return bf16_choice(ctx["device"], logits, ops.BF16_MIN_COSINE)


def attentive_grid(
    ops: Any,
    X: Any,
    y: np.ndarray,
    n_classes: int,
    grid: Any,
    epochs: int,
    seed: int,
    device: str,
    amp: str,
    plan: GridPlan | None,
    val: Any,
    keep: str,
) -> tuple[list, dict[str, Any]]:
    """:func:`featcache.probes.attentive.train_attentive_grid` (its arguments); ``ops``: the
    module :mod:`featcache.probes.attentive` itself (its heads, step, schedules, block reads and
    bf16 bound: passed in, so this module does not import it back)."""
    import torch

    from featcache.core.progress import tqdm
    from featcache.probes.attentive_modules import attention_heads

    plan = plan or GridPlan(progress=False)
    n, T, D = X.shape
    combos = [(lr, wd) for lr in grid.lrs for wd in grid.wds]
    batch = int(min(grid.batch_size, n))
    rows = ops.shuffle_block_rows(n, T * D * 4, batch, grid.block_bytes)
    per_epoch = sum(math.ceil((min(n, a + rows) - a) / batch) for a in range(0, n, rows))
    t_max = epochs * per_epoch
    if plan.schedule == "halving" and val is None:
        raise ProbeError("grid schedule 'halving' drops heads on validation scores: pass val=(X_val, y_val, metric)")
    rungs = grid_rungs(plan.schedule, len(combos), t_max, plan.eta)
    mem = grid_memory(grid.variant, T, D, n_classes, batch, rows)
    groups = head_groups(range(len(combos)), mem["state"], mem["shared"], plan.max_memory, plan.what)
    line = memory_line(plan.what, len(combos), mem["params"], mem["state"], mem["shared"], plan.max_memory, len(groups))
    log.info("%s (token blocks and one head's activations: heads step one after the other)", line)
    ctx = {"X": X, "y": torch.from_numpy(np.asarray(y, np.int64)), "grid": grid, "D": D, "K": n_classes, "combos": combos,
           "device": device, "seed": seed, "rows": rows, "batch": batch, "epochs": epochs, "per_epoch": per_epoch,
           "t_max": t_max, "warm": int(grid.warmup_epochs * per_epoch), "val": val, "bar": None, "alive": len(combos),
           "ops": ops}  # fmt: skip
    ctx["dtype"], rec = _amp(ctx, amp, groups)
    with tqdm(total=head_steps(len(combos), rungs), desc=plan.what, unit="head-step", disable=not plan.progress) as bar:
        ctx["bar"] = bar
        out = run_grid(len(combos), rungs, len(groups[0]), _callbacks(ctx), keep=keep)
    heads = [out.kept[i].module if i in out.kept else None for i in range(len(combos))]
    finite = [out.kept[i].finite if i in out.kept else out.val[i] != -math.inf for i in range(len(combos))]
    info = {"combos": combos, "finite": finite, "batch_size": batch, "steps_per_epoch": per_epoch, "steps": t_max,
            "shuffle_block_rows": rows, "attention_heads": attention_heads(D), "amp": rec, "amp_dtype": ctx["dtype"],
            "grid": _summary(out), "memory": mem}  # fmt: skip
    return heads, info


def _summary(out: Any) -> dict[str, Any]:
    """The run's record (:class:`~featcache.probes.head_grid.GridOutcome` without the heads)."""
    keys = ("val", "status", "best", "head_steps", "full_head_steps", "rungs", "groups")
    return {k: getattr(out, k) for k in keys}
