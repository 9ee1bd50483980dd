"""Keras's own BatchNormalization tests, run with SyncBatchNormalization swapped in.

The test file is the one installed with keras (``keras/src/layers/normalization/
batch_normalization_test.py``), imported as it is; its ``layers.BatchNormalization``
is pointed at our layer. ``test_launch.py`` runs it at 2 ranks, under horovodrun on the
host path and under mpirun on the device path (``HVD_SYNCBN_STATS``), so the two launches
cover both. Every rank seeds the same data before each test, so the global batch is the
local one repeated: the global statistics equal the local ones, and Keras's expected
values hold unchanged.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
from keras.src import layers  # noqa: E402
from keras.src.layers.normalization import batch_normalization_test as keras_tests  # noqa: E402

from hvd_syncbn import launchers  # noqa: E402
from hvd_syncbn.tensorflow import SyncBatchNormalization  # noqa: E402

hvd = pytest.importorskip("horovod.tensorflow")
hvd.init()


class _Layers:
    """``keras.src.layers`` with ``BatchNormalization`` replaced by our layer."""

    def __getattr__(self, name):
        return SyncBatchNormalization if name == "BatchNormalization" else getattr(layers, name)


keras_tests.layers = _Layers()


STATS = "host" if (launchers.launcher() or "").startswith("horovodrun") else "device"


@pytest.fixture(autouse=True)
def same_data_on_every_rank(monkeypatch):
    keras.utils.set_random_seed(1234)
    monkeypatch.setenv("HVD_SYNCBN_STATS", STATS)


class TestKerasBatchNormalizationWithSyncBN(keras_tests.BatchNormalizationTest):
    """Every test of Keras's ``BatchNormalizationTest``, on SyncBatchNormalization."""

    def test_the_swap_is_in_place(self):
        assert keras_tests.layers.BatchNormalization is SyncBatchNormalization
        assert keras_tests.layers.BatchNormalization(axis=-1).stats == STATS
