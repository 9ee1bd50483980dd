"""REPORT.md and its plots from the results of one ``run.py`` run.

    python benchmarks/report.py results/bench/results.json     # rewrite the report
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import scaling
from common import SHAPE_ORIGIN

PREDICT_RANKS = (8, 64, 512)


# ---------------------------------------------------------------- small helpers


def med(job: dict, shape: str, impl: str) -> float:
    try:
        return job["shapes"][shape]["times"][impl]["median"]
    except (KeyError, TypeError):
        return math.nan


def quartile(job: dict, shape: str, impl: str) -> float:
    """The lower quartile of a timed implementation: less of other load in it than the median."""
    try:
        return job["shapes"][shape]["times"][impl]["q1"]
    except (KeyError, TypeError):
        return math.nan


def ratio(a: float, b: float) -> str:
    return "—" if not (a == a and b == b and b > 0) else f"**{a / b:.2f}×**"


def ms(v: float) -> str:
    return "—" if v != v else f"{v:.2f}"


def table(head: list, rows: list) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def shape_label(key: str) -> str:
    s = tuple(json.loads(key))
    return f"{s} {SHAPE_ORIGIN.get(s, '')}".strip()


def errors(section: dict, what: str) -> list:
    return [f"- {what} `{k}` failed: {v['error']}" for k, v in section.items()
            if isinstance(v, dict) and "error" in v]


def rel(pred: float, meas: float) -> str:
    return "—" if not (meas == meas and meas > 0) else f"{(pred - meas) / meas:+.0%}"


# --------------------------------------------------------------- collectives


def summarize_counts(c: dict) -> dict:
    """``{"hvd": (calls, bytes) by group, "mpi": (calls, bytes), "mpi_kinds": [kind]}``
    of one counted step."""
    out = {"hvd": {}, "mpi": (0, 0), "mpi_kinds": sorted(c.get("mpi") or {})}
    for key, v in (c.get("horovod") or {}).items():
        op, _, group = key.partition(" ")
        calls, nbytes = out["hvd"].get(group, (0, 0))
        out["hvd"][group] = (calls + v["calls"], nbytes + v["bytes"])
    for v in (c.get("mpi") or {}).values():
        out["mpi"] = (out["mpi"][0] + v["calls"], out["mpi"][1] + v["bytes"])
    return out


def count_cell(c: dict, groups=None, mpi: bool = True) -> str:
    """``"2 hvd (2,096 B)"`` style text of one counted step, optionally for some groups."""
    s = summarize_counts(c)
    parts = []
    hvd = [(g, v) for g, v in s["hvd"].items() if groups is None or g in groups]
    if hvd:
        calls, nbytes = sum(v[0] for _, v in hvd), sum(v[1] for _, v in hvd)
        parts.append(f"{calls:g} Horovod ({nbytes:,.0f} B)")
    if mpi and s["mpi"][0]:
        what = "MPI sends" if s["mpi_kinds"] == ["send"] else "MPI"
        parts.append(f"{s['mpi'][0]:g} {what} ({s['mpi'][1]:,.0f} B)")
    return " + ".join(parts) or "0"


def transport_in_effect(c: dict) -> str:
    s = summarize_counts(c)
    if "hvd_syncbn" in s["hvd"] and s["mpi"][0]:
        return "both?"
    return "horovod" if "hvd_syncbn" in s["hvd"] else "mpi" if s["mpi"][0] else "none counted"


# ------------------------------------------------------------------- sections


def torch_section(res: dict) -> tuple:
    tl, out, summary = res["torch_layers"], [], {}
    for ranks in res["conf"]["ranks"]:
        h, m = tl.get(f"{ranks}/horovod", {}), tl.get(f"{ranks}/mpi", {})
        if "error" in h and "error" in m:
            continue
        note = " — **oversubscribed: 4 ranks share 2 cores**" if ranks > (res["cores"] or 1) else ""
        head = ["shape (per rank)", "ours / local", "ours / (local + floor)", "ours / hand-written",
                "ours[mpi] / local", "ours[mpi] / (local + floor_hvd)", "ours[mpi] / (local + floor_mpi)",
                "ours ms", "local ms", "floor_hvd ms", "hand ms", "ours[mpi] ms", "local ms (mpi job)", "floor_mpi ms"]
        if ranks == 1:
            head += ["A/A: local again / local", "A/A [mpi job]"]
        refusals = h.get("refusals")
        if refusals:
            head += ["torch.nn.SyncBatchNorm", "hvd.SyncBatchNorm"]
        rows = []
        for key in res["shapes"]:
            key = json.dumps(key)
            o, l_, f, hd = (med(h, key, i) for i in ("ours", "local", "floor_hvd", "hand"))
            om, lm, fm = (med(m, key, i) for i in ("ours", "local", "floor_mpi"))
            row = [shape_label(key), ratio(o, l_), ratio(o, l_ + f), ratio(o, hd), ratio(om, lm), ratio(om, lm + f),
                   ratio(om, lm + fm),
                   ms(o), ms(l_), ms(f), ms(hd), ms(om), ms(lm), ms(fm)]
            if ranks == 1:
                row += [ratio(med(h, key, "local_again"), l_), ratio(med(m, key, "local_again"), lm)]
            if refusals:
                row += [refusals.get("torch_syncbn", "—"), refusals.get("hvd_syncbn_layer", "—")]
            rows.append(row)
            summary.setdefault(ranks, []).append((o / l_ if l_ else math.nan, om / lm if lm else math.nan,
                                                  o / hd if hd else math.nan, med(h, key, "local_again") / l_,
                                                  med(m, key, "local_again") / lm, o / (l_ + f), om / (lm + f),
                                                  om / (lm + fm)))
        out.append(f"### {ranks} rank{'s' * (ranks > 1)}{note}\n\n{table(head, rows)}\n")
    return "\n".join(out), summary


def counts_section(res: dict) -> str:
    tl, parts = res["torch_layers"], []
    head = ["implementation (PyTorch, 2 ranks)", "transport in effect"] + [
        f"{tuple(k)}" for k in res["shapes"]]
    rows = []
    for comm in ("horovod", "mpi"):
        job = tl.get(f"count 2/{comm}", {})
        if "error" in job or not job:
            continue
        first = next(iter(job["shapes"].values()))["counts"]
        for impl in first:
            cells = [count_cell(job["shapes"][json.dumps(k)]["counts"][impl]) for k in res["shapes"]]
            eff = transport_in_effect(first[impl]) if impl == "ours" else "—"
            rows.append([f"{impl} [HVD_SYNCBN_COMM={comm}]", eff] + cells)
    parts.append(table(head, rows) if rows else "(no counting job succeeded)")
    parts.append("\nExpected from the designs: ours 2 collectives of (2C+3)·8 + (2C+2)·8 = 32C+40 B; "
                 "hand-written 3 forward (4 B + 4C + 4C) and 2 autograd backward (4C each) = 16C+4 B in 5 calls; "
                 "local 0. Over MPI each of ours' two allreduces is one MPI `Iallreduce` of the whole buffer. "
                 "`barrier` calls of the benchmark itself are left out.")
    tfc = [(k[6:], v) for k, v in res.get("tf_layers", {}).items() if k.startswith("count ") and "error" not in v]
    if tfc:
        rows = []
        for name, job in tfc:
            first = next(iter(job["shapes"].values()))["counts"]
            for impl in first:
                cells = [count_cell(job["shapes"][k]["counts"][impl]) for k in job["shapes"]]
                rows.append([f"{name}: {impl}"] + cells)
        keys = list(tfc[0][1]["shapes"])
        parts.append("\nKeras, 2 ranks (Keras 3 `synchronized=True` goes through TF's own gRPC collectives, "
                     "which neither Horovod's timeline nor the MPI shim sees: not counted):\n\n"
                     + table(["configuration: layer"] + [f"{tuple(json.loads(k))}" for k in keys], rows))
    return "\n".join(parts)


def e2e_section(res: dict) -> str:
    e, rows, crow = res["e2e"], [], []
    nets = next((j["nets"] for j in e.values() if "nets" in j), {})
    for net, info in nets.items():
        h, m = (e.get(c, {}).get("nets", {}).get(net, {}).get("times", {}) for c in ("horovod", "mpi"))
        g = lambda t, k: t.get(k, {}).get("median", math.nan)  # noqa: E731
        rows.append([net, len(info["bn_channels"]), tuple(info["input"]),
                     ratio(g(h, "sync"), g(h, "local")), ratio(g(m, "sync"), g(m, "local")),
                     ms(g(h, "sync")), ms(g(h, "local")), ms(g(m, "sync")), ms(g(m, "local"))])
        for comm in ("horovod", "mpi"):
            cj = e.get(f"count {comm}", {}).get("nets", {}).get(net, {}).get("counts", {})
            for variant, c in cj.items():
                crow.append([net, f"{variant} [HVD_SYNCBN_COMM={comm}]",
                             count_cell(c, {"hvd_syncbn"}) if variant == "sync" else "—",
                             count_cell(c, {g_ for g_ in summarize_counts(c)["hvd"] if g_ != "hvd_syncbn"}, mpi=False),
                             transport_in_effect(c) if variant == "sync" else "—"])
    out = table(["net (2 ranks)", "BN layers", "input per rank", "sync / local [horovod]", "sync / local [mpi]",
                 "sync ms [horovod]", "local ms", "sync ms [mpi]", "local ms (mpi job)"], rows)
    if crow:
        out += "\n\nCollectives per training step, counted (rank 0):\n\n" + table(
            ["net", "variant", "SyncBN collectives (+ MPI calls)", "gradient allreduces (Horovod)",
             "SyncBN transport in effect"], crow)
    return out


def tf_e2e_section(res: dict) -> str:
    """The Keras training step (``e2e_tf.py``): each variant against local Keras BN."""
    t = res.get("tf_e2e", {})
    if "skipped" in t:
        return f"Skipped: {t['skipped']}."
    job = t.get("2 ranks", {})
    if "nets" not in job:
        return "The Keras training-step job did not run." if not job else "The Keras training-step job failed."
    rows = []
    for net, r in job["nets"].items():
        g = lambda k: r["times"].get(k, {}).get("median", math.nan)  # noqa: E731
        rows.append([net, r["bn_layers"], tuple(r["input"]), ratio(g("host"), g("local")),
                     ratio(g("device"), g("local")), ratio(g("xla"), g("local")), ratio(g("xla"), g("local_xla")),
                     ratio(g("local_xla"), g("local")), *(ms(g(k)) for k in ("local", "local_xla", "host", "device",
                                                                               "xla"))])
    return table(["net (2 ranks)", "BN layers", "input per rank", "host / local", "device / local", "XLA / local",
                  "XLA / local XLA", "local XLA / local", "local ms", "local XLA ms", "host ms", "device ms",
                  "XLA ms"], rows)


def tf_section(res: dict) -> str:
    t = res.get("tf_layers", {})
    if "skipped" in t:
        return f"Skipped: {t['skipped']}."
    jobs = {k: v for k, v in t.items() if not k.startswith("count ") and "error" not in v}
    if not jobs:
        return "No Keras job succeeded."
    keys = list(next(iter(jobs.values()))["shapes"])
    g = lambda job, k, impl: med(t.get(job, {}), k, impl)  # noqa: E731
    rows = []
    for k in keys:
        oh, lh, om, lm = g("ours[horovod]", k, "ours"), g("ours[horovod]", k, "local"), g("ours[mpi]", k, "ours"), \
            g("ours[mpi]", k, "local")
        k2, k3 = g("hvd_keras2", k, "hvd_keras2"), g("keras3_sync", k, "keras3_sync")
        o1, l1, a1 = g("ours 1 rank", k, "ours"), g("ours 1 rank", k, "local"), g("ours 1 rank", k, "local_again")
        rows.append([shape_label(k), ratio(o1, l1), ratio(a1, l1), ratio(oh, lh), ratio(om, lm), ratio(oh, k2),
                     ratio(oh, k3), ratio(om, k2), ratio(om, k3), ms(o1), ms(l1), ms(oh), ms(lh), ms(om), ms(lm),
                     ms(k2), ms(k3)])
    return table(["shape (per rank, as NCHW; run NHWC)", "1 rank: ours / local", "1 rank, A/A: local again / local",
                  "ours / local", "ours[mpi] / local",
                  "ours / hvd Keras 2", "ours / Keras 3 sync", "ours[mpi] / hvd Keras 2", "ours[mpi] / Keras 3 sync",
                  "1 rank: ours ms", "1 rank: local ms", "ours ms", "local ms", "ours[mpi] ms", "local ms (mpi job)",
                  "hvd Keras 2 ms", "Keras 3 sync ms"], rows)


# ---------------------------------------------------------------------- model


def sweep_point(row: dict, transport: str) -> float:
    """The statistic the model fits: a sweep point's lower quartile (older results: the
    lower decile, else the median)."""
    return row.get(f"{transport}_q1", row.get(f"{transport}_p10", row[transport]))


def fits(res: dict) -> dict:
    """``{(transport, network): params}`` fitted on the allreduce sweeps at 1–4 ranks."""
    out = {}
    ab, cores = res["alphabeta"], res["cores"] or 1
    for network in ("loopback", "netns"):
        for transport in ("horovod", "mpi4py"):
            pts = [(job["ranks"], r["bytes"], sweep_point(r, transport)) for job in ab.get(network, {}).values()
                   if "rows" in job for r in job["rows"]]
            if network == "netns":  # one rank has no network: reuse loopback's 1-rank points
                pts += [(1, r["bytes"], sweep_point(r, transport)) for r in ab["loopback"].get("1", {}).get("rows", [])]
            if len({p[0] for p in pts}) >= 2:
                out[(transport, network)] = scaling.fit(pts, cores)
    return out


def model_section(res: dict, fitted: dict) -> tuple:
    parts = []
    cores = res["cores"] or 1
    rows = [[t, n, f"{p['h'] * 1e3:.1f}", f"{p['alpha'] * 1e3:.1f}", f"{p['sigma'] * 1e3:.1f}",
             "∞" if p["beta"] == 0 else f"{1e-6 / p['beta']:.2f}", p["points"], f"{p['rms_rel_err']:.0%}"]
            for (t, n), p in fitted.items()]
    parts.append(table(["transport", "network", "h µs (per call)", "α µs (per round)",
                        f"σ µs (per round, ranks > {cores} cores)", "1/β GB/s", "points", "rms rel. error of fit"],
                       rows))
    parts.append(f"\nThe 3- and 4-rank runs oversubscribe the {cores} cores: there a round also waits for a peer "
                 "that is not scheduled, which σ takes up (Horovod's cost is its cycle either way). Measured "
                 "points: `results.json` → `alphabeta`; plot `alphabeta.png`.")
    skipped = res["alphabeta"].get("netns_skipped")
    if skipped:
        parts.append(f"\nNamespace hosts skipped: {skipped}.")
    # check against the per-layer measurements (loopback fits, same machine)
    tl, check = res["torch_layers"], []
    errs = []
    for ranks in (2, 4):
        if ranks not in res["conf"]["ranks"]:  # a --quick run has no 4-rank layer jobs
            continue
        h, m = tl.get(f"{ranks}/horovod", {}), tl.get(f"{ranks}/mpi", {})
        for key in res["shapes"]:
            key = json.dumps(key)
            c = json.loads(key)[1]
            ours = scaling.DESIGNS[next(iter(scaling.DESIGNS))](c)
            row = [ranks, c]
            for transport, job, floor in (("horovod", h, "floor_hvd"), ("mpi4py", m, "floor_mpi")):
                p = fitted.get((transport, "loopback"))
                pred = scaling.cost(p, ours, ranks, cores) if p else math.nan
                fl, over = med(job, key, floor), med(job, key, "ours") - med(job, key, "local")
                fl_q1 = quartile(job, key, floor)
                row += [ms(pred), f"{ms(fl)} ({ms(fl_q1)})", f"{rel(pred, fl)} ({rel(pred, fl_q1)})", ms(over),
                        rel(pred, over)]
                if fl_q1 == fl_q1 and fl_q1 > 0:
                    errs.append(((pred - fl_q1) / fl_q1, transport, ranks))
            check.append(row)
    parts.append("\nModel against measurement (loopback fit; the floor is the same two allreduces timed "
                 "between the layers' runs, in other jobs than the sweep; the error in brackets is against its "
                 "lower quartile, the statistic the model is fitted on; ours − local adds our layer's extra "
                 "compute).\n\n" + table(
                     ["ranks", "C", "predicted, Horovod", "floor_hvd measured: median (q1)", "rel. err",
                      "ours − local", "rel. err", "predicted, mpi4py", "floor_mpi measured: median (q1)",
                      "rel. err", "ours[mpi] − local", "rel. err"], check))
    # predictions
    key = ("mpi4py", "netns") if ("mpi4py", "netns") in fitted else ("mpi4py", "loopback")
    nets = {"ResNet-50 (53 BN)": scaling.resnet50_bn_channels(), "DeepLab-v3, ResNet-50 (60 BN)":
            scaling.deeplabv3_bn_channels()}
    preds = {}
    for transport_key in (key, ("horovod", key[1])):
        p = fitted.get(transport_key)
        if not p:
            continue
        rows = []
        for net, chans in nets.items():
            base = {w: scaling.step_overhead(p, next(iter(scaling.DESIGNS)), chans, w) for w in PREDICT_RANKS}
            for design in scaling.DESIGNS:
                v = {w: scaling.step_overhead(p, design, chans, w) for w in PREDICT_RANKS}
                preds[(transport_key, net, scaling.SHORT[design])] = v
                rows.append([net, scaling.SHORT[design]] + [f"{v[w]:.1f}" for w in PREDICT_RANKS]
                            + [f"{v[w] / base[w]:.2f}×" for w in PREDICT_RANKS])
        bw = "∞" if not p["beta"] else f"{1e-6 / p['beta']:.2f}"
        parts.append(f"\nPredicted SyncBN communication per training step, ms, with the "
                     f"{transport_key[0]} / {transport_key[1]} fit (h={p['h'] * 1e3:.1f} µs, "
                     f"α={p['alpha'] * 1e3:.1f} µs, 1/β={bw} GB/s; a core per rank, so no σ):\n\n"
                     + table(["net", "design"] + [f"W={w}" for w in PREDICT_RANKS]
                             + [f"/ ours, W={w}" for w in PREDICT_RANKS], rows))
    groups = group_model(fitted)
    if groups:
        rows = [[t, f"{n} fit", "all ranks" if g == 0 else f"groups of {g}"] + [f"{x:.1f}" for x in v]
                for (t, n, g), v in groups.items()]
        parts.append("\nBN groups (`group_size`), ResNet-50, ours: predicted SyncBN communication per step, ms, "
                     "each collective spanning one group (a model, plot `scaling_groups.png`):\n\n"
                     + table(["transport", "fit", "synchronized over"] + [f"W={w}" for w in scaling.GROUP_RANKS],
                             rows))
    return "\n".join(parts), errs, preds, groups


# ---------------------------------------------------------------------- plots


def _save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def plots(res: dict, fitted: dict, preds: dict, groups: dict, out: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    tl = res["torch_layers"]
    keys = [json.dumps(k) for k in res["shapes"]]
    h, m = tl.get("2/horovod", {}), tl.get("2/mpi", {})
    if "shapes" in h:
        fig, ax = plt.subplots(figsize=(10, 4))
        series = [("local", h, "local"), ("ours [horovod]", h, "ours"), ("ours [mpi]", m, "ours"),
                  ("floor_hvd", h, "floor_hvd"), ("hand-written", h, "hand")]
        width = 0.8 / len(series)
        for i, (label, job, impl) in enumerate(series):
            ax.bar([k + i * width for k in range(len(keys))], [med(job, k, impl) for k in keys], width, label=label)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], [str(tuple(json.loads(k))) for k in keys],
                      fontsize=8)
        ax.set_ylabel("ms, forward+backward (median)")
        ax.set_title("PyTorch per-layer, 2 ranks")
        ax.legend(fontsize=8)
        made.append(_save(plt, fig, out, "layers_torch_2ranks.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for comm, style in (("horovod", "-o"), ("mpi", "--s")):
        for k in keys:
            xs = [r for r in res["conf"]["ranks"] if "shapes" in tl.get(f"{r}/{comm}", {})]
            ys = [med(tl[f"{r}/{comm}"], k, "ours") / med(tl[f"{r}/{comm}"], k, "local") for r in xs]
            ax.plot(xs, ys, style, label=f"C={json.loads(k)[1]} [{comm}]")
    ax.set_xlabel("ranks (4: oversubscribed)")
    ax.set_ylabel("ours / local BN")
    ax.set_xticks(res["conf"]["ranks"])
    ax.legend(fontsize=6, ncol=2)
    made.append(_save(plt, fig, out, "ratio_vs_ranks.png"))
    ab = res["alphabeta"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, transport in zip(axes, ("horovod", "mpi4py")):
        for network, marker in (("loopback", "o"), ("netns", "^")):
            p = fitted.get((transport, network))
            for w, job in ab.get(network, {}).items():
                if "rows" not in job:
                    continue
                xs = [r["bytes"] for r in job["rows"]]
                ys = [sweep_point(r, transport) for r in job["rows"]]
                line = ax.loglog(xs, ys, marker, label=f"{network} W={w}")[0]
                if p:
                    ax.loglog(xs, [scaling.cost(p, [("allreduce", x)], int(w), res["cores"] or 1) for x in xs], "-",
                              color=line.get_color(), lw=0.8)
        ax.set_title(f"{transport} allreduce: lower quartile measured, lines fitted", fontsize=9)
        ax.set_xlabel("bytes per rank")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("ms (lower quartile)")
    made.append(_save(plt, fig, out, "alphabeta.png"))
    if preds:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        transports = sorted({k[0] for k in preds})
        for ax, tk in zip(axes, transports):
            for (t, net, design), v in preds.items():
                if t == tk and net.startswith("ResNet-50"):
                    ax.loglog(PREDICT_RANKS, [v[w] for w in PREDICT_RANKS], "-o", label=design)
            ax.set_title(f"ResNet-50, {tk[0]} / {tk[1]} fit", fontsize=9)
            ax.set_xlabel("ranks W")
            ax.set_ylabel("predicted SyncBN comm ms / step")
            ax.legend(fontsize=6)
        made.append(_save(plt, fig, out, "scaling_model.png"))
    if groups:
        fig, ax = plt.subplots(figsize=(7, 4))
        for (transport, network, group), v in groups.items():
            ax.loglog(scaling.GROUP_RANKS, v, "-o" if group == 0 else "--s", markersize=3,
                      label=f"{transport} ({network} fit), {'all ranks' if group == 0 else f'BN groups of {group}'}")
        ax.set_title("A MODEL, not a measurement: SyncBN communication per ResNet-50 step\n(ours; α-β fitted at "
                     "1-4 ranks on one machine, a core per rank)", fontsize=9)
        ax.set_xlabel("ranks (GPUs) W")
        ax.set_ylabel("predicted ms / step")
        ax.legend(fontsize=7)
        made.append(_save(plt, fig, out, "scaling_groups.png"))
    return made


def group_model(fitted: dict) -> dict:
    """``{(transport, network, group): [predicted ms per ResNet-50 step at each of
    scaling.GROUP_RANKS]}`` for ours, all ranks (group 0) and BN groups of 8, with each
    transport's fit (between the namespace hosts where there is one)."""
    network = "netns" if any(n == "netns" for _, n in fitted) else "loopback"
    chans, ours = scaling.resnet50_bn_channels(), next(iter(scaling.DESIGNS))
    return {(t, n, g): [scaling.step_overhead(p, ours, chans, w, g) for w in scaling.GROUP_RANKS]
            for (t, n), p in fitted.items() if n == network for g in (0, 8)}


# --------------------------------------------------------------------- report


def write_report(res: dict, out: Path) -> Path:
    fitted = fits(res)
    torch_md, summary = torch_section(res)
    model_md, errs, preds, groups = model_section(res, fitted)
    made = plots(res, fitted, preds, groups, out)
    fails = errors(res["torch_layers"], "PyTorch job") + errors(res["e2e"], "end-to-end job") + errors(
        res.get("tf_layers", {}), "Keras job") + errors(res.get("tf_e2e", {}), "Keras training-step job") + errors(res["alphabeta"]["loopback"], "allreduce sweep") + errors(
        res["alphabeta"].get("netns", {}), "namespace-hosts sweep")
    lines = [f"# SyncBN benchmark report{' (QUICK smoke run: not for quoting)' if res['quick'] else ''}", "",
             f"`{res['argv']}` — started {res['started']}, {res['seconds'] / 60:.1f} min; commit {res['commit']}; "
             f"{res['cores']} CPU cores, 1 thread per rank; medians of interleaved runs (per-layer "
             f"{res['conf']['layer_iters']}, Keras {res['conf']['tf_iters']}, training steps "
             f"{res['conf']['e2e_iters']}). Every ratio divides two numbers measured in this run; a ratio "
             "between columns of different jobs (e.g. ours[mpi] vs the hand-written layer) crosses jobs. "
             "The machine may be shared: expect ±10–30% between runs. Every mpirun job runs with Open MPI's "
             "`mpi_yield_when_idle=1` (a waiting rank yields its core instead of spinning)"
             + (f" and with `GLIBC_TUNABLES={res['conf']['malloc']}`: glibc's malloc keeps freed memory, "
                "so activation-sized allocations do not fault their pages in again (`benchmarks/jobs.py`)"
                if res["conf"].get("malloc") else "") + ".", "", "## Summary: ratios", ""]
    for ranks, vals in summary.items():
        f = lambda i: " ".join(f"{v[i]:.2f}" for v in vals)  # noqa: E731
        aa = f"; A/A control, a second nn.BatchNorm2d / local [horovod] {f(3)}, [mpi] {f(4)}" if ranks == 1 else ""
        floors = (f"; ours/(local + floor_hvd) [horovod] {f(5)}, [mpi] {f(6)}; ours[mpi]/(local + floor_mpi) "
                  f"{f(7)}") if ranks > 1 else ""
        lines.append(f"- PyTorch per layer, {ranks} rank(s), shapes in order: ours/local [horovod] {f(0)}; "
                     f"ours/local [mpi] {f(1)}; ours/hand-written {f(2)}{floors}{aa}.")
    e = res["e2e"]
    for comm in ("horovod", "mpi"):
        for net, r in e.get(comm, {}).get("nets", {}).items():
            s, l_ = r["times"]["sync"]["median"], r["times"]["local"]["median"]
            lines.append(f"- Training step, {net}, 2 ranks [{comm}]: SyncBN / local BN = {s / l_:.2f}×.")
    for net, r in res.get("tf_e2e", {}).get("2 ranks", {}).get("nets", {}).items():
        t = {k: v["median"] for k, v in r["times"].items()}
        lines.append(f"- Keras training step, {net}, 2 ranks: ours / local Keras BN: host path "
                     f"{t['host'] / t['local']:.2f}×, device path {t['device'] / t['local']:.2f}×, inside XLA "
                     f"{t['xla'] / t['local']:.2f}× (against local BN inside XLA {t['xla'] / t['local_xla']:.2f}×).")
    t = res.get("tf_layers", {})
    one = t.get("ours 1 rank", {})
    if "shapes" in one:
        r = lambda a: " ".join(f"{med(one, k, a) / med(one, k, 'local'):.2f}" for k in one["shapes"])  # noqa: E731
        lines.append(f"- Keras per layer, 1 rank, shapes in order: ours/local {r('ours')}; A/A control, a second "
                     f"Keras BN / local {r('local_again')}.")
    for comm in ("horovod", "mpi"):
        job = t.get(f"ours[{comm}]", {})
        if "shapes" not in job:
            continue
        keys = list(job["shapes"])

        def vs(other_job: dict, impl: str, job=job, keys=keys) -> str:
            return " ".join(f"{med(job, k, 'ours') / med(other_job, k, impl):.2f}" for k in keys)

        lines.append(f"- Keras per layer, 2 ranks [{comm}], shapes in order: ours/local {vs(job, 'local')}; "
                     f"ours/hvd Keras 2 {vs(t.get('hvd_keras2', {}), 'hvd_keras2')}; "
                     f"ours/Keras 3 sync {vs(t.get('keras3_sync', {}), 'keras3_sync')}.")
    if "load_start" in res:
        la = lambda v: ", ".join(f"{x:.1f}" for x in v)  # noqa: E731
        lines.append(f"- Load average (1, 5, 15 min) at the start {la(res['load_start'])}, at the end "
                     f"{la(res['load_end'])}, on {res['cores']} cores: values near or above {res['cores']} mean "
                     "other work shared the cores, and collectives waited for descheduled ranks.")
    if errs:
        for transport in ("horovod", "mpi4py"):
            sel = [abs(x[0]) for x in errs if x[1] == transport]
            if sel:
                lines.append(f"- Scaling model vs measured per-layer floor, lower quartile ({transport}, 2 and 4 ranks): "
                             f"median |rel. error| {sorted(sel)[len(sel) // 2]:.0%}, worst {max(sel):.0%}.")
    if fails:
        lines += ["", "**Failed jobs:**", ""] + fails
    lines += ["", "## 1. Per-layer forward+backward, PyTorch", "",
              "ours = `hvd_syncbn.torch.SyncBatchNorm`; local = `nn.BatchNorm2d` on the rank's rows; floor = two "
              "raw allreduces of float64 2C+3 and 2C+2 values (Horovod: `floor_hvd`, mpi4py: `floor_mpi`); "
              "hand-written = `bench_torch.HandSyncBN` (autograd through `hvd.allreduce`, float32 E[x²]−E[x]²). "
              "[mpi] columns come from a second job with `HVD_SYNCBN_COMM=mpi`, with its own local baseline; "
              "ours[mpi] / (local + floor_hvd) takes floor_hvd from the Horovod job.", "",
              torch_md, "![per-layer](layers_torch_2ranks.png) ![ratio vs ranks](ratio_vs_ranks.png)", "",
              "## 2. Per-layer forward+backward, Keras (1 and 2 ranks)", "",
              "ours and local BN share a job (one at 1 rank, one per `HVD_SYNCBN_COMM` at 2 ranks); "
              "Horovod's Keras 2 layer and Keras 3's "
              "`synchronized=True` (MultiWorkerMirroredStrategy) run in jobs of their own.", "", tf_section(res), "",
              "## 3. Training step (forward, loss, backward, SGD step), 2 ranks", "", e2e_section(res), "",
              "Keras (`e2e_tf.py`, one job under mpirun, `train_on_batch` with `DistributedOptimizer(SGD)` in "
              "every variant): local = Keras BN on the rank's rows; host, device = ours with `stats=` that; "
              "XLA = ours with `jit_compile=True` (the device path, our XLA allreduce over MPI); local XLA = "
              "Keras BN with `jit_compile=True`.", "", tf_e2e_section(res), "",
              "## 4. Collectives and bytes per layer per step, counted", "",
              "Counted in separate jobs (Horovod's timeline on, `HOROVOD_TIMELINE=DYNAMIC`; MPI calls of the "
              "Python thread by the `mpi_count.c` shim" + ("" if res.get("counting_shim") else ", **not built**")
              + "), rank 0, bytes this rank contributes.", "", counts_section(res), "",
              "## 5. Scaling model", "", scaling.__doc__.split("\n\n", 1)[1].strip(), "",
              "Assumptions: collectives of one layer do not overlap each other or compute (true for ours, whose "
              "forward waits for its statistics; Horovod may fuse a layer's async collectives into one cycle, "
              "which the model does not credit to the all-gather designs); fitted α, β carry over to W ranks "
              "(a real cluster's network differs: the numbers show the shape — latency-bound, count of "
              "collectives × log2 W — rather than a forecast); a cluster gives each rank a core (no σ). "
              "ResNet-50 BN channels: "
              f"{scaling.resnet50_bn_channels()}; DeepLab-v3 adds 7 × 256.", "", model_md, "",
              "![alpha-beta fit](alphabeta.png) ![scaling model](scaling_model.png)", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "results/bench/results.json")
    print(write_report(json.loads(src.read_text()), src.parent))
