"""Runs README command 1's demos, examples/torch_segmentation.py and its Keras twin
examples/keras_segmentation.py, at 2 ranks on tiny data: training, --resume, --compare
with its plot, and --resume without a checkpoint.

Each test launches ``horovodrun --gloo -np 2`` and reads rank 0's output.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launching import clean_env

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEMO = ROOT / "examples" / "torch_segmentation.py"
KERAS_DEMO = ROOT / "examples" / "keras_segmentation.py"
TIMEOUT_S = 300

pytestmark = [pytest.mark.ranks, pytest.mark.slow]  # each test trains a demo at 2 ranks, some twice
TINY = ["--train-size", "16", "--val-size", "8", "--image-size", "16", "--width", "4"]
SAME = "BN running statistics identical on all 2 ranks: yes"
KERAS_SAME = "BN moving statistics identical on all 2 ranks: yes"


def run_demo(*args, ok: bool = True, demo: Path = DEMO) -> str:
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2",
           sys.executable, str(demo), *TINY, *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    log = out.stdout + out.stderr
    assert (out.returncode == 0) == ok, f"{' '.join(cmd)} exited {out.returncode}:\n{log[-6000:]}"
    return log


def epochs(log: str, bn: str) -> dict:
    """``{epoch: (train loss, val mIoU)}`` as printed, strings, for ``--bn bn``."""
    found = re.findall(rf"{bn} BN epoch (\d+)/\d+: train loss (\S+)\s+val mIoU (\S+)", log)
    return {int(e): (loss, miou) for e, loss, miou in found}


def check_compare(log: str, plot: Path, same: str) -> None:
    """A 2-epoch ``--compare`` run printed both runs' epochs, ``same`` (BN statistics agree)
    once per sync epoch, the final mIoU line, and wrote its plot."""
    assert "global batch = 2 ranks x 2 images; BN statistics over 4 images (sync) / 2 images (local)" in log
    assert sorted(epochs(log, "sync")) == [1, 2] and sorted(epochs(log, "local")) == [1, 2], log[-3000:]
    assert log.count(same) == 2, log[-3000:]  # the sync run's two epochs
    assert "final val mIoU: sync BN" in log
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One uninterrupted 2-epoch ``--compare`` run: its log and plot path."""
    tmp = tmp_path_factory.mktemp("compare")
    plot = tmp / "compare.png"
    return run_demo("--epochs", 2, "--compare", "--checkpoint-dir", tmp / "ckpt", "--plot", plot), plot


def test_compare_writes_plot(compared):
    check_compare(*compared, SAME)


def test_train_then_resume_matches_uninterrupted(tmp_path, compared):
    ckpt = tmp_path / "ckpt"
    first = run_demo("--epochs", 1, "--checkpoint-dir", ckpt)
    assert sorted(epochs(first, "sync")) == [1] and first.count(SAME) == 1, first[-3000:]
    assert torch.load(ckpt / "segmentation_sync.pt")["epoch"] == 1

    second = run_demo("--epochs", 2, "--resume", "--checkpoint-dir", ckpt)
    assert "resumed from epoch 1" in second, second[-3000:]
    assert sorted(epochs(second, "sync")) == [2] and second.count(SAME) == 1, second[-3000:]
    # Same data order, weights, Adam state: epoch 2 prints what the uninterrupted run printed.
    assert epochs(second, "sync")[2] == epochs(compared[0], "sync")[2]

    state = torch.load(ckpt / "segmentation_sync.pt")
    assert state["epoch"] == 2 and len(state["history"]["miou"]) == 2
    spec = importlib.util.spec_from_file_location("torch_segmentation", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.SegNet(4).load_state_dict(state["model"])  # the plain nn.BatchNorm2d model loads it


def readme_demo_output() -> list:
    """The lines of the documented demo output (docs/demo.md): its first code block that is
    not a command."""
    text = (ROOT / "docs" / "demo.md").read_text()
    blocks = re.findall(r"^```\n(.*?)^```$", text, re.S | re.M)
    return blocks[0].splitlines()


def test_readme_demo_output_is_what_the_command_prints(tmp_path):
    """README command 1, into a file as CI runs it, prints after the set-up's
    ``[install]`` lines exactly the demo output in docs/demo.md, numbers aside (this run is tiny):
    rank 0's tagged lines, the transport line in its place, no framework start-up lines,
    no progress bar."""
    cmd = ["bash", str(ROOT / "launch" / "demo.sh"), *TINY, "--checkpoint-dir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout[-6000:]
    printed = [line for line in out.stdout.splitlines() if not line.startswith("[install] ")]

    def shape(lines: list) -> list:
        return [re.sub(r"\d+(\.\d+)?", "#", line) for line in lines]

    assert shape(printed) == shape(readme_demo_output()), "\n".join(printed)


def test_resume_without_checkpoint_fails(tmp_path):
    log = run_demo("--resume", "--checkpoint-dir", tmp_path / "empty", ok=False)
    assert "--resume: no checkpoint at" in log, log[-3000:]


# ------------------------------------------------------------------ the Keras demo


@pytest.fixture(scope="module")
def keras_compared(tmp_path_factory):
    """One uninterrupted 2-epoch Keras ``--compare`` run: its log and plot path."""
    tmp = tmp_path_factory.mktemp("keras_compare")
    plot = tmp / "compare.png"
    return run_demo("--epochs", 2, "--compare", "--checkpoint-dir", tmp / "ckpt", "--plot", plot,
                    demo=KERAS_DEMO), plot


def test_keras_compare_writes_plot(keras_compared):
    check_compare(*keras_compared, KERAS_SAME)


def test_keras_train_then_resume_matches_uninterrupted(tmp_path, keras_compared):
    ckpt = tmp_path / "ckpt"
    meta = ckpt / "keras_segmentation_sync.json"
    first = run_demo("--epochs", 1, "--checkpoint-dir", ckpt, demo=KERAS_DEMO)
    assert sorted(epochs(first, "sync")) == [1] and first.count(KERAS_SAME) == 1, first[-3000:]
    assert json.loads(meta.read_text())["epoch"] == 1

    second = run_demo("--epochs", 2, "--resume", "--checkpoint-dir", ckpt, demo=KERAS_DEMO)
    assert "resumed from epoch 1" in second, second[-3000:]
    assert sorted(epochs(second, "sync")) == [2] and second.count(KERAS_SAME) == 1, second[-3000:]
    # Same data order, weights, Adam state: epoch 2 prints what the uninterrupted run printed.
    assert epochs(second, "sync")[2] == epochs(keras_compared[0], "sync")[2]

    state = json.loads(meta.read_text())
    assert state["epoch"] == 2 and len(state["history"]["miou"]) == 2
    assert sorted(p.name for p in ckpt.glob("*.keras")) == [state["model"]]  # epoch 1's model removed
    # The .keras file loads in a plain process, without Horovod, with its optimizer state.
    check = ("import sys, keras, hvd_syncbn.tensorflow; m = keras.models.load_model(sys.argv[1]); "
             "print(type(m.optimizer).__name__, int(m.optimizer.iterations), "
             "m.predict(keras.ops.zeros((1, 16, 16, 3)), verbose=0).shape)")
    out = subprocess.run([sys.executable, "-c", check, str(ckpt / state["model"])], env=clean_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "Adam 8 (1, 16, 16, 4)", out.stdout  # 2 epochs x 4 steps


def test_keras_resume_without_checkpoint_fails(tmp_path):
    log = run_demo("--resume", "--checkpoint-dir", tmp_path / "empty", ok=False, demo=KERAS_DEMO)
    assert "--resume: no checkpoint at" in log, log[-3000:]
