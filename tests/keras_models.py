"""Small Keras models the Keras tests build, in one process and at any world size."""

from __future__ import annotations

import keras


def small_model(bn=keras.layers.BatchNormalization):
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(inputs)
    x = bn(name="stem_bn")(x)
    x = keras.layers.ReLU()(x)
    block = keras.Sequential([keras.layers.Conv2D(6, 3, padding="same", use_bias=False), bn(name="block_bn")],
                             name="block")
    x = block(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x), name="small")
