"""The Keras layer in one process: which kernels its graph runs, the converter, its
argument and input checks (the same bad input on every rank of a thread world at 1, 2
and 3 ranks), XLA refused, and a saved ``.keras`` file loading in a plain process. None
of it depends on the world size, so it runs once, here, instead of in every launch of
the rank-side suites."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import collective_timeout, results, run, tensorflow, world

tf = tensorflow()
import keras  # noqa: E402

from hvd_syncbn.tensorflow import (  # noqa: E402
    BroadcastGlobalVariablesCallback, DistributedOptimizer, MetricAverageCallback, SyncBatchNormalization,
    convert_sync_batchnorm, revert_sync_batchnorm,
)
from keras_models import small_model  # noqa: E402
from oracle import UNEQUAL, assert_close, global_batch  # noqa: E402

hvd = pytest.importorskip("horovod.tensorflow")


@pytest.mark.parametrize("tail, axis, fused", [((5, 5, 4), -1, True), ((4, 6), 1, True), ((3, 2, 3, 4), 1, True),
                                                ((6,), -1, True), ((3, 5, 4), [1, 3], False), ((3, 4, 5), 2, False)])
def test_common_layouts_run_the_fused_kernels(tail, axis, fused):
    """Channels right after the batch or last, any rank: forward and backward run
    ``FusedBatchNormV3``/``FusedBatchNormGradV3`` (the equivalence tests above check
    their results); other layouts, the composite ops."""
    layer = SyncBatchNormalization(axis=axis)
    layer.build((None, *tail))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return tape.gradient(y, [x] + layer.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec((None, *tail))).graph.as_graph_def()
    kinds = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    want = {"FusedBatchNormV3", "FusedBatchNormGradV3"}
    assert kinds & want == (want if fused else set()), sorted(kinds)


def test_converter_replaces_nested_bn_and_keeps_weights():
    keras.utils.set_random_seed(0)
    model = small_model()
    x = global_batch(9, 4, (8, 8, 3))
    model(x, training=True)  # move the moving statistics off their initial values
    converted = convert_sync_batchnorm(model)
    kinds = {l.name: type(l) for l in converted.layers}
    assert kinds["stem_bn"] is SyncBatchNormalization
    assert type(converted.get_layer("block").get_layer("block_bn")) is SyncBatchNormalization
    assert type(model.get_layer("stem_bn")) is keras.layers.BatchNormalization  # original untouched
    for a, b in zip(converted.weights, model.weights):
        assert a.name == b.name
        assert_close(a, b, f"weight {a.path}")
    assert_close(converted(x, training=False), model(x, training=False), "inference output")


def renorm_model(bn=keras.layers.BatchNormalization):
    inputs = keras.Input((6,))
    x = keras.layers.Dense(4, name="dense")(inputs)
    x = bn(renorm=True, renorm_clipping={"rmax": 2.0, "dmax": 1.0}, renorm_momentum=0.7, name="rn")(x)
    return keras.Model(inputs, x)


def test_converter_carries_renorm_config_and_weights():
    keras.utils.set_random_seed(0)
    model = renorm_model()
    for seed in (3, 4):  # move every statistic off its initial value
        model(global_batch(seed, 8, (6,), offset=seed), training=True)
    converted = convert_sync_batchnorm(model)
    layer = converted.get_layer("rn")
    assert type(layer) is SyncBatchNormalization
    assert (layer.renorm, layer.renorm_clipping, layer.renorm_momentum) == (True, {"rmax": 2.0, "dmax": 1.0}, 0.7)
    assert [w.name for w in converted.weights] == [w.name for w in model.weights]
    for a, b in zip(converted.weights, model.weights):
        assert_close(a, b, f"weight {a.path}")
    x = global_batch(5, 8, (6,), offset=1.0)  # the same rows on every rank: global = local statistics
    assert_close(converted(x, training=True), model(x, training=True), "renorm training output", rtol=1e-5)
    for a, b in zip(converted.weights, model.weights):
        assert_close(a, b, f"{a.path} after a renorm step", rtol=1e-5)


def test_converter_refuses_unknown_bn_subclasses_unless_mapped():
    class TwiceBN(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return 2 * super().call(inputs, training=training, mask=mask)

    class SyncTwiceBN(SyncBatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return 2 * super().call(inputs, training=training, mask=mask)

    with pytest.raises(ValueError, match=r"layer 'rn' is a .*TwiceBN, a subclass of BatchNormalization this "
                                         r"converter does not know.*classes="):
        convert_sync_batchnorm(renorm_model(TwiceBN))
    converted = convert_sync_batchnorm(renorm_model(TwiceBN), classes={TwiceBN: SyncTwiceBN})
    assert type(converted.get_layer("rn")) is SyncTwiceBN
    with pytest.raises(TypeError, match="expected classes to map BatchNormalization subclasses"):
        convert_sync_batchnorm(renorm_model(), classes={TwiceBN: keras.layers.BatchNormalization})


def test_converter_rejects_what_it_cannot_convert():
    with pytest.raises(ValueError, match="expected a Sequential or functional keras.Model, got Dense"):
        convert_sync_batchnorm(keras.layers.Dense(3))


@pytest.mark.parametrize(
    "x, match",
    [(np.ones((4, 3), np.int32), r"bn_bad: expected a floating-point input .* got int32; cast it first, "
                                 r"e\.g\. tf\.cast\(x, tf\.float32\)"),
     (np.ones((4, 3), np.complex64), r"bn_bad: expected a floating-point input .* got complex64"),
     (np.ones((4,), np.float32), r"bn_bad: expected an input with at least 2 dims")],
    ids=["int", "complex", "ndim"],
)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bad_input_names_layer(x, match, size):
    """The same bad input on every rank of a thread world (alone at 1: no collective;
    across ranks every rank's error goes through the poisoned collective)."""
    comms = world(size)
    layers = [SyncBatchNormalization(name="bn_bad", comm=c) for c in comms]

    def rank(r, comm):
        with pytest.raises(ValueError, match=match):
            layers[r](x, training=True)

    with collective_timeout(5.0):
        results(run(size, rank, comms))


@pytest.mark.parametrize("kwargs, match", [(dict(momentum=1.5), r"momentum in \[0, 1\]"),
                                           (dict(epsilon=0.0), "epsilon > 0"),
                                           (dict(renorm=True, renorm_clipping={"rmax": 1.0, "rmin": 2.0}),
                                            "rmax should"),
                                           (dict(comm="nccl"), "comm: expected one of auto, horovod, mpi"),
                                           (dict(comm="torch"), "SyncBatchNormalization: comm='torch' is not a "
                                                                "TensorFlow transport; with TensorFlow use 'auto', "
                                                                "'mpi', 'horovod'")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncBatchNormalization(**kwargs)


def test_torch_from_the_environment_is_refused_at_construction(monkeypatch):
    monkeypatch.setenv("HVD_SYNCBN_COMM", "torch")
    with pytest.raises(ValueError, match=r"\$HVD_SYNCBN_COMM='torch' is not a TensorFlow transport"):
        SyncBatchNormalization()


@pytest.mark.parametrize("synchronized", [False, True])
def test_config_says_it_synchronizes_and_round_trips(synchronized):
    """Keras's own ``synchronized`` argument is accepted, and the config tells the truth
    (this layer always synchronizes); Horovod's ``fused`` argument is accepted too."""
    layer = SyncBatchNormalization(axis=[1, 3], momentum=0.9, synchronized=synchronized, fused=True, check_finite=True,
                                   comm="mpi", name="bn_cfg")
    config = layer.get_config()
    assert config["synchronized"] is True and config["comm"] == "mpi" and config["check_finite"] is True
    again = SyncBatchNormalization.from_config(config)
    assert again.get_config() == config and type(again) is SyncBatchNormalization
    assert keras.layers.deserialize(keras.layers.serialize(layer)).get_config() == config


def test_host_path_under_xla_says_to_turn_it_off():
    """stats='host' with an explicit jit_compile=True: Keras's compile falls back with its
    own warning; a tf.function(jit_compile=True) of the user's own raises ours, naming the layer."""
    model = small_model(lambda name: SyncBatchNormalization(name=name, stats="host"))
    with pytest.warns(UserWarning, match="Model doesn't support `jit_compile=True`"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is False
    step = tf.function(lambda x: model(x, training=True), jit_compile=True)
    with pytest.raises(ValueError, match=r"SyncBatchNormalization 'stem_bn' cannot run inside XLA yet"):
        step(global_batch(42, 2, (8, 8, 3)))


def test_default_stats_run_inside_xla_where_the_xla_allreduce_is_built():
    """The default stats on this (CPU) machine, where launch/install.sh built the XLA
    allreduce: the layer supports XLA, Keras keeps jit_compile=True, and a compiled
    training step equals Keras BN (alone: the same statistics)."""
    from hvd_syncbn.tensorflow import xla

    assert xla.available() is None, xla.available()
    model = small_model(SyncBatchNormalization)
    plain = small_model()
    plain.set_weights(model.get_weights())
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is True
    x = tf.constant(global_batch(42, 4, (8, 8, 3)))
    got = tf.function(lambda t: model(t, training=True), jit_compile=True)(x)
    assert_close(got, plain(x, training=True), "compiled output, alone", rtol=1e-5, atol=1e-5)
    opted_out = SyncBatchNormalization()
    opted_out.supports_jit = False  # a user's choice stands
    assert not opted_out.supports_jit and not SyncBatchNormalization(stats="host").supports_jit


@pytest.fixture
def gpu_listed(monkeypatch):
    """``tf.config`` lists a GPU besides the CPUs, as on a GPU machine: all that Keras's
    ``jit_compile="auto"`` reads of the machine (``Trainer._resolve_auto_jit_compile``)."""
    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda device_type=None: real(device_type) + ([gpu] if device_type in (None, "GPU") else []))


@pytest.mark.parametrize("callback", [BroadcastGlobalVariablesCallback, MetricAverageCallback])
@pytest.mark.parametrize("wrap", ["ours", "loss-scaled"])
def test_default_compile_on_a_gpu_machine_trains_without_xla(gpu_listed, callback, wrap):
    """Keras picks XLA for a plain model where a GPU is listed (else this tests nothing);
    not with our layer in it (``supports_jit``); with plain BN and our optimizer, which
    Keras does not ask, our callbacks turn it off, with a warning, when ``fit`` hands
    them the model (``CallbackList``), before it builds the train step."""
    plain = small_model()
    plain.compile(optimizer="sgd", loss="mse")
    assert plain.jit_compile is True, "a listed GPU no longer turns XLA on: this test no longer tests it"
    keras.callbacks.CallbackList([callback()], model=plain)
    assert plain.jit_compile is True, "our callback turned XLA off for a model without our optimizer"
    sync = small_model(SyncBatchNormalization)
    sync.compile(optimizer="sgd", loss="mse")
    assert sync.jit_compile is False
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1))
    model = small_model()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(opt) if wrap == "loss-scaled" else opt, loss="mse")
    assert model.jit_compile is True  # compile() reads the layers only
    with pytest.warns(UserWarning, match="DistributedOptimizer: Horovod's allreduce has no XLA kernel, so this "
                                         r"model trains without XLA \(jit_compile=False\)"):
        keras.callbacks.CallbackList([callback()], model=model)
    assert model.jit_compile is False


def test_distributed_optimizer_saves_as_plain_class_and_rejects_bad_op():
    opt = DistributedOptimizer(keras.optimizers.Adam(1e-3))
    assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
    assert keras.optimizers.serialize(opt)["class_name"] == "Adam"
    with pytest.raises(ValueError, match="expected op hvd.Average or hvd.Sum"):
        DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum)


def test_keras_file_saved_here_loads_in_a_plain_process(rank_tmp):
    keras.utils.set_random_seed(0)
    model = small_model(SyncBatchNormalization)
    x_all = global_batch(11, sum(UNEQUAL), (8, 8, 3))
    model(x_all, training=True)  # moving statistics off their initial values
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.Adam()), loss="mse")  # saved with it
    path = rank_tmp / "model.keras"
    model.save(path)
    want = model.predict(x_all, verbose=0)
    code = (
        "import sys, numpy as np, keras, hvd_syncbn.tensorflow\n"
        "m = keras.models.load_model(sys.argv[1])\n"
        "assert type(m.optimizer) is keras.optimizers.Adam, type(m.optimizer)\n"
        "np.save(sys.argv[2], m.predict(np.load(sys.argv[3]), verbose=0))\n"
    )
    np.save(path.with_suffix(".x.npy"), x_all)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    out = subprocess.run([sys.executable, "-c", code, str(path), str(path.with_suffix(".y.npy")),
                          str(path.with_suffix(".x.npy"))], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_close(np.load(path.with_suffix(".y.npy")), want, "predictions after load in a plain process")


def layers(model) -> dict:
    """Every layer of ``model`` (nested ones too) by name: its class and config (the inputs
    aside, whose generated names cloning changes)."""
    return {layer.name: (type(layer), layer.get_config()) for layer in model._flatten_layers(include_self=False)
            if not isinstance(layer, keras.layers.InputLayer)}


def test_revert_undoes_the_converter_exactly():
    """A converted model (nested, and renorm's statistics) reverted: every layer is Keras's
    own BN with the original's config and weights; converted again, the converted model's."""
    keras.utils.set_random_seed(0)
    for model in (small_model(), renorm_model()):
        x = global_batch(9, 4, model.input_shape[1:])
        model(x, training=True)  # moving statistics off their initial values
        converted = convert_sync_batchnorm(model)
        plain = revert_sync_batchnorm(converted)
        assert layers(plain) == layers(model)
        assert [w.path for w in plain.weights] == [w.path for w in model.weights]
        assert all(np.array_equal(a, b) for a, b in zip(plain.get_weights(), model.get_weights()))
        assert layers(convert_sync_batchnorm(plain)) == layers(converted)
        assert_close(plain(x, training=False), converted(x, training=False), "inference output")


def test_reverted_model_saves_files_that_load_without_hvd_syncbn(rank_tmp):
    """``.keras`` and ``.weights.h5`` of a reverted model, in a process where hvd_syncbn
    cannot be imported: the model loads, and the weights load into the plain model built
    by hand; both predict as before."""
    keras.utils.set_random_seed(0)
    x = global_batch(11, 6, (8, 8, 3))
    converted = small_model(SyncBatchNormalization)
    converted(x, training=True)
    plain = revert_sync_batchnorm(converted)
    plain.save(rank_tmp / "m.keras")
    plain.save_weights(rank_tmp / "m.weights.h5")
    np.save(rank_tmp / "x.npy", x)
    code = (
        "import sys; sys.modules['hvd_syncbn'] = None\n"
        "import numpy as np, keras\nsys.path.insert(0, sys.argv[2])\nfrom keras_models import small_model\n"
        "d = sys.argv[1]; x = np.load(d + '/x.npy')\n"
        "m = keras.models.load_model(d + '/m.keras')\n"
        "h = small_model(); h(x[:1]); h.load_weights(d + '/m.weights.h5')\n"
        "np.save(d + '/y.npy', np.stack([m.predict(x, verbose=0), h.predict(x, verbose=0)]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    out = subprocess.run([sys.executable, "-c", code, str(rank_tmp), os.path.dirname(os.path.dirname(__file__))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    want = converted.predict(x, verbose=0)
    for got in np.load(rank_tmp / "y.npy"):
        assert_close(got, want, "predictions of the reverted model loaded without hvd_syncbn")


def test_revert_refuses_what_it_cannot_revert():
    class SyncTwiceBN(SyncBatchNormalization):
        pass

    with pytest.raises(ValueError, match="revert_sync_batchnorm: expected a Sequential or functional keras.Model, "
                                         "got Dense"):
        revert_sync_batchnorm(keras.layers.Dense(3))
    with pytest.raises(ValueError, match=r"layer 'rn' is a .*SyncTwiceBN, a subclass of SyncBatchNormalization this "
                                         r"function does not know.*classes="):
        revert_sync_batchnorm(renorm_model(SyncTwiceBN))
    reverted = revert_sync_batchnorm(renorm_model(SyncTwiceBN), classes={SyncTwiceBN: keras.layers.BatchNormalization})
    assert type(reverted.get_layer("rn")) is keras.layers.BatchNormalization
    with pytest.raises(TypeError, match="expected classes to map SyncBatchNormalization subclasses"):
        revert_sync_batchnorm(renorm_model(), classes={SyncTwiceBN: SyncBatchNormalization})
