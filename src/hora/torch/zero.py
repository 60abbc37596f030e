"""ZeroRedundancyOptimizer: optimizer state sharded across ranks (ZeRO stage 1), torch's API on hora.

Every Horovod rank holds the whole optimizer state, and Adam's two moments are twice the model. Here
each rank keeps state only for its own shard of the parameters (``hora.binding.shard_plan`` decides which,
the same way on every rank), steps only that shard, and the updated parameters are allgathered back.

hora has no DistributedDataParallel to average gradients before ``step()``, so ``step()`` averages
them itself, in the form sharding wants: a reducescatter of a flat bucket laid out in shard order,
so that the block each rank receives is exactly the averaged gradients of its own shard. Shards
differ in size, so the reducescatter names each member's block (``blocks``, hora's addition to
Horovod's equal blocks) and nothing is padded; the allgather back takes blocks of any length. Both move the
runs in pieces of at most ``chunk_bytes`` per member, two collectives in flight at a time, so the
buffers a step makes stay bounded however large the model: one flat bucket per dtype of the whole
model would cost more memory, for the length of the step, than sharding the state saves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from hora import basics, collectives
from hora.basics import Average, ProcessSet, global_process_set
from hora.binding.shard_plan import ShardPlan, chunk_bounds, plan_shards
from hora.errors import CollectivePreconditionError, UnsupportedOperationError
from hora.torch import mpi_ops, sharded_join
from hora.torch.flat_run import FlatRun
from hora.torch.zero_state import (
    from_bytes,
    full_state_dict,
    gather_everywhere,
    gather_to,
    hyperparameters,
    saved_positions,
    to_bytes,
)

#: Collectives of one kind kept in flight at once while a step moves its pieces: the next piece is on
#: its way while the last one is written out, and at most this many pieces' buffers exist at a time.
_IN_FLIGHT = 2

#: Per dtype, in the order the dtypes first appear: each member's parameter positions.
_Segments = dict[torch.dtype, list[list[int]]]


def _check_arguments(optimizer_class: Any, process_group: Any, overlap_with_ddp: bool,
                     process_set: Any) -> None:
    if process_group is not None:
        raise TypeError("ZeroRedundancyOptimizer on hora takes a hora process set, not a torch.distributed "
                        "process group: pass process_set=hvd.add_process_set([...]) (or nothing, for every "
                        "rank) and leave process_group=None")
    if overlap_with_ddp:
        raise UnsupportedOperationError("overlap_with_ddp=True overlaps the step with DistributedDataParallel's "
                                        "gradient buckets, and hora has no DistributedDataParallel: leave it "
                                        "False (step() averages the gradients itself)")
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass (the class, e.g. "
                        f"torch.optim.Adam), got {optimizer_class!r}")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hora ProcessSet, got {type(process_set).__name__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` so that each rank of ``process_set`` holds and steps only its shard.

    The constructor, ``consolidate_state_dict``, ``state_dict``, ``load_state_dict``, ``step``,
    ``zero_grad`` and ``add_param_group`` are torch's ``ZeroRedundancyOptimizer``'s. ``param_groups``
    hold every parameter with its full settings (learning-rate schedulers work on them); ``optim`` is
    the local optimizer over this rank's shard, and ``state`` is its state. Every rank must build it
    over the same parameters in the same order, and call ``step``, ``consolidate_state_dict`` and
    ``add_param_group`` together. ``to`` and the process set's members are global ranks, as
    everywhere in hora. A rank outside ``process_set`` takes no part: it steps every parameter alone.

    ``parameters_as_bucket_view=True`` moves the parameters into one flat buffer per dtype (each
    ``param.data`` a view into it), torch's layout; the updated parameters land in it.

    ``chunk_bytes`` (a hora addition, the same on every rank) is how many bytes of each member's
    shard one collective carries: a step's transient buffers are a few times ``chunk_bytes`` times
    the number of members, not the model's size.
    """

    #: Bytes of each member's run per collective (see the class docstring).
    chunk_bytes: int = 4 << 20

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 process_group: Any = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, *, process_set: ProcessSet = global_process_set,
                 **defaults: Any) -> None:
        _check_arguments(optimizer_class, process_group, overlap_with_ddp, process_set)
        self._built = False
        super().__init__(params, defaults)  # checks and fills param_groups as torch does
        basics.engine()  # fail early, with the init() message, when hora is not initialised
        self._optimizer_class = optimizer_class
        self._local_defaults = dict(defaults)
        self._process_set = process_set
        self._included = process_set.included()
        self._members = len(process_set.ranks) if self._included else 1
        self._me = process_set.ranks.index(basics.rank()) if self._included else 0
        # One fixed name per instance (counted among the set's members, so the same on each): the
        # per-step collectives then keep their names, and the engine's response cache serves them.
        self._name = basics.next_name("ZeroRedundancyOptimizer", process_set) if self._included else "zero"
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._consolidated: dict[str, Any] | None = None
        self._plan_version = 0
        self._pending_reshard: Callable[[], Any] | None = None
        # Checked at the first collective rather than here: a rank that joins a running elastic job
        # builds its optimizer alone, while the others are re-forming the world.
        self._checked = False
        self._build()
        self._built = True
        if self._included:  # even alone: an elastic world may grow
            sharded_join.register(self)

    # ---- the shard plan and the local optimizer ---------------------------------------------------

    def _check_same_parameters(self) -> None:
        """Shards are positions in the parameter list, so a rank whose list differs would step other
        parameters than its peers think: every rank compares every rank's list and raises alike."""
        if self._members == 1:
            return
        mine = [(tuple(p.shape), _dtype_name(p.dtype)) for g in self.param_groups for p in g["params"]]
        every = collectives.allgather_object(mine, process_set=self._process_set)
        for member, theirs in enumerate(every):
            if theirs != every[0]:
                raise ValueError(
                    f"ZeroRedundancyOptimizer: the parameters given on rank {self._process_set.ranks[member]} "
                    f"({len(theirs)}) differ from rank {self._process_set.ranks[0]}'s ({len(every[0])}) in "
                    f"number, shape or dtype; every rank must pass the same parameters in the same order")

    def _build(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"ZeroRedundancyOptimizer needs every parameter on one device, got "
                             f"{sorted(str(d) for d in devices)}")
        if any(p.is_sparse for p in params):
            raise ValueError("ZeroRedundancyOptimizer takes dense parameters only")
        self._params = params
        self._device = params[0].device
        self._index = {p: i for i, p in enumerate(params)}
        self._plan = plan_shards([p.numel() * p.element_size() for p in params], self._members)
        self._owned = self._plan.items(self._me)
        local_groups = [{**hyperparameters(g), "params": [p for p in g["params"] if self._index[p] in self._owned]}
                        for g in self.param_groups]
        self.optim = self._optimizer_class(local_groups, **self._local_defaults)
        for group, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in hyperparameters(local).items():
                group.setdefault(key, value)  # the class's own defaults, visible as torch's are
        self.defaults = dict(self.optim.defaults)
        self._gradient_segments: dict[tuple[bool, ...], _Segments] = {}
        self._all_segments = self._segments(trainable_only=False)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        if self.parameters_as_bucket_view:
            self._build_buffers()

    def _segments(self, trainable_only: bool) -> _Segments:
        """Each member's parameters of each dtype: the plan's runs, so plan order is buffer order."""
        out: _Segments = {}
        for member in range(self._members):
            for i in self._plan.items(member):
                p = self._params[i]
                if trainable_only and not p.requires_grad:
                    continue
                out.setdefault(p.dtype, [[] for _ in range(self._members)])[member].append(i)
        return out

    @torch.no_grad()
    def _build_buffers(self) -> None:
        for dtype, segments in self._all_segments.items():
            members = [i for segment in segments for i in segment]
            buffer = torch.empty(sum(self._params[i].numel() for i in members), dtype=dtype, device=self._device)
            offset = 0
            for i in members:
                p = self._params[i]
                piece = buffer[offset:offset + p.numel()]
                piece.copy_(p.detach().reshape(-1))
                p.data = piece.view_as(p)
                offset += p.numel()
            self._buffers[dtype] = buffer

    @property
    def shard_plan(self) -> ShardPlan:
        """Which member owns which parameter (positions in ``param_groups`` order)."""
        return self._plan

    # What sharded gradients (hora.torch.gradient_shards) read: the members, who owns what, the name.

    @property
    def members(self) -> int:
        """How many members share the parameters (1 on a rank outside the process set)."""
        return self._members

    @property
    def member(self) -> int:
        """This rank's member index."""
        return self._me

    @property
    def process_set(self) -> ProcessSet:
        return self._process_set

    @property
    def name(self) -> str:
        """The prefix of this optimizer's collectives' names (the same on every member)."""
        return self._name

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def plan_version(self) -> int:
        """Counts :meth:`replan` calls: what a plan-derived layout compares to know it is stale."""
        return self._plan_version

    def owned_positions(self) -> range:
        """Positions (in ``param_groups`` order) of the parameters this rank owns."""
        return self._owned

    def shard_state(self) -> dict[int, Any]:
        """This rank's state by parameter position (what every rank's shard adds up to)."""
        return self._shard_state()

    def load_shard_state(self, by_position: Mapping[int, Any]) -> None:
        """Load, of ``by_position`` (state by parameter position, any rank's), what this rank owns."""
        self._load_shard(dict(by_position))

    def replan(self) -> None:
        """Plan the shards again for the process set as it is now, after elastic training re-formed the
        world (every member calls it): the local optimizer is rebuilt empty, for
        :meth:`load_shard_state` to fill. The collectives keep the name the set's first rank uses."""
        process_set = self._process_set
        self._included = process_set.included()
        self._members = len(process_set.ranks) if self._included else 1
        self._me = process_set.ranks.index(basics.rank()) if self._included else 0
        if self._members > 1:
            self._name = collectives.broadcast_object(self._name, root_rank=process_set.ranks[0],
                                                      process_set=process_set)
        self._consolidated = None
        self._check_same_parameters()
        self._checked = True
        self._build()
        self._plan_version += 1

    def defer_reshard(self, reshard: Callable[[], Any] | None) -> bool:
        """Run ``reshard`` (a :func:`hora.torch.zero_elastic.reshard` bound to what the ranks kept)
        before this optimizer next moves anything: elastic training re-formed the world, and every
        member reaches that point together, where it may not reach a sync. None drops one left
        before; returns whether one was left."""
        left, self._pending_reshard = self._pending_reshard is not None, reshard
        return left

    def before_collectives(self) -> None:
        """What must happen, on every member, before this optimizer moves anything: the reshard
        :meth:`defer_reshard` left (once), or else, the first time, the check that every member was
        built over the same parameters."""
        reshard, self._pending_reshard = self._pending_reshard, None
        if reshard is not None:
            reshard()
        elif not self._checked:
            self._check_same_parameters()
            self._checked = True

    def owner_of(self, param: torch.Tensor) -> int:
        """The member that owns (holds the state of, and steps) ``param``."""
        return self._plan.owner(self._index[param])

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank owns."""
        return [self._params[i] for i in self._owned]

    @property
    def state(self) -> Any:
        """This rank's optimizer state: its shard's only (torch.optim.Optimizer sets it while building)."""
        optim = self.__dict__.get("optim")
        return optim.state if optim is not None else self.__dict__.get("_state_before_build")

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["_state_before_build"] = value

    # ---- a step -----------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Average the gradients (each rank receives its shard's), step this rank's shard, and
        gather every shard's updated parameters.

        With a ``closure``, each call the local optimizer makes of it is followed by the averaging,
        and a scalar loss is averaged too, so every rank's optimizer sees the same loss. Optimizers
        whose update couples parameters (L-BFGS, a global gradient norm) see only their shard.

        A rank that has run out of data calls ``hvd.join()``, which keeps stepping its shard while the
        others train (:mod:`hora.torch.sharded_join`); each step starts with the join probe for that.
        """
        if self._members > 1:
            entry = sharded_join.STEP if closure is None else sharded_join.CLOSURE_STEP
            training, _ = sharded_join.probed(sharded_join.start_probe(self, entry))
            if len(training) < self._members:
                if closure is not None:
                    raise sharded_join.refusal(self, "ZeroRedundancyOptimizer.step(closure)", training)
                sharded_join.agree_on_step(self, self.param_groups, training)
        return self._step(closure, **kwargs)

    def _step(self, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        with collectives.through_join():
            self._before_step()
            if closure is None:
                self._reduce_gradients()
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(self._averaging(closure), **kwargs)
        with collectives.through_join():
            self._gather_parameters()
        return loss

    def step_averaged(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step this rank's shard with the gradients as they are, then gather every shard's updated
        parameters: for a caller that has averaged every gradient already (hora.torch's
        ``DistributedOptimizer(shard_optimizer_state=True)``, whose hooks allreduce them). A ``closure``
        is passed to the local optimizer as it is (the caller averages inside it). The caller probes
        for joined ranks (:mod:`hora.torch.sharded_join`)."""
        with collectives.through_join():
            self._before_step()
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure, **kwargs)
        with collectives.through_join():
            self._gather_parameters()
        return loss

    # ---- hvd.join() (hora.torch.sharded_join) -----------------------------------------------------

    @property
    def join_probe_name(self) -> str:
        return f"{self._name}.join_probe"

    @property
    def join_process_set(self) -> ProcessSet:
        return self._process_set

    def serve_joined_step(self, training: list[int]) -> None:
        """On a rank in ``hvd.join()``: the ``training`` members' step, with zero gradients from this rank."""
        for p in self._params:
            p.grad = None  # packed as zeros
        sharded_join.agree_on_step(self, self.param_groups, training)
        self._step(None)

    def _before_step(self) -> None:
        self.before_collectives()
        if self._buffers:
            self._check_buffers()
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update(hyperparameters(group))  # a scheduler changes param_groups, not optim's

    def _averaging(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def averaged() -> Any:
            with torch.enable_grad():
                loss = closure()
            with collectives.through_join():
                self._reduce_gradients()
                if isinstance(loss, torch.Tensor) and loss.numel() == 1 and self._members > 1:
                    loss = mpi_ops.allreduce(loss.detach(), name=f"{self._name}.closure_loss", op=Average,
                                             process_set=self._process_set)
            return loss
        return averaged

    def _trainable_segments(self) -> _Segments:
        key = tuple(p.requires_grad for p in self._params)
        segments = self._gradient_segments.get(key)
        if segments is None:
            segments = self._gradient_segments[key] = self._segments(trainable_only=True)
        return segments

    def _gradient(self, i: int) -> torch.Tensor | None:
        p = self._params[i]
        if p.grad is not None and p.grad.is_sparse:
            raise UnsupportedOperationError(f"ZeroRedundancyOptimizer reduces dense gradients only; parameter "
                                            f"{i} has a sparse one")
        return p.grad  # None: unused on this rank, packed as zeros so every rank reduces the same bucket

    def _calls(self, dtype: torch.dtype) -> int:
        """How many collectives move one dtype's runs: from every parameter's size, never from which
        ones have a gradient this step, so that the count (and the collectives' names) is the same on
        every rank even where ranks disagree on ``requires_grad`` (the size checks then say so)."""
        longest = max(self._counts(self._all_segments[dtype]))
        element = torch.empty(0, dtype=dtype).element_size()
        return max(1, -(-longest * element // max(1, int(self.chunk_bytes))))

    def _runs(self, segments: list[list[int]]) -> list[FlatRun]:
        return [FlatRun([self._params[i].numel() for i in segment]) for segment in segments]

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        if self._members == 1:
            return
        pending: deque[tuple[FlatRun, list[torch.Tensor], tuple[int, int], mpi_ops.TorchHandle]] = deque()
        for dtype, segments in self._trainable_segments().items():
            runs = self._runs(segments)
            lengths = [run.length for run in runs]
            if not max(lengths):
                continue
            gradients = [[self._gradient(i) for i in segment] for segment in segments]
            mine = [self._own_gradient(i) for i in segments[self._me]]
            for k, bounds in enumerate(chunk_bounds(lengths, self._calls(dtype))):
                blocks = [b - a for a, b in bounds]
                send = torch.empty(sum(blocks), dtype=dtype, device=self._device)
                offset = 0
                for member, (a, b) in enumerate(bounds):
                    runs[member].pack(gradients[member], a, b, send[offset:offset + b - a])
                    offset += b - a
                handle = mpi_ops.reducescatter_async(send, name=f"{self._name}.grad.{_dtype_name(dtype)}.{k}",
                                                     op=Average, process_set=self._process_set, blocks=blocks,
                                                     donate=True)
                pending.append((runs[self._me], mine, bounds[self._me], handle))
                if len(pending) > _IN_FLIGHT:
                    self._land_gradients(*pending.popleft())
        while pending:
            self._land_gradients(*pending.popleft())

    def _own_gradient(self, i: int) -> torch.Tensor:
        """The gradient tensor the average of an owned parameter lands in, made writable in place."""
        p = self._params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        return p.grad

    @staticmethod
    def _land_gradients(run: FlatRun, grads: list[torch.Tensor], bounds: tuple[int, int],
                        handle: mpi_ops.TorchHandle) -> None:
        a, b = bounds
        block = mpi_ops.synchronize(handle)
        run.unpack(block[:b - a], a, b, grads)

    def _counts(self, segments: list[list[int]]) -> list[int]:
        return [sum(self._params[i].numel() for i in segment) for segment in segments]

    def _check_buffers(self) -> None:
        """A bucket view holds only while each parameter still points into its buffer: moving the model
        (``.to()``, ``.half()``) or assigning ``param.data`` after building the optimizer replaces
        them, and the gathered parameters would land where nothing reads them."""
        for p in self._params:
            buffer = self._buffers.get(p.dtype)
            if buffer is None or p.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
                raise RuntimeError("ZeroRedundancyOptimizer(parameters_as_bucket_view=True): a parameter no "
                                   "longer lives in its bucket (the model was moved or param.data replaced "
                                   "after the optimizer was built); build the optimizer after moving the model")

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        if self._members == 1:
            return
        segments_by_dtype = self._all_segments if self._buffers else self._trainable_segments()
        pending: deque[tuple[torch.dtype, list[FlatRun], list[list[torch.Tensor]], list[tuple[int, int]],
                             mpi_ops.TorchHandle]] = deque()
        for dtype, segments in segments_by_dtype.items():
            runs = self._runs(segments)
            lengths = [run.length for run in runs]
            if not max(lengths):
                continue
            params = [[self._params[i].detach() for i in segment] for segment in segments]
            for k, bounds in enumerate(chunk_bounds(lengths, self._calls(dtype))):
                a, b = bounds[self._me]
                send = torch.empty(b - a, dtype=dtype, device=self._device)
                runs[self._me].pack(params[self._me], a, b, send)
                handle = mpi_ops.allgather_async(send, name=f"{self._name}.param.{_dtype_name(dtype)}.{k}",
                                                 process_set=self._process_set)
                pending.append((dtype, runs, params, bounds, handle))
                if len(pending) > _IN_FLIGHT:
                    self._land_parameters(*pending.popleft())
        while pending:
            self._land_parameters(*pending.popleft())

    def _land_parameters(self, dtype: torch.dtype, runs: list[FlatRun], params: list[list[torch.Tensor]],
                         bounds: list[tuple[int, int]], handle: mpi_ops.TorchHandle) -> None:
        gathered = mpi_ops.synchronize(handle)
        total = sum(b - a for a, b in bounds)
        if gathered.numel() != total:
            raise CollectivePreconditionError(
                f"ZeroRedundancyOptimizer gathered {gathered.numel()} {_dtype_name(dtype)} elements of "
                f"parameters where its plan has {total}: ranks disagree on which parameters require grad")
        gathered = gathered.to(self._device)
        offset = 0
        for member, (a, b) in enumerate(bounds):
            if member != self._me:
                runs[member].unpack(gathered[offset:offset + b - a], a, b, params[member])
            offset += b - a

    # ---- parameter groups and checkpoints ---------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, as torch's does; every rank must call it. The shards are planned afresh over
        all parameters (balanced again), and the state already kept moves to its new owners."""
        super().add_param_group(param_group)
        if not self.__dict__.get("_built"):
            return  # torch.optim.Optimizer's constructor adding the initial groups
        self.before_collectives()
        carried = self._shard_state()  # positions stay: the new group comes last
        self._check_same_parameters()
        self._build()
        parts = [carried] if self._members == 1 else gather_everywhere(carried, self._process_set)
        self._load_shard({i: s for part in parts for i, s in part.items()})

    def _shard_state(self) -> dict[int, Any]:
        """This rank's state by parameter position (what every rank's shard adds up to)."""
        state = self.optim.state
        return {self._index[p]: state[p] for p in (self._params[i] for i in self._owned) if p in state}

    def keep_owned_state(self, state: Mapping[torch.Tensor, Any]) -> None:
        """Take over per-parameter state made elsewhere (an optimizer's ``state`` from before it was
        sharded): this rank loads the entries of the parameters it owns and drops the rest."""
        self._load_shard({self._index[p]: s for p, s in state.items() if p in self._index})

    def _load_shard(self, by_position: dict[int, Any]) -> None:
        """Load the state of the owned parameters among ``by_position`` into the local optimizer,
        through its own ``load_state_dict`` (which puts each tensor on its parameter's device)."""
        local_position = {p: n for n, p in enumerate(p for g in self.optim.param_groups for p in g["params"])}
        state = {local_position[self._params[i]]: s for i, s in by_position.items() if i in self._owned}
        groups = [{**hyperparameters(group), "params": [local_position[p] for p in local["params"]]}
                  for group, local in zip(self.param_groups, self.optim.param_groups)]
        self.optim.load_state_dict({"state": state, "param_groups": groups})

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on rank ``to`` (every member calls it), where :meth:`state_dict`
        then returns it in torch's ordinary format: it loads into an unsharded optimizer, and into this
        class at any world size. Tensors arrive on the CPU; the other ranks hold nothing extra."""
        to = int(to)
        if self._included and to not in self._process_set.ranks:
            raise ValueError(f"consolidate_state_dict(to={to}): rank {to} is not in the process set "
                             f"(ranks {self._process_set.ranks})")
        self.before_collectives()
        shard = self._shard_state()
        if self._members == 1:  # nothing to exchange; a snapshot, as rank `to` gets elsewhere
            parts: list[Any] | None = [from_bytes(to_bytes(shard))]
        else:
            parts = gather_to(shard, to, self._process_set)
        if parts is None:
            self._consolidated = None
            return
        merged = {i: s for part in parts for i, s in part.items()}
        self._consolidated = full_state_dict(self.param_groups, merged)

    def state_dict(self) -> dict[str, Any]:
        """The whole state as last consolidated on this rank (see :meth:`consolidate_state_dict`)."""
        if self._consolidated is None:
            raise RuntimeError(f"the optimizer state has not been consolidated on this rank: call "
                               f"consolidate_state_dict(to={basics.rank()}) on every rank of the process set "
                               f"first, then state_dict() on rank {basics.rank()}")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (from :meth:`state_dict`, or an unsharded optimizer's, saved at any world
        size): every rank passes all of it and keeps its own shard."""
        self.before_collectives()  # a reshard left for later would load its own state over this one
        ids = saved_positions(state_dict, self.param_groups)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(hyperparameters(saved))
        self._load_shard({ids[k]: s for k, s in state_dict["state"].items() if k in ids})
