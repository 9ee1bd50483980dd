"""TensorFlow/Keras adapter: SyncBatchNormalization, the model converter, the functional op."""

from .batchnorm import SyncBatchNormalization, sync_moments_and_normalize
from .convert import convert_sync_batchnorm

__all__ = ["SyncBatchNormalization", "convert_sync_batchnorm", "sync_moments_and_normalize"]
