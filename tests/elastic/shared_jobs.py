"""The real 2-rank jobs that several test modules here share (tests/elastic/conftest.py starts them),
and what a job's sections need to run one after another in the same processes.

A worker pays seconds of CPU to import its framework: about 8 for TensorFlow, or for Keras (on either
backend), against about 5 for a torch worker that builds an optimizer. So one job runs the sections of
test_tensorflow_elastic.py and Keras-on-TensorFlow's of test_keras_elastic.py, and another (Keras on
torch, where TensorFlow is never imported) those of test_torch_elastic.py and Keras-on-torch's of
test_keras_elastic.py, rather than one job per module and backend.

Those workers also go without the packages TensorFlow and Keras merely import when installed
(tf_env.skip_optional_imports).

Several of these sections re-form the world (a host change announced by rank 0, a failed collective),
one after the other in the same processes. So each counts rendezvous rounds from the one it started in
(:func:`generation`), and announces a host change with the next announcement id
(:func:`announce_host_change`): a state takes the announcement the store already holds as one its world
reflects.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from tf_env import skip_optional_imports

from hora import basics
from hora.elastic.notification import HostsUpdate, announce_hosts_update, read_hosts_update

Sections = list[tuple[str, Callable[[], Any]]]


def generation() -> int:
    """The rendezvous round this process's world formed in."""
    return basics._ctx.runtime.round.generation


def announce_host_change(skip_sync: bool = False) -> None:
    """Write the next host-update announcement, as the elastic driver would for new hosts."""
    store = basics._ctx.runtime.store
    last = read_hosts_update(store)
    announce_hosts_update(store, HostsUpdate(id=1 if last is None else last.id + 1, skip_sync=skip_sync))


def tensorflow_sections() -> Sections:
    """Run in a job with ``KERAS_BACKEND=tensorflow``."""
    skip_optional_imports()
    import test_keras_elastic
    import test_tensorflow_elastic

    return test_tensorflow_elastic.sync_and_loop_sections() + test_keras_elastic.fit_sections()


def torch_sections() -> Sections:
    """Run in a job with ``KERAS_BACKEND=torch``; Keras' section only where Keras is installed."""
    skip_optional_imports()
    import test_torch_elastic

    sections = test_torch_elastic.state_and_training_sections()
    if importlib.util.find_spec("keras") is not None:
        import test_keras_elastic

        sections += test_keras_elastic.fit_sections()
    return sections
