"""PyTorch Lightning plugin: :class:`SyncBatchNormPlugin` converts a model's BN layers to
:class:`~hvd_syncbn.torch.SyncBatchNorm` for ``fit`` and gives the plain ones back after."""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Optional

try:
    from lightning.pytorch.plugins import LayerSync
except ImportError as e:
    raise ImportError(f"hvd_syncbn.lightning needs PyTorch Lightning ({e}); install it with: "
                      "pip install 'hvd_syncbn[lightning]'") from e
from torch import nn

from hvd_syncbn import validation
from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from hvd_syncbn.torch.batchnorm import one_group
from hvd_syncbn.torch.convert import _replace
from hvd_syncbn.transports import requested_kind

__all__ = ["SyncBatchNormPlugin"]


class SyncBatchNormPlugin(LayerSync):
    """Synchronized batch normalization for Lightning's ``Trainer``, on CPUs and GPUs.

    Lightning's own ``sync_batchnorm=True`` builds ``torch.nn.SyncBatchNorm``, which runs
    on GPUs only. With this plugin, ``fit`` under a parallel strategy (``"ddp"``, also
    under ``mpirun`` or ``srun``) converts each BN layer of the model by
    :func:`~hvd_syncbn.torch.convert_sync_batchnorm` (:meth:`apply`), and after ``fit``
    gives back each converted layer's original class, with its trained state
    (:meth:`revert`). Layers already :class:`~hvd_syncbn.torch.SyncBatchNorm` before
    ``fit`` stay as they are. The ``state_dict`` keys do not change, so a checkpoint saved
    during ``fit`` loads into the unconverted model. A single-device ``Trainer`` applies
    no layer sync plugin: the model keeps its plain BN.

    Args:
        process_set: Horovod process set (or ``torch.distributed`` group, with
            ``comm="torch"``) the layers synchronise within. Default: all ranks.
        comm: how statistics travel, as for :class:`~hvd_syncbn.torch.SyncBatchNorm`.
            Under Lightning's DDP a process group exists, so ``"auto"`` takes
            ``torch.distributed``. Default: ``$HVD_SYNCBN_COMM``, else ``"auto"``.
        check_finite: as for :class:`~hvd_syncbn.torch.SyncBatchNorm`. Default: ``False``.
        stats: as for :class:`~hvd_syncbn.torch.SyncBatchNorm`. Default:
            ``$HVD_SYNCBN_STATS``, else ``"auto"``.
        process_group: ``process_set`` under ``torch.nn.SyncBatchNorm``'s name; give
            one of the two, not both.
        classes: more conversions, as for :func:`~hvd_syncbn.torch.convert_sync_batchnorm`.
        group_size: BN groups, as for :class:`~hvd_syncbn.torch.SyncBatchNorm`: ``k``
            consecutive ranks or ``"node"``. Default: ``None`` (all ranks).

    Examples::

        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
        ...                     plugins=[SyncBatchNormPlugin()])
        >>> trainer.fit(model, datamodule=dm)  # model has plain BN again here
    """

    def __init__(self, process_set: Any = None, *, comm: Any = None, check_finite: bool = False,
                 stats: Optional[str] = None, process_group: Any = None,
                 classes: Optional[Mapping[type, type]] = None, group_size: Any = None) -> None:
        requested_kind(comm)  # bad arguments fail at the Trainer's construction, not in fit
        validation.stats_choice("SyncBatchNormPlugin", stats)
        self.process_set = one_group("SyncBatchNormPlugin", process_set, process_group, group_size)
        self.layer_args = dict(comm=comm, check_finite=check_finite, stats=stats, classes=classes,
                               group_size=group_size)

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` with its BN layers converted to :class:`~hvd_syncbn.torch.SyncBatchNorm`."""
        before = set(_sync_layers(model))
        model = convert_sync_batchnorm(model, self.process_set, **self.layer_args)
        self._converted = weakref.WeakSet(m for m in _sync_layers(model) if m not in before)
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        """``model`` with each layer :meth:`apply` converted back to its original class."""
        converted = getattr(self, "_converted", ())
        return _replace(model, lambda m, path: revert_sync_batchnorm(m) if m in converted else None)


def _sync_layers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, SyncBatchNorm)]
