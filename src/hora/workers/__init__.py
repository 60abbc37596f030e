"""Where each worker runs and who it is: the layer every other part of hora stands on to place ranks.

Modules, one job each: :mod:`hosts` (host lists and the rank layout derived from them), :mod:`identity`
(a worker reading who it is from hora's launcher), :mod:`launcher_env` (who a process is when
``mpirun``, ``mpiexec`` or ``srun`` started it), :mod:`network` (the addresses a multi-host job uses)
and :mod:`remote_bootstrap` (the stdlib-only remote end of an SSH-launched rank). They import nothing
of hora's above the foundation and the rendezvous, so the runtime, the MPI bootstrap and the launcher
can all read them without reaching into each other. Nothing is imported here up front.
"""
