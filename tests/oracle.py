"""The oracle every layer test uses: shards, global batches, one runner, comparisons.

Every rank builds the same global batches from a seed, trains its layer on its own
slice and compares with plain BN trained on the whole batches in one process
(:func:`train_like_one_process`), wherever its ranks run: as launched processes or as
threads of one process (:class:`Ranks`), for PyTorch (:class:`TorchTrainer`) and Keras
(:class:`KerasTrainer`). Frameworks are imported only by the trainer that needs one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Sequence, Tuple

import numpy as np

# Where each comparison's used share of its tolerance goes (one JSON line per call, a file
# per process), to find tolerances that hold by a hair: HVD_SYNCBN_TEST_MARGINS=folder.
_MARGINS = os.environ.get("HVD_SYNCBN_TEST_MARGINS")

# Rows per rank for a world of any size: unequal, and (``EMPTY``) with an empty rank.
UNEQUAL = (3, 5, 2, 4)
EMPTY = (4, 0, 3, 0)


def shard_sizes(pattern: Sequence[int], world: int) -> List[int]:
    """Rows held by each of ``world`` ranks, cycling through ``pattern``."""
    return [pattern[r % len(pattern)] for r in range(world)]


def shard_slice(sizes: Sequence[int], rank: int) -> slice:
    """The rows of the global batch that ``rank`` holds."""
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def global_batch(seed: int, rows: int, tail: Sequence[int], offset: float = 0.0, scale: float = 1.0):
    """A float32 numpy batch ``(rows, *tail)``, identical on every rank for a seed."""
    rng = np.random.default_rng(seed)
    return (offset + scale * rng.standard_normal((rows, *tail))).astype(np.float32)


def training_batches(rows: int, tail: Sequence[int], steps: int = 3, seed: int = 0, offset: float = 0.0,
                     drift: float = 1.0, scale: float = 1.0, mask: bool = False) -> list:
    """The global batches of the oracle's training steps, the same on every rank and in
    every suite: per step ``(x, r, m)``, the input (``scale`` times unit normal, its mean
    at ``offset + drift·step``), the upstream gradient ``r`` (the loss is ``Σ y·r``), and
    with ``mask`` a boolean mask over all axes but the last (else ``None``)."""
    return [(global_batch(seed + step, rows, tail, offset=offset + drift * step, scale=scale),
             global_batch(100 + seed + step, rows, tail),
             global_batch(200 + seed + step, rows, tail[:-1]) > -0.5 if mask else None) for step in range(steps)]


def eval_batch(rows: int, tail: Sequence[int], seed: int = 0, offset: float = 0.0, scale: float = 1.0):
    """The global batch the oracle evaluates on after :func:`training_batches`."""
    return global_batch(seed + 50, rows, tail, offset=offset, scale=scale)


class Ranks(NamedTuple):
    """The ranks of a test as this process holds them: ``run(fn)`` calls ``fn(rank)`` for
    each rank held here (one when launched, all in a world of threads) and returns
    ``{rank: result}``; ``sum(values, name)`` sums ``{rank: tensor}`` over every rank of
    the world (a collective called ``name`` when launched)."""

    size: int
    run: Callable[[Callable[[int], Any]], Dict[int, Any]]
    sum: Callable[[Dict[int, Any], str], Any]


def launched(rank: int, size: int, allreduce: Callable[[Any, str], Any]) -> Ranks:
    """This process is ``rank`` of ``size``; ``allreduce(tensor, name)`` sums over them."""
    return Ranks(size, lambda fn: {rank: fn(rank)}, lambda values, name: allreduce(values[rank], name))


def launched_group(rank: int, world: int, parts: Sequence[Sequence[int]],
                   allreduce: Callable[[np.ndarray, str], Any]) -> Tuple[list, Ranks]:
    """This process's group of ``parts`` (BN groups of a launch of ``world``) and its
    :class:`Ranks`, whose sums go over the group: ``allreduce(table, name)`` sums a
    ``(world, ...)`` numpy table in the value's dtype over the launch, this rank's value
    in its row."""
    mine = list(next(g for g in parts if rank in g))
    here = mine.index(rank)

    def summed(values: Dict[int, Any], name: str) -> np.ndarray:
        value = values[here]
        value = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        table = np.zeros((world, *value.shape), value.dtype)
        table[rank] = value
        return allreduce(table, name)[mine].sum(0)

    return mine, Ranks(len(mine), lambda fn: {here: fn(here)}, summed)


# What a trainer returns: per row (each rank compares its own rows) or per parameter
# (summed over the ranks first, as an optimizer would); everything else is compared whole.
ROWS = ("output", "input grad", "eval output")
SUMMED = ("weight grad", "bias grad", "gamma grad", "beta grad")


def train_like_one_process(ranks: Ranks, sizes: Sequence[int], batches: list, eval_x, ours: Callable[[int], Any],
                           references: list, compare: Callable) -> Dict[int, list]:
    """The oracle: each rank's trainer ``ours(rank)`` trains on its rows (``sizes``) of
    ``batches`` (per step ``(x, r, m)``: :func:`training_batches`) and then evaluates on
    its rows of ``eval_x``; each trainer of ``references`` does the same on the whole
    batches. Per step (and the evaluation) and rank held here,
    ``compare(ours, [reference, ...], what, batch)`` with the reference's :data:`ROWS` cut
    to the rank's rows and ours' :data:`SUMMED` summed over the ranks. Returns ours'
    results, ``{rank: [dict per step..., eval dict]}``."""
    def trained(trainer, rows: slice) -> list:
        return ([trainer.train(*(None if t is None else t[rows] for t in batch)) for batch in batches]
                + [trainer.evaluate(eval_x[rows])])

    got = ranks.run(lambda rank: trained(ours(rank), shard_slice(sizes, rank)))
    wants = [trained(reference, slice(None)) for reference in references]
    for i, batch in enumerate([*batches, (eval_x,)]):
        what = f"step {i}" if i < len(batches) else "eval"
        summed = {name: ranks.sum({rank: g[i][name] for rank, g in got.items()}, f"oracle.{what}.{name}")
                  for name in SUMMED if name in wants[0][i]}
        for rank, g in got.items():
            rows = shard_slice(sizes, rank)
            cut = [{name: t[rows] if name in ROWS else t for name, t in want[i].items()} for want in wants]
            compare({**g[i], **summed}, cut, f"{what}, rank {rank} of {sizes}", batch)
    return got


def as_accurate(alone: bool = False, **kwargs) -> Callable:
    """The comparison for references ``[plain, plain in float64]``: ours as close to
    float64 as plain is (:func:`assert_as_accurate`); ``alone``, equal to plain."""
    return lambda got, refs, what, batch: assert_as_accurate(got, refs[0], refs[1], what, alone=alone, **kwargs)


def conditioned(channel_axes: Sequence[int], grad_atol: float = None, **tol) -> Callable:
    """The comparison for references ``[plain in float64]``, element-wise, within a
    tolerance from each batch's conditioning, unless ``tol`` gives one: x̂ in float32 is
    off by about ε·max|x|/std (the smallest channel's std), in ours as in plain float32
    BN, so the output (γ ≤ 1.5) by 1.5 times that, with 4x room; the input gradient,
    γ·(...)/std, by that over the std (``grad_atol`` replaces its atol). γ/β gradients
    are float32 sums of ~10² O(1) terms that nearly cancel: their rounding alone is
    ~1e-6·√rows against float64, hence atol 1e-5."""
    def compare(got, refs, what, batch):
        x = batch[0]
        std = x.std(axis=tuple(a for a in range(x.ndim) if a not in channel_axes)).min()
        atol = 4 * 1.5 * float(np.finfo(np.float32).eps) * np.abs(x).max() / std
        grad = {**(tol or dict(rtol=1e-5, atol=atol * max(1.0, 1 / std))), **({"atol": grad_atol} if grad_atol else {})}
        for name, t in got.items():
            bound = grad if name == "input grad" else {"atol": 1e-5, **tol} if name in SUMMED else (
                tol or dict(rtol=1e-5, atol=atol))
            assert_close(t, refs[0][name], f"{name} ({what})", **bound)
    return compare


class TorchTrainer:
    """One step of a torch BN layer: input in ``dtype`` (default: the layer's), loss
    ``Σ y·r``; returns the output, the input gradient, the trained parameters' gradients
    and the running buffers."""

    def __init__(self, layer, channels_last: bool = False, dtype=None) -> None:
        self.layer, self.channels_last, self.dtype = layer, channels_last, dtype

    def _input(self, x):
        import torch

        dtype = self.dtype or next((t.dtype for t in self.layer.state_dict().values() if t.is_floating_point()),
                                   torch.float32)
        x = torch.as_tensor(x).to(dtype)
        return x.contiguous(memory_format=self._format(x)) if self.channels_last else x

    @staticmethod
    def _format(x):
        import torch

        return torch.channels_last if x.dim() == 4 else torch.channels_last_3d

    def train(self, x, r, m=None) -> dict:
        import torch

        layer, x = self.layer, self._input(x).requires_grad_(True)
        y = layer(x)
        if self.channels_last:
            assert y.is_contiguous(memory_format=self._format(y)), "channels_last output lost"
        (y * torch.as_tensor(r).to(y.dtype)).sum().backward()
        out = {"output": y.detach(), "input grad": x.grad}
        for name in ("weight", "bias"):
            p = getattr(layer, name)
            if p is not None and p.requires_grad:
                out[f"{name} grad"], p.grad = p.grad, None
        return {**out, **{name: t.clone() for name in ("running_mean", "running_var", "num_batches_tracked")
                          if (t := getattr(layer, name)) is not None}}

    def evaluate(self, x) -> dict:
        import torch

        training = self.layer.training
        with torch.no_grad():
            y = self.layer.eval()(self._input(x))
        self.layer.train(training)
        return {"eval output": y}


class KerasTrainer:
    """One step of a Keras BN layer (in a ``tf.function`` if ``compiled``, compiled by
    XLA if ``"xla"``): input and ``r`` in the layer's variable dtype, loss ``Σ y·r``;
    returns the output, the input gradient, γ's and β's gradients and the moving statistics."""

    def __init__(self, layer, compiled: Any = False) -> None:
        import tensorflow as tf

        self.layer, self.tf = layer, tf
        self._step = (tf.function(self._forward_backward, jit_compile=compiled == "xla") if compiled
                      else self._forward_backward)

    def _forward_backward(self, x, r, m):
        layer, tf = self.layer, self.tf
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True) if m is None else layer(x, training=True, mask=m)
            loss = tf.reduce_sum(tf.cast(y, r.dtype) * r)
        return y, tape.gradient(loss, [x, *self._weights().values()])

    def _weights(self) -> dict:
        return {name: w for name in ("gamma", "beta") if (w := getattr(self.layer, name, None)) is not None}

    def train(self, x, r, m=None) -> dict:
        layer, tf = self.layer, self.tf
        y, (dx, *dw) = self._step(tf.cast(x, layer.variable_dtype), tf.cast(r, layer.variable_dtype),
                                  None if m is None else tf.constant(m))
        names = list(self._weights())
        assert y.dtype == layer.compute_dtype, f"output dtype {y.dtype} != {layer.compute_dtype}"
        state = ("moving_mean", "moving_variance") + (
            ("moving_stddev", "renorm_mean", "renorm_stddev") if getattr(layer, "renorm", False) else ())
        return {"output": y, "input grad": dx, **{f"{n} grad": g for n, g in zip(names, dw)},
                **{name: tf.identity(getattr(layer, name)) for name in state}}

    def evaluate(self, x) -> dict:
        return {"eval output": self.layer(x, training=False)}


def assert_close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``np.testing``-style closeness that prints the largest difference and where."""
    got, want = _numpy(got), _numpy(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != expected {want.shape}"
    if got.size == 0:
        return
    diff = np.abs(got - want)
    bound = atol + rtol * np.abs(want)
    _record(what, _used(diff, bound))
    if not np.all(diff <= bound):
        i = np.unravel_index(np.argmax(diff - bound), diff.shape)
        raise AssertionError(
            f"{what}: largest difference {diff.max():.3g} (at {i}: got {got[i]!r}, "
            f"expected {want[i]!r}); rtol={rtol}, atol={atol}, "
            f"{int(np.sum(diff > bound))} of {diff.size} elements outside"
        )


def assert_as_accurate(got: Mapping[str, Any], plain: Mapping[str, Any], ref: Mapping[str, Any], what: str, *,
                       alone: bool = False, k: float = 4.0, ulps: float = 16.0) -> None:
    """Each tensor of ``got`` (ours: outputs, gradients, a model's state...) is as close
    to the float64 reference ``ref`` (plain BN on the concatenated batch) as ``plain``,
    plain BN computing the same in a lower precision, is. Per tensor of ``n`` elements,
    in L2::

        ‖got − ref‖ ≤ s·k·(‖plain − ref‖ + σ·√n) + ulps·ε·‖ref‖

    with ε the machine epsilon of ``got``'s dtype, ``s = ε / ε(plain's dtype)`` (rounding
    errors grow with ε, so for a float64 ``got`` plain float32's measured error, scaled
    down, stands for plain float64's) and σ plain's RMS error per element over all the
    tensors. σ covers tensors where plain's kernels happen to be more accurate than ours,
    or where rounding noise is large against the tensor itself (a mean of ~0, a small
    moving mean); the ulps term, scalars such as a loss. Integers must be exact.

    ``alone``: one rank, where the synchronized layers are plain BN: ``got`` must equal
    ``plain`` (then plain BN in ``got``'s precision) exactly.

    For float32 noise that exceeds any element-wise tolerance which would still catch a
    wrong statistic (ill-conditioned nets, large offsets), and so that the bound follows
    each machine's own kernels. Measured at 1-4 ranks: ours uses at most 0.29 of it on
    the real models (``ranks_models.py``), 0.19 in the oracle cases of ``ranks_torch.py``
    and the thread worlds of ``unit/test_thread_worlds.py``; local BN on the shards exceeds it in
    20-80% of the real models' tensors, by 1e3 and more.
    """
    assert list(got) == list(ref) == list(plain), f"{what}: tensors differ: {list(got)}, {list(plain)}, {list(ref)}"
    if alone:
        for name, t in got.items():
            assert_close(t, plain[name], f"{what}: {name}", rtol=0.0, atol=0.0)
        return
    ref = {name: _numpy(t) for name, t in ref.items()}
    errs = {name: _numpy(plain[name]) - r for name, r in ref.items()}
    sigma = np.sqrt(sum(np.sum(e**2) for e in errs.values()) / max(1, sum(r.size for r in ref.values())))
    for name, t in got.items():
        eps, eps_plain = _eps(t), _eps(plain[name])
        r = ref[name]
        err, err_plain, size = np.linalg.norm(_numpy(t) - r), np.linalg.norm(errs[name]), np.linalg.norm(r)
        bound = (eps / eps_plain * k * (err_plain + sigma * np.sqrt(r.size)) if eps else 0.0) + ulps * eps * size
        _record(f"{what}: {name}", _used(err, bound))
        if not err <= bound:
            raise AssertionError(
                f"{what}: {name} off the float64 reference by {err:.3g} (L2), plain BN by {err_plain:.3g} "
                f"(RMS {sigma:.3g} per element over all); allowed {k:g}x (plain's + RMS·√{r.size}), scaled to "
                f"{_dtype_name(t)}, + {ulps:g} ulps of the norm {size:.3g} = {bound:.3g}"
            )


def _eps(x) -> float:
    """Machine epsilon of a tensor's dtype; 0 for integers."""
    if _dtype_name(x) == "bfloat16":  # 8 significand bits; numpy has no name for it
        return 2.0**-7
    dtype = np.dtype(_dtype_name(x))
    return float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 0.0


def _dtype_name(x) -> str:
    """'float32' for a torch, numpy, TF or Keras tensor or variable of that dtype."""
    dtype = x.dtype
    return getattr(dtype, "name", None) or str(dtype).split(".")[-1]


def _used(diff: np.ndarray, bound: np.ndarray) -> float:
    """The largest share of its bound a difference uses (1 = at the limit)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(diff == 0, 0.0, diff / bound)
    return float(np.max(share)) if share.size else 0.0


def _record(what: str, used: float) -> None:
    if _MARGINS:
        with open(os.path.join(_MARGINS, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "what": what, "used": used}) + "\n")


def _numpy(x) -> np.ndarray:
    """float64 numpy copy of a numpy array, torch tensor (any dtype, grad or not) or TF tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().double()
    return np.asarray(x, dtype=np.float64)
