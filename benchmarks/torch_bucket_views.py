"""Host time hora.torch.DistributedOptimizer adds to a step: gradient buckets as views (this tree) vs a baseline.

On a GPU the training step is bound by the host thread launching kernels, so every host microsecond
the optimizer's hooks and ``synchronize()`` spend is lost. This measures that cost on the CPU, for
the optimizer in this tree (each bucket's gradients are views of one persistent flat buffer) and for
the one at git revision ``--baseline``, loaded from ``git show REV:src/hora/torch/optimizer.py`` as a
module of its own (before the views, each bucket was flattened with ``torch.cat`` in the hooks and
copied back with ``torch.split`` and ``torch._foreach_copy_`` at ``synchronize()``).

The model is ResNet-50's 161 parameter tensors (53 convolutions, 53 batch norms' weight and bias,
the classifier), channels divided by ``--divisor`` so that memory bandwidth, which a GPU's host
thread does not spend, stays small beside the per-tensor work; the bucket cap is divided by the
divisor's square, so there are as many buckets as at full size. The backward pass is one multiply
per parameter: the hooks fire as in training, and the step holds little else.

Contenders: plain torch, the baseline and this tree, each after ``zero_grad()`` (``none``) and after
``zero_grad(set_to_none=False)`` (``zeros``), and plain torch with an empty hook on every parameter
(the floor of any design that reduces from per-parameter hooks). Each owns its own copy of the
parameters; they take turns step by step, ``--rounds`` rounds of ``--steps`` (the ranks meet in a
barrier between rounds). A step's figure is the main thread's CPU time (``time.thread_time``, which
leaves out waiting for the reduction) in backward and in ``synchronize()``; ``hooks`` is backward
less plain torch's after the same ``zero_grad``, and ``hora`` is hooks plus synchronize: hora's added
host time per step (medians over the steps, rank 0).

    python benchmarks/torch_bucket_views.py --baseline REV [--np 1] [--divisor 16] [--steps 50] [--rounds 5]

Without ``--baseline`` only this tree is timed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import types
from typing import Any

ENV = {"OMP_NUM_THREADS": "1"}
RESNET50_STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))  # (bottleneck width, blocks); expansion 4
MODES = {"none": True, "zeros": False}  # zero_grad's set_to_none


def resnet50_shapes(divisor: int) -> list[tuple[int, ...]]:
    """ResNet-50's parameter shapes in registration order, every channel count divided by ``divisor``."""
    def c(n: int) -> int:
        return max(1, n // divisor)

    shapes: list[tuple[int, ...]] = [(c(64), 3, 7, 7), (c(64),), (c(64),)]
    channels = 64
    for width, blocks in RESNET50_STAGES:
        for block in range(blocks):
            for cin, cout, k in ((channels, width, 1), (width, width, 3), (width, 4 * width, 1)):
                shapes += [(c(cout), c(cin), k, k), (c(cout),), (c(cout),)]
            if block == 0:  # the projection shortcut
                shapes += [(c(4 * width), c(channels), 1, 1), (c(4 * width),), (c(4 * width),)]
            channels = 4 * width
    return shapes + [(c(1000), c(2048)), (c(1000),)]


def load_baseline(source: str) -> Any:
    """The baseline optimizer module, from its source text, beside (not instead of) hora.torch.optimizer."""
    module = types.ModuleType("hora_baseline_optimizer")
    module.__file__ = "<baseline hora/torch/optimizer.py>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


class Contender:
    """One optimizer over its own copy of the parameters, with the CPU seconds of each of its steps."""

    def __init__(self, label: str, shapes: list[tuple[int, ...]], make: Any) -> None:
        import torch

        torch.manual_seed(0)
        self.label = label
        self.set_to_none = MODES[label.split("/")[1]]
        self.params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        self.opt = make(self.params, label)
        self.backward_s: list[float] = []
        self.sync_s: list[float] = []

    def step(self) -> None:
        import torch

        self.opt.zero_grad(set_to_none=self.set_to_none)
        outs = [p * 0.5 for p in self.params]
        seeds = [torch.ones_like(o) for o in outs]
        start = time.thread_time()
        torch.autograd.backward(outs, seeds)
        middle = time.thread_time()
        if hasattr(self.opt, "synchronize"):
            self.opt.synchronize()
        self.backward_s.append(middle - start)
        self.sync_s.append(time.thread_time() - middle)


def _nothing(_: Any) -> None:
    pass


def contenders(shapes: list[tuple[int, ...]], modules: dict[str, Any]) -> list[Contender]:
    import torch

    def plain(params: list, _: str) -> Any:
        return torch.optim.SGD(params, lr=1e-3)

    def empty_hooks(params: list, _: str) -> Any:
        for p in params:
            p.register_post_accumulate_grad_hook(_nothing)
        return plain(params, _)

    def distributed(module: Any) -> Any:
        def make(params: list, label: str) -> Any:
            named = [(f"{label}.{i}", p) for i, p in enumerate(params)]
            return module.DistributedOptimizer(plain(params, label), named_parameters=named)
        return make

    out = [Contender(f"plain/{mode}", shapes, plain) for mode in MODES]
    out.append(Contender("empty_hooks/none", shapes, empty_hooks))
    out += [Contender(f"{name}/{mode}", shapes, distributed(module)) for name, module in modules.items()
            for mode in MODES]
    return out


def worker(baseline_source: str | None, divisor: int, steps: int, rounds: int, warmup: int) -> dict:
    """Every contender on this rank, taking turns; the median CPU seconds of each one's steps."""
    import torch

    import hora.torch as hvd
    from hora.torch import optimizer as current

    torch.set_num_threads(1)
    hvd.init()
    shapes = resnet50_shapes(divisor)
    modules = {"views": current}
    if baseline_source is not None:
        modules = {"baseline": load_baseline(baseline_source), **modules}
    everyone = contenders(shapes, modules)
    for _ in range(warmup):
        for c in everyone:
            c.step()
    for c in everyone:
        c.backward_s.clear()
        c.sync_s.clear()
    for _ in range(rounds):
        hvd.barrier()
        for _ in range(steps):  # step by step in turn: every contender meets the same machine
            for c in everyone:
                c.step()
    buckets = len(everyone[-1].opt._buckets)
    hvd.shutdown()
    return {"tensors": len(shapes), "buckets": buckets,
            "numel": sum(int(torch.Size(s).numel()) for s in shapes),
            "backward": {c.label: statistics.median(c.backward_s) for c in everyone},
            "sync": {c.label: statistics.median(c.sync_s) for c in everyone}}


def report(result: dict, np: int, steps: int, rounds: int) -> None:
    backward, sync = result["backward"], result["sync"]
    print(f"-np {np}: {result['tensors']} tensors ({result['numel']} elements) in {result['buckets']} buckets; "
          f"median of {rounds * steps} steps; main-thread CPU ms per step (rank 0)")
    print(f"{'contender':17s} {'backward':>9s} {'hooks':>8s} {'sync':>8s} {'hora':>8s}")
    added = {}
    for label in backward:
        hooks = backward[label] - backward[f"plain/{label.split('/')[1]}"]
        added[label] = hooks + sync[label]
        print(f"{label:17s} {1e3 * backward[label]:9.3f} {1e3 * hooks:8.3f} {1e3 * sync[label]:8.3f} "
              f"{1e3 * added[label]:8.3f}")
    for mode in MODES:
        if f"baseline/{mode}" in added:
            print(f"{mode}: hora's host time, baseline / views: "
                  f"{added[f'baseline/{mode}'] / added[f'views/{mode}']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision whose src/hora/torch/optimizer.py is the baseline")
    parser.add_argument("--np", type=int, default=1, help="ranks (default 1)")
    parser.add_argument("--divisor", type=int, default=16, help="divide ResNet-50's channels by this (default 16)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per contender per round (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --steps steps (default 5)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per contender first (default 5)")
    args = parser.parse_args()

    import hora

    source = None
    if args.baseline:
        source = subprocess.run(["git", "show", f"{args.baseline}:src/hora/torch/optimizer.py"], check=True,
                                capture_output=True, text=True).stdout
    cap = max(1, 4 * 1024 * 1024 // args.divisor ** 2)  # as many buckets as ResNet-50 at the default 4 MiB
    results = hora.run(worker, args=(source, args.divisor, args.steps, args.rounds, args.warmup), np=args.np,
                       env={**ENV, "HORA_GRADIENT_BUCKET_BYTES": str(cap)})
    report(results[0], args.np, args.steps, args.rounds)


if __name__ == "__main__":
    main()
