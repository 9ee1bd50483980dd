"""The checks of a step, deferred: no host read during the step.

For CUDA tensors and under ``torch.compile`` (and everywhere with ``stats="device"``) a
check that would need a host read — a global batch of one row, ``check_finite``, ranks
that summed different collectives over ``torch.distributed`` — sets a flag in the
layer's ``_sync_errors`` buffer instead (:mod:`hvd_syncbn.torch.device`); the running
statistics are left alone on such a step, and the output is NaN after a mismatch.
:func:`check` raises them, naming the layers; :meth:`SyncBatchNorm.train` and
:meth:`~SyncBatchNorm.eval` call it. With ``$HVD_SYNCBN_DEVICE_ASSERT=1`` (debugging)
each flag is also a ``torch._assert_async`` at the step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hvd_syncbn.settings import env_flag
from hvd_syncbn.deferred import messages, raise_seen

SLOTS = ("mismatch", "mismatch", "not_one_row", "steps", "non_finite")
"""A layer's ``_sync_errors``, counts of steps since the last :func:`check`: a header
mismatch per header value, a global batch of other than one row, every step, non-finite
statistics. A step of one row is one counted in ``steps`` and not in ``not_one_row``:
adding a step's flags is then one op for every slot."""


_NOT_ONE_ROW = SLOTS.index("not_one_row")

ASSERT_ENV = "HVD_SYNCBN_DEVICE_ASSERT"


@torch.compiler.assume_constant_result
def asserts() -> bool:
    """Whether the deferred checks also assert at the step (``$HVD_SYNCBN_DEVICE_ASSERT=1``),
    with ``torch._assert_async``: a debug mode, since on CUDA a failed assert loses its
    message and leaves the CUDA context unusable."""
    return env_flag(ASSERT_ENV, False, "errors deferred to check(), the default",
                    "also assert at the step, for debugging")


def record(name: str, seen: Tensor, flags: Tensor, heads: int, debug: bool) -> None:
    """Add a step's ``flags`` of layer ``name`` (a mismatch per header value for its
    ``heads`` of them, ``N ≠ 1``, the step, then non-finite statistics where checked) to
    what it has ``seen`` (its ``_sync_errors``, :data:`SLOTS`), asserting them first where
    ``debug`` (:func:`asserts`)."""
    start = _NOT_ONE_ROW - heads
    if debug:
        mismatch, single_row, non_finite = messages(name)
        texts = (mismatch,) * heads + (single_row, None, non_finite)
        for i, (flag, text) in enumerate(zip(flags, texts)):
            if text is not None:  # every flag but N != 1 is an error
                torch._assert_async(flag if i == heads else ~flag, f"SyncBatchNorm (deferred check): {text}")
    seen[start:start + flags.numel()].add_(flags)


def check(module: nn.Module) -> None:
    """Raise the deferred errors of ``module``'s SyncBN layers (one host
    read), naming each layer and what it saw since the last check, and clear them.

    Raises:
        SyncBatchNormError: ranks summed different collectives.
        ValueError: a global batch of one row, or non-finite statistics with ``check_finite``.
    """
    layers = [m for m in module.modules() if getattr(m, "_sync_errors", None) is not None]
    if not layers:
        return
    first = layers[0]._sync_errors.device
    seen = torch.stack([m._sync_errors.to(first) for m in layers]).cpu().numpy()  # (layers, SLOTS)
    for m in layers:
        m._sync_errors.zero_()
    rows = [(row[:2].any(), row[3] > row[2], row[4] > 0) for row in seen]  # as FLAGS
    raise_seen("SyncBatchNorm (deferred check)", [(m.layer_name, row) for m, row in zip(layers, rows)])
