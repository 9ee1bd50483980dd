"""PyTorch adapter: :class:`SyncBatchNorm` and conversion to and from ``nn.BatchNorm``."""

from .batchnorm import SyncBatchNorm
from .convert import convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"]
