"""Convert GSM8K to the DAPO schema.

Usage::

    python tools/prepare_gsm8k.py --input gsm8k_train.jsonl --output data/gsm8k.parquet --split-val 500

Writes ``data_source="openai/gsm8k"`` rows whose ground truth is the number
after ``####`` (thousands separators removed); see ``dapo_megatron.data.gsm8k``.
"""

from dapo_megatron.data.gsm8k import main

if __name__ == "__main__":
    main()
