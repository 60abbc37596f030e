"""hora.spark.common.store: Horovod's Store API on pyarrow filesystems.

No Spark here (test_data.py writes through Spark): the layout, the three spellings of a path, one
fit's data kept apart from another's, the DBFS mount mapping on a stand-in mount root, and HDFS's
path handling (on the local filesystem standing in for HDFS) and its one-line error without Hadoop.
"""

from __future__ import annotations

import ctypes.util
import pickle

import pytest

pytest.importorskip("pyarrow")

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from hora.errors import ConfigError
from hora.spark.common.store import DBFSLocalStore, HDFSStore, LocalStore, Store


def _write_dataset(store: Store, path: str, ids: list[int]) -> None:
    local = store.get_localized_path(path)
    store.filesystem.create_dir(local, recursive=True)
    pq.write_table(pa.table({"id": ids}), f"{local}/part-0.parquet", filesystem=store.filesystem)


def _ids(store: Store, path: str) -> list[int]:
    return sorted(store.get_parquet_dataset(path).read().column("id").to_pylist())


def test_create_picks_the_store_from_the_prefix(tmp_path):
    assert type(Store.create(str(tmp_path / "s"))) is LocalStore
    assert type(Store.create(f"file://{tmp_path}/s")) is LocalStore
    assert type(Store.create("dbfs:/hora/s", mount_root=str(tmp_path))) is DBFSLocalStore
    assert type(Store.create("/dbfs/hora/s", mount_root=str(tmp_path))) is DBFSLocalStore
    with pytest.raises(ConfigError, match="s3://"):
        Store.create("s3://bucket/s")


def test_local_store_layout_in_horovod_names(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    prefix = f"file://{tmp_path}/s"
    assert store.prefix_path == prefix
    assert store.get_train_data_path() == f"{prefix}/intermediate_train_data"
    assert store.get_train_data_path(7) == f"{prefix}/intermediate_train_data.7"
    assert store.get_val_data_path("a") == f"{prefix}/intermediate_val_data.a"
    assert store.get_test_data_path("a") == f"{prefix}/intermediate_test_data.a"
    assert store.get_runs_path() == f"{prefix}/runs"
    assert store.get_run_path("r1") == f"{prefix}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{prefix}/runs/r1"
    assert store.get_checkpoint_filename() == "checkpoint"
    assert store.get_logs_path("r1") == f"{prefix}/runs/r1/logs" and store.get_logs_subdir() == "logs"
    assert store.saving_runs()
    assert store.get_localized_path(store.get_run_path("r1")) == f"{tmp_path}/s/runs/r1"
    assert store.to_spark_path(f"{tmp_path}/s/x") == f"{prefix}/x"
    assert isinstance(store.filesystem, pafs.LocalFileSystem)
    quiet = Store.create(str(tmp_path / "q"), save_runs=False, storage_options={"anon": True})
    assert quiet.get_checkpoint_path("r1") is None and quiet.get_logs_path("r1") is None
    assert quiet.storage_options == {"anon": True}


def test_read_write_exists_and_checkpoints(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    target = f"{store.get_checkpoint_path('r1')}/{store.get_checkpoint_filename()}"
    assert not store.exists(target)
    store.write(target, b"weights-1")
    store.write(target, b"weights-2")
    assert store.exists(target) and store.read(target) == b"weights-2"
    assert store.read(store.get_localized_path(target)) == b"weights-2"  # any spelling of the path
    assert sorted(p.name for p in (tmp_path / "s" / "runs" / "r1").iterdir()) == ["checkpoint"]  # no leftovers
    store.write(f"{store.get_run_path('r1')}/epoch-1.ckpt", b"1")
    assert store.get_checkpoints("r1") == [f"{store.get_run_path('r1')}/epoch-1.ckpt"]


def test_two_dataset_indices_keep_their_data_apart_and_remove_data_removes_one(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    first, second = store.new_dataset_index(), store.new_dataset_index()
    assert first != second
    assert store.get_train_data_path(first) != store.get_train_data_path(second)
    _write_dataset(store, store.get_train_data_path(first), [1, 2, 3])
    _write_dataset(store, store.get_val_data_path(first), [4])
    _write_dataset(store, store.get_train_data_path(second), [10, 20])
    assert store.is_parquet_dataset(store.get_train_data_path(first))
    assert _ids(store, store.get_train_data_path(first)) == [1, 2, 3]
    assert _ids(store, store.get_train_data_path(second)) == [10, 20]
    store.remove_data(first)
    assert not store.exists(store.get_train_data_path(first)) and not store.exists(store.get_val_data_path(first))
    assert not store.is_parquet_dataset(store.get_train_data_path(first))
    assert _ids(store, store.get_train_data_path(second)) == [10, 20]
    store.remove_data(first)  # already gone: nothing to do
    with pytest.raises(ConfigError, match="dataset index"):
        store.remove_data(None)


def test_store_pickles_and_reopens_its_filesystem(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    store.write(store.get_run_path("r") + "/f", b"x")
    copy = pickle.loads(pickle.dumps(store))
    assert copy.read(copy.get_run_path("r") + "/f") == b"x"


def test_remote_view_and_sync(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    remote = store.to_remote("r1", "idx")
    assert remote.train_data_path == store.get_train_data_path("idx") and remote.run_path == store.get_run_path("r1")
    with remote.get_local_output_dir() as local:
        with open(f"{local}/model.ckpt", "wb") as f:
            f.write(b"m")
        remote.sync(local)
    assert store.read(f"{store.get_run_path('r1')}/model.ckpt") == b"m"


def test_dbfs_paths_map_to_the_mount(tmp_path):
    mount = tmp_path / "dbfs"
    store = Store.create("dbfs:/team/hora", mount_root=str(mount))
    assert store.prefix_path == "dbfs:/team/hora"
    train = store.get_train_data_path("i")
    assert train == "dbfs:/team/hora/intermediate_train_data.i"
    assert store.get_localized_path(train) == f"{mount}/team/hora/intermediate_train_data.i"
    assert store.get_localized_path("/dbfs/team/x") == f"{mount}/team/x"
    assert store.get_full_path(f"{mount}/team/x") == "dbfs:/team/x"
    assert store.to_spark_path(train) == f"file://{mount}/team/hora/intermediate_train_data.i"
    store.write(f"{store.get_checkpoint_path('r')}/checkpoint", b"c")
    assert (mount / "team" / "hora" / "runs" / "r" / "checkpoint").read_bytes() == b"c"
    assert store.exists("dbfs:/team/hora/runs/r/checkpoint")
    # The spellings Horovod accepts name the same store.
    for spelling in ("/dbfs/team/hora", "file:/dbfs/team/hora", "file:///dbfs/team/hora"):
        assert DBFSLocalStore(spelling, mount_root=str(mount)).prefix_path == "dbfs:/team/hora"


def test_dbfs_on_databricks_gives_spark_dbfs_urls():
    store = DBFSLocalStore("/dbfs/team/hora")  # opens nothing until used
    assert store.get_localized_path(store.get_runs_path()) == "/dbfs/team/hora/runs"
    assert store.to_spark_path(store.get_runs_path()) == "dbfs:/team/hora/runs"
    with pytest.raises(ConfigError, match="not a DBFS path"):
        DBFSLocalStore("/tmp/elsewhere")


def test_hdfs_path_handling(tmp_path, monkeypatch):
    # The local filesystem stands in for HDFS: the paths pyarrow gets are HDFS's, under tmp_path.
    monkeypatch.setattr(HDFSStore, "_connect", lambda self: pafs.LocalFileSystem())
    store = Store.create(f"hdfs://namenode:8020{tmp_path}/hora", user="me")
    assert type(store) is HDFSStore
    assert store._hdfs_kwargs["host"] == "namenode" and store._hdfs_kwargs["port"] == 8020
    assert store.get_train_data_path(3) == f"hdfs://namenode:8020{tmp_path}/hora/intermediate_train_data.3"
    assert store.to_spark_path(store.get_train_data_path(3)) == store.get_train_data_path(3)
    assert store.get_localized_path(store.get_run_path("r")) == f"{tmp_path}/hora/runs/r"
    assert store.get_full_path(f"{tmp_path}/x") == f"hdfs://namenode:8020{tmp_path}/x"
    store.write(f"{store.get_run_path('r')}/checkpoint", b"h")
    assert (tmp_path / "hora" / "runs" / "r" / "checkpoint").read_bytes() == b"h"
    default = HDFSStore("hdfs:///user/me/hora", host="nn2", port=9000)
    assert default.get_run_path("r") == "hdfs:///user/me/hora/runs/r"
    assert default._hdfs_kwargs["host"] == "nn2" and default._hdfs_kwargs["port"] == 9000
    bare = HDFSStore("/user/me/hora")
    assert bare.prefix_path == "hdfs:///user/me/hora" and bare._hdfs_kwargs["host"] == "default"
    with pytest.raises(ConfigError, match="not an HDFS path"):
        HDFSStore("s3://bucket/hora")


@pytest.mark.skipif(ctypes.util.find_library("hdfs") is not None, reason="libhdfs is installed here")
def test_hdfs_without_hadoop_fails_with_one_line_naming_what_is_missing(tmp_path, monkeypatch):
    for name in ("HADOOP_HOME", "ARROW_LIBHDFS_DIR", "CLASSPATH"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as info:
        Store.create("hdfs://namenode:8020/user/me/hora")
    message = str(info.value)
    assert "\n" not in message and "HDFSStore('hdfs://namenode:8020/user/me/hora') cannot open HDFS" in message
    assert "HADOOP_HOME" in message and "CLASSPATH" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
