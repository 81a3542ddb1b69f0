"""Megatron ⇄ HF weights: one mapping table (:mod:`.mapping`), TP/PP gather/scatter,
bucketed streaming (:func:`iter_hf_weights`) and model-only distributed checkpoints; the weight
sync into the engines: its buckets (:mod:`.buckets`, SGLang's flattened form :mod:`.flat_bucket`),
the verification of every sync (:mod:`.verify`), what a receiving model holds, the tracker that
checks a sync against it and the receiving protocol every rollout engine inherits (:mod:`.receiver`
``WeightReceiver``), and the sync into separate servers (:mod:`.servers`).
The submodules of the sync are imported by name (not re-exported here).

Design: docs/design.md §1 step 7 (weight sync).
"""

from .dist_ckpt import (
    check_config_fits,
    load_checkpoint_hf_config,
    load_model_checkpoint,
    read_checkpoint_meta,
    save_model_checkpoint,
)
from .mapping import (
    FAMILY_RULES,
    ModelLayout,
    Rule,
    canonical_megatron_name,
    expected_hf_names,
    hf_to_megatron_shard,
    megatron_to_hf,
    megatron_to_hf_into,
)
from .sources import SafetensorsSource, load_gguf_state_dict, open_hf_source
from .weights import (
    ExportBuffers,
    LoadReport,
    expert_turn,
    export_hf_state_dict,
    iter_hf_weights,
    load_hf_weights,
    local_parameters,
    model_layout,
    unwrap_model,
)

__all__ = [
    "ExportBuffers",
    "FAMILY_RULES",
    "LoadReport",
    "ModelLayout",
    "Rule",
    "SafetensorsSource",
    "canonical_megatron_name",
    "check_config_fits",
    "expected_hf_names",
    "expert_turn",
    "export_hf_state_dict",
    "hf_to_megatron_shard",
    "iter_hf_weights",
    "load_checkpoint_hf_config",
    "load_gguf_state_dict",
    "load_hf_weights",
    "load_model_checkpoint",
    "local_parameters",
    "megatron_to_hf",
    "megatron_to_hf_into",
    "model_layout",
    "open_hf_source",
    "read_checkpoint_meta",
    "save_model_checkpoint",
    "unwrap_model",
]
