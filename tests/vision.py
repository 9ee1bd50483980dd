"""timm and torchvision for the tests, with the CPU torch of this project.

The registry's torchvision wheels are CUDA builds: with a CPU torch their C ops do not
load, and ``import torchvision`` then fails registering fake kernels for two of them
(``operator torchvision::nms does not exist``). Declaring those two schemas first, with
no kernel (calling them raises), lets torchvision, and so timm, import; the models the
tests build use no torchvision C op. Test harness only: the package never imports either.
"""

from __future__ import annotations

import sys

import torch

_DECLARED = []  # the Library must stay alive for its schemas to stay registered


def import_vision():
    """``(torchvision, timm)``, declaring torchvision's missing op schemas if needed."""
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _DECLARED.append(lib)
        import torchvision
    import timm

    return torchvision, timm
