"""An elastic training worker for the launcher's fault tests: EPOCHS x BATCHES steps under
``hora.elastic.run``, committing after every batch, printing one ``LOG {json}`` line per event.

Environment:
  ELASTIC_STATE  object (numpy weights in an ObjectState, the default), torch (a tiny model and its
                 optimizer in a TorchState, trained by hora.torch.DistributedOptimizer) or torch-sharded
                 (the same with ``shard_gradients=True``: the optimizer state of a rank that fails
                 survives only in its successor's copy)
  FAULT          none (default), raise (an exception) or kill (SIGKILL to itself)
  FAULT_MARK     a file: the fault fires once, in the rank that creates it (required with FAULT)
  FAULT_AT       "epoch,batch" where rank 0 fails (default 1,0)
  EPOCHS, BATCHES (default 3 and 4)

Every line carries pid, rank, size and gen (the rendezvous round). Events:
  start   once per process, before the first sync
  epoch   at batch 0 of an epoch (again after a reset that rolled back to it)
  commit  after ``state.commit()`` of batch (epoch, batch): that pair is now committed
  done    the end: ``done`` lists the pairs in the final state (appended before each step's
          collective, so only a restore keeps a failed step out of it), ``checksum`` the weights';
          with torch, rank 0 also gives ``reference_diff``: how far the weights are from the same
          steps trained serially without hora (every rank trains on the same batches, so a run that
          restored and re-synced correctly matches it), from rank 0's initial model, or, where the
          fault came before the first commit, from the new rank 0's own
"""

from __future__ import annotations

import os
import sys

import numpy as np
from worker_common import first_to_claim, log

import hora
import hora.elastic

STATE = os.environ.get("ELASTIC_STATE", "object")
TORCH_STATES = ("torch", "torch-sharded")
FAULT = os.environ.get("FAULT", "none")
FAULT_AT = tuple(int(x) for x in os.environ.get("FAULT_AT", "1,0").split(","))
EPOCHS = int(os.environ.get("EPOCHS", "3"))
BATCHES = int(os.environ.get("BATCHES", "4"))


def maybe_fail(epoch: int, batch: int) -> None:
    if FAULT == "none" or (epoch, batch) != FAULT_AT or hora.rank() != 0:
        return
    if not first_to_claim(os.environ["FAULT_MARK"]):
        return  # it already fired once
    log("fault", mode=FAULT, epoch=epoch, batch=batch)
    if FAULT == "raise":
        raise RuntimeError("injected failure")
    os.kill(os.getpid(), 9)


def batch_data(epoch: int, batch: int):
    import torch

    generator = torch.Generator().manual_seed(100 * epoch + batch)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


def torch_parts(seed: int):
    import torch

    torch.manual_seed(seed)
    # Six parameters: sharded over 4 ranks each rank owns some (ranks 0 and 1 one each), so losing
    # two neighbours loses state unless a copy survived elsewhere.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer


def torch_step(model, optimizer, epoch: int, batch: int) -> None:
    import torch

    x, y = batch_data(epoch, batch)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def torch_weights(model) -> np.ndarray:
    return np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])


def serial_reference(seed: int) -> np.ndarray:
    """The initial model of the rank seeded ``seed`` trained on every batch without hora."""
    model, optimizer = torch_parts(seed=seed)
    for epoch in range(EPOCHS):
        for batch in range(BATCHES):
            torch_step(model, optimizer, epoch, batch)
    return torch_weights(model)


def main() -> int:
    hora.init()
    first_rank = hora.rank()
    if STATE in TORCH_STATES:
        import hora.torch as hvd
        from hora.torch.elastic import TorchState

        model, optimizer = torch_parts(seed=hora.rank())  # rank-dependent: the first sync must fix it
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             shard_gradients=STATE == "torch-sharded")
        state = TorchState(model, optimizer, epoch=0, batch=0, done=[])
        run = hvd.elastic.run
    else:
        state = hora.elastic.ObjectState(epoch=0, batch=0, done=[], w=np.full(3, float(hora.rank())))
        run = hora.elastic.run
    log("start")

    def step(epoch: int, batch: int) -> None:
        if STATE in TORCH_STATES:
            torch_step(state.model, state.optimizer, epoch, batch)
        else:
            grad = hora.allreduce(np.full(3, 10.0 * epoch + batch + 1 + hora.rank()), op=hora.Average,
                                  name="grad")
            state.w = state.w + grad - (hora.size() - 1) / 2.0  # the same on every world size

    @run
    def train(state) -> None:
        while state.epoch < EPOCHS:
            if state.batch == 0:
                log("epoch", epoch=state.epoch)
            while state.batch < BATCHES:
                epoch, batch = state.epoch, state.batch
                maybe_fail(epoch, batch)
                state.done.append([epoch, batch])  # uncommitted until the commit below
                step(epoch, batch)
                state.batch += 1
                state.commit()
                log("commit", epoch=epoch, batch=batch)
            state.epoch += 1
            state.batch = 0
            state.commit()

    train(state)
    weights = torch_weights(state.model) if STATE in TORCH_STATES else state.w
    fields = {"done": state.done, "checksum": [float(x) for x in weights]}
    if STATE in TORCH_STATES and hora.rank() == 0:
        # A failure before the first commit rolls every survivor back to the model it was built with
        # (before the first sync), and the new rank 0 hands out its own: its seed is its first rank.
        seed = first_rank if FAULT_AT == (0, 0) and FAULT != "none" else 0
        fields["reference_diff"] = float(np.max(np.abs(weights - serial_reference(seed))))
    log("done", **fields)
    hora.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
