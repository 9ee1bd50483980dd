"""The package as a user gets it: an adapter imported without its framework names the
extra to install, and (slow) the sdist and wheel built from this checkout install into a
fresh virtual environment whose metadata is complete and whose ``hvd_syncbn.torch``, not
the source tree's, runs a synchronized step at 2 ranks equal to one process."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from launching import clean_env, launch_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("adapter, framework", [("torch", "torch"), ("tensorflow", "tensorflow"),
                                                ("lightning", "lightning")])
def test_adapter_without_its_framework_names_the_extra(adapter, framework):
    # None in sys.modules makes `import torch` fail as it does where torch is not installed.
    code = f"import sys; sys.modules[{framework!r}] = None; import hvd_syncbn.{adapter}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "ImportError" in out.stderr, out.stderr[-3000:]
    assert f"pip install 'hvd_syncbn[{adapter}]'" in out.stderr, out.stderr[-3000:]


STEP = """
import sys
import numpy as np
import torch
from mpi4py import MPI
import hvd_syncbn
from hvd_syncbn.torch import convert_sync_batchnorm

venv = sys.argv[1]
assert hvd_syncbn.__file__.startswith(venv), f"hvd_syncbn from {hvd_syncbn.__file__}, expected under {venv}"
rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
torch.manual_seed(0)
x = torch.randn(7, 3, 4, 5, dtype=torch.float64) * 2 + 5      # the global batch, on every rank
w = torch.randn(7, 3, 4, 5, dtype=torch.float64)               # d loss / d output
rows = np.array_split(np.arange(7), size)[rank]                # unequal shards: 4 and 3 rows

ref = torch.nn.BatchNorm2d(3, momentum=0.3).double()          # one process, the whole batch
xr = x.clone().requires_grad_()
yr = ref(xr)
(yr * w).sum().backward()

ours = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=0.3).double()))
bn = ours[0]
assert type(bn).__module__.startswith("hvd_syncbn.torch"), type(bn)
xo = x[rows].clone().requires_grad_()
yo = ours(xo)
(yo * w[rows]).sum().backward()
# Each rank's parameter gradient is its shard's share; their sum is one process's.
summed = MPI.COMM_WORLD.allreduce(torch.stack([bn.weight.grad, bn.bias.grad]).numpy())
checks = {
    "output": (yo, yr[rows]), "input gradient": (xo.grad, xr.grad[rows]),
    "weight and bias gradients, summed over ranks": (torch.from_numpy(summed), torch.stack([ref.weight.grad, ref.bias.grad])),
    "running_mean": (bn.running_mean, ref.running_mean), "running_var": (bn.running_var, ref.running_var),
}
for name, (got, want) in checks.items():
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"rank {rank}, {name}: {m}")
print(f"rank {rank}: step equals one process on the concatenated batch, hvd_syncbn {hvd_syncbn.__version__}")
"""


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_syncs_two_ranks(tmp_path):
    # Build: the sdist from a copy of this checkout (setuptools writes an egg-info into the
    # tree it builds, and reads an old one's file list back), then the wheel from the sdist,
    # as a user's pip would. --no-isolation: the project's setuptools, no download.
    src, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             "checkpoints", "results"))
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "-o", str(dist), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, (built.stdout + built.stderr)[-6000:]
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")

    with tarfile.open(sdist) as tar:
        sdist_files = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "hvd_syncbn/py.typed"} <= sdist_files
    # No tests, or all of them: the sdist carries none (they need the whole repository).
    assert not [n for n in sdist_files if n.startswith("tests/")], sorted(sdist_files)
    with zipfile.ZipFile(wheel) as whl:
        wheel_files = set(whl.namelist())
    assert "hvd_syncbn/py.typed" in wheel_files and "hvd_syncbn/torch/__init__.py" in wheel_files
    assert "hvd_syncbn/tensorflow/xla_allreduce.cc" in wheel_files  # xla_build compiles it where installed
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_files), sorted(wheel_files)

    # A fresh venv beside the project's, the wheel installed with pip (from the project's
    # environment, --python). First with numpy only, the core's one dependency (linked from
    # the project's environment): the core imports, and each adapter names its extra.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    project_site = Path(sysconfig.get_paths()["purelib"])
    numpy_only = tmp_path / "numpy_only"
    numpy_only.mkdir()
    for name in ("numpy", "numpy.libs"):
        if (project_site / name).exists():
            (numpy_only / name).symlink_to(project_site / name)
    (site / "deps.pth").write_text(f"{numpy_only}\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, (pip.stdout + pip.stderr)[-6000:]
    core = subprocess.run([py, "-c", "import hvd_syncbn, hvd_syncbn.backend, hvd_syncbn.comm; print(hvd_syncbn.__file__)"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert core.returncode == 0 and core.stdout.startswith(str(venv)), core.stdout + core.stderr[-3000:]
    for adapter in ("torch", "tensorflow", "lightning"):
        bare = subprocess.run([py, "-c", f"import hvd_syncbn.{adapter}"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
        assert bare.returncode != 0 and f"pip install 'hvd_syncbn[{adapter}]'" in bare.stderr, bare.stderr[-3000:]

    # Then with the project's packages (torch, mpi4py) seen through a .pth line, after the
    # venv's own site-packages: no download, no CUDA torch, and hvd_syncbn still the
    # installed one, never the source tree's.
    (site / "deps.pth").write_text(f"{project_site}\n")

    meta = subprocess.run([py, "-c", textwrap.dedent("""
        import importlib.metadata as m, json, hvd_syncbn
        md = m.metadata("hvd_syncbn")
        print(json.dumps({"file": hvd_syncbn.__file__, "version": hvd_syncbn.__version__,
                          **{k: md.get_all(k) for k in ["Version", "License-Expression", "Author", "Classifier",
                                                         "Project-URL", "Provides-Extra", "Requires-Dist",
                                                         "Requires-Python"]},
                          "description": md.get_payload()}))
        """)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert meta.returncode == 0, meta.stderr[-3000:]
    md = json.loads(meta.stdout)
    assert md["file"].startswith(str(venv)), md["file"]
    assert md["Version"] == [md["version"]], (md["Version"], md["version"])
    assert md["License-Expression"] == ["Apache-2.0"] and md["Author"] and md["Requires-Python"]
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in md["Classifier"]), md["Classifier"]
    assert {u.split(",")[0] for u in md["Project-URL"]} >= {"Homepage", "Documentation", "Repository", "Issues"}
    assert set(md["Provides-Extra"]) >= {"torch", "tensorflow", "horovod", "lightning", "test"}
    torch_req = [r for r in md["Requires-Dist"] if r.startswith("torch") and 'extra == "torch"' in r]
    assert torch_req and "<2.14" in torch_req[0], md["Requires-Dist"]
    assert [r for r in md["Requires-Dist"] if r.startswith("mpi4py") and 'extra == "torch"' in r]
    assert not [r for r in md["Requires-Dist"] if r.startswith("horovod") and 'extra == "horovod"' not in r]
    # PyPI shows the README: every link and image absolute (or an anchor on the page).
    targets = re.findall(r"\]\(([^)\s]+)", md["description"])
    assert targets and not [t for t in targets if not t.startswith(("https://", "http://", "#"))], targets

    script = tmp_path / "step.py"
    script.write_text(STEP)
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    out = subprocess.run([*launch_command("mpirun", 2), str(py), str(script), str(venv)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert log.count("step equals one process on the concatenated batch") == 2, log[-6000:]
