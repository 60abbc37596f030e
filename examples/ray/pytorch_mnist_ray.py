"""Data-parallel training on handwritten digits with hora.torch, on workers that Ray starts.

examples/pytorch_mnist.py (the same network, the same digits data: scikit-learn's 1797 8x8 scans,
split 80/20, the same training steps) run by ``hora.ray.RayExecutor`` the way horovod.ray's examples
run Horovod. On this machine (a local Ray instance is started for you):

    pip install "hora[ray]" torch scikit-learn
    python examples/ray/pytorch_mnist_ray.py --num-workers 2 --epochs 3

On a Ray cluster (``ray start --head`` on one node, ``ray start --address=HEAD_IP:6379`` on the
others), from any of its nodes:

    python examples/ray/pytorch_mnist_ray.py --address auto --num-hosts 2 --num-workers-per-host 2 [--use-gpu]

Flags other than the Ray ones below are examples/pytorch_mnist.py's training flags (``--epochs``,
``--lr``, ``--seed``...). What the driver does, step by step:
1. ``RayExecutor(settings, num_workers=N)`` describes the job; ``start()`` places N Ray actors (one
   CPU each, or a GPU each with ``--use-gpu``), numbers them node by node and serves the job's
   rendezvous store from this process;
2. ``run(pytorch_mnist.main, args=[training flags])`` calls the training script's ``main`` on every
   worker, unchanged: its ``hvd.init()`` joins this job (the worker's environment says how), then it
   shards the data, wraps the optimizer in ``DistributedOptimizer``, broadcasts rank 0's weights and
   trains; rank 0's progress lines reach this terminal through Ray's log forwarding;
3. ``run`` returns what ``main`` returned on each rank, in rank order (the test accuracy, averaged
   over the workers, so they agree), and ``shutdown()`` stops the workers.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import ray

from hora.ray import RayExecutor

# The training script the workers run. They import it too: RayExecutor gives them this process's
# import path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pytorch_mnist


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str], argparse.Namespace]:
    """(Ray flags, training flags, training flags parsed): the training flags are
    examples/pytorch_mnist.py's own."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every other flag is a training flag of examples/pytorch_mnist.py: --epochs, --batch-size, "
               "--lr, --momentum, --seed, --log-interval, --num-threads, --fp16-allreduce, ...")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join ('auto': the one this node belongs to; default: start a "
                             "local Ray instance)")
    parser.add_argument("--num-workers", type=int, default=None, metavar="N",
                        help="number of workers, packed onto as few nodes as Ray can (default: 2)")
    parser.add_argument("--num-hosts", type=int, default=None, metavar="H",
                        help="spread the job over H nodes instead (with --num-workers-per-host)")
    parser.add_argument("--num-workers-per-host", type=int, default=1, metavar="N",
                        help="workers on each of the --num-hosts nodes (default: 1)")
    parser.add_argument("--cpus-per-worker", type=float, default=1, metavar="C",
                        help="CPUs Ray reserves for each worker (default: 1)")
    parser.add_argument("--use-gpu", action="store_true", default=False, help="give each worker a GPU")
    parser.add_argument("--timeout-s", type=float, default=60, metavar="S",
                        help="bound on the workers' start and on waiting for each other (default: 60)")
    ray_args, training_argv = parser.parse_known_args(argv)
    if ray_args.num_workers is None and ray_args.num_hosts is None:
        ray_args.num_workers = 2
    if not ray_args.use_gpu:
        training_argv.append("--no-cuda")  # the workers hold no GPU, whatever their node has
    # The training flags are checked here, before anything starts; the workers parse them again.
    training = pytorch_mnist.parse_args(training_argv)
    if training.use_adasum:
        parser.error("--use-adasum: hora does not implement Adasum yet; run without it")
    if training.use_mixed_precision and not ray_args.use_gpu:
        parser.error("--use-mixed-precision needs --use-gpu")
    return ray_args, training_argv, training


def main(argv=None) -> float:
    ray_args, training_argv, training = parse_args(argv)
    if not ray.is_initialized():
        if ray_args.address:
            ray.init(address=ray_args.address)
        else:
            # A local instance with a CPU per worker at least, so more workers than cores still start.
            workers = ray_args.num_workers or ray_args.num_hosts * ray_args.num_workers_per_host
            ray.init(address="local",
                     num_cpus=max(os.cpu_count() or 1, math.ceil(workers * ray_args.cpus_per_worker)))

    settings = RayExecutor.create_settings(timeout_s=ray_args.timeout_s)
    executor = RayExecutor(settings, num_workers=ray_args.num_workers, num_hosts=ray_args.num_hosts,
                           num_workers_per_host=ray_args.num_workers_per_host if ray_args.num_hosts else 1,
                           cpus_per_worker=ray_args.cpus_per_worker, use_gpu=ray_args.use_gpu)
    started = time.perf_counter()
    executor.start()
    print(f"Started {len(executor.workers)} hora workers on Ray in {executor.start_seconds:.1f} s", flush=True)
    try:
        # Every worker runs the training script's main(): hvd.init() there joins this job.
        accuracies = executor.run(pytorch_mnist.main, args=[training_argv])
    finally:
        executor.shutdown()
    accuracy = accuracies[0]
    print(f"RayExecutor.run returned: test accuracy {100.0 * accuracy:.2f}% after {training.epochs} epoch(s) on "
          f"{len(accuracies)} worker(s), {time.perf_counter() - started:.1f} s in all", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
