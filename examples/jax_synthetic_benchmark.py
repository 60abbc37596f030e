"""Training throughput of a JAX model on synthetic data with hora.jax, in Horovod's benchmark format.

Horovod's ``*_synthetic_benchmark`` scripts time a model on one fixed random batch and print images/sec
per worker and in total; this is the JAX one (plain JAX + optax, a multilayer perceptron on flattened
images, so nothing but JAX is needed). Run it with:

    hora run -np 2 python examples/jax_synthetic_benchmark.py --hidden 1024 --layers 4
"""

from __future__ import annotations

import argparse
import timeit

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hora.jax as hvd


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size, per worker")
    parser.add_argument("--image-size", type=int, default=32, help="height and width of the (3-channel) images")
    parser.add_argument("--hidden", type=int, default=512, help="units per hidden layer")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--num-warmup-batches", type=int, default=5, help="number of warm-up batches")
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    return parser.parse_args(argv)


def make_model(key: jax.Array, inputs: int, hidden: int, layers: int, classes: int = 1000):
    sizes = [inputs] + [hidden] * layers + [classes]
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append((jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2.0 / n_in), jnp.zeros(n_out)))
    return params


def loss_fn(params, x, y):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y).mean()


def main(argv=None) -> float:
    args = parse_args(argv)
    hvd.init()
    inputs = 3 * args.image_size * args.image_size
    params = hvd.broadcast_parameters(make_model(jax.random.PRNGKey(0), inputs, args.hidden, args.layers), 0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    tx = hvd.DistributedOptimizer(optax.sgd(0.01), compression=compression)
    opt_state = tx.init(params)
    rng = np.random.default_rng(hvd.rank())
    x = jnp.asarray(rng.normal(size=(args.batch_size, inputs)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 1000, size=args.batch_size).astype(np.int32))

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = [params, opt_state]

    def benchmark_step() -> None:
        state[0], state[1] = step(state[0], state[1])
        jax.block_until_ready(state[0])

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: MLP {args.layers}x{args.hidden}, input {inputs}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of workers: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per worker")
        rates.append(rate)
    mean, conf = float(np.mean(rates)), 1.96 * float(np.std(rates))
    log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    return mean


if __name__ == "__main__":
    main()
