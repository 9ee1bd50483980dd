"""Runs the small-batch experiment, examples/why_syncbn.py, at 2 ranks on tiny data under
mpirun: SyncBN at 2 ranks x b images trains like one process on the 2*b images, local BN
does not, and the tables and the plot are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launching import clean_env, launch_command

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "why_syncbn.py"
TINY = ["--seeds", "1", "--epochs", "1", "--train-size", "16", "--val-size", "8", "--image-size", "16",
        "--width", "4"]

pytestmark = pytest.mark.ranks


def test_tiny_experiment(tmp_path):
    out = tmp_path / "why"
    cmd = [*launch_command("mpirun", 2), sys.executable, str(SCRIPT), *TINY, "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"

    runs = {(r["bn"], r["b"]): r for r in json.loads(out.with_suffix(".json").read_text())["runs"]}
    assert sorted(runs) == [(bn, b) for bn in ("alone", "local", "sync") for b in (1, 2)]
    for b in (1, 2):
        steps = 16 // (2 * b)
        sync, alone, local = (np.array(runs[(bn, b)]["losses"]) for bn in ("sync", "alone", "local"))
        assert len(sync) == len(alone) == len(local) == steps
        # The same mathematics up to float summation order; Adam amplifies it step by step.
        np.testing.assert_allclose(sync[:3], alone[:3], rtol=1e-5, atol=0,
                                   err_msg=f"SyncBN 2 x {b} vs one process at {2 * b} images")
        # Local BN normalises with each rank's b images: another loss from the first step.
        assert abs(local[0] - sync[0]) > 1e-5, (b, local[0], sync[0])
        assert set(runs[("local", b)]["averaged"]) == {"miou", "gap"}
        assert len(runs[("sync", b)]["gap"]) == 8 and all(g >= 0 for g in runs[("sync", b)]["gap"].values())

    table = out.with_suffix(".md").read_text()
    for row in ("| local BN, 2 ranks x 1 | 1 image |", "| SyncBN, 2 ranks x 2 | 4 images |",
                "| one process, 4 images | 4 images |", "| setting | enc1.0 | enc1.1 |"):
        assert row in table, table
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(png) < 200_000, len(png)
