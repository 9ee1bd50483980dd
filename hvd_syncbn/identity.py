"""A collective's identity: the :class:`Call` each rank makes (layer, direction, step,
channels, input rank, dtype), and the ``[h, h²]`` header that hashes it, so that the sum
of the headers tells whether every rank was in the same collective.

Every buffer starts with the :data:`HEADER` values ``[h, h²]``. After the sum every rank
checks ``Σh = W·h`` and ``Σh² = W·h²``; both hold on one rank only if all ``h`` are
equal, so a mismatch fails on every rank at once (MPI matches collectives by order, not
name, and would otherwise mix two layers' statistics).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import List

from hvd_syncbn.communicator import Communicator

HEADER = 2
"""Values of the identity header that open every summed buffer."""


@dataclass
class Call:
    """What one rank is doing in one collective: the identity its header hashes."""

    layer: str
    direction: str
    step: int
    channels: int
    ndim: int
    dtype: str
    rank: int = 0
    problem: str = ""

    @property
    def key(self) -> str:
        """What identifies the collective on every rank: all of it but the rank and problem."""
        return f"{self.layer}|{self.direction}|{self.step}|{self.channels}|{self.ndim}|{self.dtype}"

    @property
    def name(self) -> str:
        """The collective's name: deterministic, unique per layer and direction, readable."""
        return f"hvd_syncbn.{self.layer}.{self.direction}"

    def where(self) -> str:
        """Its layer, direction and step (a traced collective has neither: ``""``, ``-1``) and
        shape (none before the layer's first collective: its set-up)."""
        way = {"fwd": " forward", "bwd": " backward"}.get(self.direction, f" {self.direction}" if self.direction else "")
        step = f", step {self.step}" if self.step >= 0 else ""
        shape = f" ({self.channels} channels, {self.ndim}D {self.dtype})" if self.channels else ""
        return f"layer {self.layer!r}{way}{step}{shape}"


def header(call: Call, world: int) -> List[float]:
    """``[h, h²]`` with ``h`` small enough that ``W·h²`` is exact in float64."""
    bits = max(8, min(26, (53 - max(1, math.ceil(math.log2(max(world, 2))))) // 2))
    h = float(zlib.crc32(call.key.encode()) % (1 << bits) + 1)
    return [h, h * h]


def static_header(layer: str, direction: str, channels: int, ndim: int, dtype: str, world: int) -> List[float]:
    """The static ``[h, h²]`` of a collective traced once (a graph op: no step count)."""
    return header(Call(layer, direction, 0, channels, ndim, dtype), world)


def make_call(comm: Communicator, layer: str, direction: str, channels: int, ndim: int, dtype: str,
              count: bool = True) -> Call:
    """This rank's identity of ``layer``'s next collective in ``direction`` over ``comm``;
    its ``step`` counts this process's earlier calls of that collective on ``comm``.
    ``count=False``: the latest one's instead, counting nothing."""
    steps = comm.__dict__.setdefault("_steps", {})
    latest = steps.get((layer, direction), -1)
    step = latest + 1 if count else max(latest, 0)
    if count:
        steps[layer, direction] = step
    return Call(layer, direction, step, channels, ndim, dtype, comm.rank)
