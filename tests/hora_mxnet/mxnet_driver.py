"""Runs one MXNet test job inside the MXNet venv and writes each rank's section results to a file.

Usage (by tests/hora_mxnet/mxnet_job.py, with the venv's Python): ``mxnet_driver.py FUNC NP OUT`` where
FUNC names a function of mxnet_jobs.py returning its sections. The results (plain Python and NumPy
values, or SectionFailure records) are pickled to OUT for the test process to read.
"""

from __future__ import annotations

import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # mxnet_jobs, and tests/ for sections

import mxnet_jobs  # noqa: E402
import sections  # noqa: E402

MXNET_ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}


def main() -> None:
    func_name, np_, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    results = sections.run_job(getattr(mxnet_jobs, func_name), np_, MXNET_ENV)
    with open(out, "wb") as f:
        pickle.dump(results.per_rank, f)


if __name__ == "__main__":
    main()
