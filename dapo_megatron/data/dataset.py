"""DAPO-schema prompt datasets: read, validate, apply the chat template, filter.

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
:class:`DatasetStats` (and logged). Prompts longer than ``max_prompt_length``
tokens after the chat template are filtered out and counted too (verl's
``filter_overlong_prompts``); nothing is dropped silently.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from dapo_megatron.data.arithmetic import ArithmeticConfig

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
class DataConfig:
    """Prompt data settings (names follow verl's ``data.*`` config)."""

    train_files: list[str] = field(default_factory=list)
    """parquet/jsonl file(s) in DAPO schema. Empty means the embedded arithmetic task (see
    :func:`resolve_data_files`)."""
    val_files: list[str] = field(default_factory=list)
    """validation file(s); empty means an arithmetic validation set."""
    max_prompt_length: int = 512
    """prompts whose chat-templated length exceeds this many tokens are filtered out (and counted)."""
    prompt_key: str = "prompt"
    """column holding the chat messages."""
    skip_invalid_rows: bool = False
    """skip (and count) broken rows instead of raising."""
    shuffle: bool = True
    """reshuffle the training prompts every epoch."""
    seed: int = 1
    """seed of the per-epoch shuffle and of the arithmetic generator."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """the embedded arithmetic task (used when files are empty)."""

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        if isinstance(self.val_files, str):
            self.val_files = [self.val_files]
        self.train_files = list(self.train_files)
        self.val_files = list(self.val_files)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field (``arithmetic`` validates itself)."""
        if isinstance(self.max_prompt_length, bool) or not isinstance(self.max_prompt_length, int) \
                or self.max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length={self.max_prompt_length!r} must be a positive int (tokens)")
        if not self.prompt_key:
            raise ValueError("prompt_key='' must name the messages column, e.g. 'prompt'")


@dataclass(frozen=True)
class PromptRecord:
    """One validated, tokenized prompt.

    Attributes:
        index: position in the :class:`PromptDataset` (0-based, after filtering);
            this is what :class:`~dapo_megatron.data.stream.PromptStream` yields.
        data_source: reward-function selector (``data_source`` column).
        prompt_ids: chat-templated prompt token ids (with the generation prompt),
            length <= ``max_prompt_length``.
        messages: the chat messages, list of ``{"role", "content"}`` dicts.
        ground_truth: ``reward_model.ground_truth``.
        extra_info: the ``extra_info`` dict.
    """

    index: int
    data_source: str
    prompt_ids: list[int]
    messages: list[dict[str, str]]
    ground_truth: str
    extra_info: dict[str, Any]


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
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
            present = [c for c in columns if c in schema.names]
            table = pq.read_table(path, columns=present)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise DatasetError(path, None, None, f"cannot read parquet: {exc}") from exc
        yield from enumerate(table.to_pylist())
        return
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
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


# --------------------------------------------------------------------------- tokenizing


def chat_template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` with the generation prompt appended.

    Calls ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`` (transformers API). transformers 5 returns a
    ``BatchEncoding`` (``{"input_ids", "attention_mask"}``); older versions a
    ``list[int]``; both (and a 1-row nested list / tensor) are accepted.

    Returns:
        ``list[int]`` of token ids.

    Raises:
        TypeError: the tokenizer returned something else.
    """
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, list) and len(out) == 1 and isinstance(out[0], list):
        out = out[0]
    if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
        raise TypeError(
            f"apply_chat_template returned {type(out).__name__}; expected token ids "
            "(list[int] or a BatchEncoding with input_ids)"
        )
    return out


class PromptDataset:
    """An in-memory list of :class:`PromptRecord` (validated and tokenized).

    ``len(ds)``, ``ds[i]`` (a ``PromptRecord`` with ``index == i``) and
    ``ds.stats`` (:class:`DatasetStats`). Build with :func:`load_prompt_dataset`.
    """

    def __init__(self, records: list[PromptRecord], stats: DatasetStats):
        for i, r in enumerate(records):
            if r.index != i:
                raise ValueError(f"PromptDataset: record {i} has index {r.index}; indices must be 0..N-1")
        self.records = records
        self.stats = stats

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def __iter__(self):
        return iter(self.records)


def load_prompt_dataset(
    paths: str | Sequence[str],
    tokenizer: Any,
    max_prompt_length: int,
    prompt_key: str = "prompt",
    skip_invalid_rows: bool = False,
) -> PromptDataset:
    """Read, validate, chat-template and length-filter DAPO-schema files.

    Args:
        paths: parquet/jsonl file(s).
        tokenizer: a transformers tokenizer with a chat template.
        max_prompt_length: keep prompts with at most this many tokens.
        prompt_key: the messages column.
        skip_invalid_rows: skip broken rows instead of raising.

    Returns:
        :class:`PromptDataset`; ``stats.num_overlong`` counts the filtered prompts
        (also logged as a warning when non-zero).

    Raises:
        DatasetError: broken rows (unless skipped), missing files, or nothing left.
    """
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be > 0 tokens, got {max_prompt_length}")
    paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    rows, stats = read_dapo_rows(paths, prompt_key, skip_invalid_rows)
    records: list[PromptRecord] = []
    # DAPO-Math-17k repeats each prompt 100x (1.79M rows) and AIME 2024 32x:
    # render + tokenize each distinct conversation once.
    cache: dict[tuple, list[int]] = {}
    for path, i, row in rows:
        messages = [{"role": m["role"], "content": m["content"]} for m in row[prompt_key]]
        key = tuple((m["role"], m["content"]) for m in messages)
        if key not in cache:
            cache[key] = chat_template_ids(tokenizer, messages)
        ids = list(cache[key])
        if len(ids) > max_prompt_length:
            stats.num_overlong += 1
            if len(stats.overlong_examples) < MAX_REPORTED_INDICES:
                stats.overlong_examples.append((path, i, len(ids)))
            continue
        records.append(
            PromptRecord(
                index=len(records),
                data_source=row["data_source"],
                prompt_ids=ids,
                messages=messages,
                ground_truth=row["reward_model"]["ground_truth"],
                extra_info=dict(row["extra_info"]),
            )
        )
    stats.num_kept = len(records)
    if stats.num_overlong:
        logger.warning(
            "filtered %d of %d prompt(s) longer than max_prompt_length=%d tokens; first: %s",
            stats.num_overlong,
            stats.num_rows - stats.num_invalid,
            max_prompt_length,
            stats.overlong_examples,
        )
    if not records:
        raise DatasetError(
            ", ".join(paths),
            None,
            None,
            f"no prompts left ({stats.num_rows} read, {stats.num_invalid} invalid, "
            f"{stats.num_overlong} longer than max_prompt_length={max_prompt_length})",
        )
    return PromptDataset(records, stats)


def unique_prompts(records: Sequence[PromptRecord]) -> list[tuple[PromptRecord, list[int]]]:
    """The distinct problems of ``records``, each with the positions of all its copies.

    Evaluation files often repeat each problem: the AIME 2024 parquet of the DAPO paper
    holds its 30 problems 32 times each (verl samples each copy once, which is avg@32 per
    problem). To sample ``n`` responses per *problem* instead (avg@n and an unbiased
    pass@k over all ``n`` samples), evaluate one entry per distinct problem.

    Two records are copies when ``data_source``, ``prompt_ids`` (the chat-templated
    prompt) and ``ground_truth`` are all equal; ``extra_info`` (e.g. a per-row index) is
    ignored.

    Args:
        records: :class:`PromptRecord` s, e.g. ``PromptDataset.records``.

    Returns:
        ``[(first_record, positions), ...]`` in order of first occurrence; ``positions``
        are the 0-based positions in ``records`` of every copy (ascending, the first is the
        position of ``first_record``). Their lengths sum to ``len(records)``.

    Raises:
        TypeError: an element is not a :class:`PromptRecord`.
    """
    groups: dict[tuple, tuple[PromptRecord, list[int]]] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, PromptRecord):
            raise TypeError(f"unique_prompts: records[{i}] is a {type(rec).__name__}, expected a PromptRecord")
        key = (rec.data_source, tuple(rec.prompt_ids), rec.ground_truth)
        if key in groups:
            groups[key][1].append(i)
        else:
            groups[key] = (rec, [i])
    return list(groups.values())


def load_from_config(cfg: DataConfig, tokenizer: Any, split: str = "train") -> PromptDataset:
    """:func:`load_prompt_dataset` on ``cfg.train_files`` or ``cfg.val_files``.

    Raises:
        ValueError: ``split`` is not ``"train"``/``"val"`` or its file list is empty
            (call :func:`resolve_data_files` first to fill in the arithmetic default).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    cfg.validate()
    files = cfg.train_files if split == "train" else cfg.val_files
    if not files:
        raise ValueError(
            f"data.{split}_files is empty; set it or call resolve_data_files(cfg, run_dir) "
            "to generate the arithmetic default"
        )
    return load_prompt_dataset(files, tokenizer, cfg.max_prompt_length, cfg.prompt_key, cfg.skip_invalid_rows)


def resolve_data_files(cfg: DataConfig, data_dir: str) -> DataConfig:
    """Fill empty ``train_files``/``val_files`` with the embedded arithmetic task.

    Writes ``<data_dir>/arithmetic_train.parquet`` (seed ``cfg.seed``) and
    ``arithmetic_val.parquet`` (seed ``cfg.seed + 1``) with
    :func:`~dapo_megatron.data.arithmetic.write_arithmetic_dataset`, so the
    default task goes through the same reader as real data. Deterministic:
    the same config writes the same files. Returns ``cfg`` (modified in place).
    """
    from dapo_megatron.data.arithmetic import write_arithmetic_dataset

    a = cfg.arithmetic
    if not cfg.train_files:
        path = os.path.join(data_dir, "arithmetic_train.parquet")
        write_arithmetic_dataset(path, a.num_train_problems, cfg.seed, config=a, split="train")
        cfg.train_files = [path]
    if not cfg.val_files:
        path = os.path.join(data_dir, "arithmetic_val.parquet")
        write_arithmetic_dataset(path, a.num_val_problems, cfg.seed + 1, config=a, split="val")
        cfg.val_files = [path]
    return cfg


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
            import pyarrow as pa
            import pyarrow.parquet as pq

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
