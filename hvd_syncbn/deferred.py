"""The device paths' deferred checks, framework-free: what each flag means, and the error.

On a device path (statistics as tensors on the input's device, traced by
``torch.compile`` or XLA) a check that would need a host read sets a flag in the layer
instead: ranks that summed different collectives (the buffer comes back NaN), a global
batch of one row, non-finite statistics under ``check_finite``. The moving statistics
are left alone on such a step. Each framework's ``check`` reads the flags of a model's
layers at once and raises them by :func:`raise_seen`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from hvd_syncbn import validation
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.diagnosis import fail
from hvd_syncbn.errors import SyncBatchNormError
from hvd_syncbn.identity import Call

FLAGS = ("mismatch", "single_row", "non_finite")
"""A layer's flags, in order."""


def messages(layer: str) -> Tuple[str, str, str]:
    """What each of :data:`FLAGS` means, for ``layer``."""
    return (f"{layer}: ranks summed different collectives (they disagree on the SyncBN layers, their order, "
            f"channel count, input rank or dtype)", validation.single_row_message(layer),
            validation.non_finite_message(layer))


def raise_seen(path: str, seen: Sequence[Tuple[str, Sequence[bool]]],
               mismatched: Optional[Tuple[Communicator, Call]] = None) -> None:
    """Raise what the layers have ``seen``, ``(layer name, flags)`` each, naming every
    layer and flag; nothing if no flag is set. ``path`` heads the message.

    ``mismatched``: the communicator and collective of this rank's first layer that
    flagged a mismatch. A mismatched sum flags every rank in it, so each rank's check
    meets the others over the communicator's side channel (as the host path's
    diagnosis does, :func:`hvd_syncbn.diagnosis.fail`), and the error names the layer of
    every rank, not only this one's.

    Raises:
        SyncBatchNormError: ranks summed different collectives.
        ValueError: a global batch of one row, or non-finite statistics with ``check_finite``.
    """
    problems = [text for name, row in seen for text, bad in zip(messages(name), row) if bad]
    if not problems:
        return
    message = f"{path}: " + "; ".join(problems)
    if any(row[FLAGS.index("mismatch")] for _, row in seen):
        if mismatched is not None:
            fail(*mismatched, message)
        raise SyncBatchNormError(message)
    raise ValueError(message)
