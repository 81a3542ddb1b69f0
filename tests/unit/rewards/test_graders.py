"""Answer extraction and comparison of each grader, run in-process (the sandbox is
tested in test_pool.py). Cases cover the extraction faults other RL stacks shipped: answers cut
off by a last-N-characters window, nested braces in \\boxed{}, \\fbox, thousands separators, a fallback to
any number in the text, invalid UTF-8."""

import ast
import pathlib
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO

from dapo_megatron.rewards.registry import grade_in_process, normalize_request, resolve_grader
from dapo_megatron.rewards.text import last_boxed_content, parse_exact_number, sanitize_text


def _grade(data_source, solution, ground_truth):
    key, sol, gold, _ = normalize_request(data_source, solution, ground_truth)
    return grade_in_process(key, sol, gold)


# --------------------------------------------------------------------------- DAPO math
LONG_TAIL = "\nLet me double check the steps once more." * 40  # > 300 characters after the answer


@pytest.mark.parametrize(
    "solution,gt,acc,pred",
    [
        ("Let me think.\nAnswer: 540", "540", True, "540"),
        ("Answer: 3\nwait, that is wrong\nAnswer: 540", "540", True, "540"),
        ("Answer: 540\nhmm\nAnswer: 3", "540", False, "3"),
        ("Answer: 540" + LONG_TAIL, "540", True, "540"),  # verl's last-300-chars window loses this
        ("Answer: $\\boxed{9{,}500}$", "9500", True, "9500"),
        ("Answer: 8,000", "8000", True, "8000"),
        ("Answer: \\$18 dollars", "18", True, "18"),
        ("Answer: \\text{5 cm}", "5", True, "5"),
        ("Answer: 30^\\circ", "30", True, "30"),
        ("Answer: x = \\dfrac{1}{2}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
        ("Answer: 0.5", "\\frac{1}{2}", True, "0.5"),
        ("answer: 42.", "42", True, "42"),
        ("**Answer:** 42", "42", True, "42"),
        ("The answer is 540.", "540", False, None),  # no Answer: line, no fallback to numbers
        ("Answer:\n540", "540", False, None),
        ("Answer: 5400", "540", False, "5400"),
        ("Answer: 1,2", "12", False, "1,2"),
    ],
)
def test_math_dapo(solution, gt, acc, pred):
    for source in ("math_dapo", "aime-2024", "AIME2025"):
        result = _grade(source, solution, gt)
        assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# Issue 23, item 12: a unit after a closing brace is dropped (only unit words, so
# "or more" is kept and the answer stays wrong); thousands grouped by spaces or
# LaTeX thin spaces are read, other digit runs split by spaces are not one number.
@pytest.mark.parametrize(
    "solution,gt,acc,pred",
    [
        ("Answer: \\frac{1}{3} \\text{meters}", "1/3", True, "\\frac{1}{3}"),
        ("Answer: 2\\sqrt{2}\\text{ cm}", "2\\sqrt{2}", True, "2\\sqrt{2}"),
        ("Answer: 2\\sqrt{2}\\text{ cm}", "\\sqrt{8}", True, "2\\sqrt{2}"),
        ("Answer: 2\\sqrt{2}\\text{ cm}^2", "2\\sqrt{2}", True, "2\\sqrt{2}"),
        ("Answer: \\frac{1}{3} meters", "1/3", True, "\\frac{1}{3}"),
        ("Answer: 5\\,\\text{square meters}.", "5", True, "5"),
        # different numbers with the same unit stay different
        ("Answer: \\frac{1}{3} \\text{meters}", "1/2", False, "\\frac{1}{3}"),
        ("Answer: 3\\sqrt{2}\\text{ cm}", "2\\sqrt{2}", False, "3\\sqrt{2}"),
        ("Answer: 3 \\text{meters}", "5", False, "3"),
        # only unit words are dropped: a bare letter after a brace may be a variable, in \\text it is a unit
        ("Answer: \\frac{1}{3} m", "1/3", False, "\\frac{1}{3}m"),
        ("Answer: \\frac{1}{3}\\text{ m}", "1/3", True, "\\frac{1}{3}"),
        ("Answer: 5 \\text{ or more}", "5", False, "5ormore"),
        ("Answer: 5 or more", "5", False, "5ormore"),
        # thousands
        ("Answer: 1 000", "1000", True, "1000"),
        ("Answer: 1000", "1 000", True, "1000"),
        ("Answer: 1\\,000", "1000", True, "1000"),
        ("Answer: 1~000", "1000", True, "1000"),
        ("Answer: 1 000 000", "1000000", True, "1000000"),
        ("Answer: 12 345.5", "12345.5", True, "12345.5"),
        ("Answer: 1,000", "1 000", True, "1000"),
        ("Answer: 1 000", "1", False, "1000"),
        ("Answer: 1 000", "0", False, "1000"),
        ("Answer: 100 0", "1000", False, "100 0"),  # verl removes every space: 1000
        ("Answer: 10 00", "1000", False, "10 00"),
        ("Answer: 5 6", "56", False, "5 6"),
        ("Answer: 5\\,6", "56", False, "5 6"),
        ("Answer: 1{,}2", "12", False, "1,2"),  # verl removes "{,}": 12
        ("Answer: 9{,}500", "9500", True, "9500"),
        ("Answer: \\frac{9{,}500}{3}", "\\frac{9500}{3}", True, "\\frac{9,500}{3}"),
        ("Answer: x + 5", "x+5", True, "x+5"),  # spaces elsewhere are still dropped
    ],
)
def test_math_dapo_units_and_thousands(solution, gt, acc, pred):
    assert _grade("math_dapo", solution, gt) == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# --------------------------------------------------------------------------- boxed math
@pytest.mark.parametrize(
    "solution,gt,acc,pred",
    [
        ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", True, "\\frac{1}{2}"),
        ("so $\\boxed{\\frac{1}{2}}$", "0.5", True, "\\frac{1}{2}"),
        # nested braces: first-closing-brace parsing would give "\frac{\sqrt{3"
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True, "\\frac{\\sqrt{3}}{2}"),
        ("\\fbox{7}", "7", True, "7"),
        ("first \\boxed{3}, then \\boxed{7}", "7", True, "7"),
        ("first \\boxed{3}, then \\boxed{7}", "3", False, "7"),
        ("\\boxed{9{,}500}", "9500", True, "9{,}500"),
        ("\\boxed{8,000}", "8000", True, "8,000"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", True, "\\{1,2\\}"),
        ("the answer is 7", "7", False, None),  # never "any number in the text"
        ("\\boxed{7} and finally \\boxed{\\frac{1}{2", "7", False, None),  # cut-off last box
        ("\\boxed{}", "7", False, None),
        ("\\boxed{2}", "so the answer is $\\boxed{2}$.", True, "2"),  # gold given as a solution
    ],
)
def test_boxed_math(solution, gt, acc, pred):
    result = _grade("lighteval/MATH", solution, gt)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# Issue 23, item 12: a relation in solved form answers an interval or set
# (math-verify's allow_set_relation_comp, guarded); (solution box, gold, acc)
SET_RELATION_CASES = [
    ("-2 \\le x \\le 7", "x \\in [-2,7]", True),
    ("-2 \\leq x \\leq 7", "x \\in [-2, 7]", True),
    ("-2 \\le x \\le 7", "[-2,7]", True),
    ("x > 3", "(3, \\infty)", True),
    ("3 < x", "(3, \\infty)", True),
    ("2 < x < 3", "(2,3)", True),
    ("x \\ne 3", "(-\\infty,3)\\cup(3,\\infty)", True),
    ("x \\in [-2,7]", "-2 \\le x \\le 7", True),  # the other way round (math-verify default)
    ("[-2,7]", "x \\in [-2,7]", True),
    # a different set
    ("-2 < x \\le 7", "x \\in [-2,7]", False),
    ("-2 \\le x \\le 8", "x \\in [-2,7]", False),
    ("x \\ge 3", "(3, \\infty)", False),
    # another variable than the gold's
    ("-2 \\le y \\le 7", "x \\in [-2,7]", False),
    ("-2 \\le y \\le 7", "[-2,7]", True),  # the gold names no variable
    # not solved: as_set would solve the restated problem for the model
    ("x^2 - 5x + 6 < 0", "(2,3)", False),
    ("(x-2)(x-3) < 0", "(2,3)", False),
    ("x^2 \\le 4", "[-2,2]", False),
    ("-7 \\le 2x \\le 7", "[-3.5, 3.5]", False),
    ("-2 \\le x \\le y", "[-2,2]", False),
]


@pytest.mark.parametrize("source", ["math", "lighteval/MATH"])
@pytest.mark.parametrize("solution,gt,acc", SET_RELATION_CASES)
def test_boxed_relation_answers_a_set(solution, gt, acc, source):
    assert _grade(source, f"so $\\boxed{{{solution}}}$", gt)["acc"] is acc


# forms math-verify pays for the wrong reason (math_boxed module docstring); (box, gold, acc)
BOXED_GUARD_CASES = [
    ("1 000", "1000", True),
    ("1\\,000", "1000", True),
    ("12 345", "12345", True),
    ("100 0", "0", False),  # math-verify: 100 * 0
    ("100 0", "1000", False),
    ("5 6", "11", False),  # math-verify: 5 + 6
    ("5 6", "56", False),
    ("5\\,6", "56", False),
    ("0x5", "0", False),  # math-verify: 0 * x * 5
    ("0x5", "5", False),
    ("10x", "10x", True),
    ("5!", "5", False),  # 120
    ("5!", "120", True),
    ("1 000", "0", False),
    ("5 \\text{ apples}", "5", True),
    ("5 \\text{ cm}", "5", True),
    ("5 \\text{cm}^2", "5", True),
    ("\\frac{1}{3} \\text{meters}", "1/3", True),
    ("2\\sqrt{2}\\text{ cm}", "2\\sqrt{2}", True),
    ("2\\pi \\text{ cm}", "2\\pi", True),
    ("3 \\text{meters}", "5", False),
    ("5 \\text{ or more}", "5", False),  # math-verify drops the text: 5
    ("5 \\text{ or 6}", "5", False),
    ("5 \\mbox{ or 6}", "5", False),
    ("5 \\textbf{ is wrong}", "5", False),
    ("2 \\text{ m} \\times 3 \\text{ m}", "2", False),  # math-verify: 2
    ("5 \\text{ or } 6", "5", False),  # a set {5, 6}
    ("5 \\text{ or } 6", "5, 6", True),
    ("\\text{(C)}", "\\text{(C)}", True),
    ("5, 5", "5", False),  # math-verify: the set {5}
    ("5 \\text{ or } 5", "5", False),
    ("\\{5, 5\\}", "5", False),
    ("1, 2, 2", "1, 2", False),
    ("2, 2", "2, 2", True),  # a double root listed twice, as the gold does
    ("5, 6", "5", False),
    ("-2021, 2021", "\\pm 2021", True),
]


@pytest.mark.parametrize("solution,gt,acc", BOXED_GUARD_CASES)
def test_boxed_guards(solution, gt, acc):
    assert _grade("lighteval/MATH", f"so $\\boxed{{{solution}}}$", gt)["acc"] is acc


# --------------------------------------------------------------------------- math: either form
# Issue 23, item 13: verl grades data_source "math" by its Answer: line; here "math"
# reads a box or an Answer: line, and grades only the one that comes last
# (rewards/math_either.py). (response, gold, acc, pred)
MATH_EITHER_CASES = [
    ("Reasoning.\nAnswer: 5", "5", True, "5"),  # verl's form: scored -1 before
    ("so $\\boxed{5}$.", "5", True, "5"),
    ("\\boxed{5}\nAnswer: 5", "5", True, "5"),
    # both forms, different answers: the later one is the answer, the other is no second chance
    ("\\boxed{3} hmm, no.\nAnswer: 5", "5", True, "5"),
    ("\\boxed{3} hmm, no.\nAnswer: 5", "3", False, "5"),
    ("Answer: 5\nwait, that is wrong: \\boxed{3}", "3", True, "3"),
    ("Answer: 5\nwait, that is wrong: \\boxed{3}", "5", False, "3"),
    # an Answer: inside the reasoning, before the box
    ("The answer: 3 is wrong, so \\boxed{5}", "5", True, "5"),
    ("The answer: 3 is wrong, so \\boxed{5}", "3", False, "5"),
    # several boxes: the last
    ("\\boxed{3}, then \\boxed{5}", "5", True, "5"),
    ("\\boxed{3}, then \\boxed{5}", "3", False, "5"),
    # a box on the Answer: line is the answer
    ("Answer: \\boxed{5}", "5", True, "5"),
    ("Answer: $\\boxed{9{,}500}$ dollars.", "9500", True, "9{,}500"),
    ("Answer: 5 \\boxed{3}", "3", True, "3"),
    ("Answer: 5 \\boxed{3}", "5", False, "3"),
    # an incomplete final candidate is wrong; the earlier one does not stand in
    ("Answer: 5\nso \\boxed{\\frac{1}{2", "5", False, None),
    ("\\boxed{5}\nAnswer:", "5", False, None),
    ("\\boxed{5}\nAnswer:\n5", "5", False, None),
    # no candidate: no fallback to numbers in the text
    ("5", "5", False, None),
    ("The answer is 5.", "5", False, None),
    # an Answer: line is compared as math_dapo does, then as the boxed grader does
    ("Answer: $(1, 4.5)$", "(1,\\frac{9}{2})", True, "(1, 4.5)"),
    ("Answer: x+1", "1+x", True, "x+1"),
    ("Answer: \\frac{1}{3} \\text{meters}", "1/3", True, "\\frac{1}{3} \\text{meters}"),
    ("Answer: $-2 \\le x \\le 7$", "x \\in [-2,7]", True, "-2 \\le x \\le 7"),
    ("Answer: 1 000", "1000", True, "1 000"),
    ("Answer: 9{,}500", "The total is $\\boxed{9500}$.", True, "9{,}500"),  # gold as a MATH solution
    ("**Answer:** 42.", "42", True, "42"),
    # ... and never pays a wrong one
    ("Answer: 43", "42", False, "43"),
    ("Answer: 0.333", "\\frac{1}{3}", False, "0.333"),
    ("Answer: x^2-5x+6<0", "(2,3)", False, "x^2-5x+6<0"),
    ("Answer: 3 or 5", "5", False, "3 or 5"),
    ("Answer: 3, 5", "5", False, "3, 5"),
    ("Answer: 5, 5", "5", False, "5, 5"),
    ("Answer: 5 \\text{ or more}", "5", False, "5 \\text{ or more}"),
    ("Answer: 100 0", "0", False, "100 0"),
    ("Answer: 5 6", "11", False, "5 6"),
]


@pytest.mark.parametrize("solution,gt,acc,pred", MATH_EITHER_CASES)
def test_math_reads_a_box_or_an_answer_line(solution, gt, acc, pred):
    assert _grade("math", solution, gt) == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 999), st.integers(0, 999), st.booleans(), st.sampled_from(["\\n", " hmm, ", "\\n\\nWait.\\n"]))
def test_math_grades_only_the_last_of_two_forms(first, last, box_first, gap):
    """Whatever two answers a response writes in the two forms, it is paid exactly
    when the later one is right."""
    forms = [f"\\boxed{{{first}}}", f"Answer: {last}"] if box_first else [f"Answer: {first}", f"\\boxed{{{last}}}"]
    response = forms[0] + gap + forms[1]
    assert _grade("math", response, str(last))["acc"]
    if first != last:
        assert not _grade("math", response, str(first))["acc"]


# --------------------------------------------------------------------------- GSM8K
GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    "solution,gt,acc,pred",
    [
        ("48 + 24 = 72\n#### 72", "72", True, "72"),
        ("48 + 24 = 72\n#### 72", GSM8K_ANSWER, True, "72"),
        ("#### 1,200", "1200", True, "1200"),
        ("#### 72.00", "72", True, "72.00"),
        ("#### $18", "18", True, "18"),
        ("#### -5", "-5", True, "-5"),
        ("#### 70\nno wait\n#### 72", "72", True, "72"),
        ("so it is 72", "72", False, None),
        ("#### 73", GSM8K_ANSWER, False, "73"),
    ],
)
def test_gsm8k(solution, gt, acc, pred):
    assert _grade("openai/gsm8k", solution, gt) == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


@pytest.mark.parametrize(
    "solution,gt,acc,pred",
    [
        ("#### 1 000", "1000", True, "1000"),  # SI thousands
        ("#### 1\\,000", "1000", True, "1000"),
        ("#### 1 000 000", "1000000", True, "1000000"),
        ("#### 1 000", "1", False, "1000"),  # verl reads 1
        ("#### 100 0", "100", False, None),  # verl reads 100
        ("#### 100 0", "1000", False, None),
        ("#### 1,2", "1", False, None),  # verl reads 1
        ("#### 3, 4", "3", False, None),
        ("#### 72\n#### 1,2", "72", False, None),  # a malformed last answer: no earlier one stands in
        ("#### 72\n\n#### Check\nIt adds up.", "72", True, "72"),  # a Markdown heading is not an answer
        ("#### 72\n3 more lines", "72", True, "72"),
    ],
)
def test_gsm8k_thousands_and_run_on_numbers(solution, gt, acc, pred):
    assert _grade("openai/gsm8k", solution, gt) == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# --------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    "solution,gt,acc,pred",
    [
        ("12", "12", True, "12"),
        ("The answer is 12.", "12", True, "12"),
        ("5 + 7 = 12", "12", True, "12"),
        ("-7", "-7", True, "-7"),
        ("3 - 10 = -7", "-7", True, "-7"),
        ("1,234", "1234", True, "1234"),
        ("12 or maybe 13", "12", False, "13"),
        ("12.5", "12", False, "12.5"),
        ("twelve", "12", False, None),
        ("", "0", False, None),
    ],
)
def test_arithmetic(solution, gt, acc, pred):
    assert _grade("arithmetic", solution, gt) == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# Issue 23, item 11: the last number is graded only when it is written as a plain
# integer; a notation that gives it another value (5! = 120, 0x15 = 21, 2^5 = 32) or
# makes it part of something else (a list, a ratio, an argument) is wrong, never read
# as its digits and never replaced by an earlier number.
@pytest.mark.parametrize(
    "solution,pred",
    [
        ("5!", "5!"),  # 120
        ("The answer is 5 !", "5 !"),
        ("0x5", "0x5"),  # hexadecimal
        ("\\boxed{5, 5}", "\\boxed{5, 5"),  # a pair, not the number 5
        ("5, 5", "5, 5"),
        ("4, 5", "4, 5"),  # a list whose last element is the answer
        ("12,5", "12,5"),  # a decimal comma: 12.5
        ("3:5", "3:5"),  # a ratio
        ("2^5", "2^5"),  # 32
        ("2^{5}", "2^{5"),
        ("3**5", "3**5"),
        ("1 * 5", "* 5"),  # echoing "Compute 1 * 5"
        ("1*5", "1*5"),
        ("3 x 5", "3 x 5"),
        ("0 + 5", "+ 5"),  # echoing "Compute 0 + 5"
        ("10 - 5", "- 5"),
        ("8-5", "8-5"),
        ("8 -5", "8 -5"),
        ("5 \\times 1", "\\times 1"),
        ("x5", "x5"),
        ("5x", "5x"),
        ("5e0", "5e0"),
        ("5th", "5th"),
        ("5\u00b2", "5\u00b2"),
        (".5", ".5"),
        ("5%", "5%"),
        ("5\\%", "5\\%"),
        ("5\\pi", "5\\pi"),
        ("x > 5", "x > 5"),
        ("x \\le 5", "\\le 5"),
        ("\\frac{1}{5}", "\\frac{1}{5"),
        ("\\frac{5}{2}", "\\frac{5}{2"),
        ("\\sqrt{5}", "\\sqrt{5"),
        ("\\sqrt[3]{5}", "\\sqrt[3]{5"),
        ("x_{5}", "x_{5"),
        ("\\overline{5}", "\\overline{5"),
        ("f(5)", "f(5"),
        ("2(5)", "2(5"),
        ("\\{5\\}", "\\{5"),
        ("100 5", "100 5"),  # two numbers, not a thousands grouping
    ],
)
def test_arithmetic_notation_is_not_the_number(solution, pred):
    result = _grade("arithmetic", solution, "5")
    assert result == {"score": -1.0, "acc": False, "pred": pred}


@pytest.mark.parametrize(
    "solution",
    [
        "5", "05", "+5", "= 5", "The answer is 5.", "Answer: 5", "Answer: **5**", "**5**", "*5*", "$5$", "$$5$$",
        "\\boxed{5}", "$\\boxed{5}$.", "\\text{5}", "\\textbf{5}", "(5)", "\\(5\\)", "\\left(5\\right)",
        "5 apples", "5 \\text{ apples}", "5\u00a0apples", "5 (five)", "<answer>5</answer>", "2 + 3 = 5",
        "5 + 0 = 5", "3 x 5 = 15, no: 5", "Step 2: 5", "the answer\u20145", "5\n\nDone.", "5 \\quad",
    ],
)
def test_arithmetic_plain_answers_are_read(solution):
    assert _grade("arithmetic", solution, "5") == {"score": 1.0, "acc": True, "pred": "5"}


@pytest.mark.parametrize(
    "solution,gold,acc,pred",
    [
        ("-5", "-5", True, "-5"),
        ("The answer is -5", "-5", True, "-5"),
        ("\u22125", "-5", True, "-5"),  # U+2212 minus
        ("\u22125", "5", False, "-5"),  # never read as 5
        ("\u20135", "5", False, "-5"),  # an en dash before a number is a minus
        # thousands: commas or spaces (SI) in groups of exactly three
        ("1000", "1000", True, "1000"),
        ("1,000", "1000", True, "1000"),
        ("1 000", "1000", True, "1000"),
        ("1\u2009000", "1000", True, "1000"),  # thin space
        ("-1 000", "-1000", True, "-1000"),
        ("1 000 000", "1000000", True, "1000000"),
        ("1 000", "0", False, "1000"),  # not the "000" of "1 000"
        ("100 0", "1000", False, "100 0"),
        ("100 0", "0", False, "100 0"),
        ("10 00", "1000", False, "10 00"),
        ("1 000 0", "10000", False, "000 0"),
        ("1,0000", "10000", False, "1,0000"),
        ("1,00,000", "100000", False, "1,00,000"),
        ("5 6", "56", False, "5 6"),
        ("5 6", "6", False, "5 6"),
        ("12\n13", "13", True, "13"),  # a line break separates two answers: the last counts
    ],
)
def test_arithmetic_signs_and_thousands(solution, gold, acc, pred):
    assert _grade("arithmetic", solution, gold) == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["!", "%", "^2", "x", "e1", "'", "\\%", "\\pi", "!!"]),
       st.sampled_from(["", "The answer is ", "**", "$", "\\boxed{"]))
def test_arithmetic_postfix_notation_never_pays_the_digits(answer, postfix, prefix):
    """No postfix notation (factorial, percent, power, a unit letter) is read as the bare number."""
    assert not _grade("arithmetic", f"{prefix}{answer}{postfix}", str(answer))["acc"]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**9))
def test_arithmetic_space_thousands_property(answer):
    spaced = f"{answer:,}".replace(",", " ")
    assert _grade("arithmetic", f"The total is {spaced}.", str(answer))["acc"]
    for wrong in {str(answer)[:-1] + " " + str(answer)[-1:], str(answer) + " 0"} - {spaced}:
        if wrong.strip() != str(answer):  # one-digit answers have no second group
            assert not _grade("arithmetic", wrong, str(answer))["acc"], wrong


@given(st.integers(-10**9, 10**9), st.integers(-10**6, 10**6))
def test_arithmetic_property(answer, other):
    with_sep = f"{answer:,}"
    result = _grade("arithmetic", f"{other} plus something gives {with_sep}", str(answer))
    assert result["acc"] and result["pred"] == str(answer)
    wrong = _grade("arithmetic", f"{answer} hmm, no: {answer + 1}", str(answer))
    assert not wrong["acc"] and wrong["score"] == -1.0


# --------------------------------------------------------------------------- thousands, every grader
_FORMS = {
    "math": lambda a: f"so $\\boxed{{{a}}}$",
    "math_dapo": lambda a: f"Answer: {a}",
    "openai/gsm8k": lambda a: f"#### {a}",
    "arithmetic": lambda a: f"The total is {a}.",
}


@settings(max_examples=60, deadline=None)
@given(st.integers(1000, 10**7), st.sampled_from(sorted(_FORMS)), st.data())
def test_digits_split_by_a_space_are_one_number_only_as_thousands(value, source, data):
    """1 000 / 1,000 / 1\\,000 are 1000 in every grader; a space anywhere else
    (100 0, 1 0000) makes no number, neither the joined value nor a part of it."""
    digits = str(value)
    write = _FORMS[source]
    for grouped in (f"{value:,}", f"{value:,}".replace(",", " "), f"{value:,}".replace(",", "\\,")):
        assert _grade(source, write(grouped), digits)["acc"], grouped
    cut = data.draw(st.integers(1, len(digits) - 1))
    if (len(digits) - cut) % 3 != 0:  # not a thousands boundary
        split = digits[:cut] + " " + digits[cut:]
        for gold in {digits, digits[:cut].lstrip("0") or "0", digits[cut:].lstrip("0") or "0"}:
            assert not _grade(source, write(split), gold)["acc"], (split, gold)


# --------------------------------------------------------------------------- dispatch / inputs
def test_unknown_data_source_names_it():
    with pytest.raises(ValueError, match="'my_dataset'"):
        resolve_grader("my_dataset")
    for source, key in [("openai/gsm8k", "gsm8k"), ("math", "math"), ("lighteval/MATH", "boxed_math"), ("aime24", "math_dapo"), ("arithmetic", "arithmetic")]:
        assert resolve_grader(source) == key


@pytest.mark.parametrize("source", ["arithmetic", "openai/gsm8k"])
def test_malformed_ground_truth_raises(source):
    with pytest.raises(ValueError, match="ground_truth"):
        _grade(source, "#### 5", "five")


def test_sanitize_text():
    assert sanitize_text(b"Answer: 5\xff\xfe") == "Answer: 5\ufffd\ufffd"
    assert sanitize_text("a\ud800b") == "a?b"
    assert sanitize_text("x\x00y") == "xy"
    with pytest.raises(TypeError, match="solution_str"):
        sanitize_text(None)


@pytest.mark.parametrize("source", ["math_dapo", "openai/gsm8k", "arithmetic", "math"])
@pytest.mark.parametrize("bad", [b"Answer: 4\xc3\x28 #### 4 \\boxed{4}", "Answer: \ufffd4 #### \ufffd \\boxed{\ufffd}", "\ud83d 4"])
def test_invalid_utf8_never_crashes(source, bad):
    result = _grade(source, bad, "4")
    assert result["score"] in (1.0, -1.0) and isinstance(result["acc"], bool)


# --------------------------------------------------------------------------- text helpers
def _balanced():
    leaf = st.text(alphabet="abcx0123456789+-^_\\ ,.", max_size=6).filter(lambda s: not s.endswith("\\"))
    return st.recursive(leaf, lambda inner: st.lists(st.one_of(inner, inner.map(lambda s: "{" + s + "}")), max_size=3).map("".join), max_leaves=8)


@settings(max_examples=100, deadline=None)
@given(_balanced(), st.text(alphabet="abc 12{", max_size=10))
def test_last_boxed_content_is_brace_balanced(content, prefix):
    text = prefix + "\\boxed{" + content + "} and done"
    assert last_boxed_content(text) == content
    assert last_boxed_content(text.replace("\\boxed", "\\fbox")) == content


@given(st.integers(-10**12, 10**12), st.integers(1, 10**6))
def test_parse_exact_number(p, q):
    assert parse_exact_number(f"\\frac{{{p}}}{{{q}}}") == Fraction(p, q)
    assert parse_exact_number(f"{p}/{q}") == Fraction(p, q)
    assert parse_exact_number(f"{p}.{q}") == Fraction(f"{p}.{q}")
    assert parse_exact_number(f"{p}x") is None
    assert parse_exact_number("9" * 5000) is None  # no int() on huge digit strings


def test_no_dynamic_evaluation_in_reward_code():
    """No grader source calls eval/exec/compile/sympify/parse_expr (they execute model text)."""
    forbidden = {"eval", "exec", "compile", "sympify", "parse_expr", "parse_latex", "__import__"}
    root = pathlib.Path(REPO) / "dapo_megatron" / "rewards"
    files = sorted(root.glob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in forbidden, f"{path.name}:{node.lineno} calls {node.func.id}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = getattr(node.func.value, "id", None)
                if not (owner == "re" and node.func.attr == "compile"):  # re.compile builds a regex only
                    assert node.func.attr not in forbidden, f"{path.name}:{node.lineno} calls .{node.func.attr}"
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not {a.name for a in node.names} & forbidden, f"{path.name} imports a dynamic evaluator"
