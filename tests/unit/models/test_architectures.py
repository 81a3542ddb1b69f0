"""config.json names the model class (issue 36 item 9): SGLang and vLLM pick the class from
``architectures`` and refuse a checkpoint without it. A config read from a GGUF file, and the
MixtralConfig ``tools/upcycle_moe.py`` builds, have none; every config this package writes names
one (``dapo_megatron.models.config.with_architectures``), and each name is one transformers,
SGLang and vLLM resolve.

The SGLang and vLLM names are embedded here as read in their sources (no SGLang or vLLM on the
CPU machine):

- SGLang 0.5.23 (the wheel sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl): the registry
  maps ``EntryClass.__name__`` of each ``python/sglang/srt/models/*.py`` to the class
  (``srt/models/registry.py:134-145``), resolved from ``hf_config.architectures``
  (``srt/model_loader/utils.py:201``);
- vLLM (vllm-project/vllm at 0002bff0b6cb36a3c8a17364de3303664463c412):
  ``vllm/model_executor/models/registry.py`` ``_TEXT_GENERATION_MODELS`` (architecture name ->
  module, class).
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import random_hf_model, tiny_hf_config, tiny_moe_config

from dapo_megatron.models.config import CAUSAL_LM_ARCHITECTURE, SUPPORTED_MODEL_TYPES, with_architectures

# EntryClass of python/sglang/srt/models/<module>.py in sglang 0.5.23 (file:line of the assignment)
SGLANG_0_5_23_ENTRY_CLASSES = {
    "LlamaForCausalLM": "llama.py:968",  # EntryClass = [LlamaForCausalLM, Phi3ForCausalLM, ...]
    "Qwen2ForCausalLM": "qwen2.py:797",
    "Qwen3ForCausalLM": "qwen3.py:808",
    "Qwen3MoeForCausalLM": "qwen3_moe.py:1298",
    "Qwen2MoeForCausalLM": "qwen2_moe.py:1436",
    "MixtralForCausalLM": "mixtral.py:482",
    # deepseek_v2.py ends with EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]; read at
    # the stored commit 00114aef (older than 0.5.23, the line not checked at the tag)
    "DeepseekV2ForCausalLM": "deepseek_v2.py (EntryClass, last line)",
    "DeepseekV3ForCausalLM": "deepseek_v2.py (EntryClass, last line)",
    # glm4_moe.py ends with EntryClass = [Glm4MoeForCausalLM, GlmMoeDsaForCausalLM]; read at the stored
    # commit 005ffc65 (its tag not known here, the line not checked at 0.5.23)
    "Glm4MoeForCausalLM": "glm4_moe.py (EntryClass, last line)",
}
# vllm/model_executor/models/registry.py _TEXT_GENERATION_MODELS: name -> (module, class)
VLLM_TEXT_GENERATION_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
}


def _resolves_everywhere(name: str, model_type: str) -> None:
    """``name`` is the transformers causal-LM class of ``model_type`` and a class SGLang 0.5.23 and
    vLLM register."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == name
    assert getattr(transformers, name).__name__ == name
    assert name in SGLANG_0_5_23_ENTRY_CLASSES, name
    assert name in VLLM_TEXT_GENERATION_MODELS, name


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_every_supported_model_type_names_a_class_all_three_resolve(model_type):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    assert not cfg.architectures  # a config built in code names no class
    assert with_architectures(cfg) is cfg and cfg.architectures == [CAUSAL_LM_ARCHITECTURE[model_type]]
    _resolves_everywhere(cfg.architectures[0], model_type)


def test_a_config_that_names_its_class_keeps_it():
    from transformers import LlamaConfig

    cfg = LlamaConfig(architectures=["MistralForCausalLM"])  # a Mistral checkpoint is model_type llama
    assert with_architectures(cfg).architectures == ["MistralForCausalLM"]
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        with_architectures(AutoConfig.for_model("gpt2"))


def test_upcycle_moe_writes_the_mixtral_class(tmp_path):
    from unit.models.test_upcycle import _tool

    cfg = tiny_hf_config("llama_tied")
    random_hf_model(cfg, seed=7).save_pretrained(tmp_path / "dense")
    # a source that names no class either (as a GGUF source's config does)
    with open(tmp_path / "dense" / "config.json") as f:
        dense = json.load(f)
    dense.pop("architectures", None)
    with open(tmp_path / "dense" / "config.json", "w") as f:
        json.dump(dense, f)
    assert _tool().main(["--hf", str(tmp_path / "dense"), "--out", str(tmp_path / "moe"), "--num-experts", "2",
                         "--top-k", "1"]) == 0
    with open(tmp_path / "moe" / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["MixtralForCausalLM"]
    _resolves_everywhere(written["architectures"][0], written["model_type"])


def test_gguf_config_names_its_class_in_every_config_json_written_from_it(smollm2_gguf, tmp_path):
    """``load_hf_config`` (the trainer, convert_hf_to_megatron) reads a GGUF file into a config with
    the class named, so the checkpoints' and exports' config.json name it."""
    from transformers import AutoConfig

    from dapo_megatron.models import load_hf_config

    path, fname = smollm2_gguf
    assert not AutoConfig.from_pretrained(path, gguf_file=fname).architectures  # the defect's cause
    cfg = load_hf_config(path, fname)
    cfg.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == ["LlamaForCausalLM"]
    _resolves_everywhere(written["architectures"][0], written["model_type"])


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_tiny_moe_configs_name_their_class(name):
    cfg = tiny_moe_config(name)
    cfg.architectures = None
    _resolves_everywhere(with_architectures(cfg).architectures[0], cfg.model_type)
