"""TensorFlow/Keras adapter: SyncBatchNormalization, the model converter, the functional op,
and what ``model.fit`` needs under Horovod with Keras 3."""

try:
    import tensorflow  # noqa: F401
except ImportError as e:
    raise ImportError(f"hvd_syncbn.tensorflow needs TensorFlow ({e}); "
                      "install it with: pip install 'hvd_syncbn[tensorflow]'") from e

from .batchnorm import SyncBatchNormalization
from .functional import sync_batch_normalization
from .convert import convert_sync_batchnorm, revert_sync_batchnorm
from .device import CheckSyncBatchNorm, check
from .training import (BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback,
                       broadcast_variables)

__all__ = [
    "SyncBatchNormalization", "convert_sync_batchnorm", "revert_sync_batchnorm", "sync_batch_normalization", "check",
    "CheckSyncBatchNorm",
    "DistributedOptimizer", "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "broadcast_variables",
]
