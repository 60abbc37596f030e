"""The digits data as a Spark DataFrame, and held-out accuracy: shared by the Spark Estimator examples."""

from __future__ import annotations

from typing import Any


def digits_frame(spark: Any) -> Any:
    """scikit-learn's 1797 8x8 digit scans: 64 pixel columns p0..p63 (0-1) and an integer label."""
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = [tuple(float(v) / 16.0 for v in x) + (int(y),) for x, y in zip(data.data, data.target)]
    return spark.createDataFrame(rows, [f"p{i}" for i in range(64)] + ["label"])


def pixel_columns() -> list[str]:
    return [f"p{i}" for i in range(64)]


def held_out_accuracy(fitted: Any, test_df: Any) -> tuple[float, int]:
    """The share of ``test_df``'s rows whose highest ``label__output`` score is their label."""
    rows = fitted.transform(test_df).select("label", "label__output").collect()
    hits = sum(int(max(range(len(row["label__output"])), key=lambda k: row["label__output"][k]) == row["label"])
               for row in rows)
    return hits / len(rows), len(rows)
