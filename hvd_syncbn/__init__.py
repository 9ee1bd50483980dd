"""Synchronized batch normalization for Horovod.

Framework-free here: the collective timeout and the error raised when ranks disagree.
The layers live in :mod:`hvd_syncbn.torch` and :mod:`hvd_syncbn.tensorflow`.
"""

__version__ = "0.1.0"

from hvd_syncbn.errors import SyncBatchNormError, SyncBatchNormInputError
from hvd_syncbn.settings import get_timeout, set_timeout

__all__ = ["SyncBatchNormError", "SyncBatchNormInputError", "get_timeout", "set_timeout"]
