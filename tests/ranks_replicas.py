"""DataParallel inside each process, SyncBN across them: 2 replica threads per process
(``data_parallel.py``: replicas made by DataParallel's seam) at any world size, against
float64 plain BN on the whole global batch, with one collective per process, layer and
direction, not one per replica; on both kernel sets (the native one through the CPU
stand-ins of ``cuda_kernels.py``).

Launched with ranks_torch.py (``test_launch.py``): plainly (1 process: the replicas
alone), under mpirun (the custom op over MPI) and under horovodrun with
``HVD_SYNCBN_COMM=torch`` (the functional collectives on a Gloo group).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from data_parallel import net, parallel_apply, replicate
from hvd_syncbn import comm
from hvd_syncbn.torch import check, reducers
from oracle import EMPTY, UNEQUAL, assert_close, global_batch, shard_sizes, shard_slice

hvd = pytest.importorskip("horovod.torch")
hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()
comm.set_timeout(float(os.environ.get("HVD_SYNCBN_TIMEOUT", "30")))
if os.environ.get("HVD_SYNCBN_COMM") == "torch" and not dist.is_initialized():
    dist.init_process_group("gloo", init_method=os.environ["HVD_SYNCBN_TEST_INIT"], rank=RANK, world_size=WORLD)
COPIES, STEPS = 2, 2


def test_replicas_and_processes_equal_one_process_on_the_global_batch(monkeypatch, kernels):
    calls = []
    for cls in (reducers.GroupReducer, reducers.OpReducer):
        real = cls.__call__

        def counted(self, buf, direction, _real=real):
            calls.append(direction)
            return _real(self, buf, direction)

        monkeypatch.setattr(cls, "__call__", counted)
    sizes = shard_sizes(EMPTY if WORLD == 3 else UNEQUAL, WORLD)
    rows, mine = sum(sizes), shard_slice(sizes, RANK)
    ours, plain = net(True), net(False)
    for step in range(STEPS):
        x = torch.from_numpy(global_batch(step, rows, (3, 6, 6), offset=2.0))
        target = torch.from_numpy(global_batch(100 + step, rows, (5, 6, 6)))
        half = (sizes[RANK] + 1) // 2  # this process's rows, split over its replicas (unequal, or empty)
        xs = [part.clone().requires_grad_() for part in (x[mine][:half], x[mine][half:])]
        targets = (target[mine][:half], target[mine][half:])
        ours.zero_grad(set_to_none=True)
        ys = parallel_apply(replicate(ours, COPIES), xs)
        for y in ys:
            if isinstance(y, BaseException):
                raise y
        sum((y * t).sum() for y, t in zip(ys, targets)).backward()
        xd = x.double().requires_grad_()
        plain.zero_grad(set_to_none=True)
        yd = plain(xd)
        (yd * target.double()).sum().backward()
        what = f"rank {RANK} of {WORLD}, step {step}"
        assert_close(torch.cat([y.detach() for y in ys]), yd.detach()[mine], f"{what} y", rtol=1e-4, atol=1e-4)
        assert_close(torch.cat([x.grad for x in xs]), xd.grad[mine], f"{what} x.grad", rtol=1e-4, atol=1e-4)
        for (name, p), (_, q) in zip(ours.named_parameters(), plain.named_parameters()):
            total = hvd.allreduce(p.grad, op=hvd.Sum, name=f"replicas.{step}.{name}")  # the optimizer's sum
            assert_close(total, q.grad, f"{what} {name}.grad", rtol=1e-4, atol=1e-3)
        ours_buffers = dict(ours.named_buffers())
        for name, b in plain.named_buffers():
            assert_close(ours_buffers[name], b, f"{what} {name}", rtol=1e-5, atol=1e-5)
        check(ours)
    assert calls == (["fwd", "fwd", "bwd", "bwd"] * STEPS if WORLD > 1 else []), calls
