"""Random access to the rows of parquet / arrow shards (the streaming source, streaming.py).

A shard is a .parquet file (read one row group at a time) or an .arrow file, in the IPC stream
format `save_to_disk` writes or the IPC file format (memory-mapped). A file that is neither, a
missing "text" column or a value that is not UTF-8 is a one-line UserError naming the file, as
in `prepare`. Readers open files lazily and keep the last row group / table read, so a pickled
Shards (a grain worker's copy) holds no open file.
"""

from __future__ import annotations

import os

from boost_jax.errors import UserError

STREAM_EXTS = (".parquet", ".arrow")
FIELD = "text"


def is_streaming(path: str) -> bool:
    """A .parquet / .arrow file, or a folder holding some (a save_to_disk folder included)."""
    from boost_jax.data.sources import _walk

    if os.path.isfile(path):
        return path.endswith(STREAM_EXTS)
    return os.path.isdir(path) and bool(_walk(path, STREAM_EXTS, {"__pycache__"}))


def list_shards(path: str, label: str, exts: tuple = STREAM_EXTS) -> list[str]:
    """The shard files of a streaming source, in sorted order (FIFOs and devices refused)."""
    from boost_jax.data.sources import _walk
    from boost_jax.file_kind import check_input

    check_input(path, label)
    if os.path.isfile(path):
        return [path]
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        raise UserError(f"{label} {path!r} is a Hugging Face DatasetDict; point it at one split, "
                        f"e.g. {os.path.join(path, 'train')}")
    files = [os.path.join(path, r) for r in _walk(path, exts, {"__pycache__"})]
    for f in files:  # a FIFO in the folder would block the read for ever
        check_input(f, f"{label} file")
    return files


def _unreadable(path: str, e: Exception, label: str) -> UserError:
    kind = "parquet" if path.endswith(".parquet") else "arrow"
    why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return UserError(f"{label} file {path!r} is not a readable {kind} file ({why}); pass a real "
                     f".{kind} file, or prepare text with python -m boost_jax.data.prepare")


def _open_arrow(path: str):
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source).read_all()  # what datasets' save_to_disk writes
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).read_all()


def check_text_column(path: str, field: str, schema, label: str) -> None:
    """A parquet / arrow column read as documents must hold text: a binary, list or number
    column would read as empty documents (nulls are; those are missing documents)."""
    import pyarrow as pa

    kind = schema.field(field).type
    values = kind.value_type if pa.types.is_dictionary(kind) else kind  # pandas' categoricals
    text = (pa.types.is_string(values) or pa.types.is_large_string(values)
            or pa.types.is_null(values)
            or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(values)))
    if not text:
        raise UserError(f"{label} file {path!r} column {field!r} holds {kind}, not text; "
                        "write it as a string column (UTF-8)")


class Shards:
    """The files of one streaming source: row counts per row group, and rows as text."""

    def __init__(self, files: list[str], label: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.files, self.label, self.groups = files, label, []
        for path in files:
            try:
                if path.endswith(".parquet"):
                    meta = pq.ParquetFile(path).metadata
                    schema = meta.schema.to_arrow_schema()
                    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
                else:
                    table = _open_arrow(path)
                    schema, rows = table.schema, [table.num_rows]
            except (pa.ArrowException, OSError) as e:
                raise _unreadable(path, e, label) from None
            if FIELD not in schema.names:
                raise UserError(f"{label} file {path!r} has no column {FIELD!r} (columns: "
                                f"{schema.names}); streaming reads the {FIELD!r} column")
            check_text_column(path, FIELD, schema, label)
            self.groups.append(rows)
        self._cache = None

    def __getstate__(self):
        return dict(self.__dict__, _cache=None)

    def _group(self, f: int, row: int):
        """(table of the row group holding `row`, its first row)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path, start = self.files[f], 0
        for g, n in enumerate(self.groups[f]):
            if row < start + n:
                break
            start += n
        if self._cache is None or self._cache[0] != (f, g):
            try:
                t = (pq.ParquetFile(path).read_row_group(g, columns=[FIELD])
                     if path.endswith(".parquet") else _open_arrow(path).select([FIELD]))
            except (pa.ArrowException, OSError) as e:
                raise _unreadable(path, e, self.label) from None
            self._cache = ((f, g), t, start)
        return self._cache[1], self._cache[2]

    def texts(self, f: int, row: int, n: int) -> list[str]:
        """Rows row..row+n of file f (one row group), as text ("" for a null; the column is
        text: check_text_column)."""
        table, start = self._group(f, row)
        try:
            col = table.column(FIELD).slice(row - start, n).to_pylist()
        except UnicodeDecodeError:
            raise UserError(f"{self.label} file {self.files[f]!r} has bytes that are not UTF-8 "
                            f"in column {FIELD!r} (at or after row {row + 1}); re-encode that "
                            "column as UTF-8") from None
        return [t if isinstance(t, str) else "" for t in col]

    @property
    def n_docs(self) -> int:
        return sum(sum(g) for g in self.groups)
