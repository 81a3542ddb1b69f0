"""Arithmetic difficulty probe: last-integer grading, and a short real SmolLM2 run."""

import re

import pytest

from dapo_megatron.data.probe import ProbeResult, last_integer


def test_last_integer():
    assert last_integer("4 + 16 = 20") == 20
    assert last_integer("The answer is -3.") == -3
    assert last_integer("19 + 3 is 22, I think 2.5") == 5
    assert last_integer("no digits") is None


def test_probe_result_rates():
    r = ProbeResult(correct=[0, 2, 8, 1], n_samples=8, texts=[[]] * 4, ground_truths=["1"] * 4)
    assert r.success_rate == pytest.approx(11 / 32)
    assert r.mixed_groups == 2


@pytest.mark.slow
def test_probe_smollm2_grades_its_own_samples(smollm2_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_megatron.data.arithmetic import write_arithmetic_dataset
    from dapo_megatron.data.dataset import load_prompt_dataset
    from dapo_megatron.data.probe import probe_success_rate

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)  # SmolLM2 de-quantised (conftest: cached once)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir).eval()
    ds = load_prompt_dataset(write_arithmetic_dataset(str(tmp_path / "a.parquet"), 1, seed=1), tok, 128)
    res = probe_success_rate(model, tok, ds, n_samples=2, max_new_tokens=4, seed=0)
    assert len(res.texts) == 1 and all(len(g) == 2 for g in res.texts)
    for group, gt, c in zip(res.texts, res.ground_truths, res.correct):
        # independent grading of the returned texts
        want = sum(bool(re.findall(r"-?\d+", t)) and int(re.findall(r"-?\d+", t)[-1]) == int(gt) for t in group)
        assert c == want
    assert 0.0 <= res.success_rate <= 1.0
