"""Failures an elastic engine recovers from stay recoverable through SyncBN.

Under Horovod elastic (``hvd.elastic.run``), a collective that fails because Horovod
shut down (a worker left or failed: ``HorovodInternalError``) makes the job reset to the
workers left. Where that happens in a SyncBN collective, the layer raises
:class:`HorovodSyncBatchNormError` at once, chained to Horovod's error: a
:class:`~hvd_syncbn.errors.SyncBatchNormError` that is also a ``HorovodInternalError``,
so that ``hvd.elastic.run`` resets as it does with plain BN (no diagnosis: the peers are
resetting too). After the reset the layers resolve their communicators anew, over the
new world. Imported by the adapters that use Horovod only.
"""

from __future__ import annotations

from horovod.common.exceptions import HorovodInternalError

from hvd_syncbn.errors import SyncBatchNormError


class HorovodSyncBatchNormError(SyncBatchNormError, HorovodInternalError):
    """A SyncBN collective failed because Horovod shut down (a worker left or failed):
    ``hvd.elastic.run`` catches it as the ``HorovodInternalError`` it is and resets."""


def reset_error(error: BaseException) -> "type | None":
    """:class:`HorovodSyncBatchNormError` where ``error`` is Horovod's ``HorovodInternalError``."""
    return HorovodSyncBatchNormError if isinstance(error, HorovodInternalError) else None
