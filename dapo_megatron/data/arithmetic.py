"""The embedded default task: arithmetic problems with exact integer answers.

``data_source = "arithmetic"``; the reward grader registered for it accepts a
response when its LAST number is a plain integer equal to ``reward_model.ground_truth``
(``5!`` or ``0x5`` is not 5: :mod:`dapo_megatron.rewards.arithmetic`).

Why this default: DAPO needs a task in the regime where a group of samples is often
mixed (neither all right nor all wrong): dynamic sampling keeps only those groups, and the
reward needs room to rise. SmolLM2-135M-Instruct at temperature 1.0 on "Compute a + b.
Reply with just the number." with operands 1-20 sits there (``python -m
dapo_megatron.data.probe``; benchmarks/README.md has the figures). Operators, range and a
word-problem phrasing are configurable.

Generation is deterministic from the seed (``random.Random(seed)``, whose
``randint`` stream is stable across CPython 3 versions), and
:func:`write_arithmetic_dataset` writes a DAPO-schema file so the default task
goes through the same reader (:func:`~dapo_megatron.data.dataset.load_prompt_dataset`)
as real data.

CLI: ``python -m dapo_megatron.data.arithmetic --out train.parquet --n 1024 [--seed 1]``.

Design: docs/design.md §1 step 1 (the prompts of a rollout).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from dapo_megatron.data.schema import write_dapo_rows

DATA_SOURCE = "arithmetic"
DEFAULT_TEMPLATE = "Compute {a} {op} {b}. Reply with just the number."
OPERATORS = ("+", "-", "*", "/")

# Word-problem phrasings per operator (style="word"); {a} and {b} are the operands.
WORD_TEMPLATES = {
    "+": "Sam has {a} marbles and finds {b} more. How many marbles does Sam have now? Reply with just the number.",
    "-": "Sam has {a} marbles and gives away {b}. How many marbles does Sam have left? Reply with just the number.",
    "*": "There are {a} boxes with {b} marbles in each box. How many marbles are there? Reply with just the number.",
    "/": "Sam shares {a} marbles equally among {b} friends. How many marbles does each friend get? Reply with just the number.",
}


@dataclass
class ArithmeticConfig:
    """Settings of the arithmetic generator (``data.arithmetic.*``)."""

    num_train_problems: int = 1024
    """rows written for training when ``data.train_files`` is empty."""
    num_val_problems: int = 64
    """rows written for validation when ``data.val_files`` is empty."""
    min_operand: int = 1
    """smallest operand (inclusive). For ``"/"`` the operand range bounds the divisor and the
    quotient; the dividend is their product."""
    max_operand: int = 20
    """largest operand (inclusive); see ``min_operand`` for ``"/"``."""
    operators: tuple[str, ...] = ("+",)
    """subset of ``("+", "-", "*", "/")``, drawn uniformly per problem."""
    allow_negative: bool = False
    """if False, ``"-"`` orders operands so the answer is >= 0."""
    style: str = "plain"
    """``"plain"`` (``template``) or ``"word"`` (short story per operator)."""
    template: str = DEFAULT_TEMPLATE
    """format string with ``{a}``, ``{op}``, ``{b}`` for ``style="plain"``."""
    system_prompt: str | None = None
    """optional system message put before the user message."""

    def __post_init__(self) -> None:
        self.operators = tuple(self.operators)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        if not self.operators:
            raise ValueError("operators=() is empty; use e.g. ('+',)")
        bad = [op for op in self.operators if op not in OPERATORS]
        if bad:
            raise ValueError(f"operators={self.operators!r} has unsupported {bad}; choose from {OPERATORS}")
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand={self.min_operand} must be <= max_operand={self.max_operand}")
        if "/" in self.operators and self.min_operand <= 0 <= self.max_operand:
            raise ValueError(f"min_operand={self.min_operand}: '/' needs a divisor range without 0; "
                             "set min_operand >= 1")
        if self.style not in ("plain", "word"):
            raise ValueError(f"style={self.style!r} must be 'plain' or 'word'")
        if self.style == "plain":
            for key in ("{a}", "{b}"):
                if key not in self.template:
                    raise ValueError(f"template={self.template!r} must contain {key}")
            try:  # the generator's own call (generate_problems): another field or a lone brace fails there
                self.template.format(a=1, op="+", b=2)
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"template={self.template!r} is not a format string of {{a}}, {{op}} and {{b}} only "
                                 f"({type(e).__name__}: {e}); write a literal brace as {{{{ or }}}}") from None
        for name in ("num_train_problems", "num_val_problems"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


def _solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if a % b:
        raise ValueError(f"{a} / {b} is not an integer")
    return a // b


def generate_problems(num_problems: int, seed: int, config: ArithmeticConfig | None = None) -> list[dict]:
    """Draw ``num_problems`` problems, deterministic in ``seed``.

    Returns:
        list of ``{"a": int, "op": str, "b": int, "answer": int, "question": str}``.

    Raises:
        ValueError: ``num_problems <= 0``.
    """
    if num_problems <= 0:
        raise ValueError(f"num_problems must be > 0, got {num_problems}")
    cfg = config or ArithmeticConfig()
    cfg.validate()
    rng = random.Random(seed)
    lo, hi = cfg.min_operand, cfg.max_operand
    problems = []
    for _ in range(num_problems):
        op = cfg.operators[rng.randrange(len(cfg.operators))]
        if op == "/":
            b, q = rng.randint(lo, hi), rng.randint(lo, hi)
            a = b * q
        else:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if op == "-" and not cfg.allow_negative and a < b:
                a, b = b, a
        answer = _solve(a, op, b)
        if cfg.style == "word":
            question = WORD_TEMPLATES[op].format(a=a, b=b)
        else:
            question = cfg.template.format(a=a, op=op, b=b)
        problems.append({"a": a, "op": op, "b": b, "answer": answer, "question": question})
    return problems


def to_dapo_rows(problems: list[dict], config: ArithmeticConfig | None = None, split: str = "train") -> list[dict]:
    """Convert problems to DAPO-schema rows (data_source ``"arithmetic"``)."""
    cfg = config or ArithmeticConfig()
    rows = []
    for i, p in enumerate(problems):
        messages = [{"role": "user", "content": p["question"]}]
        if cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": messages,
                "ability": "arithmetic",
                "reward_model": {"ground_truth": str(p["answer"]), "style": "rule"},
                "extra_info": {"index": i, "split": split, "a": p["a"], "op": p["op"], "b": p["b"]},
            }
        )
    return rows


def write_arithmetic_dataset(
    path: str,
    num_problems: int,
    seed: int,
    min_operand: int | None = None,
    max_operand: int | None = None,
    operators: tuple[str, ...] | None = None,
    config: ArithmeticConfig | None = None,
    split: str = "train",
) -> str:
    """Write ``num_problems`` arithmetic problems as a DAPO-schema file.

    Args:
        path: output ``.parquet`` (pyarrow) or ``.jsonl``.
        num_problems: number of rows.
        seed: generator seed; the same arguments always write the same rows.
        min_operand, max_operand, operators: override the fields of ``config``.
        config: :class:`ArithmeticConfig` (defaults: ``a + b``, operands 1-20).
        split: stored in ``extra_info["split"]``.

    Returns:
        ``path``.
    """
    cfg = config or ArithmeticConfig()
    overrides = {
        k: v
        for k, v in (("min_operand", min_operand), ("max_operand", max_operand), ("operators", operators))
        if v is not None
    }
    if overrides:
        cfg = replace(cfg, **overrides)
    rows = to_dapo_rows(generate_problems(num_problems, seed, cfg), cfg, split)
    return write_dapo_rows(rows, path)


def main(argv: list[str] | None = None) -> str:
    """CLI entry point; returns the written path."""
    p = argparse.ArgumentParser(description="Write the embedded arithmetic task as a DAPO-schema file.")
    p.add_argument("--out", required=True, help="output .parquet or .jsonl")
    p.add_argument("--n", type=int, default=1024, help="number of problems")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--min-operand", type=int, default=1)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--operators", default="+", help="e.g. '+-*' (subset of + - * /)")
    p.add_argument("--style", choices=("plain", "word"), default="plain")
    p.add_argument("--split", default="train")
    args = p.parse_args(argv)
    cfg = ArithmeticConfig(
        min_operand=args.min_operand,
        max_operand=args.max_operand,
        operators=tuple(args.operators),
        style=args.style,
    )
    path = write_arithmetic_dataset(args.out, args.n, args.seed, config=cfg, split=args.split)
    print(f"wrote {args.n} arithmetic problems to {path}")
    return path


if __name__ == "__main__":
    main()
