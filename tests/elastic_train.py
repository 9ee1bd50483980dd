"""Rank side of ``test_life.py``'s Horovod elastic job: a converted model trains under
``hvd.elastic.run`` at 2 workers; at step 2 the worker of rank 1 exits, the job resets to
one worker and finishes.

    horovodrun -np 2 --min-np 1 --host-discovery-script DISCOVER --network-interface lo \\
        python tests/elastic_train.py

After the reset, each step's running statistics must be those of plain BN on the one
worker's batch, from the state the reset restored: the worker prints ``AFTER-RESET size=1
max-diff=D`` per step and ``RESULT finished steps=S size=1``; where the step raised what
``hvd.elastic.run`` resets on, ``RAISED TYPE, a HorovodInternalError, at step S``.
"""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import torch
from torch import nn

from hvd_syncbn.torch import convert_sync_batchnorm

STEPS, EXIT_STEP = 5, 2

hvd.init()
torch.manual_seed(0)
model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(100 * step + rank)) + rank


@hvd.elastic.run
def train(state) -> None:
    while state.step < STEPS:
        if state.step == EXIT_STEP and hvd.rank() == 1 and hvd.size() == 2:
            sys.stdout.flush()
            os._exit(1)  # a worker lost: its host is dropped from the job
        x = batch(state.step, hvd.rank())
        reference = None
        if hvd.size() == 1:  # the one worker's batch alone, as plain BN sees it, from the same state
            reference = nn.BatchNorm2d(4)
            reference.load_state_dict({k: v for k, v in model[1].state_dict().items() if k in reference.state_dict()})
            with torch.no_grad():
                reference(model[0](x))
        optimizer.zero_grad()
        try:
            model(x).square().mean().backward()
        except hvd.HorovodInternalError as e:  # what hvd.elastic.run resets on
            print(f"RAISED {type(e).__name__}, a HorovodInternalError, at step {state.step}", flush=True)
            raise
        optimizer.step()
        if reference is not None:
            diff = max((getattr(model[1], n) - getattr(reference, n)).abs().max().item()
                       for n in ("running_mean", "running_var"))
            print(f"AFTER-RESET size={hvd.size()} step={state.step} max-diff={diff:.3g}", flush=True)
        state.step += 1
        state.commit()


train(state)
print(f"RESULT finished steps={state.step} size={hvd.size()}", flush=True)
