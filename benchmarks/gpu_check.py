"""GPU check of the PyTorch device path: one command, one table, about 4 minutes (at most 6) on one GPU.

    python benchmarks/gpu_check.py             # a machine with a CUDA GPU (no Horovod needed)
    python benchmarks/gpu_check.py --dry-run   # any machine: the same plumbing on the CPU, tiny sizes
                                               # (the native kernels: tests/cuda_kernels.py's CPU stand-ins)

fairscale's SyncBN and vacancy's Synchronized-BatchNorm are columns where ``peers/`` has
them or they are installed; else 'n/a'. ``peers/`` is git-ignored (a device run must
carry it); fill it, unmodified, with:

    pip download --no-deps --no-binary :all: fairscale==0.4.13   # BSD; then, in peers/:
    tar xzf fairscale-0.4.13.tar.gz && (cd fairscale-0.4.13 && find fairscale -name '*.py' | tar cf - -T -) | tar xf -
    # vacancy's Synchronized-BatchNorm-PyTorch (MIT), commit 7553990: its sync_batchnorm/
    # __init__.py, batchnorm.py, comm.py, replicate.py (and LICENSE) into peers/sync_batchnorm/

Sections, most important first, each in a time box on the GPU (seconds; a section or
item that would overrun is a 'skipped: time box' row, a failure a 'FAILED' row):

1. per layer (60): forward+backward of one BN layer, 8 shapes x float32/bfloat16 input
   (float32 parameters): ours on each kernel set (``native``: torch's fused kernels, the
   default on CUDA; ``composite``: generic ops), torch's SyncBN Function, fairscale's
   SyncBN and cuDNN (``nn.BatchNorm2d``), all over the 1-rank NCCL group; goals native
   <= 0.8x torch, <= 0.5x fairscale, <= 1.25x cuDNN where the input is >= 25 MB; each
   column's host time to queue a step besides (a step that takes about its host time is
   host-bound); then (10) kernel launches and memory copies per layer step, ours on each
   set, torch's, cuDNN's (the profiler; where the host time goes);
2. training steps (130): torchvision ResNet-50 (channels-first) and ResNet-18
   (channels-last), batch 32 at 224, plain BN against converted, eager and
   ``torch.compile(fullgraph=True)``: ms per step, first compiled step, peak memory; goals
   ResNet-50 eager <= 1.5x plain, compiled ResNet-18 <= 1.15x plain compiled and its first
   step <= 2x plain's; and the eager ResNet-50 step with torch's SyncBN Function in its 53
   BN layers, goal ours <= 1.0x (host time and torch's host sync per forward both count);
3. host syncs (15): ``torch.cuda.set_sync_debug_mode("error")`` over 3 steps of a
   converted ResNet-50;
4. CUDA graphs (40): capture + replay of an eager training step, and
   ``torch.compile(mode="reduce-overhead")`` steps, against the same steps eager;
5. DataParallel (30): ``nn.DataParallel`` with ``device_ids=[0, 0]`` (and every GPU where
   there are several) against one process on the whole batch; per layer against
   unsynchronized ``DataParallel(nn.BatchNorm2d)`` and vacancy's ``DataParallelWithCallback``
   (``peers/sync_batchnorm``, where fetched); goals <= 1.2x and <= 0.6x;
6. correctness (25 + 60 + 15): 2 processes (sharing the GPU where there is one), against
   one process running plain BN on the concatenated batch: over Gloo, and (where mpirun
   and mpi4py are) under mpirun over the private group (NCCL, which needs a GPU per rank),
   with the custom op over MPI (staged through pinned host memory; as it is where MPI is
   CUDA-aware) and over Horovod (where installed); then the private group at 1 rank,
   bootstrapped over a singleton MPI, its NCCL carrying a step, against plain BN.

Timing: ``STEPS`` steps queued between two CUDA events after a synchronize, ms per step,
median of ``REPEATS``, after warm-up; fewer steps (said in the row) where 5 repeats would
pass an item's share of the box. Ratios are within this run. The dry run times 2 steps
with ``time.perf_counter`` and compiles with ``aot_eager`` (inductor on 2 CPU cores takes
minutes); where torchvision is missing, its ResNets' stand-in has 1/8 of their channels
there. The layers get the 1-rank group's communicator directly (``force``): alone,
``SyncBatchNorm`` would be plain BN and make no collective.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import inspect
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "peers"))  # fairscale and vacancy's sync_batchnorm, where fetched (peers/README)
from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm, reducers  # noqa: E402
from hvd_syncbn.torch.transports import TorchDistComm  # noqa: E402

# (N, C, H, W): ResNet-50 stages and a segmentation decoder at per-GPU batches, then at batch 32/64.
SHAPES = [(8, 64, 56, 56), (2, 256, 64, 64), (8, 512, 28, 28), (4, 2048, 7, 7), (2, 64, 128, 128),
          (32, 64, 112, 112), (32, 256, 56, 56), (64, 2048, 7, 7)]
STEPS, REPEATS, WARMUP = 50, 5, 3
BUDGET_S = {"per layer": 60, "launches": 10, "training steps": 130, "host syncs": 15, "CUDA graphs": 40, "DataParallel": 30,
            "2 processes, spawned": 25, "2 processes, mpirun": 60, "private group, 1 rank": 15}
TOTAL_S = 330  # the sections' boxes end here on the GPU: 6 minutes with room for start-up and an overrun
ROWS: list = []
STAND_INS: list = []  # the dry run's CPU stand-ins of the native kernels, kept registered
STAND_IN_NARROWING = 1  # resnet()'s stand-in has 1/this of ResNet's channels (the dry run: 1/8)
SECONDS: dict = {}  # per section, for the last line


def row(check: str, setting: str, result: str) -> None:
    ROWS.append((check, setting, result))
    print(f"  {check:<28} {setting:<34} {result}", flush=True)


def force(comm) -> None:
    """Every SyncBatchNorm uses ``comm`` (1 rank here, which counts as several), registered as
    a traced layer's own ``_comm`` registers its communicator."""
    reducers.comm_index(comm)
    SyncBatchNorm._resolve_comm = lambda self, nccl=False: comm
    SyncBatchNorm._comm = lambda self, nccl=False: comm


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def ms_per_step(step, device, at_most_s: float, steps: int = STEPS) -> tuple:
    """(median ms per step, steps per repeat, median host ms per step): ``REPEATS`` times
    ``steps`` calls of ``step()`` between two events, after ``WARMUP`` calls; fewer steps
    where the repeats would take more than ``at_most_s`` (from the last warm-up step). The
    host time is what queuing a step took: near the step's time, the step is host-bound."""
    for _ in range(WARMUP):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
    one = time.perf_counter() - start
    if at_most_s < math.inf:
        steps = max(5, min(steps, int(at_most_s / (REPEATS * one))))
    times, host = [], []
    for _ in range(REPEATS):
        sync(device)
        cuda = device.type == "cuda"
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        host.append(1e3 * (time.perf_counter() - start) / steps)
        if cuda:
            end.record()
            end.synchronize()
        times.append(begin.elapsed_time(end) / steps if cuda else host[-1])
    return statistics.median(times), steps, statistics.median(host)


def goal(ratio: float, limit: float) -> str:
    return f"{ratio:.2f}x ({'met' if ratio <= limit else 'NOT met'}: <= {limit}x)"


def fairscale_class():
    """fairscale's ``SyncBatchNorm`` class, or the reason there is none."""
    try:
        with warnings.catch_warnings():  # its other modules warn about deprecated torch APIs
            warnings.simplefilter("ignore")
            from fairscale.experimental.nn.sync_batchnorm import SyncBatchNorm as FairscaleBatchNorm
        return FairscaleBatchNorm, ""
    except Exception as e:  # noqa: BLE001 - a column that says why
        return None, f"n/a ({type(e).__name__}: {str(e)[:40]})"


def torch_syncbn(channels: int):
    """A layer calling torch's SyncBN Function at world size 1 over the default group
    (``nn.SyncBatchNorm`` alone runs plain BN), its arguments passed by name: the
    Function's signature changes across torch versions."""
    from torch.nn.modules._functions import SyncBatchNorm as Function

    bn = nn.BatchNorm2d(channels)
    names = list(inspect.signature(Function.forward).parameters)[1:]  # after ctx
    given = dict(momentum=bn.momentum, process_group=dist.group.WORLD, world_size=1)
    unknown = set(names) - set(given) - {"input", "weight", "bias", "running_mean", "running_var", "eps"}
    if unknown:
        raise TypeError(f"torch's SyncBatchNorm Function takes {sorted(unknown)}, not known here")
    # the layer's own attributes at each call: .to(device) replaces its buffers
    bn.forward = lambda x: Function.apply(*(x if n == "input" else given[n] if n in given else getattr(bn, n)
                                            for n in names))
    return bn


class KernelSet(nn.Module):
    """A SyncBatchNorm whose steps run on one kernel set (``$HVD_SYNCBN_KERNELS``, set for
    each forward, which picks the set for its backward too, and put back after it: the
    later sections take the default)."""

    def __init__(self, channels: int, kernels: str) -> None:
        super().__init__()
        self.bn, self.kernels = SyncBatchNorm(channels, stats="device"), kernels
        self.weight, self.bias = self.bn.weight, self.bn.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = os.environ.get("HVD_SYNCBN_KERNELS")
        os.environ["HVD_SYNCBN_KERNELS"] = self.kernels
        try:
            return self.bn(x)
        finally:
            if before is None:
                del os.environ["HVD_SYNCBN_KERNELS"]
            else:
                os.environ["HVD_SYNCBN_KERNELS"] = before


def ours(kernels: str):
    """A maker of our layer on ``kernels`` (``native`` or ``composite``)."""
    return lambda channels: KernelSet(channels, kernels)


def layer_step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """One forward+backward of ``layer`` on ``x`` into ``x``, γ and β, as a call (``dy`` in
    the output's dtype: fairscale's output is float32 for bfloat16 input)."""
    args, grad = (x, layer.weight, layer.bias), dy.to(layer(x).dtype)
    return lambda: torch.autograd.grad(layer(x), args, grad)


def _top_level(event) -> bool:
    """Whether a profiler event has no aten op above it."""
    while event.cpu_parent is not None:
        event = event.cpu_parent
        if event.name.startswith("aten::"):
            return False
    return True


def per_layer(device, shapes, until: float) -> None:
    cuda = device.type == "cuda"
    fairscale, no_fairscale = fairscale_class()
    warnings.filterwarnings("ignore", "non-inplace resize_as is deprecated")  # fairscale's backward, every call
    for n, shape in enumerate(shapes):
        for dtype in (torch.float32, torch.bfloat16):
            mb = math.prod(shape) * (4 if dtype == torch.float32 else 2) / 1e6
            setting = f"{tuple(shape)} {str(dtype)[6:]}, {mb:.1f} MB"
            if time.time() > until:
                row("fwd+bwd per layer", setting, "skipped: time box")
                continue
            share = (until - time.time()) / (2 * (len(shapes) - n)) / 5  # of the box left, per column
            x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)
            makers = {"native": ours("native"), "composite": ours("composite"),
                      "torch": torch_syncbn,
                      "fairscale": fairscale or no_fairscale, "cuDNN": nn.BatchNorm2d}
            ms, cells, fewer = {}, [], set()
            for name, make in makers.items():
                if isinstance(make, str):
                    cells.append(f"{name} {make}")
                    continue
                try:
                    step = layer_step(make(shape[1]).to(device), x, dy)
                    ms[name], steps, host = ms_per_step(step, device, share if cuda else math.inf,
                                                        STEPS if cuda else 2)
                    cells.append(f"{name} {ms[name]:.3f} (host {host:.3f})")
                    if cuda and steps < STEPS:
                        fewer.add(steps)
                except Exception as e:  # noqa: BLE001 - a cell that says why
                    ms.pop(name, None)
                    cells.append(f"{name} FAILED ({type(e).__name__}: {str(e).splitlines()[0][:40]})")
            native = ms.get("native", math.nan)
            ratios = [f"native/torch {goal(native / ms['torch'], 0.8)}" if "torch" in ms else "",
                      f"native/fairscale {goal(native / ms['fairscale'], 0.5)}" if "fairscale" in ms else "",
                      f"native/cuDNN {goal(native / ms['cuDNN'], 1.25)}" if mb >= 25 and "cuDNN" in ms else
                      f"native/cuDNN {native / ms['cuDNN']:.2f}x" if "cuDNN" in ms else "",
                      f"composite/cuDNN {ms['composite'] / ms['cuDNN']:.2f}x" if {"composite", "cuDNN"} <= set(ms)
                      else ""]
            note = f" ({min(fewer)} steps/repeat)" if fewer else ""
            row("fwd+bwd per layer", setting, f"{', '.join(cells)} ms{note}; {', '.join(r for r in ratios if r)}")


def launches(device, steps: int = 5) -> None:
    """What one layer step launches, from the profiler, ours against torch's SyncBN Function
    and cuDNN: kernel launches and memory copies per step on the GPU (host time per step is
    about their count times the launch cost); the dry run counts the top-level aten ops."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    shape = SHAPES[0] if cuda else (2, 8, 8, 8)
    x = torch.randn(shape, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    makers = {"native": ours("native"), "composite": ours("composite"), "torch": torch_syncbn, "cuDNN": nn.BatchNorm2d}
    cells = []
    for name, make in makers.items():
        step = layer_step(make(shape[1]).to(device), x, dy)
        step()
        sync(device)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                step()
            sync(device)
        events = prof.events()
        if cuda:
            launched = sum("LaunchKernel" in e.name for e in events) / steps
            copies = sum("Memcpy" in e.name and e.device_type != torch.autograd.DeviceType.CUDA for e in events) / steps
            cells.append(f"{name} {launched:.0f} launches, {copies:.0f} copies")
        else:
            cells.append(f"{name} {sum(e.name.startswith('aten::') and _top_level(e) for e in events) / steps:.0f} "
                         f"aten ops")
    row("launches per layer step", f"{tuple(shape)} float32, {steps} steps", ", ".join(cells))


@functools.lru_cache(maxsize=None)
def torchvision_models():
    try:
        import torchvision

        return torchvision.models
    except Exception:  # noqa: BLE001 - no (working) torchvision: resnet's stand-in
        return None


def resnet(name: str) -> nn.Module:
    """torchvision's ``name`` ("ResNet-50"), or a stand-in with the same layer types."""
    if torchvision_models() is not None:
        return getattr(torchvision_models(), name.lower().replace("-", ""))(weights=None)
    k = STAND_IN_NARROWING
    blocks = [nn.Conv2d(3, 64 // k, 7, 2, 3), nn.BatchNorm2d(64 // k), nn.ReLU()]
    for c_in, c_out in ((64, 256), (256, 512), (512, 1024), (1024, 2048)):
        blocks += [nn.Conv2d(c_in // k, c_out // k, 3, 2, 1), nn.BatchNorm2d(c_out // k), nn.ReLU()]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048 // k, 1000))


def training_step(model, opt, x, target):
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.cross_entropy(model(x), target)
    loss.backward()
    opt.step()
    return loss


def with_torch_syncbn(model: nn.Module) -> nn.Module:
    """``model`` with each ``nn.BatchNorm2d`` a layer calling torch's SyncBN Function
    (:func:`torch_syncbn`)."""
    for name, child in model.named_children():
        setattr(model, name, torch_syncbn(child.num_features) if isinstance(child, nn.BatchNorm2d)
                else with_torch_syncbn(child))
    return model


def one_config(name: str, kind: str, compiled: bool, device, batch: int, size: int, at_most_s: float) -> tuple:
    """(ms per step, steps per repeat, host ms per step, first step s, peak bytes) of one
    model's training step, its BN layers ``kind``: ``"ours"``, ``"plain"`` or ``"torch"``
    (torch's SyncBN Function)."""
    cuda = device.type == "cuda"
    torch._dynamo.reset()  # the last compiled model's graphs and weights go
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = {"ours": lambda m: convert_sync_batchnorm(m, stats="device"), "plain": lambda m: m,
             "torch": with_torch_syncbn}[kind](resnet(name))
    layout = torch.channels_last if name == "ResNet-18" else torch.contiguous_format
    model = model.to(device, memory_format=layout)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=layout)
    target = torch.randint(0, 1000, (batch,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if compiled:
        model = torch.compile(model, fullgraph=True, backend="inductor" if cuda else "aot_eager")
    sync(device)
    start = time.perf_counter()
    training_step(model, opt, x, target)  # the compile, when compiled
    sync(device)
    first = time.perf_counter() - start
    ms, steps, host = ms_per_step(lambda: training_step(model, opt, x, target), device, at_most_s,
                                  STEPS if cuda else 2)
    return ms, steps, host, first, torch.cuda.max_memory_allocated() if cuda else 0


def training_steps(device, batch: int, size: int, until: float) -> None:
    """Ours (first: a compile's caches favour the second) against plain, per model and mode."""
    cuda = device.type == "cuda"
    # (model, compiled, about the seconds the pair takes on an H200, where the time box needs it)
    plan = [("ResNet-50", False, 40), ("ResNet-18", False, 15), ("ResNet-18", True, 90)]  # ResNet-50 eager: 3 runs
    plan += [("ResNet-50", True, None)] if cuda else []  # the dry run compiles one model
    r18_compiled_s = 40.0
    for name, compiled, seconds in plan:
        seconds = seconds or 2.5 * 2 * r18_compiled_s + 20  # ResNet-50 compiles about 2.5x as long
        layout = "channels-last" if name == "ResNet-18" else "channels-first"
        label = name if torchvision_models() is not None else f"{name} stand-in"
        setting = f"{label} {batch}x{size}², {layout}, {'compiled' if compiled else 'eager'}"
        if time.time() + seconds > until:
            row("training step", setting, f"skipped: time box (needs about {seconds:.0f} s)")
            continue
        try:
            at_most_s = 10 if cuda else math.inf
            o_ms, o_steps, o_host, o_first, o_peak = one_config(name, "ours", compiled, device, batch, size, at_most_s)
            if time.time() + o_first + 10 > until:  # plain's compile about as long as ours'
                row("training step", setting,
                    f"ours {o_ms:.1f} ms, first step {o_first:.1f} s; plain skipped: time box")
                continue
            p_ms, p_steps, p_host, p_first, p_peak = one_config(name, "plain", compiled, device, batch, size, at_most_s)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row("training step", setting, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        finally:
            torch._dynamo.reset()
        limit = {("ResNet-50", False): 1.5, ("ResNet-18", True): 1.15}.get((name, compiled))
        ratio = goal(o_ms / p_ms, limit) if limit else f"{o_ms / p_ms:.2f}x"
        note = f" ({min(o_steps, p_steps)} steps/repeat)" if cuda and min(o_steps, p_steps) < STEPS else ""
        result = f"ours {o_ms:.1f} ms (host {o_host:.1f}), plain {p_ms:.1f} ms (host {p_host:.1f}){note}: {ratio}"
        if compiled:
            first = goal(o_first / p_first, 2.0) if name == "ResNet-18" else f"{o_first / p_first:.2f}x"
            result += f"; first step {o_first:.1f} s vs {p_first:.1f} s: {first}"
            if name == "ResNet-18":
                r18_compiled_s = max(o_first, p_first)
        peak = f"{o_peak / 2**30:.2f} vs {p_peak / 2**30:.2f} GiB" if cuda else "n/a (CPU)"
        row("training step", setting, f"{result}; peak memory {peak}")
        if (name, compiled) == ("ResNet-50", False):
            against_torch(setting, o_ms, o_host, device, batch, size, until)


def against_torch(setting: str, o_ms: float, o_host: float, device, batch: int, size: int, until: float) -> None:
    """The eager ResNet-50 step with torch's SyncBN Function in every BN layer, against
    ours (``o_ms``, host ``o_host``): the whole step, where host time and torch's host
    sync per forward (its masked index of the gathered counts) both show."""
    if time.time() + 15 > until:
        row("training step vs torch's SyncBN", setting, "skipped: time box (needs about 15 s)")
        return
    try:
        t_ms, t_steps, t_host, _, _ = one_config("ResNet-50", "torch", False, device, batch, size,
                                                 10 if device.type == "cuda" else math.inf)
    except Exception as e:  # noqa: BLE001 - reported in the table
        row("training step vs torch's SyncBN", setting, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        return
    note = f" ({t_steps} steps/repeat)" if device.type == "cuda" and t_steps < STEPS else ""
    row("training step vs torch's SyncBN", setting,
        f"ours {o_ms:.1f} ms (host {o_host:.1f}), torch's {t_ms:.1f} ms (host {t_host:.1f}){note}: "
        f"{goal(o_ms / t_ms, 1.0)}")


def no_sync(device, size: int) -> None:
    model = convert_sync_batchnorm(resnet("ResNet-50"), stats="device").to(device)
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
    row("host syncs, ResNet-50", f"3 steps, batch 2x{size}², sync debug 'error'", result)


def small_model(device):
    torch.manual_seed(0)
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU()), stats="device")
    model = model.to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def max_diff(a: dict, b: dict) -> float:
    """The largest difference between two state dicts."""
    return max((v.double() - b[k].double()).abs().max().item() for k, v in a.items())


def cuda_graph(device) -> None:
    if device.type != "cuda":
        row("CUDA graph", "capture + replay", "needs CUDA (dry run)")
        return
    model, opt = small_model(device)
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
        result = f"replay = eager step, max diff {max_diff(replayed, model.state_dict()):.1e}"
    except Exception as e:  # noqa: BLE001 - reported in the table
        result = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    row("CUDA graph", "capture + replay of a step", result)


def compiled_graph(device, steps: int = 6) -> None:
    """``steps`` steps of ``torch.compile(mode="reduce-overhead")`` (CUDA graphs recorded,
    then replayed) against the same model eager from the same state."""
    if device.type != "cuda":
        row("CUDA graph", "compile reduce-overhead", "needs CUDA (dry run)")
        return
    from torch._dynamo.utils import counters

    (model, opt), (eager, eager_opt) = small_model(device), small_model(device)
    x, target = torch.randn(4, 3, 32, 32, device=device), torch.randn(4, 16, 30, 30, device=device)
    skips = counters["inductor"]["cudagraph_skips"]
    compiled = torch.compile(model, mode="reduce-overhead")
    try:
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            for run, o in ((compiled, opt), (eager, eager_opt)):
                o.zero_grad(set_to_none=False)
                ((run(x) - target) ** 2).mean().backward()
                o.step()
        skipped = counters["inductor"]["cudagraph_skips"] - skips
        result = (f"{steps} steps = eager, max diff {max_diff(model.state_dict(), eager.state_dict()):.1e}"
                  + (f"; CUDA graphs skipped {skipped}x (no replay)" if skipped else ""))
    except Exception as e:  # noqa: BLE001 - reported in the table
        result = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    finally:
        torch._dynamo.reset()
    row("CUDA graph", f"compile reduce-overhead, {steps} steps", result)


DP_SHAPES = [(8, 64, 56, 56), (8, 512, 28, 28), (4, 2048, 7, 7)]


def seed_library():
    """vacancy's ``(DataParallelWithCallback, SynchronizedBatchNorm2d)``, or why there are none."""
    try:
        from sync_batchnorm import DataParallelWithCallback, SynchronizedBatchNorm2d

        return (DataParallelWithCallback, SynchronizedBatchNorm2d), ""
    except Exception as e:  # noqa: BLE001 - a column that says why
        return None, f"n/a ({type(e).__name__}: {str(e)[:40]})"


def data_parallel(device, until: float) -> None:
    """``nn.DataParallel`` with ``device_ids=[0, 0]`` (replicas share the GPU; and every GPU
    where there are several): a step against one process on the whole batch; per layer,
    ours against unsynchronized ``DataParallel(nn.BatchNorm2d)`` and the seed library's
    ``DataParallelWithCallback`` where importable (goals <= 1.2x and <= 0.6x)."""
    if device.type != "cuda":
        row("DataParallel", "device_ids [0, 0]", "needs CUDA (dry run; the replicas run in threads in the unit tests)")
        return
    count = torch.cuda.device_count()
    for ids in [[0, 0]] + ([list(range(count))] if count > 1 else []):
        torch.manual_seed(0)
        model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())).to(device)
        torch.manual_seed(1)
        y = nn.DataParallel(model, device_ids=ids)(torch.randn(5, 3, 12, 12).to(device))
        y.square().sum().backward()
        compare([dict(y=y.detach().cpu(), grad=model[0].weight.grad.cpu(), mean=model[1].running_mean.cpu())],
                "DataParallel", f"device_ids {ids}, 5 rows")
    seed, no_seed = seed_library()
    for n, shape in enumerate(DP_SHAPES):
        setting = f"{tuple(shape)} float32, device_ids [0, 0]"
        if time.time() > until:
            row("DataParallel per layer", setting, "skipped: time box")
            continue
        share = (until - time.time()) / (len(DP_SHAPES) - n) / 3
        x = torch.randn(shape, device=device, requires_grad=True)
        dy = torch.randn_like(x)
        makers = {"ours": lambda c: nn.DataParallel(SyncBatchNorm(c, stats="device").to(device), device_ids=[0, 0]),
                  "unsynchronized": lambda c: nn.DataParallel(nn.BatchNorm2d(c).to(device), device_ids=[0, 0]),
                  "seed library": (lambda c: seed[0](seed[1](c).to(device), device_ids=[0, 0])) if seed else no_seed}
        ms, cells = {}, []
        for name, make in makers.items():
            if isinstance(make, str):
                cells.append(f"{name} {make}")
                continue
            try:
                layer = make(shape[1])
                ms[name] = ms_per_step(lambda: torch.autograd.grad(layer(x), (x,), dy), device, share)[0]
                cells.append(f"{name} {ms[name]:.3f}")
            except Exception as e:  # noqa: BLE001 - a cell that says why
                cells.append(f"{name} FAILED ({type(e).__name__}: {str(e).splitlines()[0][:40]})")
        ours = ms.get("ours", math.nan)
        ratios = [f"ours/unsynchronized {goal(ours / ms['unsynchronized'], 1.2)}" if "unsynchronized" in ms else "",
                  f"ours/seed library {goal(ours / ms['seed library'], 0.6)}" if "seed library" in ms else ""]
        row("DataParallel per layer", setting, f"{', '.join(cells)} ms; {', '.join(r for r in ratios if r)}")


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


def under_mpirun(device, until: float) -> None:
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
    if cuda and _mpi_reads_cuda(mpirun, until):
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
        if until - time.time() < 10:
            row("2 processes, mpirun", setting, "skipped: time box")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                done = _under_mpirun(mpirun, __file__, "--rank-of-2", device.type, f"{tmp}/out",
                                     timeout=until - time.time(),
                                     HVD_SYNCBN_COMM=comm, HVD_SYNCBN_MPI_CUDA=cuda_aware or "0")
                why = (done.stderr or done.stdout).strip().splitlines()[-1:] if done.returncode else []
            except subprocess.TimeoutExpired:
                why = ["timed out: time box"]
            if why:
                row("2 processes, mpirun", setting, f"FAILED: {' '.join(why)[:80]}")
                continue
            compare([torch.load(f"{tmp}/out.{r}") for r in range(2)], "2 processes, mpirun", setting)


def _mpi_reads_cuda(mpirun: str, until: float) -> bool:
    """What ``mpi.mpi_reads_cuda`` says under mpirun (no answer in time: no)."""
    try:
        return _under_mpirun(mpirun, "-c", "from hvd_syncbn import mpi; "
                             "assert mpi.mpi_reads_cuda()",
                             timeout=min(60.0, until - time.time())).returncode == 0
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
    from hvd_syncbn.mpi import MpiCommunicator

    setting = f"over MPI ({'NCCL' if device.type == 'cuda' else 'Gloo'}), {device.type} tensors"
    with tempfile.TemporaryDirectory() as tmp:
        try:  # in this process: a failure is a row, not the loss of the table
            force(private_comm(MpiCommunicator(), "gpu_check, the private group alone"))
            _one_rank(0, device.type, f"{tmp}/out", world=1)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row("private group, 1 rank", setting, f"FAILED: {type(e).__name__}: {str(e)[:60]}")
            return
        compare([torch.load(f"{tmp}/out.0")], "private group, 1 rank", setting)


def _under_mpirun(mpirun: str, *args: str, timeout: float, **settings: str) -> subprocess.CompletedProcess:
    """``python args`` at 2 ranks under ``mpirun``, with the environment ``settings``."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    passed = [a for name in ("OMP_NUM_THREADS", "PATH", *settings) for a in ("-x", name)]
    return subprocess.run([mpirun, *root, "--oversubscribe", "-np", "2", *passed, sys.executable, *args], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **settings), capture_output=True, text=True,
                          timeout=max(timeout, 1.0) if timeout < math.inf else 300)


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


def section(name: str, cuda: bool, end: float, fn, *args, boxed: bool = False) -> None:
    """``fn(*args)`` (with its box's end last where ``boxed``); a failure is a row. On the
    GPU a section whose box would end in under 10 s does not start; the dry run has no boxes."""
    until = min(time.time() + BUDGET_S[name], end) if cuda else math.inf
    if until - time.time() < 10:
        row(name, "-", "skipped: time box")
        return
    start = time.time()
    try:
        fn(*args, until) if boxed else fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the table
        row(name, "-", f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
    SECONDS[name] = time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes: check the plumbing")
    parser.add_argument("--rank-of-2", nargs=2, metavar=("DEVICE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of_2:  # a rank under mpirun, started by under_mpirun
        _rank_under_mpirun(*args.rank_of_2)
        return
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 11):
        sys.exit(f"gpu_check: expected torch >= 2.11 (the [torch] extra's floor), got {torch.__version__}")
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        sys.exit("gpu_check: expected a CUDA GPU (torch.cuda.is_available() is False); use --dry-run on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # tiny sizes: 1 warm-up step, 2 repeats of 2 steps; the native kernels' CPU stand-ins
        global WARMUP, REPEATS, STAND_IN_NARROWING
        # A ResNet stand-in of full width spends its CPU step on the optimizer's 25M
        # parameters (0.2-0.3 s a step); at 1/8 of its channels it runs the same layers.
        WARMUP, REPEATS, STAND_IN_NARROWING = 1, 2, 8
        sys.path.insert(0, str(ROOT / "tests"))
        import cuda_kernels

        STAND_INS.append(cuda_kernels.registered())  # for this process: its layers take the native set, as on CUDA
        STAND_INS[-1].__enter__()
    started = time.time()
    end = started + TOTAL_S
    print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU (dry run)'}")
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        if cuda:  # first compiles cold, as a user's first run is
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"{tmp}/inductor")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        force(TorchDistComm(None))
        shapes = SHAPES if cuda else [(2, s[1] // 8, 8, 8) for s in SHAPES]
        section("per layer", cuda, end, per_layer, device, shapes, boxed=True)
        section("launches", cuda, end, launches, device)
        section("training steps", cuda, end, training_steps, device, *((32, 224) if cuda else (2, 32)), boxed=True)
        section("host syncs", cuda, end, no_sync, device, 224 if cuda else 32)
        section("CUDA graphs", cuda, end, lambda: (cuda_graph(device), compiled_graph(device)))
        section("DataParallel", cuda, end, data_parallel, device, boxed=True)
        dist.destroy_process_group()
    section("2 processes, spawned", cuda, end, two_processes, device)
    section("2 processes, mpirun", cuda, end, under_mpirun, device, boxed=True)
    section("private group, 1 rank", cuda, end, private_group_alone, device)  # last: it sets every layer's comm
    print("\n| check | setting | result |\n|---|---|---|")
    for r in ROWS:
        print(f"| {' | '.join(r)} |")
    print(f"\ngpu_check: {time.time() - started:.0f} s ({', '.join(f'{k} {v:.0f}' for k, v in SECONDS.items())})")


if __name__ == "__main__":
    main()
