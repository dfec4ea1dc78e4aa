"""``dinov2-linear``'s head grid run by :mod:`featcache.probes.head_grid`: the full grid or
successive halving, in groups within ``--max-memory``.

Each head's state is its own weight, bias and momentum buffers; a group's heads are stacked
per input variant for the step (one matmul forward, one backward per variant, as
:func:`~featcache.probes.dinov2_linear.train_joint`), on the batches and lrs of one
uninterrupted run (:class:`~featcache.probes.dinov2_linear.JointStream`). The full grid in one
group is :func:`~featcache.probes.dinov2_linear.train_joint` step for step. When heads are
dropped or grouped the stacked matmuls change shape (fewer heads), which changes the float
summation order of the BLAS kernels: a head's trajectory then equals its full-grid run to
float32 rounding, not bit for bit (tests/probes/test_head_grid.py measures the tolerance)."""

from __future__ import annotations

import logging
import math
from typing import Any

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

__all__ = ["dinov2_grid", "grid_memory"]

#: bytes per parameter while training: weight, momentum buffer, the step's gradient (float32)
SGD_BYTES = 12


def grid_memory(specs: list, D: int, C: int, batch: int, S: int) -> dict[str, int]:
    """Memory in bytes: ``params`` of the largest head, ``state`` per head (weights, momentum,
    gradient, its logits and softmax at ``batch`` rows), ``shared`` (the batch and its inputs)."""
    p = max((s.n_blocks + int(s.avgpool)) * D * C + C for s in specs)
    return {"params": p, "state": SGD_BYTES * p + 8 * batch * C, "shared": 3 * batch * S * D * 4}


def _callbacks(ctx: dict[str, Any]) -> GridCallbacks:
    import torch

    ops, specs = ctx["ops"], ctx["specs"]
    JointHeads = ops.JointHeads

    def init(idx: list[int]) -> list[tuple]:
        gen = torch.Generator().manual_seed(int(ctx["seed"]))
        h = JointHeads(specs, ctx["D"], ctx["C"], gen, ctx["init_std"], keep=idx).to(ctx["device"])
        return [(W, b, torch.zeros_like(W), torch.zeros_like(b)) for W, b in (h.head(k) for k in range(len(idx)))]

    def stack(states: list[tuple], idx: list[int]) -> tuple[Any, dict, dict]:
        h = JointHeads.from_heads(specs, idx, [s[0] for s in states], [s[1] for s in states])
        buf = JointHeads.from_heads(specs, idx, [s[2] for s in states], [s[3] for s in states])
        return h, buf.W, buf.b

    def train(states: list[tuple], idx: list[int], s0: int, s1: int) -> None:
        h, bW, bb = stack(states, idx)
        ops.joint_steps(h, bW, bb, ctx["stream"], s0, s1, ctx["momentum"], ctx["amp"], progress)
        for k in range(len(idx)):
            v = (h.specs[k].n_blocks, h.specs[k].avgpool)
            j = h.members[v].index(k)
            states[k] = (h.W[v][j], h.b[v][j], bW[v][j], bb[v][j])

    def score(states: list[tuple], idx: list[int]) -> list[float]:
        h = JointHeads.from_heads(specs, idx, [s[0] for s in states], [s[1] for s in states])
        finite = [bool(torch.isfinite(s[0]).all()) for s in states]
        sc = ops.score_heads(h, ctx["Xva"], ctx["yva"], ctx["metric"])
        return [v if f else -math.inf for v, f in zip(sc, finite)]

    def alive(k: int) -> None:
        ctx["alive"] = k

    def progress(step: int, stepped: int) -> None:
        bar, n = ctx["bar"], ctx["stream"].max_iter
        if bar is not None:
            bar.update(stepped)
            ep, E = (step - 1) // ctx["epoch_length"] + 1, math.ceil(n / ctx["epoch_length"])
            bar.set_postfix_str(
                f"epoch {ep}/{E}, step {step}/{n}, {ctx['alive']}/{len(specs)} heads training", refresh=False
            )

    dump = lambda st: tuple(t.detach().cpu().clone() for t in st)  # noqa: E731
    load = lambda i, obj: tuple(t.to(ctx["device"]) for t in obj)  # noqa: E731
    take = lambda st: (st[0].detach().cpu().clone(), st[1].detach().cpu().clone())  # noqa: E731
    return GridCallbacks(init, train, score, dump, load, take, alive)


def dinov2_grid(ctx: dict[str, Any], plan: GridPlan, max_iter: int) -> tuple[Any, dict[str, Any]]:
    """Train ``ctx``'s grid (keys: ops, the module :mod:`featcache.probes.dinov2_linear` itself,
    passed in so this module does not import it back; specs, D, C, seed, init_std, device, stream, momentum, Xva,
    yva, metric, batch, S) by ``plan``, the bf16 choice first (``ctx["amp"]``,
    ``ctx["precision"]``); returns (the outcome, the memory estimate)."""
    from featcache.core.progress import tqdm

    specs = ctx["specs"]
    rungs = grid_rungs(plan.schedule, len(specs), max_iter, plan.eta)
    mem = grid_memory(specs, ctx["D"], ctx["C"], ctx["batch"], ctx["S"])
    groups = head_groups(range(len(specs)), mem["state"], mem["shared"], plan.max_memory, plan.what)
    log.info(
        memory_line(plan.what, len(specs), mem["params"], mem["state"], mem["shared"], plan.max_memory, len(groups))
    )
    ctx["amp"], ctx["precision"] = _precision(ctx, groups)
    with tqdm(total=head_steps(len(specs), rungs), desc=plan.what, unit="head-step", disable=not plan.progress) as bar:
        ctx["bar"] = bar
        out = run_grid(len(specs), rungs, len(groups[0]), _callbacks(ctx))
    return out, mem


def _precision(ctx: dict[str, Any], groups: list[list[int]]) -> tuple[Any, dict[str, Any]]:
    """bf16 autocast for training where the device has it and the fresh heads' logits on the
    first rows agree with fp32 (:func:`~featcache.probes._precision.bf16_choice`); else fp32."""
    from featcache.probes._precision import bf16_choice

    xb = ctx["stream"].X[: ctx["batch"]]
    return bf16_choice(ctx["device"], lambda: group_logits(ctx, groups, xb), ctx["ops"].BF16_MIN_COSINE)


def group_logits(ctx: dict[str, Any], groups: list[list[int]], xb: Any) -> Any:
    """The fresh heads' logits on ``xb``, built group by group (the bf16 check)."""
    import torch

    JointHeads = ctx["ops"].JointHeads
    out = []
    for idx in groups:
        gen = torch.Generator().manual_seed(int(ctx["seed"]))
        h = JointHeads(ctx["specs"], ctx["D"], ctx["C"], gen, ctx["init_std"], keep=idx).to(ctx["device"])
        out += [h.logits(xb, v) for v in h.variants]
    return torch.cat(out, 1)
