"""Where a Spark Estimator keeps its intermediate data and its runs (horovod.spark.common.store).

A store is a directory tree under ``prefix_path``::

    <prefix>/intermediate_train_data.<idx>   training rows of one fit, as Parquet
    <prefix>/intermediate_val_data.<idx>     its validation rows
    <prefix>/runs/<run_id>/checkpoint         the run's checkpoint (see get_checkpoint_path)
    <prefix>/runs/<run_id>/logs               its logs

Every fit takes a dataset index of its own (:meth:`Store.new_dataset_index`), so two estimators
fitted one after the other on one store and ``run_id`` never read each other's rows, and
:meth:`Store.remove_data` removes exactly one fit's data afterwards.

A path has three spellings, because three readers want different ones: the store's own (what the
``get_*_path`` methods return: ``file:///...``, ``hdfs://nn:8020/...``, ``dbfs:/...``), Spark's
(:meth:`Store.to_spark_path`, what ``DataFrameWriter.parquet`` takes) and pyarrow's
(:meth:`Store.get_localized_path`, what :attr:`Store.filesystem` opens). Every method that takes a
path accepts any of them.

Storage goes through ``pyarrow.fs`` (local disk, HDFS through libhdfs, Databricks' ``/dbfs`` FUSE
mount), so a store pickles to Spark's executors and reopens its filesystem there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import tempfile
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from hora.errors import ConfigError

logger = logging.getLogger(__name__)

_TRAIN = "intermediate_train_data"
_VAL = "intermediate_val_data"
_TEST = "intermediate_test_data"
_RUNS = "runs"


class Store:
    """Storage for intermediate DataFrames (Parquet) and training artefacts (checkpoints, logs).

    Construct one with :meth:`Store.create`, which picks the class from the prefix. The concrete
    stores share :class:`FilesystemStore`; this base says what an Estimator may rely on.
    """

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> Store:
        """The store for ``prefix_path``: HDFS for ``hdfs://``, Databricks' DBFS for ``dbfs:/`` and
        ``/dbfs/``, the local filesystem for a plain path or ``file://`` (Horovod's dispatch)."""
        if not isinstance(prefix_path, str) or not prefix_path:
            raise ConfigError(f"Store.create needs a path or URL as prefix_path, got {prefix_path!r}")
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        return LocalStore(prefix_path, *args, **kwargs)

    # What every store provides (implemented by FilesystemStore).
    def is_parquet_dataset(self, path: str) -> bool:
        raise NotImplementedError

    def get_parquet_dataset(self, path: str) -> Any:
        raise NotImplementedError

    def get_train_data_path(self, idx: str | int | None = None) -> str:
        raise NotImplementedError

    def get_val_data_path(self, idx: str | int | None = None) -> str:
        raise NotImplementedError

    def get_test_data_path(self, idx: str | int | None = None) -> str:
        raise NotImplementedError

    def saving_runs(self) -> bool:
        raise NotImplementedError

    def get_runs_path(self) -> str:
        raise NotImplementedError

    def get_run_path(self, run_id: str) -> str:
        raise NotImplementedError

    def get_checkpoint_path(self, run_id: str) -> str | None:
        raise NotImplementedError

    def get_checkpoint_filename(self) -> str:
        raise NotImplementedError

    def get_logs_path(self, run_id: str) -> str | None:
        raise NotImplementedError

    def get_logs_subdir(self) -> str:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def write_text(self, path: str, text: str) -> None:
        self.write(path, text.encode("utf-8"))

    @property
    def filesystem(self) -> Any:
        """The ``pyarrow.fs.FileSystem`` the store's localized paths belong to."""
        raise NotImplementedError

    def new_dataset_index(self) -> str:
        raise NotImplementedError

    def remove_data(self, idx: str | int) -> None:
        raise NotImplementedError

    def to_remote(self, run_id: str, dataset_idx: str | int | None) -> SimpleNamespace:
        """The paths and helpers one run needs, as plain attributes (Horovod's remote view)."""
        return SimpleNamespace(
            train_data_path=self.get_train_data_path(dataset_idx),
            val_data_path=self.get_val_data_path(dataset_idx),
            test_data_path=self.get_test_data_path(dataset_idx),
            saving_runs=self.saving_runs(),
            runs_path=self.get_runs_path(),
            run_path=self.get_run_path(run_id),
            checkpoint_path=self.get_checkpoint_path(run_id),
            logs_path=self.get_logs_path(run_id),
            checkpoint_filename=self.get_checkpoint_filename(),
            logs_subdir=self.get_logs_subdir(),
            get_local_output_dir=self.get_local_output_dir_fn(run_id),
            sync=self.sync_fn(run_id),
        )

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        raise NotImplementedError

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        raise NotImplementedError


class FilesystemStore(Store):
    """A store on one ``pyarrow.fs`` filesystem; subclasses say how paths are spelled.

    ``train_path``/``val_path``/``test_path``/``runs_path`` move those trees elsewhere (Horovod's
    arguments); ``save_runs=False`` keeps no checkpoints or logs (their paths are then None);
    ``storage_options`` is kept for Horovod compatibility (pyarrow's local, HDFS and DBFS
    filesystems take their settings from the subclass's own arguments).
    """

    def __init__(self, prefix_path: str, train_path: str | None = None, val_path: str | None = None,
                 test_path: str | None = None, runs_path: str | None = None, save_runs: bool = True,
                 storage_options: dict | None = None, checkpoint_filename: str | None = None,
                 **kwargs: Any) -> None:
        if kwargs:
            logger.warning("%s ignores %s (not a Horovod store argument hora knows)",
                           type(self).__name__, ", ".join(sorted(kwargs)))
        self._filesystem: Any = None
        self.prefix_path = self.get_full_path(prefix_path)
        self._train_path = self._full_or_default(train_path, _TRAIN)
        self._val_path = self._full_or_default(val_path, _VAL)
        self._test_path = self._full_or_default(test_path, _TEST)
        self._runs_path = self._full_or_default(runs_path, _RUNS)
        self._save_runs = bool(save_runs)
        self.storage_options = dict(storage_options or {})
        self.checkpoint_filename = checkpoint_filename or "checkpoint"

    # -- spelling of paths (subclasses) -------------------------------------------------------

    def get_full_path(self, path: str) -> str:
        """``path`` in the store's own spelling (a URL naming the storage)."""
        raise NotImplementedError

    def get_localized_path(self, path: str) -> str:
        """``path`` as :attr:`filesystem` (pyarrow) opens it."""
        raise NotImplementedError

    def to_spark_path(self, path: str) -> str:
        """``path`` as Spark's DataFrameWriter/DataFrameReader take it (the full URL by default)."""
        return self.get_full_path(path)

    def get_full_path_fn(self) -> Callable[[str], str]:
        """A picklable function giving the full path (Horovod's name)."""
        return self.get_full_path

    def _connect(self) -> Any:
        """Open the pyarrow filesystem (again, after unpickling on an executor)."""
        raise NotImplementedError

    @property
    def filesystem(self) -> Any:
        """The ``pyarrow.fs.FileSystem`` the store's localized paths belong to."""
        if self._filesystem is None:
            self._filesystem = self._connect()
        return self._filesystem

    @property
    def fs(self) -> Any:
        """Horovod's name for :attr:`filesystem`."""
        return self.filesystem

    def get_filesystem(self) -> Any:
        return self.filesystem

    def __getstate__(self) -> dict[str, Any]:
        # A filesystem handle (an HDFS connection) is reopened where the store lands, not shipped.
        state = dict(self.__dict__)
        state["_filesystem"] = None
        return state

    # -- layout --------------------------------------------------------------------------------

    def _full_or_default(self, path: str | None, default_name: str) -> str:
        if path is not None:
            return self.get_full_path(path)
        return _join(self.prefix_path, default_name)

    def get_train_data_path(self, idx: str | int | None = None) -> str:
        return _indexed(self._train_path, idx)

    def get_val_data_path(self, idx: str | int | None = None) -> str:
        return _indexed(self._val_path, idx)

    def get_test_data_path(self, idx: str | int | None = None) -> str:
        return _indexed(self._test_path, idx)

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return _join(self._runs_path, run_id)

    def get_checkpoint_path(self, run_id: str) -> str | None:
        """The directory the run's checkpoint file (:meth:`get_checkpoint_filename`) goes in, as in
        Horovod 0.28 (the run's directory); None when the store saves no runs."""
        return self.get_run_path(run_id) if self._save_runs else None

    def get_checkpoint_filename(self) -> str:
        return self.checkpoint_filename

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> list[str]:
        """The run's files ending in ``suffix``, sorted (store spelling)."""
        directory = self.get_checkpoint_path(run_id)
        if directory is None or not self.exists(directory):
            return []
        from pyarrow import fs as pafs

        infos = self.filesystem.get_file_info(pafs.FileSelector(self.get_localized_path(directory)))
        return sorted(_join(directory, info.base_name) for info in infos
                      if info.type == pafs.FileType.File and info.base_name.endswith(suffix))

    def get_logs_path(self, run_id: str) -> str | None:
        return _join(self.get_run_path(run_id), self.get_logs_subdir()) if self._save_runs else None

    def get_logs_subdir(self) -> str:
        return "logs"

    # -- intermediate data ---------------------------------------------------------------------

    def new_dataset_index(self) -> str:
        """A dataset index no other fit has: the fit's data lives under paths no one else writes."""
        return uuid.uuid4().hex[:16]

    def remove_data(self, idx: str | int) -> None:
        """Delete one fit's intermediate train/val/test data (only that index's directories)."""
        if idx is None or str(idx) == "":
            raise ConfigError("remove_data needs the fit's dataset index; without one it would remove "
                              "the store's shared intermediate data paths")
        for path in (self.get_train_data_path(idx), self.get_val_data_path(idx), self.get_test_data_path(idx)):
            self.delete(path)

    # -- file access ---------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        from pyarrow import fs as pafs

        info = self.filesystem.get_file_info(self.get_localized_path(path))
        return info.type != pafs.FileType.NotFound

    def read(self, path: str) -> bytes:
        with self.filesystem.open_input_stream(self.get_localized_path(path)) as stream:
            return stream.read()

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (parents created); readers see the old file or the new one,
        never half of it: it is written beside the target, then moved over it."""
        local = self.get_localized_path(path)
        self.filesystem.create_dir(posixpath.dirname(local), recursive=True)
        partial = f"{local}.{uuid.uuid4().hex[:8]}.partial"
        try:
            with self.filesystem.open_output_stream(partial) as stream:
                stream.write(data)
            self.filesystem.move(partial, local)
        except BaseException:
            with contextlib.suppress(OSError):
                self.filesystem.delete_file(partial)
            raise

    def delete(self, path: str) -> None:
        """Remove a file or a directory tree; nothing happens when it is not there."""
        from pyarrow import fs as pafs

        local = self.get_localized_path(path)
        kind = self.filesystem.get_file_info(local).type
        if kind == pafs.FileType.Directory:
            self.filesystem.delete_dir(local)
        elif kind != pafs.FileType.NotFound:
            self.filesystem.delete_file(local)

    def is_parquet_dataset(self, path: str) -> bool:
        """Whether ``path`` is a Parquet dataset with at least one data file."""
        try:
            return len(self.get_parquet_dataset(path).files) > 0
        except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
            return False

    def get_parquet_dataset(self, path: str) -> Any:
        import pyarrow.parquet as pq

        return pq.ParquetDataset(self.get_localized_path(path), filesystem=self.filesystem)

    # -- run output ----------------------------------------------------------------------------

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """A context manager giving a local scratch directory for the run's output (Horovod's API:
        frameworks write checkpoints there, then :meth:`sync_fn` copies them into the store)."""
        @contextlib.contextmanager
        def local_output_dir() -> Iterator[str]:
            with tempfile.TemporaryDirectory(prefix=f"hora-{run_id}-") as directory:
                yield directory

        return local_output_dir

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A function copying a local directory's tree into the run's directory in the store."""
        store, run_path = self, self.get_run_path(run_id)

        def sync(local_dir: str) -> None:
            from pyarrow import fs as pafs

            target = store.get_localized_path(run_path)
            store.filesystem.create_dir(target, recursive=True)
            pafs.copy_files(local_dir, target, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=store.filesystem)

        return sync

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class LocalStore(FilesystemStore):
    """A store on this machine's filesystem (or one every executor mounts at the same path).

    ``prefix_path`` is a plain path (made absolute) or a ``file://`` URL; store paths are
    ``file:///...`` URLs, which Spark writes through its executors.
    """

    def get_full_path(self, path: str) -> str:
        return "file://" + self.get_localized_path(path)

    def get_localized_path(self, path: str) -> str:
        return _local_path(path, type(self).__name__)

    def _connect(self) -> Any:
        from pyarrow import fs as pafs

        return pafs.LocalFileSystem()


class HDFSStore(FilesystemStore):
    """A store on HDFS through ``pyarrow.fs.HadoopFileSystem`` (libhdfs and a JVM in this process).

    ``prefix_path`` is ``hdfs://namenode:8020/user/me/hora``, ``hdfs:///user/me/hora`` (the
    cluster's default namenode) or ``/user/me/hora``. Spark gets the full URL; pyarrow the path
    alone. ``host``/``port`` override the URL's, defaulting to ``default``/0 (``fs.defaultFS``).
    The filesystem is opened at once, so a machine without Hadoop fails here, saying what is missing.
    """

    FS_PREFIX = "hdfs://"

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None,
                 user: str | None = None, kerb_ticket: str | None = None, driver: str = "libhdfs",
                 extra_conf: dict[str, str] | None = None, *args: Any, **kwargs: Any) -> None:
        url_prefix, url_host, url_port, _ = self.parse_url(prefix_path)
        self._url_prefix = url_prefix
        if driver != "libhdfs":
            logger.warning("HDFSStore: driver=%r ignored: pyarrow.fs talks to HDFS through libhdfs only", driver)
        self._hdfs_kwargs = {"host": host or url_host or "default", "port": int(port or url_port or 0),
                             "user": user, "kerb_ticket": kerb_ticket, "extra_conf": extra_conf}
        super().__init__(prefix_path, *args, **kwargs)
        self._filesystem = self._connect()

    @classmethod
    def matches(cls, path: str) -> bool:
        return path.startswith(cls.FS_PREFIX)

    @classmethod
    def parse_url(cls, url: str) -> tuple[str, str | None, int | None, str]:
        """``(url_prefix, host, port, path)`` of an HDFS URL or a bare absolute path."""
        if not isinstance(url, str) or not url:
            raise ConfigError(f"HDFSStore needs an hdfs:// URL or an absolute path, got {url!r}")
        if not cls.matches(url):
            if "://" in url or not url.startswith("/"):
                raise ConfigError(f"HDFSStore: {url!r} is not an HDFS path: give hdfs://host:port/path, "
                                  f"hdfs:///path or /path")
            return cls.FS_PREFIX, None, None, url
        parts = urlsplit(url)
        if not parts.path.startswith("/"):
            raise ConfigError(f"HDFSStore: no path in {url!r}: give hdfs://host:port/path")
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"HDFSStore: bad port in {url!r}") from None
        return f"{cls.FS_PREFIX}{parts.netloc}", parts.hostname, port, parts.path

    def get_full_path(self, path: str) -> str:
        if self.matches(path):
            return path
        return self._url_prefix + self.get_localized_path(path)

    def get_localized_path(self, path: str) -> str:
        if self.matches(path):
            return self.parse_url(path)[3]
        if not path.startswith("/"):
            raise ConfigError(f"HDFSStore: {path!r} is not an absolute HDFS path")
        return path

    def _connect(self) -> Any:
        from pyarrow import fs as pafs

        kwargs = self._hdfs_kwargs
        try:
            return pafs.HadoopFileSystem(kwargs["host"], kwargs["port"], user=kwargs["user"],
                                         kerb_ticket=kwargs["kerb_ticket"], extra_conf=kwargs["extra_conf"])
        except OSError as exc:
            raise ConfigError(_hdfs_unavailable(self.prefix_path, exc)) from None


def _hdfs_unavailable(prefix_path: str, exc: OSError) -> str:
    """One line saying why pyarrow could not open HDFS, naming the missing pieces of Hadoop."""
    reason = (str(exc).strip().splitlines() or ["unknown error"])[0]
    missing = []
    if not os.environ.get("JAVA_HOME"):
        missing.append("JAVA_HOME is not set (libhdfs runs a JVM in this process)")
    if not (os.environ.get("HADOOP_HOME") or os.environ.get("ARROW_LIBHDFS_DIR")):
        missing.append("neither HADOOP_HOME nor ARROW_LIBHDFS_DIR is set (where libhdfs.so is)")
    if "hadoop" not in os.environ.get("CLASSPATH", "").lower():
        missing.append("CLASSPATH lacks Hadoop's jars (export CLASSPATH=$(hadoop classpath --glob))")
    hint = "; ".join(missing) if missing else "check the namenode address and the Hadoop configuration"
    return f"HDFSStore({prefix_path!r}) cannot open HDFS: pyarrow said '{reason}'; {hint}"


class DBFSLocalStore(LocalStore):
    """A store on Databricks' DBFS through its local FUSE mount (``/dbfs``), as in Horovod.

    ``prefix_path`` is ``dbfs:/path``, ``/dbfs/path``, ``file:/dbfs/path`` or ``file:///dbfs/path``.
    Store paths are spelled ``dbfs:/path``; pyarrow opens them under the mount root (``/dbfs/path``);
    Spark gets ``dbfs:/path`` on Databricks. ``mount_root`` (default :attr:`MOUNT_ROOT`) moves the
    mount elsewhere, e.g. a directory standing in for DBFS in tests; Spark then writes through
    that directory (``file://<mount_root>/path``) as pyarrow does, since it has no ``dbfs:`` there.
    """

    MOUNT_ROOT = "/dbfs"
    DBFS_PREFIX = "dbfs:/"

    def __init__(self, prefix_path: str, *args: Any, mount_root: str | None = None, **kwargs: Any) -> None:
        root = mount_root if mount_root is not None else self.MOUNT_ROOT
        self.mount_root = os.path.abspath(root).rstrip("/") or "/"
        if not self.matches_dbfs(prefix_path) and not self._under_mount(prefix_path):
            raise ConfigError(f"DBFSLocalStore: {prefix_path!r} is not a DBFS path: give dbfs:/path or /dbfs/path")
        super().__init__(prefix_path, *args, **kwargs)

    @classmethod
    def matches_dbfs(cls, path: str) -> bool:
        """Whether ``path`` names DBFS: ``dbfs:/`` (not ``dbfs://``), ``/dbfs/``, ``file:/dbfs/``."""
        if path.startswith("dbfs:/"):
            return not path.startswith("dbfs://")
        return any(path == p or path.startswith(p + "/") for p in ("/dbfs", "file:/dbfs", "file:///dbfs"))

    def _under_mount(self, path: str) -> bool:
        return path == self.mount_root or path.startswith(self.mount_root + "/")

    def _dbfs_relative(self, path: str) -> str:
        """The path inside DBFS (``/x`` for ``dbfs:/x``, ``/dbfs/x``, ``<mount_root>/x``...)."""
        if path.startswith("dbfs:/") and not path.startswith("dbfs://"):
            inner = path[len("dbfs:"):]
        elif self._under_mount(path):
            inner = path[len(self.mount_root):]
        elif self.matches_dbfs(path):
            inner = _local_path(path, type(self).__name__)[len("/dbfs"):]
        else:
            raise ConfigError(f"DBFSLocalStore: {path!r} is not a DBFS path: give dbfs:/path or /dbfs/path")
        return posixpath.normpath("/" + inner.lstrip("/"))

    def get_full_path(self, path: str) -> str:
        return "dbfs:" + self._dbfs_relative(path)

    def get_localized_path(self, path: str) -> str:
        inner = self._dbfs_relative(path)
        return self.mount_root + inner if inner != "/" else self.mount_root

    def to_spark_path(self, path: str) -> str:
        if self.mount_root == self.MOUNT_ROOT:
            return self.get_full_path(path)
        return "file://" + self.get_localized_path(path)


def _local_path(path: str, owner: str) -> str:
    """An absolute local path from a plain path or a ``file:`` URL."""
    if path.startswith("file:"):
        parts = urlsplit(path)
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"{owner}: {path!r} names another host; give file:///path or a plain path")
        return posixpath.normpath(parts.path or "/")
    if "://" in path:
        scheme = path.split("://", 1)[0]
        raise ConfigError(f"{owner}: no hora store for {scheme}:// paths ({path!r}); hora stores take a local "
                          f"path or file://, hdfs:// and dbfs:/ URLs")
    return os.path.abspath(path)


def _join(base: str, *names: str) -> str:
    """``base/name/...``, for URLs as for paths (store paths are URLs, not OS paths)."""
    return "/".join([base.rstrip("/")] + [str(n).strip("/") for n in names])


def _indexed(path: str, idx: str | int | None) -> str:
    return f"{path}.{idx}" if idx is not None else path
