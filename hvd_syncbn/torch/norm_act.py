"""SyncBatchNorm followed by a drop layer and an activation.

The synchronized form of timm's ``BatchNormAct2d`` (and of its ``SyncBatchNormAct``);
importing this module does not import timm.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from .batchnorm import SyncBatchNorm


class SyncBatchNormAct2d(SyncBatchNorm):
    r""":class:`SyncBatchNorm` then ``drop`` then ``act``, as timm's ``BatchNormAct2d``.

    .. math::
        y = \mathrm{act}(\mathrm{drop}(\mathrm{SyncBatchNorm}(x)))

    :func:`~hvd_syncbn.torch.convert_sync_batchnorm` makes one from each timm
    ``BatchNormAct2d``, keeping its ``drop`` and ``act`` modules (so ``state_dict`` keys
    stay the same); :func:`~hvd_syncbn.torch.revert_sync_batchnorm` gives the timm layer
    back.

    Args:
        num_features: ``C`` from an input of size ``(N, C, H, W)``.
        *args: as for :class:`SyncBatchNorm`.
        act: the activation module. Default: ``nn.Identity()``.
        drop: the drop module, applied before ``act``. Default: ``nn.Identity()``.
        **kwargs: as for :class:`SyncBatchNorm`.

    Shape:
        - Input: ``(N, C, H, W)``; ``N`` may differ per rank, even 0.
        - Output: same shape as the input.

    Examples::

        >>> layer = SyncBatchNormAct2d(64, act=nn.SiLU())
        >>> y = layer(torch.randn(2, 64, 8, 8))
    """

    def __init__(self, num_features: int, *args: Any, act: Optional[nn.Module] = None,
                 drop: Optional[nn.Module] = None, **kwargs: Any) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.drop = nn.Identity() if drop is None else drop
        self.act = nn.Identity() if act is None else act

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"{self.layer_name}: expected 4D input (got {input.dim()}D input of shape "
                             f"{tuple(input.shape)})")
        super()._check_input_dim(input)

    def forward(self, input: Tensor) -> Tensor:
        return self.act(self.drop(super().forward(input)))
