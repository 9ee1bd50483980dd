"""The private ``torch.distributed`` group, bootstrapped over a thread world of ranks in
one process: its sums, the store's address option, and that it leaves
``torch.distributed`` uninitialised. (Across processes, under mpirun, it carries a
converted CNN's statistics in ``ranks_compile.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from hvd_syncbn import comm as transport  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm, private_group  # noqa: E402
from hvd_syncbn.torch import transports as torch_transports  # noqa: E402
from hvd_syncbn.torch.transports import PrivateGroupComm  # noqa: E402
from conftest import collective_timeout, results, run  # noqa: E402


def sums_over_the_group(rank, over):
    """What one rank sees through its private group: the host path's sum (our header and
    deadline over Gloo), a functional collective's, and its rank and size."""
    pc = PrivateGroupComm(over)
    call = transport.Call("bn", "fwd", 0, 3, 4, "float32", rank)
    host = transport.allreduce(pc, np.full(3, rank + 1.0), call)
    fc = funcol.wait_tensor(funcol.all_reduce(torch.full((2,), rank + 1.0, dtype=torch.float64), "sum", pc.group))
    return host, fc.numpy(), pc.group.rank(), pc.group.size(), pc.side() is over.side()


@pytest.mark.parametrize("size", [2, 3])
def test_private_group_sums_and_leaves_torch_distributed_uninitialised(size, monkeypatch):
    monkeypatch.delenv(private_group.STORE_ADDR_ENV, raising=False)
    with collective_timeout(30):
        out = results(run(size, sums_over_the_group, timeout=120))
    total = size * (size + 1) / 2
    for rank, (host, fc, r, n, side) in enumerate(out):
        np.testing.assert_array_equal(host, np.full(3, total))
        np.testing.assert_array_equal(fc, np.full(2, total))
        assert (r, n, side) == (rank, size, True)
    assert not dist.is_initialized()


def test_store_address_option_and_its_default(monkeypatch):
    assert private_group.store_address(None) == ""  # the default: see connect_to
    assert private_group.store_address("iface:lo") == "127.0.0.1"
    assert private_group.store_address(" localhost ") == "localhost"
    mine = dict(addr="", host=private_group.host_id(), default="10.1.2.3", port=1)
    assert private_group.connect_to(mine) == "127.0.0.1"  # on rank 0's host: loopback
    assert private_group.connect_to(dict(mine, host="elsewhere")) == "10.1.2.3"  # else rank 0's address
    assert private_group.connect_to(dict(mine, addr="node0")) == "node0"  # the option wins
    for bad, expected in [("iface:nope0", r"expected iface:NAME with NAME one of rank 0's interfaces \(.*lo"),
                          ("iface:", r"expected iface:NAME"), ("", r"expected an address of rank 0's host"),
                          ("a b", r"expected an address .* or iface:NAME \(e.g. iface:eth0\), got 'a b'")]:
        with pytest.raises(ValueError, match=expected):
            private_group.store_address(bad)
    monkeypatch.setenv(private_group.ENV, "yes")
    with pytest.raises(ValueError, match=r"HVD_SYNCBN_PRIVATE_GROUP: expected 0 .* or 1 .*, got 'yes'"):
        private_group.enabled()


def test_a_bad_store_address_on_rank_0_fails_every_rank(monkeypatch):
    monkeypatch.setenv(private_group.STORE_ADDR_ENV, "iface:nope0")
    with collective_timeout(30):
        out = run(2, lambda rank, over: PrivateGroupComm(over), timeout=60)
    for e in out:
        assert isinstance(e, RuntimeError) and "rank 0 could not open the private group's store" in str(e), e
        assert "expected iface:NAME" in str(e) and "got iface:nope0" in str(e), e


def test_the_address_option_is_what_the_ranks_connect_to(monkeypatch):
    monkeypatch.setenv(private_group.STORE_ADDR_ENV, "iface:lo")
    with collective_timeout(30):
        out = results(run(2, sums_over_the_group, timeout=120))
    assert [o[1].tolist() for o in out] == [[3.0, 3.0]] * 2


@pytest.mark.parametrize("private, why", [("1", "not launched by mpirun"), ("0", "HVD_SYNCBN_PRIVATE_GROUP=0")])
def test_comm_torch_with_no_group_and_nothing_to_build_one_over_says_so(private, why, monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch_transports, "_horovod_on", lambda: False)  # as if no hvd.init() in this process
    monkeypatch.setenv(private_group.ENV, private)
    with pytest.raises(RuntimeError, match=rf"comm='torch' needs torch.distributed.init_process_group\(\) first, "
                                           rf"or a job started by mpirun .* \(.*{why}.*\)"):
        SyncBatchNorm(4, comm="torch")(torch.randn(3, 4))


def test_ranks_in_different_layers_get_one_diagnosis_on_every_rank():
    """A header mismatch on the private group's host path: every rank raises, naming both
    layers (the diagnosis travels over the communicator the group was built over)."""
    def different_layers(rank, over):
        call = transport.Call("a" if rank == 0 else "b", "fwd", 0, 3, 4, "float32", rank)
        transport.allreduce(PrivateGroupComm(over), np.zeros(3), call)

    with collective_timeout(10):
        out = run(2, different_layers, timeout=60)
    for e in out:
        assert isinstance(e, transport.SyncBatchNormError), e
        assert "ranks [0] are waiting in layer 'a' forward" in str(e), e
        assert "ranks [1] are waiting in layer 'b' forward" in str(e), e


def test_the_transport_line_says_why_a_private_group(monkeypatch, caplog):
    """The log line naming the transport gives the private group's reason (it was empty:
    "statistics travel over private (; ranks started by ...")."""
    monkeypatch.setattr(torch_transports.REGISTRY, "built", {})  # this process's first communicator
    with caplog.at_level("WARNING", logger="hvd_syncbn"), collective_timeout(30):
        results(run(1, lambda rank, over: torch_transports.private_comm(over, "CUDA tensors on the device path")))
    assert "statistics travel over private (CUDA tensors on the device path: a torch.distributed group of its " \
           "own, bootstrapped over " in caplog.text, caplog.text
