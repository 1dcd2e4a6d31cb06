"""Reading a dataset file into rows, each value as the file wrote it.

JSON Lines and JSON are read with the json module: a string stays a string ("003", "1.50") and a
number a number, row by row. (The `datasets` loader infers one type per column and, when a
column mixes types, falls back to pandas, which re-types it: one row with `"answer": 42` turned
every answer of the file into an int, and "003" into 3, before any reward function saw them.)
CSV cells are text, as written; an empty cell is a missing value (None). Parquet is typed by its
own schema and is read through `datasets`.
"""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path
from typing import Any

from grpod.config import ConfigError

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetError(ConfigError):
    """A dataset file that cannot be used; the message names the file, and the row and column."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a local JSONL / JSON / Parquet / CSV file, as dicts with the same keys (the
    union of the rows' keys, in order of appearance; a key a row lacks is None there)."""
    suffix = path.suffix.lower()
    if suffix not in LOADERS:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r}; use one of {', '.join(LOADERS)}")
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    try:
        if suffix in (".jsonl", ".json"):
            text = path.read_text(encoding="utf-8-sig")
            if not text.strip():
                raise DatasetError(f"{path}: the file is empty (the dataset has no rows)")
            rows = _json_lines(path, text) if suffix == ".jsonl" else _json(path, text)
        elif path.stat().st_size == 0:
            raise DatasetError(f"{path}: the file is empty (the dataset has no rows)")
        else:
            rows = _csv(path) if suffix == ".csv" else _parquet(path)
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key) for key in keys} for row in rows]


def row_where(path: Path, index: int) -> str:
    """Row `index` of `read_rows(path)` for an error message: "row N", or "row N (line L)" where the
    line of a JSON Lines or CSV file it starts on is another number (blank lines, CSV's header
    and multi-line cells). It reads the file again: for errors only."""
    line = None
    try:
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            line = _json_line_of(path.read_text(encoding="utf-8-sig"), index, array=suffix == ".json")
        elif suffix == ".csv":
            line = _csv_line_of(path, index)
    except (OSError, ValueError, csv.Error):
        line = None
    return f"row {index + 1}" if line in (None, index + 1) else f"row {index + 1} (line {line})"


def _csv_line_of(path: Path, index: int) -> int | None:
    with path.open(encoding="utf-8-sig", newline="") as text:
        reader = csv.reader(text)
        if next(reader, None) is None:
            return None
        start = reader.line_num + 1
        for cells in reader:
            if cells:  # read_rows skips empty lines too
                if index == 0:
                    return start
                index -= 1
            start = reader.line_num + 1
    return None


def _json_line_of(text: str, index: int, *, array: bool) -> int | None:
    if array:
        try:
            json.loads(text)
            return None  # a JSON array: its elements have no lines of their own
        except (ValueError, RecursionError):
            pass
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            if index == 0:
                return number
            index -= 1
    return None


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: a JSON {type(value).__name__}, expected an object (one row)")
    return value


def _json_lines(path: Path, text: str) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may stand in a JSON string
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise DatasetError(f"{path}: line {number}: not JSON ({exc})") from None
        rows.append(_object(value, f"{path}: line {number}"))
    return rows


def _json(path: Path, text: str) -> list[dict[str, Any]]:
    """A JSON array of objects, or JSON Lines under a .json name."""
    try:
        value = json.loads(text)
    except ValueError:
        return _json_lines(path, text)
    except RecursionError:
        raise DatasetError(f"{path}: JSON nested too deeply") from None
    if not isinstance(value, list):
        raise DatasetError(f"{path}: a JSON {type(value).__name__}; expected an array of row objects (or JSON Lines)")
    return [_object(row, f"{path}: element {index} of the array") for index, row in enumerate(value)]


def _csv(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8-sig", newline="") as text:
        reader = csv.reader(text)
        header = next(reader, None)
        if not header or not any(name.strip() for name in header):
            raise DatasetError(f"{path}: no header row (the first line names the columns)")
        if len(set(header)) != len(header):
            raise DatasetError(f"{path}: the header names a column twice: {header}")
        for cells in reader:
            if not cells:
                continue
            if len(cells) > len(header):
                raise DatasetError(f"{path}: line {reader.line_num}: {len(cells)} cells under a header of {len(header)}")
            rows.append({name: (cell if cell != "" else None) for name, cell in zip(header, cells)})
    return rows


def _parquet(path: Path) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    # A throw-away cache: the file is read into memory once, nothing is left behind.
    with tempfile.TemporaryDirectory(prefix="grpod-dataset-") as cache:
        try:
            table = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache,
                                          keep_in_memory=True)
        except Exception as exc:  # noqa: BLE001 — the loader raises many types; the user needs the file named
            reasons = [str(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None and str(e)]
            raise DatasetError(f"{path}: cannot read as parquet: {' <- '.join(dict.fromkeys(reasons)) or type(exc).__name__}") from exc
        return table.to_list()
