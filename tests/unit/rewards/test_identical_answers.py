"""An answer written exactly as its gold is always right (issue 36 item 11), and the two false
negatives of the boxed grader (``lighteval/MATH``) found in the peers' public suites:

- ``1 - \\frac{1}{\\mathrm{e}}`` graded wrong against the identical gold: math-verify's
  normaliser turns ``\\mathrm{e}`` into ``\\text{e}`` and its unit rule deletes it and the rest
  (huggingface/Math-Verify tests/test_yujianll.py expects this pair to match);
- a set literal of tuples that names a member twice, against the gold set: a set that repeats
  a member is that set (our repeated-element guard refused it).

The property test grades every gold of this package's grader corpora (tests/unit/rewards/
test_graders.py and test_public_cases.py) against a response that writes the gold itself.
"""

import pytest

from dapo_megatron.rewards.math_boxed import gold_content
from dapo_megatron.rewards.registry import grade_in_process, normalize_request
from unit.rewards.test_graders import BOXED_GUARD_CASES, MATH_EITHER_CASES, SET_RELATION_CASES
from unit.rewards.test_public_cases import (
    MV2_TRUE,
    MV14_FALSE_POSITIVES,
    MV14_TRUE,
    MV69,
    OPENCOMPASS_2647,
    VERL_CANONICAL,
)

BOXED_SOURCES = ("lighteval/MATH", "math")


def _grade(data_source, solution, ground_truth):
    key, sol, gold, _ = normalize_request(data_source, solution, ground_truth)
    return grade_in_process(key, sol, gold)


def _boxed(answer):
    return f"The answer is $\\boxed{{{answer}}}$."


E_GOLD = "1 - \\frac{1}{\\mathrm{e}}"


@pytest.mark.parametrize("source", BOXED_SOURCES)
def test_upright_e_identical_to_the_gold_is_right(source):
    out = _grade(source, _boxed(E_GOLD), E_GOLD)
    assert out == {"score": 1.0, "acc": True, "pred": E_GOLD}


@pytest.mark.parametrize(
    "pred,acc",
    [
        ("1 - e^{-1}", True),  # the same number, other notation
        ("\\frac{\\mathrm{e} - 1}{\\mathrm{e}}", True),
        ("1 - \\frac{1}{e}", True),
        ("1 + \\frac{1}{\\mathrm{e}}", False),  # Math-Verify issue #14's wrong answer stays wrong
        ("1 - \\frac{1}{\\mathrm{e}^2}", False),
        ("1 - \\frac{2}{\\mathrm{e}}", False),
        ("0.63", False),  # a rounded decimal of 1 - 1/e (0.6321...)
    ],
)
def test_upright_e_is_read_as_the_number_e(pred, acc):
    assert _grade("lighteval/MATH", _boxed(pred), E_GOLD)["acc"] is acc


def test_upright_letters_other_than_e_stay_units():
    """Only e is read: ``\\mathrm{m}`` is still a unit that math-verify drops (5 m is 5)."""
    assert _grade("lighteval/MATH", _boxed("5 \\mathrm{m}"), "5")["acc"] is True
    assert _grade("lighteval/MATH", _boxed("5 \\mathrm{m}"), "5 \\mathrm{m}")["acc"] is True


TUPLE_SET_GOLD = "\\{(1,2),(3,4)\\}"


@pytest.mark.parametrize(
    "pred,acc",
    [
        ("\\{(1,2),(1,2),(3,4)\\}", True),  # names (1,2) twice: the same set
        ("\\{(3,4),(1,2),(3,4)\\}", True),
        ("\\left\\{(1,2),(3,4),(1,2)\\right\\}", True),
        ("\\{(3,4),(1,2)\\}", True),
        ("\\{(1,2),(1,2)\\}", False),  # a member missing
        ("\\{(1,2),(3,4),(5,6)\\}", False),  # a member too many
        ("\\{(1,2),(1,2),(4,3)\\}", False),
        ("(1,2),(1,2),(3,4)", False),  # a list that repeats an answer is still refused
    ],
)
def test_a_set_of_tuples_that_repeats_a_member_is_the_set(pred, acc):
    assert _grade("lighteval/MATH", _boxed(pred), TUPLE_SET_GOLD)["acc"] is acc


def test_repeats_against_a_gold_that_is_no_set_are_still_refused():
    """The guard of math_boxed's docstring stands where the gold is not written as a set."""
    assert not _grade("lighteval/MATH", _boxed("\\{5, 5\\}"), "5")["acc"]
    assert not _grade("lighteval/MATH", _boxed("5, 5"), "5")["acc"]
    assert not _grade("lighteval/MATH", _boxed("1, 2, 2"), "1, 2")["acc"]


def _gold_corpus():
    """Every gold of the boxed / math graders' test corpora, de-duplicated, in a stable order."""
    golds = [gt for _, gt, _ in SET_RELATION_CASES] + [gt for _, gt, _ in BOXED_GUARD_CASES]
    golds += [gt for _, gt, _, _ in MATH_EITHER_CASES]
    golds += [g for g, _ in MV14_FALSE_POSITIVES] + [g for g, _ in MV14_TRUE] + [g for g, _ in MV2_TRUE]
    golds += [g for _, g in OPENCOMPASS_2647] + [g for _, g, _ in MV69] + [g for g, _ in VERL_CANONICAL]
    golds += ["33.3", E_GOLD, TUPLE_SET_GOLD]
    return list(dict.fromkeys(golds))


GOLDS = _gold_corpus()


@pytest.mark.parametrize("source", BOXED_SOURCES)
def test_an_answer_identical_to_its_gold_is_always_right(source):
    """The gold's own answer (its last box for a MATH solution, else the whole string), boxed as the
    response, scores +1 for every gold of the corpora: one test for the whole corpus, listing
    every gold it fails on."""
    assert len(GOLDS) >= 60
    wrong = []
    for gt in GOLDS:
        answer = gold_content(gt)
        out = _grade(source, _boxed(answer), gt)
        if not out["acc"]:
            wrong.append((gt, out["pred"]))
    assert not wrong, wrong
