"""hora.lightning: PyTorch Lightning on hora. ``Trainer(strategy=HoraStrategy())`` (or
``strategy="hora"`` once this module is imported) trains data-parallel under ``hora run``, with
Horovod's semantics: averaged gradients, rank 0's initial state broadcast, ``sync_dist`` metrics
reduced across ranks. Needs ``lightning`` (2.2 or newer): ``pip install "hora[lightning]"``.
"""

from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("hora.lightning needs PyTorch Lightning 2.2 or newer: pip install \"lightning>=2.2\"") from exc

from hora.lightning.strategy import HoraEnvironment, HoraStrategy, HoraSyncBatchNorm

# Lightning registers its own strategies when it is imported; ours joins the registry here, so that
# Trainer(strategy="hora") works in any script that imported hora.lightning.
HoraStrategy.register_strategies(StrategyRegistry)

__all__ = ["HoraEnvironment", "HoraStrategy", "HoraSyncBatchNorm"]
