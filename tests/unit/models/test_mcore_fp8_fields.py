"""The FP8 settings the project passes to megatron-core, checked against the installed megatron-core
on CPU (issue 34 item 3): the FP8 path only builds on a GPU, so a field renamed or a recipe gate
moved by a megatron-core upgrade would otherwise first show on the GPU machine.

* every FP8 recipe the config accepts builds a ``TransformerConfig`` of the installed megatron-core
  with the FP8 fields set as the config says (a field removed or renamed raises ``TypeError``);
* every accepted recipe is a member of megatron-core's ``Fp8Recipe``;
* the minimum Transformer Engine version per recipe (``models/config.py``
  ``FP8_RECIPE_MIN_TE``) equals the gate megatron-core's ``fp8_utils.get_fp8_recipe`` applies,
  read from the installed source (0.19.2 ``fp8_utils.py:732-748``): with a lower bound the run
  would pass ``validate_fp8`` and then fail inside megatron-core.
"""

from __future__ import annotations

import re

import pytest

import dapo_megatron.models.config as mc
from conftest import tiny_hf_config
from dapo_megatron.models.config import FP8_RECIPE_MIN_TE, ModelConfig, hf_to_transformer_config
from dapo_megatron.platform import ParallelConfig


@pytest.mark.parametrize("recipe", sorted(FP8_RECIPE_MIN_TE))
def test_fp8_fields_reach_the_installed_transformer_config(monkeypatch, recipe):
    monkeypatch.setattr(mc, "_cuda_capability", lambda: (10, 0))
    monkeypatch.setattr(mc, "_te_version", lambda: "2.20.2")
    # the TE spec needs CUDA; the FP8 fields are TransformerConfig's whatever the spec
    monkeypatch.setattr(mc, "resolve_transformer_impl", lambda model_cfg: "local")
    bf16_ends = recipe != "delayed"  # megatron-core refuses bf16 end layers under delayed scaling
    cfg = ModelConfig(fp8="hybrid", fp8_recipe=recipe, first_last_layers_bf16=bf16_ends,
                      num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    tc = hf_to_transformer_config(tiny_hf_config("llama_tied", num_hidden_layers=4), ParallelConfig(), cfg)
    assert (tc.fp8, tc.fp8_recipe, tc.first_last_layers_bf16) == ("hybrid", recipe, bf16_ends)
    assert (tc.num_layers_at_start_in_bf16, tc.num_layers_at_end_in_bf16) == (1, 1)


def test_accepted_recipes_are_megatron_cores():
    from megatron.core.enums import Fp8Recipe

    assert set(FP8_RECIPE_MIN_TE) <= {r.value for r in Fp8Recipe}


def test_fp8_recipe_te_gates_equal_megatron_cores():
    import megatron.core.fp8_utils as fu

    src = open(fu.__file__).read()
    # the TE branch of get_fp8_recipe: one outer gate, then per recipe an optional extra one
    body = src[src.index("def get_fp8_recipe(config"):]
    body = body[:body.index("def get_fp8_context")]
    outer = re.search(r'if is_te_min_version\("([^"]+)"\):\s*\n\s*if config\.fp8_recipe == Fp8Recipe\.delayed', body)
    assert outer, "megatron-core's get_fp8_recipe no longer opens with one TE version gate"
    gates = {name: outer.group(1) for name in ("delayed", "mxfp8")}
    for name, version in re.findall(r'config\.fp8_recipe == Fp8Recipe\.(\w+) and is_te_min_version\("([^"]+)"\)',
                                    body):
        gates[name] = version
    assert set(gates) >= set(FP8_RECIPE_MIN_TE) - {"delayed"}
    from packaging.version import Version

    for name, need in FP8_RECIPE_MIN_TE.items():
        if name == "delayed":  # megatron-core's non-TE-2.1 branch keeps delayed scaling on any TE
            continue
        assert Version(need) == Version(gates[name]), (name, need, gates[name])
