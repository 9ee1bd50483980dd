"""A latency/bandwidth model of SyncBN's communication, fitted on measured allreduces.

Cost of one collective on ``W`` ranks moving ``n`` bytes per rank (Hockney model, with
the latency term of a tree / recursive doubling and the bandwidth term of a ring,
the textbook lower bounds that MPI libraries approach for small and large messages):

    allreduce(W, n) = h + ceil(log2 W)·(α + σ·[W > cores]) + 2(W−1)/W · n·β
    allgather(W, n) = h + ceil(log2 W)·(α + σ·[W > cores]) + (W−1) · n·β   (n: one rank's part)

``h`` is a fixed per-call cost (Horovod: waiting for its next background cycle, a
full one when the call follows another Horovod collective, and its negotiation;
mpi4py: the call itself and the ranks' skew), ``α`` the per-round latency, ``β``
seconds per byte, and ``σ`` what a round costs more when ranks outnumber the cores:
the wait for a peer that is not scheduled. They are fitted (non-negative least squares
on relative error) to the lower quartile of each point of ``alphabeta.py``'s sweeps at
1–4 ranks, each call timed right after a Horovod barrier as in the layer benchmarks,
and checked against the lower quartile of the layer jobs' floors. A cluster gives each
rank a core: the predictions beyond this machine leave ``σ`` out. SyncBN's collectives
sit on the critical path one after another, so a step's overhead is the sum over its BN
layers of their collectives.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, Iterable, List, Tuple

import numpy as np

Collective = Tuple[str, int]  # (kind, bytes per rank)


def resnet50_bn_channels() -> List[int]:
    """C of every BN layer of ResNet-50: the stem, then per bottleneck ``(w, w, 4w)``
    plus one downsample BN at each stage's first block."""
    chans = [64]
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            chans += [width, width, 4 * width] + ([4 * width] if b == 0 else [])
    assert len(chans) == 53, len(chans)
    return chans


def deeplabv3_bn_channels() -> List[int]:
    """DeepLab-v3 on a ResNet-50 backbone (torchvision's layout): the backbone's 53 BN
    layers, ASPP's five 256-channel branches, its projection, and the head's 3x3 conv."""
    return resnet50_bn_channels() + [256] * 5 + [256, 256]


# Per-layer collectives of each design, (kind, bytes each rank sends), for C channels.
DESIGNS = {
    "ours (1 allreduce each way, float64 2C+3 / 2C+2)":
        lambda c: [("allreduce", 8 * (2 * c + 3)), ("allreduce", 8 * (2 * c + 2))],
    "all-gather (torch.nn.SyncBatchNorm / apex: gather W·(2C+1) fwd, allreduce 2C bwd)":
        lambda c: [("allgather", 4 * (2 * c + 1)), ("allreduce", 4 * 2 * c)],
    "hvd.SyncBatchNorm (3 all-gathers fwd: count, mean, invstd; 2 allreduces bwd)":
        lambda c: [("allgather", 4), ("allgather", 4 * c), ("allgather", 4 * c),
                   ("allreduce", 4 * c), ("allreduce", 4 * c)],
    "three-collective hand-written (count, Σx, Σx² fwd; 2 autograd allreduces bwd)":
        lambda c: [("allreduce", 4), ("allreduce", 4 * c), ("allreduce", 4 * c),
                   ("allreduce", 4 * c), ("allreduce", 4 * c)],
}
SHORT = {k: k.split(" (")[0] for k in DESIGNS}


def features(kind: str, ranks: int, nbytes: float, cores: int = 0) -> np.ndarray:
    """Coefficients of ``(h, α, β, σ)`` in the cost of one collective; ``cores``: the
    machine's (0: one per rank, as on a cluster)."""
    rounds = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    if ranks == 1:
        volume = 0.0
    elif kind == "allreduce":
        volume = 2 * (ranks - 1) / ranks * nbytes
    elif kind == "allgather":
        volume = (ranks - 1) * nbytes
    else:
        raise ValueError(f"unknown collective kind {kind!r}; expected allreduce or allgather")
    return np.array([1.0, rounds, volume, rounds if cores and ranks > cores else 0.0])


def fit(points: Iterable[Tuple[int, float, float]], cores: int) -> Dict[str, float]:
    """``{"h", "alpha", "beta", "sigma"}`` (ms, ms, ms/byte, ms) from ``(ranks, bytes, ms)``
    allreduce points on a machine with ``cores`` cores: the non-negative least-squares fit
    of relative error (every subset of the four terms is tried; the best one with no
    negative coefficient wins)."""
    pts = [(w, n, t) for w, n, t in points if t > 0]
    a = np.array([features("allreduce", w, n, cores) for w, n, _ in pts])
    t = np.array([p[2] for p in pts])
    a_rel, one = a / t[:, None], np.ones(len(t))
    best, best_err = np.zeros(4), math.inf
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            coef, *_ = np.linalg.lstsq(a_rel[:, cols], one, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[list(cols)] = coef
            err = float(np.sum((a_rel @ full - one) ** 2))
            if err < best_err:
                best, best_err = full, err
    rms = math.sqrt(best_err / len(t)) if len(t) else math.nan
    return {"h": best[0], "alpha": best[1], "beta": best[2], "sigma": best[3], "rms_rel_err": rms,
            "points": len(t)}


def cost(params: Dict[str, float], collectives: Iterable[Collective], ranks: int, cores: int = 0) -> float:
    """Predicted ms of ``collectives`` run one after another on ``ranks`` ranks
    (``cores``: the machine's; 0: one per rank)."""
    coef = np.array([params["h"], params["alpha"], params["beta"], params["sigma"]])
    return float(sum(features(kind, ranks, n, cores) @ coef for kind, n in collectives))


GROUP_RANKS = tuple(2 ** k for k in range(3, 13))
"""The job sizes of the BN-group model: 8 to 4,096 ranks (GPUs)."""


def step_overhead(params: Dict[str, float], design: str, channels: List[int], ranks: int,
                  group: int = 0) -> float:
    """Predicted SyncBN communication ms per training step (forward + backward), with a
    core per rank; ``group``: BN groups of that many ranks (each collective spans one
    group, all groups at once), 0 for all ranks."""
    return cost(params, [c for ch in channels for c in DESIGNS[design](ch)], min(ranks, group or ranks))
