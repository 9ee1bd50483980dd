"""Rank-side script: one SyncBN training step in one framework; rank 0 saves the global
batch mean and biased variance it produced. ``python cross_stats.py torch|tf OUT.npy``."""

import os
import sys

import numpy as np

from oracle import UNEQUAL, global_batch, shard_sizes, shard_slice

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
framework, out = sys.argv[1], sys.argv[2]
C = 6
if framework == "torch":
    import horovod.torch as hvd
    import torch

    from hvd_syncbn.torch import SyncBatchNorm

    hvd.init()
    sizes = shard_sizes(UNEQUAL, hvd.size())
    x = global_batch(5, sum(sizes), (C, 4, 4), offset=3.0, scale=2.0)  # (N, C, H, W)
    bn = SyncBatchNorm(C, momentum=1.0)  # running stats = this batch's
    bn(torch.from_numpy(x[shard_slice(sizes, hvd.rank())]))
    n = x.size // C
    mean, var = bn.running_mean.double().numpy(), bn.running_var.double().numpy() * (n - 1) / n
else:
    import horovod.tensorflow as hvd

    from hvd_syncbn.tensorflow import SyncBatchNormalization

    hvd.init()
    sizes = shard_sizes(UNEQUAL, hvd.size())
    x = global_batch(5, sum(sizes), (C, 4, 4), offset=3.0, scale=2.0)
    bn = SyncBatchNormalization(axis=1, momentum=0.0)  # moving stats = this batch's
    bn(x[shard_slice(sizes, hvd.rank())], training=True)
    mean, var = np.float64(bn.moving_mean.numpy()), np.float64(bn.moving_variance.numpy())
if hvd.rank() == 0:
    np.save(out, np.stack([mean, var]))
