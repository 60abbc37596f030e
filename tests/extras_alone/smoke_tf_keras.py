"""The tf-keras extra alone: Keras 2 (tf_keras, under TF_USE_LEGACY_KERAS=1) trained by
``model.fit`` with hora.keras's DistributedOptimizer for one epoch of one batch on 2 ranks.

Both ranks start from the same weights [0.5, -0.25, 1.0] and fit different rows ((rank + 1) * [1, 1, 1],
target 0, mean squared error): their gradients are 2.5 and 10.0 per weight, so one SGD step of 0.1
lands on [-0.125, -0.875, 0.375] only when the optimizer averaged them (unreduced, rank 0 would
reach [0.25, -0.5, 0.75]). The test also checks that the model and optimizer are tf_keras's, i.e.
that Keras 2 really was in use.
"""

from __future__ import annotations

import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import tf_keras as keras
from smoke_report import report  # this folder: on the path of a script run from it

import hora.keras as hvd


def main() -> None:
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank = hvd.rank()
    model = keras.Sequential([
        keras.Input(shape=(3,)),
        keras.layers.Dense(1, use_bias=False,
                           kernel_initializer=keras.initializers.Constant([[0.5], [-0.25], [1.0]])),
    ])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1))
    model.compile(optimizer=optimizer, loss="mse")
    x = np.full((4, 3), float(rank + 1), np.float32)
    y = np.zeros((4, 1), np.float32)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    report({
        "rank": rank, "size": hvd.size(), "weights": model.get_weights()[0].flatten().tolist(),
        "loss": history.history["loss"], "model_module": type(model).__module__,
        "optimizer_is_tf_keras": isinstance(optimizer, keras.optimizers.Optimizer),
        "keras": keras.__version__,
    })
    hvd.shutdown()


if __name__ == "__main__":
    main()
