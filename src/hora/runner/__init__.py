"""The runner layer: launching workers, their identity, output and failure propagation.

Modules, one job each: :mod:`hosts` (host lists and rank layout), :mod:`locality` (is a host this
machine?), :mod:`worker_env` (each worker's environment), :mod:`process` (spawning and signalling
process groups), :mod:`output` (prefixed output forwarding), :mod:`launch` (supervising workers),
:mod:`job` (a local job with its rendezvous store), :mod:`run_args` (``hora run`` options),
:mod:`check` (``hora check``), :mod:`api` (``hora.run``), :mod:`task` (the worker side of
``hora.run``) and :mod:`identity` (a worker reading who it is).

Nothing is imported here, so a worker importing :mod:`hora.runner.identity` pays only for that.
"""
