"""The demos' checkpoint writing (``examples/demo_common.atomic_write``): a full disk is
told as such, naming the file and the space needed, and the previous checkpoint stays."""

from __future__ import annotations

import errno
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import demo_common  # noqa: E402

Usage = namedtuple("Usage", "total used free")


def test_a_full_disk_names_the_file_and_the_space_and_keeps_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "segmentation_sync.pt"
    demo_common.atomic_write(ckpt, lambda tmp: Path(tmp).write_bytes(b"epoch 1"))

    def fill(tmp):
        Path(tmp).write_bytes(b"x" * 3000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(demo_common.DiskFullError) as caught:
        demo_common.atomic_write(ckpt, fill, size=5 * 2**20)
    text = str(caught.value)
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value.__cause__, OSError)
    assert f"cannot write {ckpt}: no space left on its disk (5.0 MiB needed, " in text, text
    assert "the previous segmentation_sync.pt is left as it was" in text, text
    assert ckpt.read_bytes() == b"epoch 1" and [p.name for p in tmp_path.iterdir()] == [ckpt.name]


def test_a_writer_whose_error_hides_the_cause_is_read_from_the_disk(tmp_path, monkeypatch):
    """torch.save on a full disk raises ``RuntimeError: basic_ios::clear`` (no errno):
    under 1 MiB free, that is a full disk too, the size needed at least what was written."""
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: Usage(2**30, 2**30 - 2000, 2000))

    def torn(tmp):
        Path(tmp).write_bytes(b"x" * 4096)
        raise RuntimeError("basic_ios::clear: iostream error")

    with pytest.raises(demo_common.DiskFullError, match=r"\(more than the 4.0 KiB written needed, 2.0 KiB free\); "
                                                        r"there is no earlier ck\.pt"):
        demo_common.atomic_write(tmp_path / "ck.pt", torn)
    assert list(tmp_path.iterdir()) == []


def test_other_errors_pass_through(tmp_path):
    def broken(tmp):
        raise ValueError("cannot pickle this")

    with pytest.raises(ValueError, match="cannot pickle this"):
        demo_common.atomic_write(tmp_path / "ck.pt", broken)
    assert list(tmp_path.iterdir()) == []
