#!/usr/bin/env python
"""PyTorch Lightning on 2 processes: ``Trainer(strategy=HoraStrategy())`` against Lightning's own
``strategy="ddp"`` (DistributedDataParallel over Gloo), same model, data, batch and threads.

Both sets of workers are started by ``hora.run``; the DDP ones get the variables of an externally
launched job (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK), so Lightning forms its Gloo group
instead of spawning processes. Each worker times the steps after ``--warmup`` with a callback; the
slowest rank's time counts. The two take turns for ``--rounds`` rounds (the machine is shared) and
the median round is reported.

With ``--shared-workers`` the two workers are started once and every turn runs inside them: the timed
steps are the same, only the start-up (each worker importing Lightning) is paid once. The strategies
then share warm processes, so report numbers from fresh ones, the default.

    python benchmarks/lightning_vs_ddp.py                 # deep MLP (200 gradient tensors), 3 rounds
    python benchmarks/lightning_vs_ddp.py --layers 4 --json
    python benchmarks/lightning_vs_ddp.py --layers 2 --steps 3 --rounds 1 --shared-workers   # does it run?
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any


def _worker(strategy_name: str, layers: int, width: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Deep(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            dims = [64] + [width] * layers + [10]
            self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

        def training_step(self, batch_, _):
            x, y = batch_
            for layer in self.layers[:-1]:
                x = torch.relu(layer(x))
            return torch.nn.functional.cross_entropy(self.layers[-1](x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(pl.Callback):
        started = 0.0

        def on_train_batch_start(self, trainer, module, batch_, index):
            if index == warmup:
                self.started = time.perf_counter()

    clock = Clock()
    data = TensorDataset(torch.randn(batch * (steps + warmup) * 2, 64),
                         torch.randint(0, 10, (batch * (steps + warmup) * 2,)))
    if strategy_name == "hora":
        from hora.lightning import HoraStrategy
        strategy: Any = HoraStrategy()
    else:
        strategy = "ddp"
    # HoraStrategy drives one device per process (hora run starts the processes); DDP, launched
    # externally, is told the devices of its node.
    trainer = pl.Trainer(accelerator="cpu", devices=1 if strategy_name == "hora" else 2, strategy=strategy,
                         max_steps=steps + warmup,
                         callbacks=[clock], enable_progress_bar=False, enable_model_summary=False,
                         logger=False, enable_checkpointing=False)
    trainer.fit(Deep(), DataLoader(data, batch_size=batch))
    # Every rank reports its own time and the driver takes the slowest (_rate): a last collective
    # through DDP's Gloo group here may hang the process as the group is freed right after it (Gloo's
    # thread still needs the GIL to drop its tensors, which the group's destructor holds).
    return {"seconds": time.perf_counter() - clock.started, "tensors": 2 * (layers + 1)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_env() -> dict[str, str]:
    """The variables of an externally launched DDP job that are the same on every rank."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "NODE_RANK": "0",
            "GLOO_SOCKET_IFNAME": "lo"}


def _worker_args(strategy_name: str, args: argparse.Namespace) -> tuple[Any, ...]:
    return (strategy_name, args.layers, args.width, args.batch_size, args.steps, args.warmup)


def _rate(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> float:
    """Samples per second over both workers of one run, timed by the slowest rank."""
    return 2 * args.batch_size * args.steps / max(result["seconds"] for result in per_rank)


def run(strategy_name: str, args: argparse.Namespace) -> float:
    """Samples per second over both workers for one run."""
    import hora

    env = {"OMP_NUM_THREADS": "1"}
    worker_args = _worker_args(strategy_name, args)
    if strategy_name == "ddp":
        env.update(_ddp_env())
        per_rank = hora.run(_ddp_entry, args=worker_args, np=2, env=env)
    else:
        per_rank = hora.run(_worker, args=worker_args, np=2, env=env)
    return _rate(per_rank, args)


def _ddp_entry(*worker_args: Any) -> dict[str, Any]:
    """Give Lightning the variables of an externally launched job, from hora's ranks."""
    os.environ["RANK"] = os.environ["HORA_RANK"]
    os.environ["LOCAL_RANK"] = os.environ["HORA_LOCAL_RANK"]
    return _worker(*worker_args)


def _shared_entry(turns: list[tuple[tuple[Any, ...], dict[str, str] | None]]) -> list[dict[str, Any]]:
    """Every turn in this one process, in order (``--shared-workers``): ``(worker args, DDP variables)``.

    A hora turn leaves hora's job after its fit (HoraStrategy keeps it, as a script would, but its
    background engine must not run under the next turn); a DDP turn has the variables of its own
    externally launched job only while it runs, and destroys its Gloo group at the end, so that
    the next one forms a new group on its own port.
    """
    import torch.distributed as dist

    import hora

    results = []
    for worker_args, ddp_env in turns:
        if ddp_env is None:
            results.append(_worker(*worker_args))
            hora.shutdown()
            continue
        saved = dict(os.environ)
        os.environ.update(ddp_env)
        try:
            results.append(_ddp_entry(*worker_args))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(saved)
    return results


def run_shared(names: list[str], args: argparse.Namespace) -> list[float]:
    """Samples per second over both workers for each turn of ``names``, all in one job started once."""
    import hora

    turns = [(_worker_args(name, args), _ddp_env() if name == "ddp" else None) for name in names]
    per_rank = hora.run(_shared_entry, args=(turns,), np=2, env={"OMP_NUM_THREADS": "1"})
    return [_rate([results[turn] for results in per_rank], args) for turn in range(len(turns))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=99, help="hidden Linear layers (default 99: 200 tensors)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shared-workers", action="store_true",
                        help="start the two workers once and run every turn in them: the start-up is paid "
                             "once; the processes are warm and shared, so not for results")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rounds: dict[str, list[float]] = {"hora": [], "ddp": []}
    if args.shared_workers:
        names = [name for _ in range(args.rounds) for name in rounds]
        for name, rate in zip(names, run_shared(names, args)):
            rounds[name].append(rate)
    else:
        for _ in range(args.rounds):
            for name in rounds:
                rounds[name].append(run(name, args))
    hora_rate, ddp_rate = statistics.median(rounds["hora"]), statistics.median(rounds["ddp"])
    report = {"samples_per_s": rounds, "hora_median": hora_rate, "ddp_median": ddp_rate,
              "ratio_hora_to_ddp": hora_rate / ddp_rate, "gradient_tensors": 2 * (args.layers + 1)}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"Lightning, 2 workers, {2 * (args.layers + 1)} gradient tensors, batch {args.batch_size} per worker, "
              f"{args.steps} timed steps, median of {args.rounds} rounds (samples/s over both workers):")
        print(f"  HoraStrategy     {hora_rate:10.1f}   rounds {[round(r) for r in rounds['hora']]}")
        print(f"  strategy='ddp'   {ddp_rate:10.1f}   rounds {[round(r) for r in rounds['ddp']]}")
        print(f"  ratio hora/ddp   {hora_rate / ddp_rate:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
