"""Public test cases of peer graders, run through our graders (in-process; the
sandbox is tested in test_pool.py).

Each block cites where its cases come from (repository and test file, issue or
pull request), using the texts published there. Where this project deliberately
gives another verdict than the peer, the case says so and why. Graders:
``math`` = last ``\\boxed{}`` (exact for numbers, math-verify otherwise),
``math_dapo`` = last ``Answer:`` line, ``openai/gsm8k`` = number after ``####``.
"""

import pytest

from dapo_megatron.rewards.exact import parse_exact
from dapo_megatron.rewards.registry import grade_in_process, normalize_request


def _acc(data_source, solution, ground_truth):
    key, sol, gold, _ = normalize_request(data_source, solution, ground_truth)
    return grade_in_process(key, sol, gold)["acc"]


def _boxed(answer):
    return f"Reasoning ... so the answer is $\\boxed{{{answer}}}$."


# --------------------------------------------------------------------------- verl
# volcengine/verl tests/utils/reward_score/test_numeric_canonicalization_on_cpu.py:
# legal integer strings are canonicalised ("033" -> "33"), and end to end
# is_equiv(remove_boxed(gt), pred) holds for these (gt, pred) pairs.
VERL_CANONICAL = [("\\boxed{033}", "33"), ("\\boxed{+033}", "33"), ("\\boxed{-0}", "0"), ("\\boxed{000}", "0")]


@pytest.mark.parametrize("gt,pred", VERL_CANONICAL)
def test_verl_canonical_integers(gt, pred):
    assert _acc("math", _boxed(pred), gt)
    assert _acc("math", gt, pred)  # the other way round
    assert _acc("math_dapo", f"Answer: {gt[7:-1]}", pred)


# verl's "illegal / non-integer" strings stay untouched by its integer
# canonicaliser. parse_exact declines all but "3.3": our graders read decimals
# too (3.3 == 3.30), where verl's helper handles integers only.
@pytest.mark.parametrize("illegal", ["foo", "--33", "", "+", "33a"])
def test_verl_illegal_integer_strings_are_not_numbers(illegal):
    assert parse_exact(illegal) is None


def test_verl_malformed_sign():
    assert parse_exact("3.3").value == parse_exact("3.30").value
    # DAPO (string + exact value, like verl's is_equiv): "--33" is not the answer 33
    assert not _acc("math_dapo", "Answer: --33", "33")
    # Deliberate difference: the boxed grader leaves "--33" to math-verify, which
    # reads it as -(-33) = 33 and pays it; the value is right, only the notation is odd.
    assert _acc("math", _boxed("--33"), "33")


# --------------------------------------------------------------------------- Math-Verify #14
# huggingface/Math-Verify issue #14 ("Some possible error cases", verify should be
# False). The first two are the tiny values that math-verify still accepts: its own
# regression test (tests/test_yujianll.py) keeps them commented out. (gold, pred):
MV14_FALSE_POSITIVES = [
    ("$\\frac{1}{2004!}$", "$\\frac{1}{2006!}$"),
    ("$\\frac{1}{2^{99}}$", "$\\frac{1}{2^{98}}$"),
    ("$n=2, 3, 4$", "$n=1, 2, 3$"),
    ("$D = (0, 1)$", "$D = (0, 1.5)$"),
    ("$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$", "$F_n = \\sum_{k=0}^{n-2} F_k F_{n-k-2}$"),
    ("$19, 46, \\text{ and } 82$", "$21, 36, and 82$"),
    ("$\\frac{2^{2005}+1}{3 \\cdot 2^{2006}}$", "$\\frac{1}{3 \\cdot 2^{2006}}$"),
    ("$1 - \\frac{1}{\\mathrm{e}}$", "$1 + \\frac{1}{\\mathrm{e}}$"),
    ("$\\pm 2021$", "$2021$"),
    ("$12:00$", "$1:00$"),
    ("$1, 2, \\ldots, n$", "$1, 3, 5, \\ldots, 2n-1$"),
    ("$1:2:3:\\ldots$", "$1:4:9:\\ldots$"),
]
# the positive controls of tests/test_yujianll.py (same answers, other notation)
MV14_TRUE = [
    ("$n=1, 2, 3$", "$n=1, 2, 3$"),
    ("$D = (0, 1)$", "$D = (0, 1)$"),
    ("$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$", "$F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k$"),
    ("$19, 46, and 82$", "$19, 46, \\text{ and } 82$"),
    ("$1 - \\frac{1}{\\mathrm{e}}$", "$1 - \\frac{1}{\\mathrm{e}}$"),
    ("$\\pm 2021$", "${-2021, 2021}$"),
    ("$12:00$", "$12:00$"),
]


@pytest.mark.parametrize("gold,pred", MV14_FALSE_POSITIVES)
def test_math_verify_14_wrong_answers_are_wrong(gold, pred):
    assert not _acc("math", _boxed(pred), gold)


@pytest.mark.parametrize("gold,pred", MV14_TRUE)
def test_math_verify_14_controls(gold, pred):
    assert _acc("math", _boxed(pred), gold)


def test_math_verify_14_tiny_values_in_dapo():
    assert not _acc("math_dapo", "Answer: \\frac{1}{2006!}", "\\frac{1}{2004!}")
    assert not _acc("math_dapo", "Answer: \\frac{1}{2^{98}}", "\\frac{1}{2^{99}}")
    assert _acc("math_dapo", "Answer: 2^{-99}", "\\frac{1}{2^{99}}")


# huggingface/Math-Verify issue #21: verify(parse("0.0000001"), parse("0.0000002"))
# is True because floats are rounded to 6 decimals. Two decimals are compared exactly here.
def test_math_verify_21_decimals_are_exact():
    assert not _acc("math", _boxed("0.0000002"), "0.0000001")
    assert _acc("math", _boxed("0.00000010"), "0.0000001")


# Our extension of #14: a decimal written for a tiny value with no finite decimal
# form goes to math-verify's tolerant comparison, which rounds 1/2004! to 0.000000.
# The relative-error guard (exact.APPROXIMATION_REL_TOL) refuses it.
@pytest.mark.parametrize("pred", ["0.0", "0.000000", "0"])
def test_tiny_value_rounded_to_zero_is_wrong(pred):
    assert not _acc("math", _boxed(pred), "\\frac{1}{2004!}")
    assert not _acc("math", _boxed(pred), "\\frac{1}{2^{99}}")


def test_assignment_does_not_hide_a_tiny_difference():
    assert not _acc("math", _boxed("x = \\frac{1}{2^{98}}"), "\\frac{1}{2^{99}}")
    assert _acc("math", _boxed("x = 2^{-99}"), "\\frac{1}{2^{99}}")


# --------------------------------------------------------------------------- Math-Verify #41
# huggingface/Math-Verify issue #41: verify(parse("$4$"), parse("$4\\sqrt(2)$")) is
# True but should be False (the maintainers: "sqrt(2)" is not valid LaTeX).
def test_math_verify_41():
    assert not _acc("math", _boxed("4\\sqrt(2)"), "4")
    # the valid spellings from the thread are 4 sqrt 2, which is not 4 either
    assert not _acc("math", _boxed("4\\sqrt{2}"), "4")
    assert not _acc("math", _boxed("4\\sqrt2"), "4")
    assert _acc("math", _boxed("4\\sqrt2"), "4\\sqrt{2}")


# --------------------------------------------------------------------------- Math-Verify #69
# huggingface/Math-Verify issue #69 (reported false negatives, graded 0 by verl's
# math_verify reward; model_output vs ground_truth):
MV69 = [
    ("-1 + exp(16)", "e^{16} - 1", "e^{16}-1"),
    ("pi/2", "\\dfrac{\\pi}{2}", "\\frac{\\pi}{2}"),
    ("14.0 + -1.0i", "14 - i", "14-i"),
    ("Theta(log log n)", "O(\\log \\log n)", None),
    ("-2*pi", "-2\\pi", "-2\\pi"),
]


@pytest.mark.parametrize("model_output,ground_truth,latex_form", MV69)
def test_math_verify_69_python_syntax_is_not_read(model_output, ground_truth, latex_form):
    """Deliberate: these stay wrong. They are Python expression syntax, which only
    math-verify's ExprExtractionConfig reads, through sympy's parse_expr (eval);
    model text is never evaluated here (a commenter on the issue also judges them 0).
    The same values written in LaTeX are paid; Theta vs O is a different claim."""
    assert not _acc("math", _boxed(model_output), ground_truth)
    if latex_form is not None:
        assert _acc("math", _boxed(latex_form), ground_truth)


# --------------------------------------------------------------------------- Math-Verify #2
# huggingface/Math-Verify issue #2 ("Some wrong cases", false negatives; the issue's
# {"pred", "gt"} pairs, Python escapes removed). math-verify's regression test for
# them is the "Tests from qwen parser" block of tests/test_all.py. (gt, pred):
MV2_TRUE = [
    ("\\frac{1}{12}", "0.0833333333333333"),  # a decimal for 1/12: tolerant path, relative error 4e-16
    ("(1,\\frac{9}{2})", "(1,4.5)"),
    ("\\frac{x+2}{7}", "\\frac{x}{7}+\\frac{2}{7}"),
    ("\\tan^2(y)+1", "\\sec^2(y)"),
    (
        "(\\begin{pmatrix}-\\frac{7}{4}&-2\\\\4&\\frac{1}{4}\\\\\\end{pmatrix})",
        "\\begin{pmatrix}-\\frac{7}{4}&-2\\\\4&\\frac{1}{4}\\end{pmatrix}",
    ),
    (
        "(\\begin{pmatrix}\\frac{1}{3\\sqrt[3]{x}^2}&0&0\\\\0&1&0\\\\-\\sin(x)&0&0\\\\\\end{pmatrix})",
        "\\begin{pmatrix}\\frac{1}{3x^{2/3}}&0&0\\\\0&1&0\\\\-\\sin(x)&0&0\\end{pmatrix}",
    ),
    ("34x+45y-20z+100=0", "-34x-45y+20z-100=0"),
    # the exact path: both are algebraic numbers, equal under sympy's canonical form
    (
        "\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{15+2\\sqrt{33}}",
        "\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{2\\sqrt{33}+15}",
    ),
]


@pytest.mark.parametrize("gt,pred", MV2_TRUE)
def test_math_verify_2_equivalent_answers(gt, pred):
    assert _acc("math", _boxed(pred), gt)


def test_math_verify_2_rounded_golds_stay_wrong():
    """Deliberate: the issue counts these as false negatives; math-verify's own
    regression test leaves them out. 33.3 is 100/3 to three significant digits,
    and the gold matrix is rounded to 2-3 decimals; grading to the gold's own
    rounding would also pay every wrong answer that rounds to the same digits."""
    assert not _acc("math", _boxed("\\frac{100}{3}"), "33.3")
    gt = "(\\begin{pmatrix}0.29\\\\0.196\\\\-0.186\\\\\\end{pmatrix})"
    pred = "\\begin{pmatrix}0.290243531202435\\\\0.196008371385084\\\\-0.186381278538813\\end{pmatrix}"
    assert not _acc("math", _boxed(pred), gt)


# --------------------------------------------------------------------------- ms-swift #10147
# modelscope/ms-swift PR #10147 ("preserve nested MathORM expressions"): first-closing-
# brace extraction made \boxed{\frac{1}{2}} and \boxed{\frac{1}{3}} the same answer
# "\frac{1", and stripping all braces made \frac{1}{23} and \frac{12}{3} identical.
def test_ms_swift_10147_nested_braces():
    assert _acc("math", _boxed("\\frac{1}{2}"), "\\frac{1}{2}")
    assert not _acc("math", _boxed("\\frac{1}{3}"), "\\frac{1}{2}")
    assert not _acc("math", _boxed("\\frac{1}{23}"), "\\frac{12}{3}")
    assert not _acc("math_dapo", "Answer: \\frac{1}{23}", "\\frac{12}{3}")
    assert _acc("math_dapo", "Answer: \\frac{12}{3}", "4")
    assert _acc("math", _boxed("2^{10}"), "1024")  # nested exponent group
    assert _acc("math", _boxed("{42}"), "42")  # "a simple outer {42} wrapper"
    assert _acc("math", _boxed("\\{1,2\\}"), "\\{1,2\\}")  # escaped braces
    multiline = "\\boxed{\\begin{pmatrix} 0 & 3 \\\\\n 0 & -1 \\end{pmatrix}\n}"
    assert _acc("math", multiline, "\\begin{pmatrix} 0 & 3 \\\\ 0 & -1 \\end{pmatrix}")


def test_ms_swift_10147_deliberate_differences():
    """ms-swift falls back to the whole text for an incomplete box and takes the
    first box. Here a cut-off last box is wrong (a truncated answer is never
    paid), and the last box is the answer (a model that corrects itself boxes
    the correction last; lmms-eval PR #1512 below)."""
    assert not _acc("math", "so \\boxed{7} and finally \\boxed{\\frac{1}{2", "7")
    assert _acc("math", "first \\boxed{3}, then \\boxed{7}", "7")
    assert not _acc("math", "first \\boxed{3}, then \\boxed{7}", "3")


# --------------------------------------------------------------------------- lmms-eval #1512
# EvolvingLMMs-Lab/lmms-eval PR #1512 (issue #1511): the greedy regex resurrected a
# retracted first box; the fix extracts the last balanced \boxed{...}.
def test_lmms_eval_1512_retracted_box():
    response = "the answer is \\boxed{2}. wait, actually \\boxed{3}"
    assert _acc("math", response, "3")
    assert not _acc("math", response, "2")
    assert _acc("math", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}")  # nested single box, unchanged


def test_lmms_eval_1512_no_box():
    """Deliberate: lmms-eval falls back to the whole string without a box; here a
    response without a box is wrong (verifiers PR #1028 below)."""
    assert not _acc("math", "3", "3")


# --------------------------------------------------------------------------- verifiers #1028
# PrimeIntellect-ai/verifiers PR #1028: without \boxed{}, extract_boxed_answer returned
# the whole text and math_verify found the number anywhere in it, so "correct_lazy"
# (just the answer, no reasoning) scored 1.00 above "perfect" (0.67). Strict mode
# returns "" instead; our graders never fall back to numbers in the text.
@pytest.mark.parametrize("response", ["42", "The answer is 42.", "We get $42$.", "48 - 6 = 42"])
def test_verifiers_1028_no_box_is_wrong(response):
    assert not _acc("math", response, "42")
    assert not _acc("math_dapo", response, "42")  # no "Answer:" line
    assert not _acc("openai/gsm8k", response, "42")  # no "####"


# --------------------------------------------------------------------------- opencompass #2647
# open-compass/opencompass issue #2647: gsm8k_postprocess splits numbers at
# thousands separators (\boxed{$9{,}500} -> 500, \boxed{8,000} -> 000).
OPENCOMPASS_2647 = [
    ("\\boxed{9500}", "9500"),
    ("\\boxed{$9{,}500}", "9500"),
    ("\\boxed{8,000}", "8000"),
    ("\\boxed{10,000}", "10000"),
]


@pytest.mark.parametrize("response,gold", OPENCOMPASS_2647)
def test_opencompass_2647_thousands_separators(response, gold):
    assert _acc("math", response, gold)
    assert _acc("math_dapo", f"Answer: {response}", gold)
    number = response[len("\\boxed{") : -1]
    assert _acc("openai/gsm8k", f"#### {number}", gold)
    assert not _acc("math", response, gold + "1")


def test_opencompass_2647_sentence_form():
    """The issue's last input, "The answer is $9{,}500.", has no marker our graders
    read; with one it is read whole. Deliberate: the GSM8K grader reads only
    "#### N" (verl strict mode), never the last number of the text."""
    assert _acc("math_dapo", "Answer: $9{,}500.", "9500")
    assert _acc("openai/gsm8k", "The answer is\n#### $9{,}500.", "9500")
    assert not _acc("openai/gsm8k", "The answer is $9{,}500.", "9500")
    assert not _acc("openai/gsm8k", "#### 1,2", "12")  # a comma between 1 and 2 digits is not a separator


# --------------------------------------------------------------------------- verl #7274
# verl-project/verl PR #7274: extract_solution() keeps only the last 300 characters,
# so an answer followed by more text scored 0 on verl main.
TAIL = " and the reasoning above confirms this result is consistent." * 8


def test_verl_7274_gsm8k_long_tail():
    assert len(TAIL) > 300
    assert _acc("openai/gsm8k", "2+40=42\n#### 42\n" + TAIL, "42")
    assert _acc("openai/gsm8k", "2+40=42\n#### 42\n", "42")
    assert not _acc("openai/gsm8k", "2+40=42\n#### 41\n" + TAIL, "42")
    assert _acc("math_dapo", "2+40=42\nAnswer: 42\n" + TAIL, "42")  # same window in verl's math_dapo
    assert _acc("math", "2+40=42\n\\boxed{42}\n" + TAIL, "42")
