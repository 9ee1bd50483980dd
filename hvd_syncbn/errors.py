"""The errors SyncBN raises: ranks that disagree or stop answering, and unusable input."""


class SyncBatchNormError(RuntimeError):
    """Ranks disagree (different layers, order, shapes or dtypes), a rank stopped
    answering, or the global batch is unusable. Raised on every rank that can tell."""


class SyncBatchNormInputError(SyncBatchNormError, ValueError):
    """Some rank's input to a SyncBN layer is invalid; raised on every rank of the collective."""
