"""Run example scripts one after another in this worker process, each as ``python SCRIPT ARGS`` runs it.

tests/examples starts one ``hora run -np N`` job for several examples instead of a job each, because
every worker spends more CPU time importing TensorFlow (or Keras, or torch and scikit-learn) than
most examples take to train in their tiny test configurations. Each example runs as ``__main__``
with its own ``sys.argv`` and its folder first on ``sys.path`` (what ``python SCRIPT`` gives it), and
joins hora and leaves it as it does alone; hora is shut down after it in case it left hora
initialised, so that the next one joins a new world. Every rank prints a marker line before and after
each example (the second with its status), so that a test can cut its example's lines out of the
job's output.

    hora run -np 2 python tests/examples/example_chain.py '[["mnist", "examples/pytorch_mnist.py", ["--epochs", "1"]]]'
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

import hora

MARK = "@@example"


def run_example(script: str, args: list[str]) -> str:
    """Run ``script`` with ``args`` as ``__main__``; "ok", or what went wrong (its traceback is printed)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        return "ok"
    except SystemExit as exc:
        return "ok" if exc.code in (None, 0) else f"exit {exc.code}"
    except BaseException as exc:  # reported to the test that reads this example
        traceback.print_exc(file=sys.stdout)
        return f"raised {type(exc).__name__}"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        hora.shutdown()


def main(argv: list[str]) -> int:
    """``argv[0]``: a JSON list of ``[name, script, args]``; the exit status is 1 if any example failed."""
    failed = 0
    for name, script, args in json.loads(argv[0]):
        print(f"{MARK} {name} begin", flush=True)
        status = run_example(script, args)
        sys.stderr.flush()
        print(f"{MARK} {name} end {status}", flush=True)
        failed += status != "ok"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
