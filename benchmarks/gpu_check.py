"""GPU check of the PyTorch device path: one command, one table, under 8 minutes on one GPU.

    python benchmarks/gpu_check.py             # a machine with a CUDA GPU (no Horovod needed)
    python benchmarks/gpu_check.py --dry-run   # any machine: the same plumbing on the CPU, tiny sizes

Checks, each a row of the table:

1. forward+backward per layer for the benchmark shapes, ours (device path over a 1-rank
   ``torch.distributed`` group: NCCL on the GPU) against ``nn.BatchNorm2d``, float32 and
   bfloat16 input;
2. ``torch.cuda.set_sync_debug_mode("error")`` over 3 training steps of a converted
   ResNet-50: no host sync;
3. a CUDA-graph capture and replay of a training step, against the same step eager;
4. 2 processes (sharing the GPU where there is one), against one process running plain
   BN on the concatenated batch: over Gloo, and (where mpirun and mpi4py are) under
   mpirun over the private group (NCCL, which needs a GPU per rank) and with the custom
   op over MPI (staged through pinned host memory; as it is where MPI is CUDA-aware) and
   over Horovod (where installed);
5. the private group at 1 rank, bootstrapped over a singleton MPI, its NCCL carrying a
   step, against plain BN (where 2 ranks cannot share a GPU over NCCL, its only check).

The layers get the 1-rank group's communicator directly: alone, ``SyncBatchNorm`` would
be plain BN and make no collective.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm  # noqa: E402
from hvd_syncbn.torch.transports import TorchDistComm  # noqa: E402

try:
    from common import SHAPES
except ImportError:  # run from elsewhere
    from benchmarks.common import SHAPES

ROWS: list = []


def row(check: str, setting: str, result: str) -> None:
    ROWS.append((check, setting, result))
    print(f"  {check:<28} {setting:<34} {result}", flush=True)


def force(comm) -> None:
    """Every SyncBatchNorm uses ``comm`` (1 rank here), on the device path."""
    SyncBatchNorm._resolve_comm = lambda self, nccl=False: comm
    SyncBatchNorm._comm = lambda self, nccl=False: comm


def timed(fn, device, iters: int) -> float:
    """Median ms of ``fn()``."""
    times = []
    for i in range(iters + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def per_layer(device, shapes, iters: int) -> None:
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)
            ms = {}
            for name, layer in (("plain", nn.BatchNorm2d(shape[1])), ("ours", SyncBatchNorm(shape[1], stats="device"))):
                layer = layer.to(device)

                def step(layer=layer):
                    layer(x).backward(dy)

                ms[name] = timed(step, device, iters)
            row("fwd+bwd per layer", f"{tuple(shape)} {str(dtype)[6:]}",
                f"{ms['ours']:.3f} ms vs BN {ms['plain']:.3f} ms ({ms['ours'] / ms['plain']:.2f}x)")


def resnet50() -> nn.Module:
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None)
    except Exception:  # noqa: BLE001 - no (working) torchvision: a stand-in with the same layer types
        blocks = [nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU()]
        for c_in, c_out in ((64, 256), (256, 512), (512, 1024), (1024, 2048)):
            blocks += [nn.Conv2d(c_in, c_out, 3, 2, 1), nn.BatchNorm2d(c_out), nn.ReLU()]
        return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def training_step(model, opt, x, target):
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    opt.step()
    return loss


def no_sync(device, size: int) -> None:
    model = convert_sync_batchnorm(resnet50()).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(2, 3, size, size, device=device)
    target = torch.randint(0, 1000, (2,), device=device)
    if device.type != "cuda":
        for _ in range(3):
            training_step(model, opt, x, target)
        row("host syncs, ResNet-50", "3 steps", "ran; sync debug mode needs CUDA (dry run)")
        return
    training_step(model, opt, x, target)  # warm-up: cuDNN and NCCL set-up may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            training_step(model, opt, x, target)
        result = "0 syncs"
    except RuntimeError as e:
        result = f"SYNC: {str(e).splitlines()[0][:60]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    row("host syncs, ResNet-50", "3 steps, sync debug 'error'", result)


def cuda_graph(device) -> None:
    if device.type != "cuda":
        row("CUDA graph", "capture + replay", "needs CUDA (dry run)")
        return
    torch.manual_seed(0)
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU())).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = torch.randn(4, 3, 32, 32, device=device), torch.randn(4, 16, 30, 30, device=device)

    def step():
        opt.zero_grad(set_to_none=False)
        ((model(x) - target) ** 2).mean().backward()
        opt.step()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        replayed = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        step()
        diff = max((replayed[k].double() - v.double()).abs().max().item() for k, v in model.state_dict().items())
        result = f"replay = eager step, max diff {diff:.1e}"
    except Exception as e:  # noqa: BLE001 - reported in the table
        result = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    row("CUDA graph", "capture + replay of a step", result)


def _one_rank(rank: int, device_type: str, out: str, world: int = 2) -> None:
    """Rank ``rank`` of ``world`` (2, or 1: all 5 rows): one device-path step on its share
    (3 + 2 rows), saved to ``out.rank``; on CUDA each rank on a GPU of its own where there are 2."""
    device = torch.device(device_type, rank % torch.cuda.device_count()) if device_type == "cuda" else \
        torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())).to(device)
    model[1].stats = "device"  # the device path on the CPU too (the dry run)
    torch.manual_seed(1)
    x = torch.randn(5, 3, 12, 12)
    mine = x if world == 1 else x[:3] if rank == 0 else x[3:]
    y = model(mine.to(device))
    y.square().sum().backward()
    torch.save(dict(y=y.detach().cpu(), grad=model[0].weight.grad.cpu(), mean=model[1].running_mean.cpu()),
               f"{out}.{rank}")


def _two_ranks(rank: int, init: str, device_type: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    _one_rank(rank, device_type, out)
    dist.destroy_process_group()


def two_processes(device) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/init"
        mp.spawn(_two_ranks, args=(init, device.type, f"{tmp}/out"), nprocs=2)
        got = [torch.load(f"{tmp}/out.{r}") for r in range(2)]
    compare(got, "2 processes, spawned", f"gloo, {device.type} tensors, 3+2 rows")


def under_mpirun(device) -> None:
    """``device`` tensors at 2 ranks under mpirun with no process group: over the private
    group (NCCL for CUDA, as ``auto`` takes), and the custom op over MPI staged through
    pinned host memory, over MPI as it is if CUDA-aware, and over Horovod."""
    mpirun = shutil.which("mpirun")
    if mpirun is None or importlib.util.find_spec("mpi4py") is None:
        row("2 processes, mpirun", "mpirun", "skipped: no mpirun or mpi4py here")
        return
    cuda = device.type == "cuda"
    one_gpu = cuda and torch.cuda.device_count() < 2  # NCCL refuses two ranks on one GPU
    runs = [("torch", "", f"private group over MPI ({'NCCL' if cuda else 'Gloo'})", one_gpu),
            ("mpi", "0", "MPI, staged" if cuda else "MPI", False)]
    if cuda and _mpi_reads_cuda(mpirun):
        runs.append(("mpi", "1", "MPI, CUDA-aware", False))
    if importlib.util.find_spec("horovod") is not None:
        try:
            import horovod.torch as hvd

            nccl = cuda and bool(hvd.nccl_built())
        except Exception:  # noqa: BLE001 - the run below reports it
            nccl = False
        runs.append(("horovod", "", f"Horovod{' (NCCL)' if nccl else ''}", one_gpu and nccl))
    for comm, cuda_aware, label, needs_two_gpus in runs:
        setting = f"{label}, {device.type} tensors, 3+2 rows"
        if needs_two_gpus:
            row("2 processes, mpirun", setting, "not run: NCCL needs a GPU per rank, 1 here")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                done = _under_mpirun(mpirun, __file__, "--rank-of-2", device.type, f"{tmp}/out",
                                     HVD_SYNCBN_COMM=comm, HVD_SYNCBN_MPI_CUDA=cuda_aware or "0")
                why = (done.stderr or done.stdout).strip().splitlines()[-1:] if done.returncode else []
            except subprocess.TimeoutExpired:
                why = ["timed out after 300 s"]
            if why:
                row("2 processes, mpirun", setting, f"FAILED: {' '.join(why)[:80]}")
                continue
            compare([torch.load(f"{tmp}/out.{r}") for r in range(2)], "2 processes, mpirun", setting)


def _mpi_reads_cuda(mpirun: str) -> bool:
    """What ``transports.mpi_reads_cuda`` says under mpirun (no answer in time: no)."""
    try:
        return _under_mpirun(mpirun, "-c", "from hvd_syncbn import transports; "
                             "assert transports.mpi_reads_cuda()").returncode == 0
    except subprocess.TimeoutExpired:
        return False


def private_group_alone(device) -> None:
    """The private group at 1 rank, bootstrapped over MPI (a singleton, no mpirun), its
    NCCL (Gloo in the dry run) carrying a step: equal to plain BN on the same batch. Runs
    where 2 ranks cannot share a GPU over NCCL."""
    if importlib.util.find_spec("mpi4py") is None:
        row("private group, 1 rank", "over MPI", "skipped: no mpi4py here")
        return
    from hvd_syncbn.torch.transports import private_comm
    from hvd_syncbn.transports import MpiCommunicator

    setting = f"over MPI ({'NCCL' if device.type == 'cuda' else 'Gloo'}), {device.type} tensors"
    with tempfile.TemporaryDirectory() as tmp:
        try:  # in this process: a failure is a row, not the loss of the table
            force(private_comm(MpiCommunicator()))
            _one_rank(0, device.type, f"{tmp}/out", world=1)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row("private group, 1 rank", setting, f"FAILED: {type(e).__name__}: {str(e)[:60]}")
            return
        compare([torch.load(f"{tmp}/out.0")], "private group, 1 rank", setting)


def _under_mpirun(mpirun: str, *args: str, **settings: str) -> subprocess.CompletedProcess:
    """``python args`` at 2 ranks under ``mpirun``, with the environment ``settings``."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    passed = [a for name in ("OMP_NUM_THREADS", "PATH", *settings) for a in ("-x", name)]
    return subprocess.run([mpirun, *root, "--oversubscribe", "-np", "2", *passed, sys.executable, *args], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **settings), capture_output=True, text=True,
                          timeout=300)


def _rank_under_mpirun(device_type: str, out: str) -> None:
    if os.environ["HVD_SYNCBN_COMM"] == "horovod":
        import horovod.torch as hvd

        hvd.init()
    from mpi4py import MPI

    _one_rank(MPI.COMM_WORLD.Get_rank(), device_type, out)


def compare(got: list, check: str, setting: str) -> None:
    """A row: the ranks' saved step against one process on the whole batch."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).double()
    torch.manual_seed(1)
    x = torch.randn(5, 3, 12, 12).double()
    y = plain(x)
    y.square().sum().backward()
    diffs = [(torch.cat([g["y"] for g in got]).double() - y).abs().max(),
             (sum(g["grad"] for g in got).double() - plain[0].weight.grad).abs().max() / plain[0].weight.grad.abs().max(),
             max((g["mean"].double() - plain[1].running_mean).abs().max() for g in got)]
    ok = all(float(d.detach()) < 1e-4 for d in diffs)
    row(check, setting,
        f"{'ok' if ok else 'MISMATCH'}: max diff y {diffs[0]:.1e}, dW {diffs[1]:.1e} rel, mean {diffs[2]:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes: check the plumbing")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rank-of-2", nargs=2, metavar=("DEVICE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of_2:  # a rank under mpirun, started by under_mpirun
        _rank_under_mpirun(*args.rank_of_2)
        return
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 4):
        sys.exit(f"gpu_check: expected torch >= 2.4 (torch.library.custom_op), got {torch.__version__}")
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        sys.exit("gpu_check: expected a CUDA GPU (torch.cuda.is_available() is False); use --dry-run on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    started = time.time()
    print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU (dry run)'}")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        force(TorchDistComm(None))
        shapes = SHAPES if cuda else [(2, s[1] // 8, 8, 8) for s in SHAPES]
        per_layer(device, shapes, args.iters if cuda else 2)
        no_sync(device, 224 if cuda else 32)
        cuda_graph(device)
        dist.destroy_process_group()
    two_processes(device)
    under_mpirun(device)
    private_group_alone(device)  # last: it sets every layer's communicator
    print(f"\n| check | setting | result |\n|---|---|---|")
    for r in ROWS:
        print(f"| {' | '.join(r)} |")
    print(f"\ngpu_check: {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
