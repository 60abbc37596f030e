"""Every hora knob in one table.

Each knob has a name, the ``HORA_*`` environment variable that sets it, the ``HOROVOD_*`` alias a
migrating user already exports, a default, a parser and a one-line doc. This module is the only place
in hora that reads hora's variables (``HORA_*`` and their ``HOROVOD_*`` aliases) from ``os.environ``:
everything else asks :func:`get` (or :func:`load` for a snapshot), so a knob is documented, parsed and
validated exactly once (tests/runtime/test_config_is_the_only_reader.py checks it). Other programs'
variables (``KUBERNETES_SERVICE_HOST``, ``JAVA_HOME``, ``TF_USE_LEGACY_KERAS``...) are read where they
are used, and a launcher copies the whole environment for its workers through :func:`environ_copy`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hora.errors import ConfigError


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on", "y", "t"):
        return True
    if lowered in ("0", "false", "no", "off", "n", "f", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _parse_str(text: str) -> str:
    return text


def _parse_nonneg_int(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError(f"expected a non-negative integer, got {text!r}")
    return value


def _parse_pos_int(text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def _parse_pos_float(text: str) -> float:
    value = float(text.strip())
    if value <= 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _parse_nonneg_float(text: str) -> float:
    value = float(text.strip())
    if value < 0:
        raise ValueError(f"expected a non-negative number, got {text!r}")
    return value


def _parse_log_level(text: str) -> str:
    level = text.strip().upper()
    allowed = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL", "CRITICAL")
    if level not in allowed:
        raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
    return level


_COMPRESSION_FORMS = ("none, fp16, bf16, powersgd[:RANK[:START_ITER]] or topk[:RATIO] (e.g. powersgd:4, "
                      "powersgd:4:100 or topk:0.01)")


def _parse_compression(text: str) -> str:
    """HORA_COMPRESSION in its canonical spelling (lower case, no blanks); the grammar's one home.

    hora.compression.parse_compression turns the result into a compressor or a PowerSGD spec.
    """
    name, *numbers = [part.strip() for part in text.strip().lower().split(":")]
    if name in ("none", "fp16", "bf16") and not numbers:
        return name
    if name == "powersgd" and len(numbers) <= 2 and all(n.isascii() and n.isdigit() for n in numbers):
        values = [int(number) for number in numbers]
        if not values or values[0] >= 1:
            return ":".join([name, *(str(value) for value in values)])
    if name == "topk" and len(numbers) <= 1:
        try:
            ratio = float(numbers[0]) if numbers else None
        except ValueError:
            ratio = -1.0
        if ratio is None:
            return name
        if 0 < ratio <= 1:
            return f"{name}:{ratio!r}"
    raise ValueError(f"expected {_COMPRESSION_FORMS}, with RANK at least 1, START_ITER at least 0 and RATIO in "
                     f"(0, 1]; got {text!r}")


@dataclass(frozen=True)
class Knob:
    """One configuration entry: where it is read from and how it is parsed."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    horovod_alias: bool = True

    @property
    def env(self) -> str:
        return "HORA_" + self.name.upper()

    @property
    def alias(self) -> str | None:
        return "HOROVOD_" + self.name.upper() if self.horovod_alias else None


MiB = 1024 * 1024

KNOBS: tuple[Knob, ...] = (
    # Identity, set by the launcher for each worker.
    Knob("rank", None, _parse_nonneg_int, "Global rank of this worker (set by hora run)."),
    Knob("size", None, _parse_nonneg_int, "Number of workers in the job (set by hora run)."),
    Knob("local_rank", None, _parse_nonneg_int, "Rank of this worker among those on its host."),
    Knob("local_size", None, _parse_nonneg_int, "Number of workers on this worker's host."),
    Knob("cross_rank", None, _parse_nonneg_int, "Index of this worker's host among hosts with the same local rank."),
    Knob("cross_size", None, _parse_nonneg_int, "Number of hosts that have a worker with this local rank."),
    Knob("hostname", None, _parse_str, "Host name the launcher assigned this worker to."),
    # Rendezvous, set by the launcher.
    Knob("rendezvous_addr", None, _parse_str, "Address of the job's rendezvous store.", horovod_alias=False),
    Knob("rendezvous_port", None, _parse_nonneg_int, "Port of the job's rendezvous store.", horovod_alias=False),
    Knob("secret", None, _parse_str, "Hex job secret every connection proves it knows.", horovod_alias=False),
    Knob("job_id", None, _parse_str, "Identifier of the job, unique per launch.", horovod_alias=False),
    # Launcher behaviour.
    Knob("start_timeout", 30.0, _parse_pos_float, "Seconds to wait for every worker to check in."),
    Knob("kill_grace", 5.0, _parse_nonneg_float,
         "Seconds between SIGTERM and SIGKILL when the launcher stops workers.", horovod_alias=False),
    Knob("ssh_command", "ssh", _parse_str,
         "The ssh program (and leading options) hora run uses to start workers on remote hosts.",
         horovod_alias=False),
    Knob("ssh_connect_timeout", 10.0, _parse_pos_float,
         "Seconds ssh may take to connect to a remote host (the reachability check and each rank).",
         horovod_alias=False),
    # Transport.
    Knob("transport_timeout", 30.0, _parse_pos_float,
         "Seconds a collective may wait on a peer without progress before failing.", horovod_alias=False),
    Knob("iface", None, _parse_str,
         "Address workers listen on for peer connections (default: the host's address).",
         horovod_alias=False),
    Knob("ring_chunk_bytes", 1 * MiB, _parse_nonneg_int,
         "Pipeline chunk of the TCP ring, in bytes.", horovod_alias=False),
    Knob("ring_small_bytes", 64 * 1024, _parse_nonneg_int,
         "Messages up to this size use the latency-optimal algorithm instead of the ring.",
         horovod_alias=False),
    Knob("unix_sockets", True, _parse_bool,
         "Connect ranks on the same host through Unix-domain sockets (faster than loopback TCP).",
         horovod_alias=False),
    Knob("shm_segment_bytes", 256 * MiB, _parse_nonneg_int,
         "Largest shared-memory segment per rank; larger messages go through it in chunks.",
         horovod_alias=False),
    Knob("transport", "auto", _parse_str,
         "Transport between ranks: auto (shared memory within a host, TCP otherwise), shm, tcp or mpi "
         "(MPI through mpi4py; the job must run under mpirun or be given a communicator).",
         horovod_alias=False),
    Knob("mpi_bootstrap", "auto", _parse_str,
         "How a job started by mpirun/srun finds rank 0's rendezvous: auto (mpi4py when usable, else a "
         "file), mpi4py, or file (see mpi_rendezvous_dir).", horovod_alias=False),
    Knob("mpi_abort_on_exception", True, _parse_bool,
         "Under MPI, an unhandled exception on one rank aborts the whole MPI job (MPI_Abort) instead of "
         "leaving the other ranks waiting in their next MPI call.", horovod_alias=False),
    Knob("mpi_rendezvous_dir", None, _parse_str,
         "Directory, shared by every host of the job, where rank 0 of a job started by mpirun/srun "
         "without mpi4py announces its rendezvous (default ~/.hora/rendezvous).", horovod_alias=False),
    Knob("socket_buffer_bytes", 4 * MiB, _parse_nonneg_int,
         "SO_SNDBUF/SO_RCVBUF for peer sockets (0 keeps the OS default).", horovod_alias=False),
    Knob("host_id", None, _parse_str,
         "Host identity this rank publishes when the world forms: ranks with equal values share a host "
         "(local ranks, shared memory). Default: the kernel's boot id and network namespace; hora.ray "
         "sets the Ray node id, since Ray may run several nodes on one machine.", horovod_alias=False),
    # Engine (read by later layers; listed here so every knob lives in one table).
    Knob("fusion_threshold", 128 * MiB, _parse_nonneg_int, "Tensor fusion buffer size in bytes; 0 disables fusion."),
    Knob("cycle_time", 1.0, _parse_nonneg_float, "Engine cycle time in milliseconds."),
    Knob("gradient_bucket_bytes", 4 * MiB, _parse_nonneg_int,
         "Gradients of the framework optimizers travel in flat buckets of at most this many bytes "
         "(and at most the fusion threshold); 0: one reduction per tensor.", horovod_alias=False),
    Knob("compression", None, _parse_compression,
         "Compression of the gradient wrappers (DistributedOptimizer, DistributedGradientTape) built without a "
         "compression argument: none, fp16, bf16, powersgd[:RANK[:START_ITER]] or topk[:RATIO] (set by hora run "
         "--compression).",
         horovod_alias=False),
    Knob("cache_capacity", 1024, _parse_nonneg_int, "Response cache entries; 0 disables the cache."),
    Knob("timeline", None, _parse_str, "Path of the Chrome-trace timeline written by rank 0, or DYNAMIC."),
    Knob("timeline_mark_cycles", False, _parse_bool, "Mark engine cycles in the timeline."),
    Knob("stall_check_disable", False, _parse_bool, "Disable the stall inspector."),
    Knob("stall_check_time_seconds", 60.0, _parse_nonneg_float, "Seconds before a stalled request is reported."),
    Knob("stall_shutdown_time_seconds", 0.0, _parse_nonneg_float,
         "Seconds before a stalled request fails the job (0: never)."),
    Knob("hierarchical_allreduce", False, _parse_bool, "Reduce within hosts first, then across hosts."),
    Knob("nccl", "auto", _parse_str,
         "CUDA tensors: auto (NCCL on the device when usable, else through host memory), off, or require "
         "(an error when NCCL cannot take a CUDA tensor); see hora.nccl.path."),
    Knob("autotune", False, _parse_bool,
         "Tune fusion threshold, cycle time, the response cache and hierarchical allreduce while training."),
    Knob("autotune_log", None, _parse_str, "CSV file the autotuner logs its trials to."),
    Knob("autotune_warmup_samples", 3, _parse_nonneg_int, "Autotune samples discarded at the start."),
    Knob("autotune_steps_per_sample", 10, _parse_nonneg_int, "Training steps scored as one autotune sample."),
    Knob("autotune_bayes_opt_max_samples", 20, _parse_nonneg_int,
         "Settings of fusion threshold and cycle time the autotuner tries."),
    Knob("autotune_gaussian_process_noise", 0.8, _parse_nonneg_float,
         "Noise (alpha) of the autotuner's Gaussian process, relative to the scores' spread."),
    Knob("log_level", "WARNING", _parse_log_level, "Log level of hora's loggers."),
    Knob("elastic", False, _parse_bool,
         "Run in elastic mode: init() after shutdown() waits for the rendezvous round the elastic "
         "driver opens, instead of opening the next round with the same ranks."),
    Knob("elastic_reset_limit", None, _parse_nonneg_int,
         "Most resets one hora.elastic.run call may make before it stops (unset: no limit).", horovod_alias=False),
    Knob("elastic_shard_copies", 1, _parse_pos_int,
         "Copies of each rank's sharded optimizer state that an elastic commit keeps on the next ranks "
         "(the state survives that many neighbouring ranks lost between commits).", horovod_alias=False),
    Knob("elastic_removal_grace", 3.0, _parse_nonneg_float,
         "Seconds a host must be missing from discovery before the elastic driver shrinks the world "
         "(a flaky answer costs no reset).", horovod_alias=False),
    Knob("spark_start_timeout", 600.0, _parse_pos_float,
         "Seconds hora.spark.run waits for Spark to start all its tasks (Horovod's "
         "HOROVOD_SPARK_START_TIMEOUT; the start_timeout argument wins)."),
    Knob("elastic_discovery_timeout", 10.0, _parse_pos_float,
         "Seconds a host discovery script may run before it is killed and the poll counts as failed.",
         horovod_alias=False),
    # Programs and libraries hora starts or loads.
    Knob("mpirun", None, _parse_str, "The mpirun that hora run --mpi starts (default: mpirun on PATH).",
         horovod_alias=False),
    Knob("nccl_library", None, _parse_str,
         "Path of the libnccl to load (a site build, say) before the NVIDIA wheel's and the system's.",
         horovod_alias=False),
    Knob("cudart_library", None, _parse_str,
         "Path of the CUDA runtime library to load before the NVIDIA wheel's and the system's.",
         horovod_alias=False),
    # Deployment.
    Knob("cluster_domain", "cluster.local", _parse_str,
         "The Kubernetes cluster domain in which `hora discover k8s` resolves the job's pods.",
         horovod_alias=False),
)

_BY_NAME: dict[str, Knob] = {knob.name: knob for knob in KNOBS}


def knob(name: str) -> Knob:
    """The table entry for ``name``; a KeyError names the unknown knob."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown hora configuration knob {name!r}") from None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The current value of a knob: ``HORA_*`` wins over ``HOROVOD_*``, then the default.

    A value that does not parse raises :class:`ConfigError` naming the variable, so a typo in a
    job's environment fails loudly at start instead of silently using a default.
    """
    entry = knob(name)
    env = os.environ if environ is None else environ
    for var in (entry.env, entry.alias):
        if var is None or var not in env:
            continue
        raw = env[var]
        try:
            return entry.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"environment variable {var}={raw!r} is invalid: {exc}") from None
    return entry.default


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a knob is given in the environment under either of its names."""
    entry = knob(name)
    env = os.environ if environ is None else environ
    return entry.env in env or (entry.alias is not None and entry.alias in env)


def load(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A snapshot of every knob, for logging and for ``hora check``."""
    return {entry.name: get(entry.name, environ) for entry in KNOBS}


def env_for(name: str, value: Any, with_alias: bool = True) -> dict[str, str]:
    """Environment entries that set ``name`` to ``value`` for a child process (both spellings)."""
    entry = knob(name)
    text = ("1" if value else "0") if isinstance(value, bool) else str(value)
    out = {entry.env: text}
    if with_alias and entry.alias is not None:
        out[entry.alias] = text
    return out


def environ_copy() -> dict[str, str]:
    """The process environment, for launchers that pass it on to workers."""
    return dict(os.environ)
