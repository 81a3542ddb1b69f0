"""The DAPO row schema: validate, read and write prompt files (parquet or JSON lines).

The DAPO / verl schema (one row per prompt), used by DAPO-Math-17k and AIME 2024:

=================  ============================================================
``data_source``    str, selects the reward function (e.g. ``"math_dapo"``,
                   ``"openai/gsm8k"``, ``"arithmetic"``)
``prompt``         list of ``{"role": str, "content": str}`` chat messages
                   (column name configurable as ``DataConfig.prompt_key``)
``ability``        str (e.g. ``"MATH"``)
``reward_model``   ``{"ground_truth": str, "style": str}`` (style ``"rule"``)
``extra_info``     dict of free-form metadata (index, split, raw problem ...)
=================  ============================================================

Files are parquet (read with pyarrow) or JSON lines (``.jsonl``/``.json``, one
JSON object per line). Every row is validated; a broken row raises
:class:`DatasetError` naming the file, the row index and the field, unless
``skip_invalid_rows=True`` in which case it is skipped and counted in
:class:`DatasetStats` (and logged). The writers (:func:`write_dapo_rows`, used by the
arithmetic generator and the GSM8K converter) validate every row first, so they cannot
produce a file the reader rejects. This module depends on nothing else of the package.

Design: docs/design.md §1 step 1 (the prompts of a rollout).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

REQUIRED_FIELDS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
VALID_ROLES = ("system", "user", "assistant")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json")
MAX_REPORTED_INDICES = 10


class DatasetError(ValueError):
    """A DAPO-schema file or row is unusable.

    Attributes:
        path: the file being read.
        row: 0-based row index within that file (line index for jsonl), or
            ``None`` for file-level problems (missing file, missing column).
        field: the offending field (e.g. ``"reward_model.ground_truth"``), or
            ``None``.
    """

    def __init__(self, path: str, row: int | None, field: str | None, message: str):
        self.path = path
        self.row = row
        self.field = field
        where = path if row is None else f"{path}, row {row}"
        if field is not None:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")


@dataclass
class DatasetStats:
    """What loading kept and dropped (also logged).

    Attributes:
        num_rows: rows read from all files.
        num_invalid: rows skipped by ``skip_invalid_rows``.
        invalid_examples: first few skipped rows as ``(path, row, field, message)``.
        num_overlong: rows dropped for exceeding ``max_prompt_length``.
        overlong_examples: first few as ``(path, row, num_tokens)``.
        num_kept: rows in the dataset.
    """

    num_rows: int = 0
    num_invalid: int = 0
    invalid_examples: list[tuple[str, int, str, str]] = field(default_factory=list)
    num_overlong: int = 0
    overlong_examples: list[tuple[str, int, int]] = field(default_factory=list)
    num_kept: int = 0


# --------------------------------------------------------------------------- reading


def _file_format(path: str) -> str:
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise DatasetError(
        path, None, None, "unknown file type; use .parquet or .jsonl (one JSON object per line)"
    )


def iter_raw_rows(path: str, columns: Sequence[str]) -> Iterable[tuple[int, Any]]:
    """Yield ``(row_index, row)`` from a parquet or jsonl file.

    Args:
        path: ``.parquet``/``.pq`` or ``.jsonl``/``.json`` file.
        columns: the columns to read from parquet (others, e.g. a pandas
            ``__index_level_0__``, are ignored). A missing parquet column is
            not an error here: the row lacks that key and validation names it.

    Yields:
        ``(i, row)``: ``row`` is a dict for parquet; for jsonl it is the parsed
        object, or a :class:`DatasetError` instance for a line that is not valid
        JSON (so the caller decides whether to raise or skip it). Blank jsonl
        lines are ignored but still advance the line index.

    Raises:
        DatasetError: the file is missing, has an unknown suffix or is not parquet.
    """
    if not os.path.isfile(path):
        raise DatasetError(path, None, None, "file not found; check data.train_files / val_files")
    fmt = _file_format(path)
    if fmt == "parquet":
        try:
            schema = pq.read_schema(path)
            present = [c for c in columns if c in schema.names]
            table = pq.read_table(path, columns=present)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise DatasetError(path, None, None, f"cannot read parquet: {exc}") from exc
        yield from enumerate(table.to_pylist())
        return
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is that row's error, not the file's
        offset = 0
        for i, raw in enumerate(f):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, DatasetError(path, i, None, f"not UTF-8: byte 0x{raw[exc.start]:02x} at byte offset "
                                                     f"{start + exc.start} of the file ({exc.reason}); save it as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                yield i, DatasetError(path, i, None, f"bad JSON ({exc.msg} at column {exc.colno})")


def validate_row(row: Any, path: str, index: int, prompt_key: str = "prompt") -> None:
    """Check one row against the DAPO schema.

    Args:
        row: the parsed row (should be a dict).
        path, index: for the error message.
        prompt_key: the column holding the chat messages.

    Raises:
        DatasetError: naming ``path``, ``index`` and the first bad field.
    """

    def fail(fld: str | None, msg: str) -> None:
        raise DatasetError(path, index, fld, msg)

    if not isinstance(row, dict):
        fail(None, f"row must be a JSON object / struct, got {type(row).__name__}")
    for name in ("data_source", prompt_key, "ability", "reward_model", "extra_info"):
        if name not in row or row[name] is None:
            fail(name, "missing (required DAPO-schema field)")
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        fail("data_source", f"must be a non-empty str, got {row['data_source']!r}")
    if not isinstance(row["ability"], str):
        fail("ability", f"must be a str, got {type(row['ability']).__name__}")

    messages = row[prompt_key]
    if not isinstance(messages, list):
        fail(prompt_key, f"must be a list of {{role, content}} messages, got {type(messages).__name__}")
    if not messages:
        fail(prompt_key, "empty prompt (no messages)")
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict):
            fail(f"{prompt_key}[{j}]", f"message must be a dict, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in VALID_ROLES:
            fail(f"{prompt_key}[{j}].role", f"must be one of {VALID_ROLES}, got {role!r}")
        if not isinstance(content, str):
            fail(f"{prompt_key}[{j}].content", f"must be a str, got {type(content).__name__}")
    if not any(m["content"].strip() for m in messages):
        fail(prompt_key, "empty prompt (all message contents are blank)")

    rm = row["reward_model"]
    if not isinstance(rm, dict):
        fail("reward_model", f"must be a dict with ground_truth and style, got {type(rm).__name__}")
    gt = rm.get("ground_truth")
    if gt is None:
        fail("reward_model.ground_truth", "missing")
    if not isinstance(gt, str):
        fail(
            "reward_model.ground_truth",
            f"must be a str, got {type(gt).__name__} {gt!r}; store answers as strings",
        )
    if not isinstance(rm.get("style"), str):
        fail("reward_model.style", f"must be a str such as 'rule', got {rm.get('style')!r}")
    if not isinstance(row["extra_info"], dict):
        fail("extra_info", f"must be a dict, got {type(row['extra_info']).__name__}")


def read_dapo_rows(
    paths: str | Sequence[str], prompt_key: str = "prompt", skip_invalid_rows: bool = False
) -> tuple[list[tuple[str, int, dict]], DatasetStats]:
    """Read and validate DAPO-schema rows from one or more files.

    Args:
        paths: file path(s), parquet or jsonl.
        prompt_key: the messages column (``DataConfig.prompt_key``).
        skip_invalid_rows: skip broken rows (counted in the stats) instead of raising.

    Returns:
        ``(rows, stats)``: ``rows`` is a list of ``(path, row_index, row_dict)``
        in file order; ``stats`` has ``num_rows``, ``num_invalid`` and examples.

    Raises:
        DatasetError: a broken row (when not skipping), a missing/unreadable file,
            or no paths given.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DatasetError("<none>", None, None, "no data files given")
    columns = ["data_source", prompt_key, "ability", "reward_model", "extra_info"]
    stats = DatasetStats()
    rows: list[tuple[str, int, dict]] = []
    for path in paths:
        for i, row in iter_raw_rows(path, columns):
            stats.num_rows += 1
            try:
                if isinstance(row, DatasetError):
                    raise row
                validate_row(row, path, i, prompt_key)
            except DatasetError as err:
                if not skip_invalid_rows:
                    raise
                stats.num_invalid += 1
                if len(stats.invalid_examples) < MAX_REPORTED_INDICES:
                    stats.invalid_examples.append((path, i, err.field or "", str(err)))
                continue
            rows.append((path, i, row))
    if stats.num_invalid:
        logger.warning(
            "skipped %d invalid row(s) of %d (skip_invalid_rows=True); first: %s",
            stats.num_invalid,
            stats.num_rows,
            [(p, i, f) for p, i, f, _ in stats.invalid_examples],
        )
    return rows, stats


# --------------------------------------------------------------------------- writing


def write_dapo_rows(rows: Sequence[dict], path: str) -> str:
    """Write DAPO-schema rows to ``path`` (parquet via pyarrow, or jsonl).

    Every row is validated first (so a writer cannot produce a file the reader
    rejects). The file is replaced atomically (temp file + ``os.replace``), so
    concurrent writers of the same content and concurrent readers are safe. ``extra_info`` must not be an empty dict for parquet (pyarrow
    cannot store a struct without fields).

    Returns:
        ``path``.

    Raises:
        DatasetError: a row violates the schema or the suffix is unknown.
    """
    path = os.fspath(path)
    fmt = _file_format(path)
    for i, row in enumerate(rows):
        validate_row(row, path, i)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    # Atomic: write a private temp file, then os.replace. Several ranks may write
    # the same (deterministic) file while others already read it.
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        if fmt == "jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            for i, row in enumerate(rows):
                if not row["extra_info"]:
                    raise DatasetError(
                        path, i, "extra_info", "empty dict cannot be stored in parquet; add e.g. an index"
                    )
            pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
