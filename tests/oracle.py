"""Test helpers shared by the rank-side suites: shards, global batches and comparisons.

Every rank builds the same global batch from a seed, runs its own slice through the
layer under test and compares with plain BN run on the whole batch in one process.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

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


def assert_close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``np.testing``-style closeness that prints the largest difference and where."""
    got, want = _numpy(got), _numpy(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}"
    if got.size == 0:
        return
    diff = np.abs(got - want)
    bound = atol + rtol * np.abs(want)
    if not np.all(diff <= bound):
        i = np.unravel_index(np.argmax(diff - bound), diff.shape)
        raise AssertionError(
            f"{what}: largest difference {diff.max():.3g} (at {i}: got {got[i]!r}, "
            f"expected {want[i]!r}); rtol={rtol}, atol={atol}, "
            f"{int(np.sum(diff > bound))} of {diff.size} elements outside"
        )


def _numpy(x) -> np.ndarray:
    """float64 numpy copy of a numpy array, torch tensor (any dtype, grad or not) or TF tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double()
    return np.asarray(x, dtype=np.float64)
