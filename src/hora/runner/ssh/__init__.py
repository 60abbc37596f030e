"""Ranks on other hosts, over SSH: the options and the reachability check (:mod:`options`), and one
remote rank's client side (:mod:`remote`), whose far end is :mod:`hora.workers.remote_bootstrap`.
Nothing is imported here up front."""
