"""A Lightning ``fit`` at 2 ranks with :class:`hvd_syncbn.lightning.SyncBatchNormPlugin`,
for ``tests/test_lightning.py``; each rank trains on its half of every global batch::

    python tests/lightning_fit.py OUT                   # Lightning's DDP starts rank 1
    mpirun -np 2 python tests/lightning_fit.py OUT mpi  # mpirun starts both; comm="mpi"

Rank r writes ``OUT/rank{r}.pt``: the model's ``state_dict`` after ``fit``, the BN
classes seen in training and after ``fit``, and the launch :mod:`hvd_syncbn.launchers`
sees; rank 0 also a checkpoint in ``OUT/ckpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vision import import_vision  # noqa: E402

import_vision()  # before lightning: torchmetrics imports torchvision (see tests/vision.py)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

from fit_case import LR, ROWS, WORLD, global_batches, net  # noqa: E402
from hvd_syncbn import launchers  # noqa: E402
from hvd_syncbn.lightning import SyncBatchNormPlugin  # noqa: E402

def norm_classes(model: nn.Module) -> list:
    return [type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__]


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.seen: set = set()
        self.launch = None

    def training_step(self, batch, index):
        self.seen.update(norm_classes(self.net))
        self.launch = (launchers.launcher(), launchers.world_size())  # during fit (Lightning unsets it after)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)  # DDP averages: the global batch's mean loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        rows = slice(self.global_rank * ROWS, (self.global_rank + 1) * ROWS)  # this rank's half of each step
        shards = [torch.cat(t) for t in zip(*((x[rows], y[rows]) for x, y in global_batches()))]
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*shards), batch_size=ROWS)


def main(out: Path, comm: str) -> None:
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=1, logger=False,
                        plugins=[SyncBatchNormPlugin(comm=comm or None)], use_distributed_sampler=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        callbacks=[ModelCheckpoint(dirpath=out / "ckpt")])
    trainer.fit(module)
    torch.save({"state": module.net.state_dict(), "during": sorted(module.seen), "after": norm_classes(module.net),
                "launch": module.launch}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
