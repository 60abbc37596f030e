"""Autotune: the engine's knobs tuned while the job trains (Horovod's ``--autotune``).

The tuner scores each setting by bytes reduced per second of wall-clock time over a sample of
training steps, so it measures what the job feels (fusion, cycle time and the cache change how well
communication overlaps compute, not just how long one transfer takes). The fusion threshold and the
cycle time are searched together by Bayesian optimisation (a Gaussian process from scikit-learn, with
expected improvement); then the categorical knobs (response cache on/off, hierarchical allreduce
where the transport can switch) are tried one at a time from the best point, as Horovod does. Knobs
the user set explicitly are held fixed.

Only the coordinator (member 0 of the global set) scores and decides. Every rank counts the same
executed operations in the same order, so every rank reaches the end of a sample in the same engine
cycle; there the coordinator's decision is broadcast and every rank applies it before the next cycle.
"""

from __future__ import annotations

import csv
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
#: Search box of the joint Bayesian parameters: (fusion threshold MiB, cycle time ms).
FUSION_MB_BOUNDS = (0.0, 128.0)
CYCLE_MS_BOUNDS = (0.5, 25.0)
#: The first points tried, before the Gaussian process proposes any (fusion MiB, cycle ms).
START_POINTS = ((64.0, 1.0), (4.0, 5.0), (128.0, 10.0), (16.0, 2.5))
LOG_HEADER = ("hierarchical_allreduce", "hierarchical_allgather", "cache_enabled", "cycle_time_ms",
              "tensor_fusion_threshold", "score")


@dataclass(frozen=True)
class TuningParams:
    """One setting of the tuned knobs, as it travels from the coordinator to every rank."""

    fusion_threshold_mb: float
    cycle_time_ms: float
    cache_enabled: bool
    hierarchical_allreduce: bool
    hierarchical_allgather: bool = False  # hora has no hierarchical allgather: never tuned
    active: bool = True  # False once tuning has finished (the best setting is then final)

    def log_row(self, score: float) -> list[str]:
        return [str(int(self.hierarchical_allreduce)), str(int(self.hierarchical_allgather)),
                str(int(self.cache_enabled)), f"{self.cycle_time_ms:.4g}", f"{self.fusion_threshold_mb:.4g}",
                f"{score:.6g}"]


@dataclass(frozen=True)
class AutotuneConfig:
    warmup_samples: int = 3
    steps_per_sample: int = 10
    bayes_opt_max_samples: int = 20
    gaussian_process_noise: float = 0.8
    log_file: str | None = None
    fixed_fusion: bool = False
    fixed_cycle: bool = False
    fixed_cache: bool = False
    fixed_hierarchical: bool = True  # tunable only where the transport can switch at run time


class BayesianSearch:
    """Expected-improvement search of a box with a Gaussian process over the scores seen so far."""

    def __init__(self, bounds: list[tuple[float, float]], noise: float, seed: int = 0) -> None:
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern

        self.bounds = np.array(bounds, dtype=float)
        self._rng = np.random.default_rng(seed)
        # Scores are standardised before fitting, so the noise term is relative to their spread
        # (Horovod's --autotune-gaussian-process-noise has the same role: alpha of the regression).
        self._gp = GaussianProcessRegressor(kernel=ConstantKernel(1.0) * Matern(length_scale=0.3, nu=2.5),
                                            alpha=max(noise, 1e-6) ** 2, normalize_y=False,
                                            n_restarts_optimizer=2, random_state=seed)
        self.xs: list[np.ndarray] = []
        self.ys: list[float] = []

    def _unit(self, x: np.ndarray) -> np.ndarray:
        lo, hi = self.bounds[:, 0], self.bounds[:, 1]
        unit: np.ndarray = (x - lo) / np.where(hi > lo, hi - lo, 1.0)
        return unit

    def add(self, x: list[float], score: float) -> None:
        self.xs.append(self._unit(np.array(x, dtype=float)))
        self.ys.append(float(score))

    def propose(self, candidates: int = 2000) -> list[float]:
        """The point of the box with the largest expected improvement over the best score."""
        from scipy.stats import norm

        ys = np.array(self.ys)
        spread = ys.std() or 1.0
        scaled = (ys - ys.mean()) / spread
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence warnings of the kernel fit on few points
            self._gp.fit(np.array(self.xs), scaled)
        unit = self._rng.random((candidates, len(self.bounds)))
        mean, std = self._gp.predict(unit, return_std=True)
        best = scaled.max()
        with np.errstate(divide="ignore", invalid="ignore"):
            z = (mean - best - 0.01) / std
            ei = np.where(std > 1e-12, (mean - best - 0.01) * norm.cdf(z) + std * norm.pdf(z), 0.0)
        chosen = unit[int(np.argmax(ei))]
        lo, hi = self.bounds[:, 0], self.bounds[:, 1]
        return list(lo + chosen * (hi - lo))


class Tuner:
    """The coordinator's decisions: which setting to try next, and the best one when done."""

    def __init__(self, config: AutotuneConfig, initial: TuningParams) -> None:
        self.config = config
        self.current = initial
        self.best: tuple[float, TuningParams] | None = None
        self._joint_dims = [d for d, fixed in (("fusion", config.fixed_fusion), ("cycle", config.fixed_cycle))
                            if not fixed]
        self._search = BayesianSearch(
            [FUSION_MB_BOUNDS if d == "fusion" else CYCLE_MS_BOUNDS for d in self._joint_dims],
            config.gaussian_process_noise) if self._joint_dims else None
        self._joint_trials = 0
        self._categorical = [name for name, fixed in (("cache_enabled", config.fixed_cache),
                                                      ("hierarchical_allreduce", config.fixed_hierarchical))
                             if not fixed]
        self._stage = "joint" if self._search is not None else "categorical"
        self._categorical_index = 0
        self.trials: list[tuple[TuningParams, float]] = []
        if self._search is not None:
            self.current = self._with_joint(self._start_point(0))

    def _start_point(self, i: int) -> list[float]:
        fusion, cycle = START_POINTS[i]
        return [fusion if d == "fusion" else cycle for d in self._joint_dims]

    def _with_joint(self, point: list[float]) -> TuningParams:
        """The current setting with the searched knobs (in ``_joint_dims`` order) set to ``point``."""
        values = dict(zip(self._joint_dims, point))
        return replace(self.current,
                       fusion_threshold_mb=float(values.get("fusion", self.current.fusion_threshold_mb)),
                       cycle_time_ms=float(values.get("cycle", self.current.cycle_time_ms)))

    def _joint_point(self, params: TuningParams) -> list[float]:
        return [params.fusion_threshold_mb if d == "fusion" else params.cycle_time_ms for d in self._joint_dims]

    def record(self, score: float) -> TuningParams:
        """Score the current setting and return the next one (``active=False``: tuning is over)."""
        tried = self.current
        self.trials.append((tried, score))
        if self.best is None or score > self.best[0]:
            self.best = (score, tried)
        best = self.best
        if self._stage == "joint" and self._search is not None:  # "joint" only with a search
            self._search.add(self._joint_point(tried), score)
            self._joint_trials += 1
            if self._joint_trials < max(1, self.config.bayes_opt_max_samples):
                if self._joint_trials < len(START_POINTS):
                    self.current = self._with_joint(self._start_point(self._joint_trials))
                else:
                    self.current = self._with_joint(self._search.propose())
                return self.current
            self._stage = "categorical"
        while self._categorical_index < len(self._categorical):
            name = self._categorical[self._categorical_index]
            self._categorical_index += 1
            base = best[1]
            self.current = replace(base, **{name: not getattr(base, name)})
            return self.current
        self._stage = "done"
        self.current = replace(best[1], active=False)
        return self.current


class Autotuner:
    """The per-rank side: counts executed operations into samples and applies the decisions.

    ``apply`` sets the engine's knobs; ``broadcast`` sends the coordinator's decision to every member
    of the global set (called at the same engine cycle on every rank).
    """

    def __init__(self, config: AutotuneConfig, initial: TuningParams, is_coordinator: bool,
                 apply: Callable[[TuningParams], None],
                 broadcast: Callable[[TuningParams | None], TuningParams],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.params = initial
        self.is_coordinator = is_coordinator
        self._apply = apply
        self._broadcast = broadcast
        self._clock = clock
        # Every rank builds the tuner for its first setting (the same everywhere: it depends only on
        # the configuration), so all start the first sample alike; only the coordinator keeps it.
        tuner = Tuner(config, initial)
        self._tuner = tuner if is_coordinator else None
        self._warmups_left = config.warmup_samples
        self._counts: dict[str, int] = {}
        self._bytes = 0
        self._started: float | None = None
        self._sample_done = False
        self.steps_seen = 0  # samples started (warm-up included), the same on every rank
        self.history: list[tuple[int, TuningParams]] = []  # (sample index, setting applied)
        self._log_rows: list[list[str]] = []
        if is_coordinator and config.log_file:
            with open(config.log_file, "w", newline="") as f:
                csv.writer(f).writerow(LOG_HEADER)
        self.params = tuner.current
        self._apply(self.params)
        self.history.append((0, self.params))

    @property
    def active(self) -> bool:
        return self.params.active

    def executed(self, names: list[str], nbytes: int) -> None:
        """Account the operations one engine cycle executed (the same names on every rank)."""
        if not self.params.active or self._sample_done:
            return
        if self._started is None:
            self._started = self._clock()
        self._bytes += nbytes
        counts = self._counts
        for name in names:
            seen = counts.get(name, 0) + 1
            counts[name] = seen
            if seen > self.config.steps_per_sample:
                self._sample_done = True

    @property
    def sample_done(self) -> bool:
        return self._sample_done

    def end_sample(self) -> None:
        """At a sample's end on every rank: the coordinator scores it and decides; all apply."""
        elapsed = max(self._clock() - (self._started or self._clock()), 1e-9)
        score = self._bytes / elapsed / 1e6  # MB/s
        decision: TuningParams | None = None
        if self.is_coordinator and self._tuner is not None:  # the coordinator is the one with a tuner
            if self._warmups_left > 0:
                self._warmups_left -= 1
                decision = self.params
                logger.info("autotune: warming up (%d samples left)", self._warmups_left)
            else:
                decision = self._tuner.record(score)
                self._log(self.params, score)
                if not decision.active and self._tuner.best is not None:  # record() has set best
                    best_score, _ = self._tuner.best
                    self._log(decision, best_score)
                    logger.warning("autotune: done; best setting %s at %.1f MB/s", _describe(decision), best_score)
        agreed = self._broadcast(decision)
        if agreed != self.params:
            self._apply(agreed)
        self.params = agreed
        self.steps_seen += 1
        self.history.append((self.steps_seen, agreed))
        self._counts = {}
        self._bytes = 0
        self._started = None
        self._sample_done = False

    def _log(self, params: TuningParams, score: float) -> None:
        logger.info("autotune: %s -> %.1f MB/s", _describe(params), score)
        if self.config.log_file:
            with open(self.config.log_file, "a", newline="") as f:
                csv.writer(f).writerow(params.log_row(score))


def _describe(p: TuningParams) -> str:
    return (f"[hierarchical_allreduce={int(p.hierarchical_allreduce)}, cache={int(p.cache_enabled)}, "
            f"cycle {p.cycle_time_ms:.3g} ms, fusion {p.fusion_threshold_mb:.3g} MiB]")


def read_log(path: str) -> list[dict[str, float]]:
    """Rows of an autotune log (Horovod's columns); the last row is the best setting."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != LOG_HEADER:
            raise ValueError(f"{path}: not an autotune log (columns {reader.fieldnames})")
        rows = [{k: float(v) for k, v in row.items()} for row in reader]
    if any(math.isnan(r["score"]) for r in rows):
        raise ValueError(f"{path}: a score is not a number")
    return rows
