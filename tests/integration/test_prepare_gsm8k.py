"""tools/prepare_gsm8k.py: GSM8K jsonl -> DAPO schema."""

import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from conftest import REPO

from dapo_megatron.data.dataset import read_dapo_rows
from dapo_megatron.data.gsm8k import GSM8KFormatError, INSTRUCTION, convert_gsm8k, extract_ground_truth

TOOL = os.path.join(REPO, "tools", "prepare_gsm8k.py")
SHARED_GSM8K = os.path.join(REPO, "..", "shared", "data", "gsm8k_train.jsonl")

SMALL = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs $12,500 and a bike $500. Total?", "answer": "12,500+500=13,000\n#### 13,000"},
    {"question": "It is 5 degrees and drops by 8. Temperature?", "answer": "5-8=-3\n#### -3"},
    {"question": "Half of 5?", "answer": "5/2 = 2.5\n#### 2.5"},
]


def write_small(path, objs=SMALL):
    with open(path, "w") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
    return str(path)


def test_extract_ground_truth():
    assert extract_ground_truth("work\n#### 72") == "72"
    assert extract_ground_truth("#### 1,234,567") == "1234567"
    assert extract_ground_truth("a #### 1 then #### 9") == "9"
    for bad in ("no marker 5", "#### seven", "####"):
        with pytest.raises(ValueError):
            extract_ground_truth(bad)


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_cli_small_file(tmp_path, ext):
    src = write_small(tmp_path / "g.jsonl")
    out = tmp_path / f"out.{ext}"
    res = subprocess.run([sys.executable, TOOL, "--input", src, "--output", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rows, stats = read_dapo_rows(str(out))
    assert stats.num_rows == 4 and stats.num_invalid == 0
    got = [r for _, _, r in rows]
    assert [r["reward_model"]["ground_truth"] for r in got] == ["7", "13000", "-3", "2.5"]
    for src_row, r in zip(SMALL, got):
        assert r["data_source"] == "openai/gsm8k"
        assert r["reward_model"]["style"] == "rule"
        assert r["prompt"] == [{"role": "user", "content": f"{src_row['question']} {INSTRUCTION}"}]
        assert "step by step" in r["prompt"][0]["content"] and '"####"' in r["prompt"][0]["content"]
        assert r["extra_info"]["answer"] == src_row["answer"]


def test_split_val_is_disjoint_and_deterministic(tmp_path):
    objs = [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(20)]
    src = write_small(tmp_path / "g.jsonl", objs)
    counts = convert_gsm8k(src, str(tmp_path / "a.parquet"), split_val=5)
    assert counts == {"train": 15, "val": 5}
    train = pq.read_table(tmp_path / "a.parquet").to_pylist()
    val = pq.read_table(tmp_path / "a_val.parquet").to_pylist()
    tr_gt = {r["reward_model"]["ground_truth"] for r in train}
    va_gt = {r["reward_model"]["ground_truth"] for r in val}
    assert not tr_gt & va_gt and tr_gt | va_gt == {str(i) for i in range(20)}
    assert {r["extra_info"]["split"] for r in val} == {"val"}
    convert_gsm8k(src, str(tmp_path / "b.parquet"), split_val=5)
    assert pq.read_table(tmp_path / "b_val.parquet").to_pylist() == val
    with pytest.raises(ValueError, match="split-val"):
        convert_gsm8k(src, str(tmp_path / "c.parquet"), split_val=20)


def test_bad_input_names_line_and_field(tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps(SMALL[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(GSM8KFormatError, match=r"line 2, field 'answer'.*####"):
        convert_gsm8k(str(src), str(tmp_path / "o.parquet"))
    src.write_text("{not json\n")
    with pytest.raises(GSM8KFormatError, match=r"line 1: bad JSON"):
        convert_gsm8k(str(src), str(tmp_path / "o.parquet"))
    src.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(GSM8KFormatError, match=r"field 'answer'"):
        convert_gsm8k(str(src), str(tmp_path / "o.parquet"))


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=300)


def test_input_errors_are_one_line_exit_2_and_never_overwrite_the_input(tmp_path):
    src = write_small(tmp_path / "g.jsonl")
    before = open(src, "rb").read()
    same = os.path.join(str(tmp_path), ".", "g.jsonl")  # the input under another spelling
    cases = [
        (["--input", src, "--output", src], f"--output {src!r} is the --input file: choose another output path"),
        (["--input", src, "--output", same], f"--output {same!r} is the --input file: choose another output path"),
        (["--input", src, "--output", str(tmp_path / "o.jsonl"), "--split-val", "1", "--val-output", src],
         f"--val-output {src!r} is the --input file: choose another output path"),
        (["--input", src, "--output", str(tmp_path / "o.jsonl"), "--split-val", "4"],
         f"--split-val must be in [0, 4) for {src}, got 4"),
        (["--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o.jsonl")],
         f"--input {str(tmp_path / 'none.jsonl')!r} is not a file (GSM8K jsonl)"),
        (["--input", src, "--output", str(tmp_path / "o.jsonl"), "--split-val", "x"],
         "argument --split-val: invalid int value: 'x' (see --help)"),
    ]
    for args, msg in cases:
        out = _tool(*args)
        assert (out.returncode, out.stderr, out.stdout) == (2, f"prepare_gsm8k: error: {msg}\n", ""), args
    assert open(src, "rb").read() == before and not (tmp_path / "o.jsonl").exists()
    (tmp_path / "empty.jsonl").write_text("\n")
    out = _tool("--input", str(tmp_path / "empty.jsonl"), "--output", str(tmp_path / "o.jsonl"), "--split-val", "5")
    assert (out.returncode, out.stderr) == (2, f"prepare_gsm8k: error: {tmp_path / 'empty.jsonl'} is empty: no GSM8K "
                                               "line (question/answer JSON) in it\n")


def test_shared_gsm8k_train(tmp_path):
    if not os.path.exists(SHARED_GSM8K):
        pytest.skip(f"shared GSM8K file not found at {SHARED_GSM8K}")
    with open(SHARED_GSM8K) as f:
        src = [json.loads(line) for line in f if line.strip()]
    counts = convert_gsm8k(SHARED_GSM8K, str(tmp_path / "gsm8k.parquet"), split_val=100)
    assert counts == {"train": len(src) - 100, "val": 100}
    rows, stats = read_dapo_rows([str(tmp_path / "gsm8k.parquet"), str(tmp_path / "gsm8k_val.parquet")])
    assert stats.num_invalid == 0 and len(rows) == len(src)
    by_index = {r["extra_info"]["index"]: r for _, _, r in rows}
    assert sorted(by_index) == list(range(len(src)))
    n_commas = 0
    for i, s in enumerate(src):
        # independent parse: the last line of the answer is "#### N"
        last = s["answer"].strip().splitlines()[-1]
        m = re.fullmatch(r"####\s*(.+)", last.strip())
        raw = m.group(1)
        n_commas += "," in raw
        gt = by_index[i]["reward_model"]["ground_truth"]
        assert gt == raw.replace(",", "") and float(gt) == float(raw.replace(",", ""))
        assert by_index[i]["extra_info"]["question"] == s["question"]
    assert n_commas > 0  # the file exercises thousands separators
