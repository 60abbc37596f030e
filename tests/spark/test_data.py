"""hora.spark.common.data on a real Spark (local[2]): checks, Parquet written once, shards read back.

The DataFrame is digits-like (64 pixel values per row, an int label 0-9) with an ``id`` column so a
test can see which rows each simulated rank read. Two ranks are two readers in this process.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import pyarrow as pa
import pyarrow.parquet as pq

from hora.errors import ConfigError
from hora.spark.common.data import ParquetShardReader, check_and_describe, steps_per_epoch, write_training_data
from hora.spark.common.store import Store

ROWS = 240


@pytest.fixture(scope="module")
def digits(spark):
    """``features`` array<double>[64], ``vector`` the same as an ML vector, ``label`` int, ``id`` long."""
    from pyspark.ml.functions import array_to_vector

    rng = np.random.default_rng(0)
    rows = [(i, [float(v) for v in rng.integers(0, 17, 64)], i % 10) for i in range(ROWS)]
    df = spark.createDataFrame(rows, "id long, features array<double>, label int")
    return df.withColumn("vector", array_to_vector("features")).cache()


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


@pytest.fixture(scope="module")
def written(digits, tmp_path_factory):
    """``digits`` written once (4 files, no validation) for the tests that only read."""
    store = Store.create(str(tmp_path_factory.mktemp("written")))
    return store, _write(store, digits, features=("features", "vector", "id"))


def _write(store, df, features=("features", "id"), labels=("label",), validation=None, partitions=4, seed=3):
    schema = check_and_describe(df, list(features), list(labels), validation=validation)
    return write_training_data(store, df, schema, validation, store.new_dataset_index(), partitions, seed)


def _epoch_ids(reader: ParquetShardReader, epochs: int) -> list[np.ndarray]:
    """The ids the reader yields, cut into its epochs (batches may straddle them)."""
    sizes = [reader.rows_in_epoch(e) for e in range(epochs)]
    batches = iter(reader)
    stream = np.concatenate([next(batches)["id"] for _ in range(math.ceil(sum(sizes) / reader.batch_size))])
    return np.split(stream[:sum(sizes)], np.cumsum(sizes)[:-1])


def _all_ids(path: str, store) -> set[int]:
    return set(pq.ParquetDataset(path, filesystem=store.filesystem).read(columns=["id"]).column("id").to_pylist())


def test_describe_records_dtypes_and_shapes(digits):
    schema = check_and_describe(digits, ["features", "vector"], ["label"], sample_weight_col="id")
    assert schema.num_rows == ROWS
    assert schema.column_names == ["features", "vector", "label", "id"]
    assert schema.shape("features") == (64,) and schema.dtype("features") == np.float64
    assert schema.shape("vector") == (64,) and schema.columns["vector"].is_vector
    assert schema.shape("label") == () and schema.dtype("label") == np.int32
    assert schema.dtype("id") == np.int64


@pytest.mark.parametrize("column", ["features", "vector"])
def test_two_ranks_read_every_row_once_per_epoch(written, column):
    store, info = written
    assert info.train_rows == ROWS and info.val_path is None and info.val_rows == 0
    readers = [ParquetShardReader(info.train_path, store.filesystem, rank, 2, [column, "label", "id"],
                                  batch_size=16, shuffle_buffer_size=32, seed=5) for rank in range(2)]
    per_rank = [_epoch_ids(reader, 3) for reader in readers]
    for epoch in range(3):
        first, second = per_rank[0][epoch], per_rank[1][epoch]
        assert sorted(np.concatenate([first, second]).tolist()) == list(range(ROWS))
    assert per_rank[0][0].tolist() != per_rank[0][1].tolist()  # reshuffled each epoch
    batch = next(iter(readers[1]))
    assert batch[column].shape == (16, 64) and batch[column].dtype == np.float64
    assert batch["label"].shape == (16,) and batch["label"].dtype == np.int32
    assert batch["id"].dtype == np.int64
    # The row's values travel with it: a row's label is its id's.
    assert (batch["label"] == batch["id"] % 10).all()


def test_shuffle_buffer_mixes_row_groups_and_no_shuffle_is_deterministic(written):
    store, info = written
    fs = store.filesystem
    file_of = {}
    for index, name in enumerate(store.get_parquet_dataset(info.train_path).files):
        with fs.open_input_file(name) as source:
            file_of.update({i: index for i in pq.read_table(source, columns=["id"]).column("id").to_pylist()})

    def switches(reader):
        ids = _epoch_ids(reader, 1)[0]
        return sum(file_of[a] != file_of[b] for a, b in zip(ids, ids[1:])), ids.tolist()

    def reader(**kwargs):
        return ParquetShardReader(info.train_path, fs, 0, 2, ["id"], batch_size=8, seed=1, **kwargs)

    unbuffered, _ = switches(reader(shuffle_buffer_size=0))
    buffered, ids = switches(reader(shuffle_buffer_size=64))
    assert unbuffered == len(reader().units_for_epoch(0)) - 1  # one row group after the other
    assert buffered > 4 * unbuffered
    assert switches(reader(shuffle_buffer_size=64))[1] == ids  # the same seed, the same order
    plain = [next(iter(reader(shuffle=False)))["id"].tolist() for _ in range(2)]
    assert plain[0] == plain[1]
    ordered = _epoch_ids(reader(shuffle=False), 2)
    assert ordered[0].tolist() == ordered[1].tolist()  # every epoch alike


def test_validation_by_fraction(digits, store):
    info = _write(store, digits, validation=0.25, seed=11)
    assert info.train_rows + info.val_rows == ROWS and 0.1 * ROWS < info.val_rows < 0.4 * ROWS
    train, val = _all_ids(info.train_path, store), _all_ids(info.val_path, store)
    assert not train & val and train | val == set(range(ROWS))


def test_validation_by_column(digits, store):
    # A boolean column passes the check; a 0/1 one is split the same way (written here).
    check_and_describe(digits.selectExpr("*", "id % 5 = 0 as is_val"), ["features"], ["label"], validation="is_val")
    # Dots in names are names, not struct fields.
    df = digits.selectExpr("id", "features as `pix.els`", "label", "cast(id % 5 = 0 as int) as `is.val`")
    info = _write(store, df, features=("pix.els", "id"), validation="is.val")
    assert _all_ids(info.val_path, store) == set(range(0, ROWS, 5))
    assert _all_ids(info.train_path, store) == set(range(ROWS)) - set(range(0, ROWS, 5))
    assert (info.train_rows, info.val_rows) == (ROWS - ROWS // 5, ROWS // 5)
    assert pq.ParquetDataset(info.train_path, filesystem=store.filesystem).schema.names == ["pix.els", "id", "label"]


def test_two_fits_on_one_store_keep_their_rows(digits, store):
    evens = _write(store, digits.filter("id % 2 = 0"), partitions=2)
    odds = _write(store, digits.filter("id % 2 = 1"), partitions=2)
    assert _all_ids(evens.train_path, store) == set(range(0, ROWS, 2))
    assert _all_ids(odds.train_path, store) == set(range(1, ROWS, 2))


def test_dbfs_store_written_by_spark_through_the_mount(digits, tmp_path):
    store = Store.create("dbfs:/team/hora", mount_root=str(tmp_path / "dbfs"))
    info = _write(store, digits, partitions=2)
    assert info.train_path.startswith(f"{tmp_path}/dbfs/team/hora/intermediate_train_data.")
    assert _all_ids(info.train_path, store) == set(range(ROWS))


def _bad(df, features=("features",), labels=("label",), validation=None):
    with pytest.raises(ConfigError) as info:
        check_and_describe(df, list(features), list(labels), validation=validation)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_input_fails_with_one_line_naming_the_problem(spark, digits):
    message = _bad(digits, features=["pixels"])
    assert "'pixels'" in message and "id, features, label, vector" in message
    message = _bad(digits.selectExpr("features", "cast(label as string) as label"))
    assert "label column 'label'" in message and "string" in message
    message = _bad(digits.selectExpr("transform(features, x -> cast(x as string)) as features", "label"))
    assert "feature column 'features'" in message and "array<string>" in message
    assert "empty" in _bad(digits.limit(0))
    assert "'nope'" in _bad(digits, validation="nope")
    assert "validation column 'tag'" in _bad(digits.selectExpr("*", "'x' as tag"), validation="tag")
    assert "0/1" in _bad(digits.selectExpr("*", "cast(id % 3 as int) as v"), validation="v")
    for fraction in (1, 1.5, -0.1):
        assert "[0, 1)" in _bad(digits, validation=fraction)
    for none in (0, 0.0, None):  # Horovod's "no validation"
        assert check_and_describe(digits, ["features"], ["label"], validation=none).num_rows == digits.count()
    assert "null" in _bad(digits.selectExpr("features", "if(id = 3, null, label) as label"))
    ragged = digits.selectExpr("if(id = 3, array(1.0), features) as features", "label")
    assert "different lengths (1 to 64)" in _bad(ragged)


def test_steps_per_epoch_is_horovods_default():
    assert steps_per_epoch(1000, 32, 2) == 15
    assert steps_per_epoch(10, 32, 4) == 1


def test_reader_splits_row_groups_when_ranks_outnumber_them(tmp_path):
    from pyarrow import fs as pafs

    path = tmp_path / "one"
    path.mkdir()
    pq.write_table(pa.table({"id": np.arange(10), "x": [[float(i)] * 3 for i in range(10)]}), path / "p.parquet")
    fs = pafs.LocalFileSystem()
    readers = [ParquetShardReader(f"file://{path}", fs, rank, 3, ["id", "x"], batch_size=2, seed=0)
               for rank in range(3)]
    ids = [_epoch_ids(reader, 1)[0] for reader in readers]
    assert sorted(np.concatenate(ids).tolist()) == list(range(10)) and all(len(i) for i in ids)
    assert next(iter(readers[0]))["x"].shape == (2, 3)
    with pytest.raises(ConfigError, match="fewer than the 11 processes"):
        ParquetShardReader(str(path), fs, 0, 11, ["id"])
    with pytest.raises(ConfigError, match="'nope'"):
        ParquetShardReader(str(path), fs, 0, 1, ["nope"])
