"""Elastic data-parallel training on handwritten digits with hora.torch, on workers that Ray starts.

examples/elastic/pytorch_mnist_elastic.py (the digits network and data of examples/pytorch_mnist.py,
trained in an ``hvd.elastic.run`` loop with a committed ``TorchState``) run by
``hora.ray.ElasticRayExecutor`` the way horovod.ray's elastic examples run Horovod. On this machine
(a local Ray instance is started for you, with at least a CPU per worker):

    pip install "hora[ray]" torch scikit-learn
    python examples/ray/pytorch_mnist_ray_elastic.py --min-workers 1 --max-workers 2 --epochs 3

On a Ray cluster (``ray start --head`` on one node, ``ray start --address=HEAD_IP:6379`` on the
others), from any of its nodes:

    python examples/ray/pytorch_mnist_ray_elastic.py --address auto --min-workers 2 --max-workers 8 [--use-gpu]

The job is as big as the cluster's live nodes allow, between ``--min-workers`` and
``--max-workers``: each node holds as many workers as its free CPUs (``--cpus-per-worker`` each, and
a GPU each with ``--use-gpu``) allow. While it trains, a node that joins the cluster (``ray start
--address=...`` on a new machine) grows the world, up to ``--max-workers``, at the workers' next
commit; a node that leaves (``ray stop`` there, or a lost machine) shrinks it: the survivors roll back
to their last commit and go on without it, as long as ``--min-workers`` remain. docs/elastic.md says
how an elastic job re-forms; docs/ray.md how hora runs on Ray.

Flags other than the Ray ones below are examples/elastic/pytorch_mnist_elastic.py's training flags
(``--epochs``, ``--lr``, ``--batches-per-commit``, ``--seed``...). What the driver does, step by step:
1. ``ElasticRayExecutor.create_settings(min_np=..., max_np=...)`` sets the job's bounds, and
   ``ElasticRayExecutor(settings, cpus_per_slot=...)`` what each worker reserves; ``start()`` only
   connects to Ray: the workers start in ``run``;
2. ``run(partial(pytorch_mnist_elastic.main, training flags))`` runs one elastic job: it serves the
   job's rendezvous store from this process, reads Ray's live nodes and their free resources, starts
   a Ray actor for every slot (up to ``--max-workers``) and calls the training script's ``main`` on
   each, unchanged: its ``hvd.init()`` joins this job's world, and its ``hvd.elastic.run`` loop
   re-forms that world whenever the nodes change or a worker is lost; rank 0's progress lines reach
   this terminal through Ray's log forwarding;
3. ``run`` returns what ``main`` returned on each rank of the final world, in rank order (the test
   accuracy, summed over the workers, so they agree), and ``last_outcome`` says how the job went:
   its rendezvous rounds (one per world formed), resets and worker failures.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import ray

from hora.ray import ElasticRayExecutor

# The training script the workers run. They import it too: ElasticRayExecutor gives them this
# process's import path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elastic"))
import pytorch_mnist_elastic


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str], argparse.Namespace]:
    """(Ray flags, training flags, training flags parsed): the training flags are
    examples/elastic/pytorch_mnist_elastic.py's own."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every other flag is a training flag of examples/elastic/pytorch_mnist_elastic.py: --epochs, "
               "--batch-size, --lr, --momentum, --batches-per-commit, --seed, --log-interval, --num-threads, "
               "--fp16-allreduce, ...")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join ('auto': the one this node belongs to; default: start a "
                             "local Ray instance)")
    parser.add_argument("--min-workers", type=int, default=1, metavar="N",
                        help="fewest workers the job trains with; fewer for --elastic-timeout ends it (default: 1)")
    parser.add_argument("--max-workers", type=int, default=2, metavar="N",
                        help="most workers the job grows to, however many the nodes could hold (default: 2)")
    parser.add_argument("--cpus-per-worker", type=float, default=1, metavar="C",
                        help="CPUs Ray reserves for each worker (default: 1)")
    parser.add_argument("--use-gpu", action="store_true", default=False, help="give each worker a GPU")
    parser.add_argument("--timeout-s", type=float, default=60, metavar="S",
                        help="how long Ray may take to start a worker on its node (default: 60)")
    parser.add_argument("--elastic-timeout", type=float, default=600, metavar="S",
                        help="how long the job waits for --min-workers workers, or for a new world to form "
                             "(default: 600)")
    ray_args, training_argv = parser.parse_known_args(argv)
    if ray_args.min_workers < 1:
        parser.error(f"--min-workers must be at least 1, got {ray_args.min_workers}")
    if ray_args.max_workers < ray_args.min_workers:
        parser.error(f"--max-workers {ray_args.max_workers} is less than --min-workers {ray_args.min_workers}")
    if ray_args.cpus_per_worker <= 0:
        parser.error(f"--cpus-per-worker must be positive, got {ray_args.cpus_per_worker:g}")
    if not ray_args.use_gpu:
        training_argv.append("--no-cuda")  # the workers hold no GPU, whatever their node has
    # The training flags are checked here, before anything starts; the workers parse them again.
    training = pytorch_mnist_elastic.parse_args(training_argv)
    return ray_args, training_argv, training


def main(argv=None) -> float:
    ray_args, training_argv, training = parse_args(argv)
    if not ray.is_initialized():
        if ray_args.address:
            ray.init(address=ray_args.address)
        else:
            # A local instance with a CPU per worker at least, so more workers than cores still start.
            ray.init(address="local",
                     num_cpus=max(os.cpu_count() or 1, math.ceil(ray_args.max_workers * ray_args.cpus_per_worker)))

    settings = ElasticRayExecutor.create_settings(min_np=ray_args.min_workers, max_np=ray_args.max_workers,
                                                  timeout_s=ray_args.timeout_s,
                                                  elastic_timeout=ray_args.elastic_timeout)
    executor = ElasticRayExecutor(settings, cpus_per_slot=ray_args.cpus_per_worker, use_gpu=ray_args.use_gpu)
    started = time.perf_counter()
    executor.start()
    print(f"Elastic job on Ray: {ray_args.min_workers} to {ray_args.max_workers} hora workers of "
          f"{ray_args.cpus_per_worker:g} CPU(s){' and a GPU' if ray_args.use_gpu else ''} each; the cluster "
          f"has {ray.cluster_resources().get('CPU', 0):g} CPU(s)", flush=True)
    try:
        # Every worker of every world runs the training script's main(): hvd.init() there joins this
        # job, and its hvd.elastic.run loop follows the world as it re-forms.
        accuracies = executor.run(functools.partial(pytorch_mnist_elastic.main, training_argv))
    finally:
        executor.shutdown()
    outcome = executor.last_outcome
    sizes = " -> ".join(str(r.size) for r in outcome.rounds) if outcome is not None else "?"
    accuracy = accuracies[0]
    print(f"ElasticRayExecutor.run returned: test accuracy {100.0 * accuracy:.2f}% after {training.epochs} "
          f"epoch(s) on {len(accuracies)} worker(s), {time.perf_counter() - started:.1f} s in all; "
          f"rendezvous rounds {len(outcome.rounds) if outcome is not None else 0} (world sizes {sizes}), "
          f"resets {outcome.resets if outcome is not None else 0}, "
          f"worker failures {len(outcome.failures) if outcome is not None else 0}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
