"""Test helpers shared by the rank-side suites: shards, global batches and comparisons.

Every rank builds the same global batch from a seed, runs its own slice through the
layer under test and compares with plain BN run on the whole batch in one process.
"""

from __future__ import annotations

import json
import os
from typing import Any, List, Mapping, Sequence

import numpy as np

# Where each comparison's used share of its tolerance goes (one JSON line per call, a file
# per process), to find tolerances that hold by a hair: HVD_SYNCBN_TEST_MARGINS=folder.
_MARGINS = os.environ.get("HVD_SYNCBN_TEST_MARGINS")

# Rows per rank for a world of any size: unequal, and (``EMPTY``) with an empty rank.
UNEQUAL = (3, 5, 2, 4)
EMPTY = (4, 0, 3, 0)


def shard_sizes(pattern: Sequence[int], world: int) -> List[int]:
    """Rows held by each of ``world`` ranks, cycling through ``pattern``."""
    return [pattern[r % len(pattern)] for r in range(world)]


def shard_slice(sizes: Sequence[int], rank: int) -> slice:
    """The rows of the global batch that ``rank`` holds."""
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def global_batch(seed: int, rows: int, tail: Sequence[int], offset: float = 0.0, scale: float = 1.0):
    """A float32 numpy batch ``(rows, *tail)``, identical on every rank for a seed."""
    rng = np.random.default_rng(seed)
    return (offset + scale * rng.standard_normal((rows, *tail))).astype(np.float32)


def training_batches(rows: int, tail: Sequence[int], steps: int = 3, seed: int = 0, offset: float = 0.0,
                     drift: float = 1.0, scale: float = 1.0, mask: bool = False) -> list:
    """The global batches of the oracle's training steps, the same on every rank and in
    every suite: per step ``(x, r, m)``, the input (``scale`` times unit normal, its mean
    at ``offset + drift·step``), the upstream gradient ``r`` (the loss is ``Σ y·r``), and
    with ``mask`` a boolean mask over all axes but the last (else ``None``)."""
    return [(global_batch(seed + step, rows, tail, offset=offset + drift * step, scale=scale),
             global_batch(100 + seed + step, rows, tail),
             global_batch(200 + seed + step, rows, tail[:-1]) > -0.5 if mask else None) for step in range(steps)]


def eval_batch(rows: int, tail: Sequence[int], seed: int = 0, offset: float = 0.0, scale: float = 1.0):
    """The global batch the oracle evaluates on after :func:`training_batches`."""
    return global_batch(seed + 50, rows, tail, offset=offset, scale=scale)


def assert_close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``np.testing``-style closeness that prints the largest difference and where."""
    got, want = _numpy(got), _numpy(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}"
    if got.size == 0:
        return
    diff = np.abs(got - want)
    bound = atol + rtol * np.abs(want)
    _record(what, _used(diff, bound))
    if not np.all(diff <= bound):
        i = np.unravel_index(np.argmax(diff - bound), diff.shape)
        raise AssertionError(
            f"{what}: largest difference {diff.max():.3g} (at {i}: got {got[i]!r}, "
            f"expected {want[i]!r}); rtol={rtol}, atol={atol}, "
            f"{int(np.sum(diff > bound))} of {diff.size} elements outside"
        )


def assert_as_accurate(got: Mapping[str, Any], plain: Mapping[str, Any], ref: Mapping[str, Any], what: str, *,
                       alone: bool = False, k: float = 4.0, ulps: float = 16.0) -> None:
    """Each tensor of ``got`` (ours: outputs, gradients, a model's state...) is as close
    to the float64 reference ``ref`` (plain BN on the concatenated batch) as ``plain``,
    plain BN computing the same in a lower precision, is. Per tensor of ``n`` elements,
    in L2::

        ‖got − ref‖ ≤ s·k·(‖plain − ref‖ + σ·√n) + ulps·ε·‖ref‖

    with ε the machine epsilon of ``got``'s dtype, ``s = ε / ε(plain's dtype)`` (rounding
    errors grow with ε, so for a float64 ``got`` plain float32's measured error, scaled
    down, stands for plain float64's) and σ plain's RMS error per element over all the
    tensors. σ covers tensors where plain's kernels happen to be more accurate than ours,
    or where rounding noise is large against the tensor itself (a mean of ~0, a small
    moving mean); the ulps term, scalars such as a loss. Integers must be exact.

    ``alone``: one rank, where the synchronized layers are plain BN: ``got`` must equal
    ``plain`` (then plain BN in ``got``'s precision) exactly.

    For float32 noise that exceeds any element-wise tolerance which would still catch a
    wrong statistic (ill-conditioned nets, large offsets), and so that the bound follows
    each machine's own kernels. Measured at 1-4 ranks: ours uses at most 0.29 of it on
    the real models (``ranks_models.py``), 0.19 in the oracle cases of ``ranks_torch.py``
    and the thread worlds of ``unit/test_thread_worlds.py``; local BN on the shards exceeds it in
    20-80% of the real models' tensors, by 1e3 and more.
    """
    assert list(got) == list(ref) == list(plain), f"{what}: tensors differ: {list(got)}, {list(plain)}, {list(ref)}"
    if alone:
        for name, t in got.items():
            assert_close(t, plain[name], f"{what}: {name}", rtol=0.0, atol=0.0)
        return
    ref = {name: _numpy(t) for name, t in ref.items()}
    errs = {name: _numpy(plain[name]) - r for name, r in ref.items()}
    sigma = np.sqrt(sum(np.sum(e**2) for e in errs.values()) / max(1, sum(r.size for r in ref.values())))
    for name, t in got.items():
        eps, eps_plain = _eps(t), _eps(plain[name])
        r = ref[name]
        err, err_plain, size = np.linalg.norm(_numpy(t) - r), np.linalg.norm(errs[name]), np.linalg.norm(r)
        bound = (eps / eps_plain * k * (err_plain + sigma * np.sqrt(r.size)) if eps else 0.0) + ulps * eps * size
        _record(f"{what}: {name}", _used(err, bound))
        if not err <= bound:
            raise AssertionError(
                f"{what}: {name} off the float64 reference by {err:.3g} (L2), plain BN by {err_plain:.3g} "
                f"(RMS {sigma:.3g} per element over all); allowed {k:g}x (plain's + RMS·√{r.size}), scaled to "
                f"{_dtype_name(t)}, + {ulps:g} ulps of the norm {size:.3g} = {bound:.3g}"
            )


def _eps(x) -> float:
    """Machine epsilon of a tensor's dtype; 0 for integers."""
    if _dtype_name(x) == "bfloat16":  # 8 significand bits; numpy has no name for it
        return 2.0**-7
    dtype = np.dtype(_dtype_name(x))
    return float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 0.0


def _dtype_name(x) -> str:
    """'float32' for a torch, numpy, TF or Keras tensor or variable of that dtype."""
    dtype = x.dtype
    return getattr(dtype, "name", None) or str(dtype).split(".")[-1]


def _used(diff: np.ndarray, bound: np.ndarray) -> float:
    """The largest share of its bound a difference uses (1 = at the limit)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(diff == 0, 0.0, diff / bound)
    return float(np.max(share)) if share.size else 0.0


def _record(what: str, used: float) -> None:
    if _MARGINS:
        with open(os.path.join(_MARGINS, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "what": what, "used": used}) + "\n")


def _numpy(x) -> np.ndarray:
    """float64 numpy copy of a numpy array, torch tensor (any dtype, grad or not) or TF tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double()
    return np.asarray(x, dtype=np.float64)
