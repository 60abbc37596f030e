"""Starting a job's workers and watching them: the local job with its rendezvous store (:mod:`job`),
each worker's environment (:mod:`worker_env`), spawning and signalling process groups
(:mod:`process`), supervising the workers until they finish or one fails (:mod:`launch`, with
:mod:`exits` reading how each ended), their prefixed output (:mod:`output`), whether a host is this
machine (:mod:`locality`), and ``hora run --mpi``, where mpirun starts the workers (:mod:`mpi`).
Nothing is imported here up front."""
