"""The models the torch benchmarks train on synthetic data, and the argument checks they share.

The models are examples/pytorch_synthetic_benchmark.py's, loaded from that file so that a benchmark
and the example a user runs train the very same network. Imported by the benchmark scripts beside
it (``python benchmarks/x.py`` puts this folder first on ``sys.path``) and by their workers, which
``hora.run`` hands the same path.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

MODEL_FILE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples",
                                           "pytorch_synthetic_benchmark.py"))
#: Classes of models built with other than the example's 1000. mlp200 is issue 17's bar model, "100
#: Linear layers of width 64-256": its output layer too is 256 wide (1000 classes would make the last
#: layer 64 -> 1000).
CLASSES = {"mlp200": 256}
#: Per model, the batch per worker and image size the memory and compression benchmarks train with
#: (torch_vs_ddp.py's defaults for the same models).
SHAPES = {"resnet18": (16, 64), "mlp200": (32, 64)}


def load_model(name: str) -> Any:
    """A freshly initialised model of the example's ``MODELS[name]`` (seed torch first)."""
    spec = importlib.util.spec_from_file_location("_synthetic_models", MODEL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODELS[name](num_classes=CLASSES[name]) if name in CLASSES else module.MODELS[name]()


def model_and_batch(name: str, seed: int, batch: int | None = None, image: int | None = None) -> tuple[Any, Any, Any]:
    """The model and one synthetic batch (images, labels), the same on every rank for one seed."""
    import torch

    torch.manual_seed(seed)
    model = load_model(name)
    default_batch, default_image = SHAPES.get(name, (32, 224))
    batch, image = batch or default_batch, image or default_image
    classes = CLASSES.get(name, 1000)
    return model, torch.randn(batch, 3, image, image), torch.randint(0, classes, (batch,))


def comma_list(parser: argparse.ArgumentParser, text: str, allowed: Sequence[str], what: str) -> list[str]:
    """The comma-separated names in ``text``; the parser exits naming any not in ``allowed``."""
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        parser.error(f"unknown {what} {unknown}; choose from {tuple(allowed)}")
    return names
