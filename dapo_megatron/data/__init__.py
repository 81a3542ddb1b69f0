"""Prompt data: DAPO-schema datasets, the arithmetic default task, the DALI prompt stream.

* :mod:`~dapo_megatron.data.schema`: the DAPO row schema, ``DatasetError``,
  ``read_dapo_rows`` / ``write_dapo_rows`` (parquet/jsonl, every row validated).
* :mod:`~dapo_megatron.data.dataset`: ``DataConfig``, ``PromptRecord``,
  ``load_prompt_dataset`` (chat template, length filter), ``resolve_data_files``.
* :mod:`~dapo_megatron.data.arithmetic`: ``ArithmeticConfig``,
  ``write_arithmetic_dataset`` (the embedded default task).
* :mod:`~dapo_megatron.data.gsm8k`: GSM8K -> DAPO schema (``tools/prepare_gsm8k.py``).
* :mod:`~dapo_megatron.data.stream`: ``PromptStream`` (DP-sharded, per-epoch
  shuffled, exactly resumable; NVIDIA DALI CPU pipeline, imported lazily).

Design: docs/design.md §1 step 1 (the prompts of a rollout).
"""

from dapo_megatron.lazy import lazy_exports

_EXPORTS = {
    "ArithmeticConfig": "arithmetic",
    "write_arithmetic_dataset": "arithmetic",
    "DataConfig": "dataset",
    "DatasetError": "schema",
    "DatasetStats": "schema",
    "PromptDataset": "dataset",
    "PromptRecord": "dataset",
    "load_from_config": "dataset",
    "load_prompt_dataset": "dataset",
    "read_dapo_rows": "schema",
    "resolve_data_files": "dataset",
    "write_dapo_rows": "schema",
    "PromptStream": "stream",
}


# `python -m dapo_megatron.data.arithmetic` must not find the module pre-imported by this package
# (runpy warning), and importing the package should not pull in pyarrow/numpy until needed
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = [
    "ArithmeticConfig",
    "DataConfig",
    "DatasetError",
    "DatasetStats",
    "PromptDataset",
    "PromptRecord",
    "PromptStream",
    "load_from_config",
    "load_prompt_dataset",
    "read_dapo_rows",
    "resolve_data_files",
    "write_arithmetic_dataset",
    "write_dapo_rows",
]
