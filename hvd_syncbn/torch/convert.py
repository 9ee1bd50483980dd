"""Conversion between BN layers and :class:`SyncBatchNorm`, in both directions.

A converted layer takes over the original's state as it is: its parameters and buffers
(the same tensors), submodules, hooks, ``training`` and every other attribute, so the
``state_dict`` keys, device, dtype and ``requires_grad`` stay. Only BN classes whose
computation is known are converted; any other ``_BatchNorm`` subclass raises.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from hvd_syncbn import validation
from hvd_syncbn.transports import requested_kind

from .batchnorm import SyncBatchNorm, one_group
from .norm_act import SyncBatchNormAct2d

_KNOWN = {nn.BatchNorm1d: SyncBatchNorm, nn.BatchNorm2d: SyncBatchNorm, nn.BatchNorm3d: SyncBatchNorm,
          nn.SyncBatchNorm: SyncBatchNorm}
# timm's BN + drop + activation layers, by name so that timm stays optional.
_KNOWN_BY_NAME = {
    f"{module}.{cls}": SyncBatchNormAct2d
    for module in ("timm.layers.norm_act", "timm.models.layers.norm_act")
    for cls in ("BatchNormAct2d", "SyncBatchNormAct")
}


def _full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _where(path: str) -> str:
    return repr(path) if path else "the module passed"


def _recast(src: nn.Module, cls: type, drop: tuple = ()) -> nn.Module:
    """A new ``cls`` module holding ``src``'s state: the same parameters, buffers and
    submodules in new containers, every other attribute as it is, less ``drop``."""
    new = cls.__new__(cls)
    state = {k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in vars(src).items() if k not in drop}
    new.__dict__.update(state)
    return new


def _sync_class(bn: _BatchNorm, path: str, classes: Mapping[type, type]) -> type:
    """The synchronized class for ``bn``, or raise naming it when there is none."""
    where, cls = _where(path), type(bn)
    if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(
            f"convert_sync_batchnorm: expected initialised BN layers, got an uninitialised {cls.__name__} at "
            f"{where}; run one forward pass (e.g. model(example_input)) before converting")
    found = classes.get(cls) or _KNOWN.get(cls) or _KNOWN_BY_NAME.get(_full_name(cls))
    if found is None:
        base = next(c for c in cls.__mro__ if c in _KNOWN or c is _BatchNorm)
        raise ValueError(
            f"convert_sync_batchnorm: {where} is a {_full_name(cls)}, a subclass of {base.__name__} this converter "
            f"does not know; replacing it by SyncBatchNorm could change what the model computes. Pass "
            f"classes={{{cls.__name__}: SyncCls}} with SyncCls a SyncBatchNorm subclass that computes what "
            f"{cls.__name__} does (or SyncBatchNorm itself if it only changes how the layer is built)")
    return found


def _replace(module: nn.Module, swap: Callable[[nn.Module, str], Optional[nn.Module]], path: str = "") -> nn.Module:
    """``module`` with each submodule for which ``swap(m, path)`` returns a new one
    replaced in place (``swap`` returns ``None`` to descend into ``m`` instead)."""
    new = swap(module, path)
    if new is not None:
        return new
    for name, child in module.named_children():
        replaced = _replace(child, swap, f"{path}.{name}" if path else name)
        if replaced is not child:
            module.add_module(name, replaced)
    return module


def convert_sync_batchnorm(module: nn.Module, process_set: Any = None, *,
                           classes: Optional[Mapping[type, type]] = None, comm: Any = None,
                           check_finite: bool = False, stats: Optional[str] = None,
                           process_group: Any = None, group_size: Any = None) -> nn.Module:
    """Replace every BN layer in ``module`` by its synchronized form.

    - ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` become :class:`SyncBatchNorm`
      (an ``nn.SyncBatchNorm``'s ``process_group`` is kept as ``process_set`` unless
      one is given);
    - timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` become
      :class:`SyncBatchNormAct2d`, keeping their ``drop`` and ``act``;
    - any other subclass of ``_BatchNorm`` raises ``ValueError`` naming its module path
      and class, unless ``classes`` maps it to a synchronized class;
    - an uninitialised lazy BN layer raises ``ValueError``;
    - :class:`SyncBatchNorm` layers, and every other module, stay as they are.

    Args:
        module: a model, or a single BN layer.
        process_set: Horovod process set (or ``torch.distributed`` group, with
            ``comm="torch"``) the new layers synchronise within. Default: all ranks.
        classes: more conversions, ``{BN subclass: SyncBatchNorm subclass}``; the new
            layer gets the old one's attributes and submodules, so its ``forward`` can
            use them as the original did. Default: none.
        comm, check_finite, stats: as :class:`SyncBatchNorm`'s, for every new layer;
            checked here, even when ``module`` holds no BN layer.
        process_group: ``process_set`` under ``torch.nn.SyncBatchNorm``'s name; give
            one of the two, not both.
        group_size: BN groups, as :class:`SyncBatchNorm`'s, for every new layer (an
            ``nn.SyncBatchNorm``'s ``process_group`` is then dropped). Default: ``None``.

    Returns:
        ``module`` with its BN children replaced in place, or the new layer if
        ``module`` itself is a BN layer. Each new layer is named by its module path
        (e.g. ``layer1.0.bn1``), which is also its collective's name.

    Examples::

        >>> model = hvd_syncbn.torch.convert_sync_batchnorm(timm.create_model("efficientnet_b0"))
        >>> model = convert_sync_batchnorm(model, classes={MyBNAct: MySyncBNAct})
        >>> model = convert_sync_batchnorm(model, process_group=group, comm="torch")
        >>> model = convert_sync_batchnorm(model, group_size="node")  # BN within each host
    """
    process_set = one_group("convert_sync_batchnorm", process_set, process_group, group_size)
    requested_kind(comm)  # a bad comm or stats fails here, not at the first synchronized step
    validation.stats_choice("convert_sync_batchnorm", stats)
    classes = _checked(classes)

    def swap(m: nn.Module, path: str) -> Optional[nn.Module]:
        if not isinstance(m, _BatchNorm) or isinstance(m, SyncBatchNorm):
            return None
        cls = _sync_class(m, path, classes)
        group = process_set if process_set is not None or group_size else getattr(m, "process_group", None)
        new = _recast(m, cls)
        new._init_sync(group, path or None, comm, check_finite, stats, group_size)
        new._plain_class = type(m)
        return new

    return _replace(module, swap)


def _checked(classes: Optional[Mapping[type, type]]) -> dict:
    """``classes`` as a dict, checked: ``_BatchNorm`` subclasses to ``SyncBatchNorm`` subclasses."""
    classes = dict(classes or {})
    for plain, sync in classes.items():
        if not (isinstance(plain, type) and issubclass(plain, _BatchNorm)
                and isinstance(sync, type) and issubclass(sync, SyncBatchNorm)):
            raise TypeError(f"convert_sync_batchnorm: expected classes to map _BatchNorm subclasses to "
                            f"SyncBatchNorm subclasses, got {plain!r}: {sync!r}")
    return classes


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every :class:`SyncBatchNorm` in ``module`` by plain BN.

    Each layer becomes the class it was converted from (timm's layers included), with
    its state as it is; a :class:`SyncBatchNorm` built directly becomes
    ``nn.BatchNorm2d`` (the BN classes differ only in their input check), and any
    other :class:`SyncBatchNorm` subclass built directly raises ``ValueError``.

    Args:
        module: a model, or a single :class:`SyncBatchNorm`.

    Returns:
        ``module`` with its SyncBN children replaced in place, or the new layer.
    """

    def swap(m: nn.Module, path: str) -> Optional[nn.Module]:
        if not isinstance(m, SyncBatchNorm):
            return None
        plain = getattr(m, "_plain_class", nn.BatchNorm2d if type(m) is SyncBatchNorm else None)
        if plain is None:
            raise ValueError(f"revert_sync_batchnorm: {_where(path)} is a {type(m).__name__} "
                             "built directly, so its plain class is unknown; build it by convert_sync_batchnorm")
        new = _recast(m, plain, drop=(*SyncBatchNorm._SYNC_ATTRIBUTES, "_plain_class"))
        del new._buffers["_sync_errors"]
        return new

    return _replace(module, swap)
