"""Convert GSM8K to the DAPO schema.

Usage::

    python tools/prepare_gsm8k.py --input gsm8k_train.jsonl --output data/gsm8k.parquet --split-val 500

Writes ``data_source="openai/gsm8k"`` rows whose ground truth is the number
after ``####`` (thousands separators removed); see ``dapo_megatron.data.gsm8k``.
Bad input (a bad line, an empty file, ``--output`` equal to ``--input``, a bad flag) is one
line, ``prepare_gsm8k: error: ...``, exit status 2; nothing is written then.
"""

import sys

from dapo_megatron.cli import run_tool
from dapo_megatron.data.gsm8k import GSM8KFormatError, main

if __name__ == "__main__":
    sys.exit(run_tool("prepare_gsm8k", main, None, (GSM8KFormatError,)))
