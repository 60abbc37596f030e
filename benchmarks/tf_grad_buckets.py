"""hora.tensorflow gradient buckets on vs off: a 2-rank DistributedGradientTape step on a many-tensor MLP.

Each rank builds the same MLP twice (``--layers`` Dense layers of ``--width``, so 2 x layers gradient
tensors) and compiles one ``tf.function`` training step per model: one traced with buckets
(``HORA_GRADIENT_BUCKET_BYTES``, default 4 MiB: one engine request per bucket), one with
``HORA_GRADIENT_BUCKET_BYTES=0`` (one request per tensor, Horovod's way). The two steps then take
turns, ``--steps`` timed steps each per round, in the same job, so both see the same machine.

    python benchmarks/tf_grad_buckets.py [--layers 100] [--width 64] [--batch 32] [--steps 50] [--rounds 5]

Prints each round's samples/s (over both ranks) and the medians; one compute thread per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
       "OMP_NUM_THREADS": "1"}


def worker(layers: int, width: int, batch: int, steps: int, rounds: int, warmup: int) -> dict:
    """Both steps on this rank; returns rank 0's seconds per round for each mode."""
    import keras
    import numpy as np
    import tensorflow as tf

    import hora.tensorflow as hvd

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.normal(size=(batch, width)).astype(np.float32))
    y = tf.constant(rng.normal(size=(batch, width)).astype(np.float32))

    def make_step(cap: int):
        os.environ["HORA_GRADIENT_BUCKET_BYTES"] = str(cap)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((width,))] +
                                 [keras.layers.Dense(width, activation="tanh") for _ in range(layers)])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for _ in range(warmup):  # traces (the bucket plan is fixed then) and warms up
            step()
        del os.environ["HORA_GRADIENT_BUCKET_BYTES"]
        return step, len(model.trainable_variables)

    steps_by_mode = {"buckets": make_step(4 * 1024 * 1024)[0], "per_tensor": make_step(0)[0]}
    tensors = 2 * layers
    seconds: dict[str, list[float]] = {mode: [] for mode in steps_by_mode}
    for _ in range(rounds):
        for mode, step in steps_by_mode.items():
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                loss = step()
            loss.numpy()
            seconds[mode].append(time.perf_counter() - start)
    hvd.shutdown()
    return {"seconds": seconds, "tensors": tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100, help="Dense layers (2 tensors each; default 100)")
    parser.add_argument("--width", type=int, default=64, help="units per layer (default 64)")
    parser.add_argument("--batch", type=int, default=32, help="batch per rank (default 32)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per mode per round (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the modes taking turns (default 5)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per mode first (default 5)")
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    args = parser.parse_args()

    import hora

    results = hora.run(worker, args=(args.layers, args.width, args.batch, args.steps, args.rounds, args.warmup),
                       np=args.np, env=ENV)
    seconds, tensors = results[0]["seconds"], results[0]["tensors"]
    samples = args.batch * args.np * args.steps
    print(f"{args.np} ranks, MLP of {args.layers} x Dense({args.width}) = {tensors} gradient tensors, "
          f"batch {args.batch} per rank, {args.steps} steps per round")
    for i in range(args.rounds):
        print(f"round {i}: " + "  ".join(
            f"{mode} {samples / s[i]:8.0f} samples/s ({1e3 * s[i] / args.steps:6.2f} ms/step)"
            for mode, s in seconds.items()))
    medians = {mode: statistics.median(s) for mode, s in seconds.items()}
    for mode, s in medians.items():
        print(f"median {mode:10s} {samples / s:8.0f} samples/s  {1e3 * s / args.steps:6.2f} ms/step")
    print(f"buckets / per_tensor speed: {medians['per_tensor'] / medians['buckets']:.2f}x")


if __name__ == "__main__":
    main()
