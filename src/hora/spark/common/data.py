"""A DataFrame's way to the training processes: checked, written once to Parquet, read in shares.

1. :func:`check_and_describe` looks at the DataFrame before anything is written or started, so a
   missing column, a string label or an empty DataFrame fails at once with one line naming the
   problem, not as a stack trace from inside a training task minutes later. It records each
   column's NumPy dtype and shape (what the model will be fed).
2. :func:`write_training_data` writes the training rows (and the validation rows) once, through
   Spark's DataFrameWriter so the executors write in parallel, under the fit's own dataset index
   in the store, in enough files that every process gets a share.
3. :class:`ParquetShardReader` is what each training process iterates: it reads its share of the
   row groups with pyarrow (every row group by exactly one rank per epoch), mixes rows through a
   shuffle buffer, and yields batches of NumPy arrays shaped as the columns are, for ever (the
   caller takes :func:`steps_per_epoch` batches per epoch, the same number on every rank).

Only the first two need PySpark (imported when called): the reader runs in any Python with pyarrow.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hora.errors import ConfigError

logger = logging.getLogger(__name__)

# Spark SQL scalar types a model can be fed, by type class name, and their NumPy dtypes.
_NUMERIC_TYPES = {
    "ByteType": np.int8, "ShortType": np.int16, "IntegerType": np.int32, "LongType": np.int64,
    "FloatType": np.float32, "DoubleType": np.float64, "BooleanType": np.bool_,
}
_ACCEPTED = "numbers, arrays of numbers or ML vectors"


@dataclass(frozen=True)
class ColumnInfo:
    """One column as the model sees it: a row's value is a ``dtype`` array of ``shape``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    spark_type: str
    is_vector: bool = False


@dataclass(frozen=True)
class DataSchema:
    """What :func:`check_and_describe` found: the columns' dtypes and shapes, and the row count."""

    feature_cols: tuple[str, ...]
    label_cols: tuple[str, ...]
    sample_weight_col: str | None
    columns: Mapping[str, ColumnInfo]
    num_rows: int

    @property
    def column_names(self) -> list[str]:
        """The columns training reads, each once: features, labels, then the sample weight."""
        names = list(self.feature_cols) + list(self.label_cols)
        if self.sample_weight_col:
            names.append(self.sample_weight_col)
        return list(dict.fromkeys(names))

    def dtype(self, name: str) -> np.dtype:
        return self.columns[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.columns[name].shape


@dataclass(frozen=True)
class DataInfo:
    """Where one fit's data went. ``train_path``/``val_path`` are spelled as the store's
    ``filesystem`` opens them (pyarrow paths), which is what :class:`ParquetShardReader` takes."""

    train_path: str
    val_path: str | None
    train_rows: int
    val_rows: int
    schema: DataSchema = field(repr=False)


# -- checking --------------------------------------------------------------------------------


def check_and_describe(df: Any, feature_cols: Sequence[str] | str, label_cols: Sequence[str] | str,
                       sample_weight_col: str | None = None, validation: float | str | None = None) -> DataSchema:
    """Check ``df`` can be trained on and describe its columns, failing with a one-line
    :class:`ConfigError` naming the problem: a missing column (and the ones there are), a column
    of strings or another type a model cannot take, an empty DataFrame, nulls, arrays of varying
    length, a validation column that is missing or not boolean/0-1, a fraction outside (0, 1).

    Runs one Spark job (an aggregation) for the row count, nulls and array lengths.
    """
    features = _names("feature_cols", feature_cols)
    labels = _names("label_cols", label_cols)
    roles = {name: "feature" for name in features}
    roles.update({name: "label" for name in labels if name not in roles})
    if sample_weight_col:
        roles.setdefault(sample_weight_col, "sample weight")
    validation_col = _check_validation_arg(validation)
    fields = {f.name: f for f in df.schema.fields}
    _check_exist(list(roles) + ([validation_col] if validation_col else []), fields)
    kinds = {name: _column_kind(name, role, fields[name].dataType) for name, role in roles.items()}
    if sample_weight_col and kinds[sample_weight_col][1] != "scalar":
        raise ConfigError(f"sample weight column {sample_weight_col!r} must hold one number per row, "
                          f"not {fields[sample_weight_col].dataType.simpleString()}")
    if validation_col:
        _check_validation_type(validation_col, fields[validation_col].dataType)
    stats = _gather_stats(df, kinds, validation_col, fields)
    columns = _describe(kinds, stats, fields, validation_col)
    return DataSchema(tuple(features), tuple(labels), sample_weight_col or None, columns, stats["rows"])


def _names(arg: str, value: Sequence[str] | str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    names = list(value or [])
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{arg} must be a non-empty list of column names, got {value!r}")
    return names


def _check_validation_arg(validation: Any) -> str | None:
    """The validation column's name, or None; a fraction must lie in (0, 1)."""
    if validation is None or isinstance(validation, str):
        return validation or None
    if isinstance(validation, bool) or not isinstance(validation, (int, float, np.integer, np.floating)):
        raise ConfigError(f"validation must be a fraction in (0, 1) or a column name, got {validation!r}")
    if float(validation) == 0.0:
        return None  # Horovod's "no validation"
    if not 0.0 < float(validation) < 1.0:
        raise ConfigError(f"validation fraction must lie in [0, 1), got {validation}")
    return None


def _check_exist(wanted: Iterable[str], fields: Mapping[str, Any]) -> None:
    missing = [name for name in dict.fromkeys(wanted) if name not in fields]
    if missing:
        noun = "column" if len(missing) == 1 else "columns"
        raise ConfigError(f"{noun} {', '.join(map(repr, missing))} not in the DataFrame; "
                          f"its columns are: {', '.join(fields)}")


def _column_kind(name: str, role: str, data_type: Any) -> tuple[np.dtype, str]:
    """``(dtype, kind)`` with kind ``scalar``, ``array`` or ``vector``; a type no model takes fails."""
    type_name = type(data_type).__name__
    if type_name == "VectorUDT":
        return np.dtype(np.float64), "vector"
    if type_name in _NUMERIC_TYPES:
        return np.dtype(_NUMERIC_TYPES[type_name]), "scalar"
    if type_name == "ArrayType":
        element = type(data_type.elementType).__name__
        if element in _NUMERIC_TYPES:
            return np.dtype(_NUMERIC_TYPES[element]), "array"
        raise ConfigError(f"{role} column {name!r} is {data_type.simpleString()}: arrays must hold numbers "
                          f"(hora trains on {_ACCEPTED})")
    simple = data_type.simpleString()
    if type_name == "StringType":
        raise ConfigError(f"{role} column {name!r} is of type {simple}: hora trains on {_ACCEPTED}; "
                          f"index or cast it first (e.g. StringIndexer)")
    if type_name == "DecimalType":
        raise ConfigError(f"{role} column {name!r} is of type {simple}: cast it to double first")
    raise ConfigError(f"{role} column {name!r} is of type {simple}: hora trains on {_ACCEPTED}")


def _check_validation_type(name: str, data_type: Any) -> None:
    type_name = type(data_type).__name__
    if type_name not in _NUMERIC_TYPES:
        raise ConfigError(f"validation column {name!r} is of type {data_type.simpleString()}: "
                          f"it must be boolean or 0/1 (true marks a validation row)")


def _gather_stats(df: Any, kinds: Mapping[str, tuple[np.dtype, str]], validation_col: str | None,
                  fields: Mapping[str, Any]) -> dict[str, Any]:
    """One aggregation: row count, nulls per column, array lengths, validation flags."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    def count_if(condition: Any, alias: str) -> Any:
        return F.sum(F.when(condition, 1).otherwise(0)).alias(alias)

    aggs = [F.count(F.lit(1)).alias("rows")]
    for i, (name, (_, kind)) in enumerate(kinds.items()):
        column = _col(df, name)
        aggs.append(count_if(column.isNull(), f"nulls_{i}"))
        if kind != "scalar":
            values = vector_to_array(column) if kind == "vector" else column
            aggs += [F.min(F.size(values)).alias(f"min_{i}"), F.max(F.size(values)).alias(f"max_{i}")]
        if kind == "array":
            aggs.append(count_if(F.exists(column, lambda x: x.isNull()), f"null_elements_{i}"))
    if validation_col:
        flag = _col(df, validation_col)
        if type(fields[validation_col].dataType).__name__ == "BooleanType":
            aggs += [count_if(flag.isNull(), "validation_bad"), count_if(flag, "validation_rows")]
        else:
            aggs += [count_if(flag.isNull() | ~flag.isin(0, 1), "validation_bad"),
                     count_if(flag == 1, "validation_rows")]
    row = df.agg(*aggs).collect()[0].asDict()
    row["rows"] = int(row["rows"])
    return row


def _describe(kinds: Mapping[str, tuple[np.dtype, str]], stats: Mapping[str, Any], fields: Mapping[str, Any],
              validation_col: str | None) -> dict[str, ColumnInfo]:
    """Turn the aggregation into column descriptions, failing on what training could not read."""
    if stats["rows"] == 0:
        raise ConfigError("the DataFrame is empty (0 rows): there is nothing to train on")
    columns = {}
    for i, (name, (dtype, kind)) in enumerate(kinds.items()):
        if stats[f"nulls_{i}"]:
            raise ConfigError(f"column {name!r} has {stats[f'nulls_{i}']} null value(s); drop or fill them first")
        shape: tuple[int, ...] = ()
        if kind != "scalar":
            low, high = int(stats[f"min_{i}"]), int(stats[f"max_{i}"])
            if low != high:
                raise ConfigError(f"{kind} column {name!r} has rows of different lengths ({low} to {high}); "
                                  f"every row must have the same length")
            if high == 0:
                raise ConfigError(f"{kind} column {name!r} holds only empty arrays")
            if stats.get(f"null_elements_{i}"):
                raise ConfigError(f"array column {name!r} has null elements in {stats[f'null_elements_{i}']} row(s)")
            shape = (high,)
        columns[name] = ColumnInfo(name, dtype, shape, fields[name].dataType.simpleString(), kind == "vector")
    if validation_col:
        if stats["validation_bad"]:
            raise ConfigError(f"validation column {validation_col!r} must be boolean or 0/1; "
                              f"{stats['validation_bad']} row(s) hold something else (or null)")
        if stats["validation_rows"] == stats["rows"]:
            raise ConfigError(f"validation column {validation_col!r} marks every row for validation: "
                              f"no rows are left to train on")
    return columns


# -- writing ---------------------------------------------------------------------------------


def write_training_data(store: Any, df: Any, schema: DataSchema, validation: float | str | None,
                        dataset_idx: str | int, num_partitions: int, random_seed: int = 0) -> DataInfo:
    """Write ``df``'s training (and validation) rows once, as Parquet under ``dataset_idx``.

    ML vectors become arrays of doubles and only the columns training reads are kept. A fraction
    splits with ``randomSplit`` and ``random_seed``; a column sends its true rows to validation.
    Each part is repartitioned into ``num_partitions`` files (give a multiple of the number of
    processes so each reads an equal share); an empty validation part is not kept (``val_path``
    None). Row counts come from the written files' footers, so they are what the readers will see.
    """
    if dataset_idx is None or str(dataset_idx) == "":
        raise ConfigError("write_training_data needs the fit's dataset index (store.new_dataset_index())")
    if int(num_partitions) < 1:
        raise ConfigError(f"num_partitions must be at least 1, got {num_partitions}")
    validation_col = _check_validation_arg(validation)
    prepared = _prepared(df, schema, validation_col)
    train, val = _split(prepared, validation, validation_col, random_seed)
    columns = schema.column_names
    train_path = store.get_train_data_path(dataset_idx)
    _write_parquet(store, train.select(*[_col(train, c) for c in columns]), train_path, int(num_partitions))
    train_rows = _count_rows(store, train_path)
    if train_rows == 0:
        store.remove_data(dataset_idx)
        raise ConfigError("no training rows are left after the validation split; lower the validation share")
    val_path, val_rows = None, 0
    if val is not None:
        val_path = store.get_val_data_path(dataset_idx)
        _write_parquet(store, val.select(*[_col(val, c) for c in columns]), val_path, int(num_partitions))
        val_rows = _count_rows(store, val_path)
        if val_rows == 0:
            logger.warning("validation %r selected no rows; training without validation", validation)
            store.delete(val_path)
            val_path = None
    logger.info("wrote %d training and %d validation rows under dataset index %s", train_rows, val_rows,
                dataset_idx)
    return DataInfo(store.get_localized_path(train_path), store.get_localized_path(val_path) if val_path else None,
                    train_rows, val_rows, schema)


def _prepared(df: Any, schema: DataSchema, validation_col: str | None) -> Any:
    """The columns to write (vectors as arrays), plus the validation column when there is one."""
    from pyspark.ml.functions import vector_to_array

    selected = [vector_to_array(_col(df, name)).alias(name) if schema.columns[name].is_vector else _col(df, name)
                for name in schema.column_names]
    if validation_col and validation_col not in schema.column_names:
        selected.append(_col(df, validation_col))
    return df.select(*selected)


def _col(df: Any, name: str) -> Any:
    """``df``'s column ``name`` taken literally (a dot in a name is not a struct field here)."""
    return df[f"`{name.replace('`', '``')}`"]


def _split(df: Any, validation: Any, validation_col: str | None, seed: int) -> tuple[Any, Any | None]:
    if validation is None or not validation_col and (isinstance(validation, str) or float(validation) == 0.0):
        return df, None
    if validation_col:
        flag = _col(df, validation_col).cast("boolean")
        return df.filter(~flag), df.filter(flag)
    fraction = float(validation)
    train, val = df.randomSplit([1.0 - fraction, fraction], seed=int(seed))
    return train, val


def _write_parquet(store: Any, df: Any, path: str, num_partitions: int) -> None:
    df.repartition(num_partitions).write.mode("overwrite").parquet(store.to_spark_path(path))


def _count_rows(store: Any, path: str) -> int:
    import pyarrow.parquet as pq

    total = 0
    for name in store.get_parquet_dataset(path).files:
        with store.filesystem.open_input_file(name) as source:
            total += pq.ParquetFile(source).metadata.num_rows
    return total


# -- reading ---------------------------------------------------------------------------------


def steps_per_epoch(total_rows: int, batch_size: int, size: int) -> int:
    """Horovod's default steps per epoch: ``total_rows // (batch_size * size)``, at least 1; every
    rank takes this many so the collectives stay matched even when shares differ by a row group."""
    return max(1, int(total_rows) // (int(batch_size) * int(size)))


@dataclass(frozen=True)
class _Unit:
    """Rows ``start:stop`` of one row group of one file: what a rank reads at a time."""

    file: int
    row_group: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class ParquetShardReader:
    """Rank ``rank`` of ``size``'s endless stream of batches from the Parquet dataset at ``path``.

    Row groups (of all the dataset's files) are dealt round-robin, so each is read by exactly one
    rank per epoch; with ``shuffle`` their order is a fresh permutation every epoch (``seed`` +
    epoch, the same on every rank) and a buffer of ``shuffle_buffer_size`` rows (default four
    batches) mixes rows across row groups. The row stream is epoch after epoch of the rank's share,
    each row once per epoch; batches are cut from it, so a batch may straddle two epochs.
    ``shuffle=False`` gives one fixed order. Batches are dicts of column name to a NumPy array of
    ``batch_size`` rows shaped like the column (an array column gives a 2-D array).

    ``path`` is a pyarrow path of ``filesystem`` (a ``file://``/``hdfs://`` URL is accepted too).
    When the dataset has fewer row groups than ranks, row groups are split into row ranges so
    every rank still gets rows.
    """

    def __init__(self, path: str, filesystem: Any, rank: int, size: int, columns: Sequence[str] | None = None,
                 batch_size: int = 32, shuffle_buffer_size: int | None = None, seed: int | None = 0,
                 shuffle: bool = True) -> None:
        if not 0 <= int(rank) < int(size):
            raise ConfigError(f"rank {rank} is not in 0..{int(size) - 1}")
        if int(batch_size) < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.path = _pyarrow_path(path)
        self.filesystem = filesystem
        self.rank, self.size, self.batch_size = int(rank), int(size), int(batch_size)
        self.shuffle = bool(shuffle)
        self.shuffle_buffer_size = 4 * self.batch_size if shuffle_buffer_size is None else int(shuffle_buffer_size)
        self.seed = int(seed or 0) % 2**32
        self._files, self._metadata = self._list_files()
        self.columns = self._check_columns(columns)
        units = [_Unit(i, g, 0, md.row_group(g).num_rows)
                 for i, md in enumerate(self._metadata) for g in range(md.num_row_groups)]
        units = [u for u in units if u.rows > 0]
        self.total_rows = sum(u.rows for u in units)
        if self.total_rows < self.size:
            raise ConfigError(f"{self.path} holds {self.total_rows} row(s), fewer than the {self.size} processes "
                              f"reading it")
        self._units = _split_units(units, self.size)

    def _list_files(self) -> tuple[list[str], list[Any]]:
        import pyarrow.parquet as pq

        try:
            files = sorted(pq.ParquetDataset(self.path, filesystem=self.filesystem).files)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the Parquet dataset at {self.path}: {exc}") from None
        if not files:
            raise ConfigError(f"no Parquet files at {self.path}")
        metadata = []
        for name in files:
            with self.filesystem.open_input_file(name) as source:
                metadata.append(pq.ParquetFile(source).metadata)
        return files, metadata

    def _check_columns(self, columns: Sequence[str] | None) -> list[str]:
        available = self._metadata[0].schema.to_arrow_schema().names
        if columns is None:
            return list(available)
        wanted = list(dict.fromkeys(columns))
        missing = [c for c in wanted if c not in available]
        if missing or not wanted:
            raise ConfigError(f"columns {missing or wanted!r} not in the Parquet data at {self.path}; "
                              f"it has: {', '.join(available)}")
        return wanted

    def units_for_epoch(self, epoch: int) -> list[_Unit]:
        """This rank's row groups (or row ranges) in ``epoch``, in reading order."""
        order = np.arange(len(self._units))
        if self.shuffle:
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(len(self._units))
        return [self._units[i] for i in order[self.rank::self.size]]

    def rows_in_epoch(self, epoch: int) -> int:
        """How many rows this rank reads in ``epoch`` (its share differs from others' by a unit)."""
        return sum(u.rows for u in self.units_for_epoch(epoch))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return _batches(self._row_chunks(), self.batch_size)

    def _row_chunks(self) -> Iterator[dict[str, np.ndarray]]:
        epoch = 0
        while True:
            chunks: Iterator[dict[str, np.ndarray]] = (self._read(unit) for unit in self.units_for_epoch(epoch))
            if self.shuffle and self.shuffle_buffer_size > 1:
                rng = np.random.default_rng([self.seed, epoch, self.rank, 1])
                chunks = _shuffle_buffer(chunks, self.shuffle_buffer_size, rng)
            yield from chunks
            epoch += 1

    def _read(self, unit: _Unit) -> dict[str, np.ndarray]:
        import pyarrow.parquet as pq

        name = self._files[unit.file]
        with self.filesystem.open_input_file(name) as source:
            table = pq.ParquetFile(source, metadata=self._metadata[unit.file]).read_row_group(
                unit.row_group, columns=self.columns)
        if unit.rows != table.num_rows:
            table = table.slice(unit.start, unit.rows)
        return {c: _to_numpy(table.column(c), c, name) for c in self.columns}


def _pyarrow_path(path: str) -> str:
    """A pyarrow filesystem path: ``file:///x`` and ``hdfs://nn:8020/x`` become ``/x``."""
    if "://" in path:
        from urllib.parse import urlsplit

        return posixpath.normpath(urlsplit(path).path or "/")
    return path


def _split_units(units: list[_Unit], size: int) -> list[_Unit]:
    """Halve the largest unit until there are at least ``size`` (every rank then reads rows)."""
    units = list(units)
    while len(units) < size:
        big = max(range(len(units)), key=lambda i: units[i].rows)
        unit = units[big]
        middle = unit.start + unit.rows // 2
        units[big:big + 1] = [_Unit(unit.file, unit.row_group, unit.start, middle),
                              _Unit(unit.file, unit.row_group, middle, unit.stop)]
    return units


def _to_numpy(column: Any, name: str, file: str) -> np.ndarray:
    """A Parquet column as a NumPy array: lists of fixed length become an extra axis."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        raise ConfigError(f"column {name!r} has null values in {file}")
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or \
            pa.types.is_fixed_size_list(array.type):
        rows = len(array)
        values = _to_numpy(array.flatten(), name, file)
        if rows == 0:
            return values.reshape((0, 0) + values.shape[1:])
        if len(values) % rows:
            raise ConfigError(f"column {name!r} has rows of different lengths in {file}")
        return values.reshape((rows, -1) + values.shape[1:])
    return array.to_numpy(zero_copy_only=False)


def _rows(chunk: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(chunk.values())))


def _take(chunk: Mapping[str, np.ndarray], index: Any) -> dict[str, np.ndarray]:
    return {name: values[index] for name, values in chunk.items()}


def _concat(chunks: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(chunks) == 1:
        return dict(chunks[0])
    return {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}


def _shuffle_buffer(chunks: Iterable[dict[str, np.ndarray]], capacity: int,
                    rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
    """Rows of ``chunks`` in a random order, as a streaming shuffle gives them: ``capacity`` rows
    are held back, and each incoming chunk is mixed with them before a random selection of
    everything over ``capacity`` goes out, so rows of different row groups meet while memory
    stays bounded (``capacity`` plus one row group). The buffer is emptied at the end: every row
    comes out exactly once."""
    buffer: dict[str, np.ndarray] | None = None
    for chunk in chunks:
        buffer = chunk if buffer is None else _concat([buffer, chunk])
        held = _rows(buffer)
        if held > capacity:
            order = rng.permutation(held)
            yield _take(buffer, order[:held - capacity])
            buffer = _take(buffer, order[held - capacity:])
    if buffer is not None and _rows(buffer):
        yield _take(buffer, rng.permutation(_rows(buffer)))


def _batches(chunks: Iterable[dict[str, np.ndarray]], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Cut a stream of row chunks into batches of exactly ``batch_size`` rows."""
    pending: list[dict[str, np.ndarray]] = []
    held = 0
    for chunk in chunks:
        rows = _rows(chunk)
        if rows == 0:
            continue
        pending.append(chunk)
        held += rows
        while held >= batch_size:
            merged = _concat(pending)
            yield {name: values[:batch_size] for name, values in merged.items()}
            pending = [{name: values[batch_size:] for name, values in merged.items()}]
            held -= batch_size
        if held == 0:
            pending = []
