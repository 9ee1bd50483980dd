"""The documentation: the mkdocs site builds with --strict (no broken link, anchor or
unparsable docstring), every public name has a docstring and a place in the API
reference, and the README is a front door whose links work on PyPI and whose named files
exist."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# Public methods still without a docstring: hvd_syncbn/comm.py is being rewritten. Add the
# docstring there and remove the name here (the test fails once one has its docstring).
KNOWN_MISSING = {"hvd_syncbn.comm.Communicator.done"}


def need(module: str):
    """``module``, or a failure saying how to install it (not a skip: CI must build the docs)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{e}: bash launch/test.sh installs the docs tools (mkdocs, mkdocstrings, griffe)")


def test_mkdocs_build_strict(tmp_path):
    need("mkdocs")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "WARNING" not in log, log[-6000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in public_names():
        assert f'id="{name}"' in api, f"{name} is public but not in the API reference (docs/api.md)"


def public_names() -> list:
    """The documented API: each public module's ``__all__``, and the Communicator users subclass."""
    griffe = need("griffe")
    package = griffe.load("hvd_syncbn", search_paths=[str(ROOT)])
    names = [f"{mod.path}.{n}" for mod in (package, package["torch"], package["tensorflow"], package["lightning"]) for n in mod.exports]
    return names + ["hvd_syncbn.comm.Communicator"]


def test_public_names_have_docstrings():
    griffe = need("griffe")
    package = griffe.load("hvd_syncbn", search_paths=[str(ROOT)])
    missing = []
    for name in public_names():
        obj = package[name.removeprefix("hvd_syncbn.")]
        obj = obj.final_target if obj.is_alias else obj
        if not obj.docstring:
            missing.append(name)
    # The Communicator is an interface users implement: every public method says what it must do.
    communicator = package["comm.Communicator"]
    missing += [f"hvd_syncbn.comm.Communicator.{k}" for k, v in communicator.members.items()
                if v.is_function and not k.startswith("_") and not v.docstring]
    assert set(missing) == KNOWN_MISSING, f"without a docstring: {sorted(set(missing) - KNOWN_MISSING)}; " \
                                          f"documented now, remove from KNOWN_MISSING: {sorted(KNOWN_MISSING - set(missing))}"


def test_readme_is_a_front_door():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines, expected at most 200: move detail to docs/"
    headings = [line for line in lines if line.startswith("## ")]
    for want in ("## Install", "## Running the tests"):
        assert want in headings, headings
    assert "pip install 'hvd_syncbn[torch]'" in text
    for command in ("bash launch/demo.sh", "bash launch/test.sh"):
        assert re.search(rf"^{re.escape(command)}\b", text, re.M), f"README lost the command {command!r}"
    # PyPI renders README.md as the project page: links and images must be absolute.
    targets = re.findall(r"\]\(([^)\s]+)", text)
    relative = [t for t in targets if not t.startswith(("https://", "http://", "#"))]
    assert targets and not relative, f"relative links break on PyPI: {relative}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_page_names_only_files_that_exist(page):
    named = set(re.findall(r"`((?:launch|examples|tests|benchmarks|docs)/[\w./-]+\.(?:sh|py|yaml|sbatch|md|c))`",
                           page.read_text()))
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"{page.name} names missing files: {missing}"
