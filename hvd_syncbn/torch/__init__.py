"""PyTorch adapter: :class:`SyncBatchNorm` and conversion to and from ``nn.BatchNorm``."""

try:
    import torch  # noqa: F401
except ImportError as e:
    raise ImportError(f"hvd_syncbn.torch needs PyTorch ({e}); install it with: pip install 'hvd_syncbn[torch]'") from e

from .batchnorm import SyncBatchNorm
from .convert import convert_sync_batchnorm, revert_sync_batchnorm
from .deferred import check
from .norm_act import SyncBatchNormAct2d

__all__ = ["SyncBatchNorm", "SyncBatchNormAct2d", "check", "convert_sync_batchnorm", "revert_sync_batchnorm"]
