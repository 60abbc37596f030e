"""Synthetic training throughput of a ResNet with TensorFlow 2 and hora.tensorflow, in images per second.

The counterpart of Horovod's ``tensorflow2_synthetic_benchmark``: the same flags and the same
printout, on random images and labels generated once, so that only compute and gradient averaging
are measured. The default model, ``ResNet18``, is defined below; any ``keras.applications`` model
name works too (``--model ResNet50``, built with ``weights=None``, so nothing is downloaded). The
defaults suit a small CPU box (64x64 images, batch 16, 5 warm-up batches, 10 iterations of 5
batches); Horovod's are ``--model ResNet50 --image-size 224 --batch-size 32
--num-warmup-batches 10 --num-batches-per-iter 10``.

    hora run -np 2 python examples/tensorflow2_synthetic_benchmark.py
    hora run -np 2 python examples/tensorflow2_synthetic_benchmark.py --fp16-allreduce --num-iters 5
"""

from __future__ import annotations

import argparse
import os
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter, before it loads

import keras
import numpy as np
import tensorflow as tf

import hora.tensorflow as hvd

# ---- the model ----------------------------------------------------------------------------------

def _basic_block(x, planes: int, stride: int):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 projection when the shape changes)."""
    out = keras.layers.Conv2D(planes, 3, strides=stride, padding="same", use_bias=False)(x)
    out = keras.layers.ReLU()(keras.layers.BatchNormalization()(out))
    out = keras.layers.Conv2D(planes, 3, padding="same", use_bias=False)(out)
    out = keras.layers.BatchNormalization()(out)
    shortcut = x
    if stride != 1 or x.shape[-1] != planes:
        shortcut = keras.layers.Conv2D(planes, 1, strides=stride, use_bias=False)(x)
        shortcut = keras.layers.BatchNormalization()(shortcut)
    return keras.layers.ReLU()(keras.layers.Add()([out, shortcut]))


def resnet18(image_size: int, classes: int = 1000) -> keras.Model:
    """The ImageNet ResNet-18 layout: 7x7 stem, max-pool, four stages of two blocks, pool, classifier."""
    inputs = keras.Input((image_size, image_size, 3))
    x = keras.layers.Conv2D(64, 7, strides=2, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
    for index, planes in enumerate((64, 128, 256, 512)):
        for block in range(2):
            x = _basic_block(x, planes, 2 if index > 0 and block == 0 else 1)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes, activation="softmax")(x), name="resnet18")


def make_model(name: str, image_size: int) -> keras.Model:
    if name == "ResNet18":
        return resnet18(image_size)
    builder = getattr(keras.applications, name, None)
    if builder is None:
        raise SystemExit(f"--model {name}: not ResNet18 and not a keras.applications model")
    return builder(weights=None, input_shape=(image_size, image_size, 3))


# ---- the benchmark ------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", type=str, default="ResNet18",
                        help="model to benchmark: ResNet18 (defined here) or a keras.applications name")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size, per worker")
    parser.add_argument("--image-size", type=int, default=64,
                        help="height and width of the synthetic images (Horovod uses 224)")
    parser.add_argument("--num-warmup-batches", type=int, default=5,
                        help="number of warm-up batches that don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="CPU threads per worker (default: the host's cores divided among its workers)")
    parser.add_argument("--eager", action="store_true", default=False, help="enables eager execution")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="use adasum algorithm to do reduction (not supported by hora yet)")
    args = parser.parse_args(argv)
    args.cuda = not args.no_cuda and bool(tf.config.list_physical_devices("GPU"))
    return args


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.use_adasum:
        raise SystemExit("--use-adasum: hora does not implement Adasum yet (DistributedGradientTape(op=hvd.Adasum) "
                         "raises NotImplementedError); run without it to average gradients")
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if args.cuda:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")  # ranks may share a GPU
    elif gpus:
        tf.config.set_visible_devices([], "GPU")
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))

    keras.utils.set_random_seed(1234 + hvd.rank())  # different on purpose: the broadcast makes them equal
    model = make_model(args.model, args.image_size)
    opt = keras.optimizers.SGD(0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # One fixed synthetic batch: random images and labels.
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)

    def benchmark_step(first_batch: bool) -> None:
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, probs))
        # Averages the gradients across workers.
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        # After the first step (which builds the optimizer's variables), every replica takes rank 0's
        # weights and optimizer state.
        if first_batch:
            hvd.broadcast_variables(model.weights, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    if not args.eager:
        benchmark_step = tf.function(benchmark_step)

    kind = "GPU" if args.cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Image size: {args.image_size}x{args.image_size}, {threads} thread(s) per worker")
    log(f"Number of {kind}s: {hvd.size()}")

    with tf.device(kind):
        log("Running warmup...")
        benchmark_step(first_batch=True)
        timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)

        log("Running benchmark...")
        img_secs = []
        for x in range(args.num_iters):
            seconds = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
            img_sec = args.batch_size * args.num_batches_per_iter / seconds
            log(f"Iter #{x}: {img_sec:.1f} img/sec per {kind}")
            img_secs.append(img_sec)

    img_sec_mean = float(np.mean(img_secs))
    img_sec_conf = float(1.96 * np.std(img_secs))
    log(f"Img/sec per {kind}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {kind}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
    size = hvd.size()
    hvd.shutdown()
    return {"img_sec_mean": img_sec_mean, "img_sec_conf": img_sec_conf, "size": size}


if __name__ == "__main__":
    main()
