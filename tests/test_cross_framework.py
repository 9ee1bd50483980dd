"""The PyTorch and TensorFlow adapters give the same global statistics on the same data."""

import subprocess
import sys

import numpy as np
import pytest

from oracle import UNEQUAL, assert_close, global_batch, shard_sizes
from launching import BIN, ROOT, TIMEOUT_S, clean_env

pytestmark = pytest.mark.ranks


@pytest.mark.parametrize("np_", [2])
def test_torch_and_tf_agree_on_global_mean_and_variance(tmp_path, np_):
    stats = {}
    for framework in ("torch", "tf"):
        out = tmp_path / f"{framework}.npy"
        cmd = [str(BIN / "horovodrun"), "--gloo", "-np", str(np_), "-H", f"localhost:{np_}",
               sys.executable, str(ROOT / "tests" / "cross_stats.py"), framework, str(out)]
        run = subprocess.run(cmd, cwd=ROOT / "tests", env=clean_env(), capture_output=True, text=True,
                             timeout=TIMEOUT_S)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        stats[framework] = np.load(out)
    x = global_batch(5, sum(shard_sizes(UNEQUAL, np_)), (6, 4, 4), offset=3.0, scale=2.0).astype(np.float64)
    want = np.stack([x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))])
    assert_close(stats["torch"], stats["tf"], "torch vs tf", rtol=1e-6, atol=0.0)
    for framework, got in stats.items():
        assert_close(got, want, f"{framework} vs float64", rtol=0.0, atol=1e-6 * np.abs(want).max())
