"""DAPO-schema prompt datasets: read, validate, apply the chat template, filter.

Rows follow the DAPO / verl schema (:mod:`~dapo_megatron.data.schema`, which reads,
validates and writes the files). A broken row raises :class:`DatasetError` naming the file, the
row index and the field, unless ``skip_invalid_rows=True`` in which case it is skipped
and counted in :class:`DatasetStats` (and logged). Prompts longer than ``max_prompt_length``
tokens after the chat template are filtered out and counted too (verl's
``filter_overlong_prompts``); nothing is dropped silently.

Design: docs/design.md §1 step 1 (the prompts of a rollout).
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from dapo_megatron.data.arithmetic import ArithmeticConfig, write_arithmetic_dataset
from dapo_megatron.data.schema import (  # noqa: F401  (the schema's names, re-exported)
    MAX_REPORTED_INDICES,
    DatasetError,
    DatasetStats,
    read_dapo_rows,
    validate_row,
    write_dapo_rows,
)
from dapo_megatron.rewards.registry import DATA_SOURCES, resolve_grader

logger = logging.getLogger(__name__)


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

    def check_inputs(self) -> None:
        """Raise ``ValueError`` (``train_files[i]='...' ...``) for a listed file that does not exist
        (read errors are :func:`load_prompt_dataset`'s)."""
        for name in ("train_files", "val_files"):
            for i, path in enumerate(getattr(self, name)):
                if not os.path.isfile(path):
                    what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
                    raise ValueError(f"{name}[{i}]={path!r} {what} (parquet or jsonl in DAPO schema; an empty list "
                                     "is the embedded arithmetic task)")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field (``arithmetic`` validates itself)."""
        if isinstance(self.max_prompt_length, bool) or not isinstance(self.max_prompt_length, int) \
                or self.max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length={self.max_prompt_length!r} must be a positive int (tokens)")
        if not self.prompt_key:
            raise ValueError("prompt_key='' must name the messages column, e.g. 'prompt'")
        if self.seed < 0:  # numpy's SeedSequence (data/stream.py) takes non-negative seeds only
            raise ValueError(f"seed={self.seed} must be >= 0")


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


def _check_data_sources(rows: list[tuple[str, int, dict]], stats: DatasetStats,
                        skip_invalid_rows: bool) -> list[tuple[str, int, dict]]:
    """The rows whose ``data_source`` has a grader (:func:`~dapo_megatron.rewards.registry.resolve_grader`):
    an unknown source stops the load here, naming file, row, value, the known sources and the
    closest one, instead of the first grading (training) or the end of all generation
    (``tools/eval.py``). With ``skip_invalid_rows`` such rows are skipped and counted instead.

    Raises:
        DatasetError: field ``data_source``.
    """
    kept, known = [], {}
    for path, i, row in rows:
        source = row["data_source"]
        if source not in known:
            try:
                resolve_grader(source)
                known[source] = None
            except ValueError:
                close = difflib.get_close_matches(source, sorted(DATA_SOURCES), n=1, cutoff=0.5)
                known[source] = (f"unknown data_source {source!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                                 + f" Known: {', '.join(sorted(DATA_SOURCES))} or any name starting with 'aime' "
                                 "(graders: dapo_megatron/rewards/registry.py DATA_SOURCES)")
        if known[source] is None:
            kept.append((path, i, row))
            continue
        if not skip_invalid_rows:
            raise DatasetError(path, i, "data_source", known[source])
        stats.num_invalid += 1
        if len(stats.invalid_examples) < MAX_REPORTED_INDICES:
            stats.invalid_examples.append((path, i, "data_source", known[source]))
    return kept


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
        DatasetError: broken rows (unless skipped: a row that is not UTF-8 or JSON, breaks the
            schema, or names a ``data_source`` without a grader), missing files, or nothing left.
    """
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be > 0 tokens, got {max_prompt_length}")
    paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    rows, stats = read_dapo_rows(paths, prompt_key, skip_invalid_rows)
    rows = _check_data_sources(rows, stats, skip_invalid_rows)
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
    files = cfg.train_files if split == "train" else cfg.val_files
    if not files:
        raise ValueError(
            f"data.{split}_files is empty; set it or call resolve_data_files(cfg, run_dir) "
            "to generate the arithmetic default"
        )
    return load_prompt_dataset(files, tokenizer, cfg.max_prompt_length, cfg.prompt_key, cfg.skip_invalid_rows)


def resolve_data_files(cfg: DataConfig, data_dir: str) -> DataConfig:
    """``cfg`` with empty ``train_files``/``val_files`` filled with the embedded arithmetic task.

    Writes ``<data_dir>/arithmetic_train.parquet`` (seed ``cfg.seed``) and
    ``arithmetic_val.parquet`` (seed ``cfg.seed + 1``) with
    :func:`~dapo_megatron.data.arithmetic.write_arithmetic_dataset`, so the
    default task goes through the same reader as real data. Deterministic:
    the same config writes the same files. Returns a copy (``dataclasses.replace``, unfrozen);
    ``cfg`` is left as it is (a loaded config is frozen).
    """
    a = cfg.arithmetic
    files = {}
    if not cfg.train_files:
        path = os.path.join(data_dir, "arithmetic_train.parquet")
        write_arithmetic_dataset(path, a.num_train_problems, cfg.seed, config=a, split="train")
        files["train_files"] = [path]
    if not cfg.val_files:
        path = os.path.join(data_dir, "arithmetic_val.parquet")
        write_arithmetic_dataset(path, a.num_val_problems, cfg.seed + 1, config=a, split="val")
        files["val_files"] = [path]
    return replace(cfg, **files)
