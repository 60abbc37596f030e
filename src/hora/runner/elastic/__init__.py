"""The launcher side of elastic training: host discovery (:mod:`discovery`), the registry of hosts
and the plan of slots they give (:mod:`hosts`), the driver that forms, re-forms and ends the worlds
(:mod:`driver`), and ``hora run``'s elastic entry (:mod:`launch`). The worker side (the reset loop,
committed state, host-change notifications) is :mod:`hora.elastic`; each framework's state classes
are in its binding (``hora.torch.elastic``, ...); Ray's and Spark's elastic executors in
:mod:`hora.ray.elastic` and :mod:`hora.spark.elastic`. Nothing is imported here up front."""
