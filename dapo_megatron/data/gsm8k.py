"""GSM8K -> DAPO schema (used by ``tools/prepare_gsm8k.py``).

Input: GSM8K JSON lines, ``{"question": str, "answer": str}`` where the answer's
last line is ``#### N`` (openai/grade-school-math). Output rows:

* ``data_source = "openai/gsm8k"``, ``ability = "math"``;
* ``prompt = [{"role": "user", "content": question + INSTRUCTION}]`` with
  verl's GSM8K instruction (reason step by step, final answer after ``####``);
* ``reward_model = {"ground_truth": N, "style": "rule"}`` with ``N`` the text
  after ``####``, thousands separators removed (``"1,000" -> "1000"``);
* ``extra_info = {"split", "index", "question", "answer"}``.

Design: docs/design.md §1 step 1 (the prompts of a rollout).
"""

from __future__ import annotations

import json
import os
import random
import re

from dapo_megatron.cli import ArgumentParser, InputError
from dapo_megatron.data.schema import write_dapo_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


class GSM8KFormatError(ValueError):
    """A GSM8K line is unusable; the message names the file, line and field."""


def extract_ground_truth(answer: str) -> str:
    """The number after the last ``####`` of a GSM8K answer, without thousands separators.

    Examples: ``"... #### 72" -> "72"``, ``"#### 1,000" -> "1000"``, ``"#### -5" -> "-5"``.

    Raises:
        ValueError: no ``####`` marker, or what follows it is not a number.
    """
    if "####" not in answer:
        raise ValueError("answer has no '####' marker before the final number")
    tail = answer.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")
    if not _NUMBER.match(tail):
        raise ValueError(f"text after '####' is not a number: {tail!r}")
    return tail


def gsm8k_to_dapo(question: str, answer: str, index: int, split: str = "train") -> dict:
    """One GSM8K problem as a DAPO-schema row (see module doc)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"ground_truth": extract_ground_truth(answer), "style": "rule"},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def read_gsm8k(path: str) -> list[tuple[str, str]]:
    """``(question, answer)`` pairs of a GSM8K jsonl file, in file order.

    Raises:
        GSM8KFormatError: bad JSON, missing/non-str ``question``/``answer``, or an
            answer without a numeric ``#### N`` (names the file and 1-based line).
    """
    pairs = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named by its number
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise GSM8KFormatError(f"{path}, line {lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                                       f"{exc.start + 1}: {exc.reason}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GSM8KFormatError(f"{path}, line {lineno}: bad JSON ({exc.msg})") from exc
            for key in ("question", "answer"):
                if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
                    raise GSM8KFormatError(f"{path}, line {lineno}, field '{key}': missing or not a str")
            try:
                extract_ground_truth(obj["answer"])
            except ValueError as exc:
                raise GSM8KFormatError(f"{path}, line {lineno}, field 'answer': {exc}") from exc
            pairs.append((obj["question"], obj["answer"]))
    return pairs


def default_val_path(output: str) -> str:
    """``out.parquet -> out_val.parquet``."""
    stem, ext = os.path.splitext(output)
    return f"{stem}_val{ext}"


def convert_gsm8k(
    input_path: str, output_path: str, split_val: int = 0, val_output: str | None = None, seed: int = 0
) -> dict[str, int]:
    """Convert a GSM8K jsonl file to DAPO-schema parquet/jsonl.

    Args:
        input_path: GSM8K jsonl.
        output_path: train output (``.parquet`` or ``.jsonl``).
        split_val: hold out this many problems (chosen with ``random.Random(seed)``)
            into ``val_output``; 0 writes everything to ``output_path``.
        val_output: validation file; default ``<output stem>_val<ext>``.
        seed: seed of the held-out selection.

    Returns:
        ``{"train": n_train, "val": n_val}``.

    Raises:
        GSM8KFormatError: bad input line, or no problem in the input.
        InputError (a ValueError): ``split_val`` out of range, or an output path is the input.
    """
    if not os.path.isfile(input_path):
        raise InputError(f"--input {input_path!r} is not a file (GSM8K jsonl)")
    val_path = val_output or default_val_path(output_path)
    for flag, path in (("--output", output_path), ("--val-output", val_path)):
        # never overwrite the source (the same file by another name too); checked before reading
        if os.path.realpath(path) == os.path.realpath(input_path) or (
                os.path.exists(path) and os.path.samefile(path, input_path)):
            raise InputError(f"{flag} {path!r} is the --input file: choose another output path")
    pairs = read_gsm8k(input_path)
    if not pairs:
        raise GSM8KFormatError(f"{input_path} is empty: no GSM8K line (question/answer JSON) in it")
    if not 0 <= split_val < len(pairs):
        raise InputError(f"--split-val must be in [0, {len(pairs)}) for {input_path}, got {split_val}")
    val_idx = set(random.Random(seed).sample(range(len(pairs)), split_val)) if split_val else set()
    train_rows, val_rows = [], []
    for i, (q, a) in enumerate(pairs):
        if i in val_idx:
            val_rows.append(gsm8k_to_dapo(q, a, i, "val"))
        else:
            train_rows.append(gsm8k_to_dapo(q, a, i, "train"))
    write_dapo_rows(train_rows, output_path)
    if val_rows:
        write_dapo_rows(val_rows, val_path)
    return {"train": len(train_rows), "val": len(val_rows)}


def main(argv: list[str] | None = None) -> dict[str, int]:
    """CLI: ``--input gsm8k_train.jsonl --output out.parquet [--split-val N]``; bad input raises
    (``tools/prepare_gsm8k.py`` prints it as one line, exit status 2)."""
    p = ArgumentParser(prog="prepare_gsm8k", description="Convert GSM8K jsonl to the DAPO schema (parquet or jsonl).")
    p.add_argument("--input", required=True, help="GSM8K jsonl with question/answer ('#### N')")
    p.add_argument("--output", required=True, help="train output, .parquet or .jsonl")
    p.add_argument("--split-val", type=int, default=0, help="hold out N random problems for validation")
    p.add_argument("--val-output", default=None, help="validation output (default: <output>_val.<ext>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation selection")
    args = p.parse_args(argv)
    counts = convert_gsm8k(args.input, args.output, args.split_val, args.val_output, args.seed)
    print(f"wrote {counts['train']} train rows to {args.output}", end="")
    if counts["val"]:
        print(f" and {counts['val']} val rows to {args.val_output or default_val_path(args.output)}")
    else:
        print()
    return counts
