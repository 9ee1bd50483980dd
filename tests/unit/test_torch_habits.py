"""What PyTorch users type from ``torch.nn.SyncBatchNorm``: ``process_group=``, the
``convert_sync_batchnorm`` classmethod, the layer's arguments through the converter, and
a layer that is never silently local under a launcher of several processes."""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from conftest import results, run, world  # noqa: E402
from hvd_syncbn import transports  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm  # noqa: E402
from hvd_syncbn.torch import transports as torch_transports  # noqa: E402


def two_rank_batches(seed: int = 0):
    """Each rank's batch (unequal, 3 and 5 rows) and the concatenated one, float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, 3, 3, generator=g, dtype=torch.float64) * 3 + 1
    return [x[:3], x[3:]], x


def test_process_group_is_process_set_under_torchs_name():
    group = object()
    assert SyncBatchNorm(4, process_group=group).process_set is group
    assert SyncBatchNorm(4, 1e-5, 0.1, True, True, group).process_set is group  # torch's 6th positional
    with pytest.raises(ValueError, match="expected process_set or process_group .* got both; drop one"):
        SyncBatchNorm(4, process_set=object(), process_group=group)


def test_the_classmethod_converts_as_torchs_does_and_reverts():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=0.3), nn.SyncBatchNorm(4))
    group = object()
    out = SyncBatchNorm.convert_sync_batchnorm(model, group, check_finite=True)
    assert out is model and [type(m) for m in model[1:]] == [SyncBatchNorm, SyncBatchNorm]
    assert all(m.process_set is group and m.check_finite for m in model[1:]) and model[1].momentum == 0.3
    revert_sync_batchnorm(model)
    assert [type(m) for m in model[1:]] == [nn.BatchNorm2d, nn.SyncBatchNorm]


def test_the_converter_gives_every_layer_its_arguments():
    model = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm1d(2)), comm="mpi",
                                   check_finite=True, stats="host", process_group="ps")
    assert [(m.comm, m.check_finite, m.stats, m.process_set) for m in model] == [("mpi", True, "host", "ps")] * 2


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(comm="nccl"), ValueError, r"comm: expected one of auto, horovod, mpi, torch, got 'nccl'"),
    (dict(stats="gpu"), ValueError, r"expected stats to be 'auto', 'host' or 'device', got 'gpu'"),
    (dict(process_set=1, process_group=2), ValueError, r"got both; drop one"),
    (dict(momentum=0.2), TypeError, r"unexpected keyword argument 'momentum'"),
])
def test_the_converter_refuses_bad_arguments_even_without_bn_layers(kwargs, error, match):
    for convert in (convert_sync_batchnorm, SyncBatchNorm.convert_sync_batchnorm):
        with pytest.raises(error, match=match):
            convert(nn.Linear(2, 2), **kwargs)


def test_a_converted_models_comm_carries_its_statistics():
    """``comm=`` through the converter reaches the layers: at 2 thread ranks with unequal
    shards, each rank's output and running statistics equal plain BN on the whole batch."""
    shards, whole = two_rank_batches()
    ref = nn.BatchNorm2d(4, dtype=torch.float64)
    expected = ref(whole)

    def rank(r, comm):
        model = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4, dtype=torch.float64)),
                                                     comm=comm)
        return model(shards[r]), model[0].running_mean, model[0].running_var

    for r, (y, mean, var) in enumerate(results(run(2, rank))):
        rows = slice(0, 3) if r == 0 else slice(3, 8)
        torch.testing.assert_close(y, expected[rows], rtol=0, atol=1e-12)
        torch.testing.assert_close((mean, var), (ref.running_mean, ref.running_var), rtol=0, atol=1e-12)


@pytest.fixture
def launched(monkeypatch):
    """This process as rank 0 of 2 started by torchrun, with no process group, no
    Horovod, no MPI; the once-per-process flag and the transport cache reset."""
    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMI", "SLURM_", "HOROVOD_", "TORCHELASTIC"))]:
        monkeypatch.delenv(key)
    monkeypatch.delenv(transports.COMM_ENV, raising=False)
    monkeypatch.delenv(transports.STRICT_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(transports, "_warned_alone", False)
    monkeypatch.setattr(torch_transports, "_resolved", {})
    return monkeypatch


def test_a_layer_alone_in_a_launch_of_two_warns_once_then_trains_as_plain_bn(launched):
    x = two_rank_batches()[1]
    bn, ref = SyncBatchNorm(4, dtype=torch.float64), nn.BatchNorm2d(4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning) as caught:
        y = bn(x)
    text = str(caught[0].message)
    for words in ("one of 2 started by torchrun", "found no transport", "this process's statistics only",
                  "init_process_group()", "hvd.init()", "mpi4py", "HVD_SYNCBN_STRICT=1"):
        assert words in text, text
    torch.testing.assert_close(y, ref(x), rtol=0, atol=1e-12)
    launched.setattr(torch_transports, "_resolved", {})  # a new state is resolved again: still one warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SyncBatchNorm(4, dtype=torch.float64)(x)


def test_strict_makes_a_layer_alone_in_a_launch_an_error(launched):
    launched.setenv(transports.STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match=r"one of 2 started by torchrun.*an error because HVD_SYNCBN_STRICT=1"):
        SyncBatchNorm(4)(torch.randn(4, 4))


@pytest.mark.parametrize("case", ["eval", "world of one", "no launcher", "a transport"])
def test_no_warning_where_local_statistics_are_what_was_asked(launched, case):
    """Eval mode with running statistics, a launch of one process, no launcher, or a
    transport found: no warning."""
    bn = SyncBatchNorm(4)
    if case == "eval":
        bn.eval()
    elif case == "world of one":
        launched.setenv("WORLD_SIZE", "1")
    elif case == "no launcher":  # (a bare WORLD_SIZE is a launch too: Lightning's)
        launched.delenv("TORCHELASTIC_RUN_ID")
        launched.delenv("WORLD_SIZE")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if case == "a transport":
            results(run(2, lambda r, comm: SyncBatchNorm(4, name="bn", comm=comm)(torch.randn(3, 4))))
        else:
            bn(torch.randn(3, 4))
