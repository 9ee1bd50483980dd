"""fit_case's training job under an engine, 2 CPU workers, for ``tests/test_engines.py``::

    python tests/engine_train.py fabric OUT       # Lightning Fabric: Fabric(devices=2).launch()
    accelerate launch --multi_gpu --num_processes 2 tests/engine_train.py accelerate OUT
    python tests/engine_train.py ray OUT          # Ray Train: TorchTrainer, 2 workers

Each worker converts the model (``convert_sync_batchnorm``), lets the engine wrap it, trains
on its half of each global batch, calls ``check(model)`` where a script logs the loss, and
writes ``OUT/rank{r}.pt``: the trained ``state_dict`` and the launch
:mod:`hvd_syncbn.launchers` sees.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from torch import nn  # noqa: E402

from fit_case import LR, WORLD, global_batches, net, shard  # noqa: E402
from hvd_syncbn import launchers  # noqa: E402
from hvd_syncbn.torch import check, convert_sync_batchnorm  # noqa: E402


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, backward=lambda loss: loss.backward()) -> None:
    for batch in global_batches():
        x, y = shard(batch, rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        backward(loss)
        opt.step()
        check(model)  # where a script logs the loss, on every rank


def save(model: nn.Module, rank: int, out: Path) -> None:
    plain = model.module if hasattr(model, "module") else model
    torch.save({"state": plain.state_dict(), "launch": (launchers.launcher(), launchers.world_size())},
               out / f"rank{rank}.pt")


def fabric(out: Path) -> None:
    from vision import import_vision

    import_vision()  # before lightning: torchmetrics imports torchvision (see tests/vision.py)
    from lightning.fabric import Fabric

    f = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp")
    f.launch()
    model = convert_sync_batchnorm(net())
    model, opt = f.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    train(model, opt, f.global_rank, f.backward)
    save(model, f.global_rank, out)


def accelerate(out: Path) -> None:
    from vision import import_vision

    import_vision()  # accelerate imports torchvision where it is installed (see tests/vision.py)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = convert_sync_batchnorm(net())
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    train(model, opt, acc.process_index, acc.backward)
    save(model, acc.process_index, out)


def ray_worker(config: dict) -> None:
    import ray.train.torch

    model = ray.train.torch.prepare_model(convert_sync_batchnorm(net()), move_to_device=False)
    rank = ray.train.get_context().get_world_rank()
    train(model, torch.optim.SGD(model.parameters(), lr=LR), rank)
    save(model, rank, Path(config["out"]))


def ray(out: Path) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=WORLD, include_dashboard=False)  # a local cluster: its workers inherit this environment
    TorchTrainer(ray_worker, train_loop_config={"out": str(out)},
                 scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False),
                 run_config=RunConfig(storage_path=str(out / "ray"))).fit()


def accelerate_launch() -> None:
    """``accelerate launch ARGS`` (``sys.argv[2:]``), with torchvision importable (tests/vision.py)."""
    from vision import import_vision

    import_vision()
    from accelerate.commands.accelerate_cli import main

    sys.argv = ["accelerate", "launch", *sys.argv[2:]]
    main()


if __name__ == "__main__" and sys.argv[1] == "accelerate-launch":
    accelerate_launch()
elif __name__ == "__main__":
    {"fabric": fabric, "accelerate": accelerate, "ray": ray}[sys.argv[1]](Path(sys.argv[2]))
