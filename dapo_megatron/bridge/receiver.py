"""What a receiving HF model holds, and the check of one weight sync against it.

The receiving side of the bridge's stream: a causal LM's parameters under their HF checkpoint names
(:func:`checkpoint_parameters`: a transformers-5 MoE model's fused experts listed one by one), their
shapes and dtypes (:class:`ParamSpec`, :func:`specs_from_module`, :func:`hf_param_specs` on the meta
device for a model in another process), and :class:`WeightSyncTracker`, which every engine and the
server sync use to refuse an unknown name or a wrong shape and to name every parameter a sync never
updated. Used by the rollout engines (``RolloutEngine.update_weights``), the server sync
(:mod:`.servers`) and ``dapo-rollout-server``.

Design: docs/design.md §1 step 7 (weight sync) and §1.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from transformers import AutoModelForCausalLM


@dataclass
class ParamSpec:
    """Shape and dtype of one engine parameter (the receiving side of a weight sync)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightSyncTracker:
    """Checks one weight sync against the engine's parameter list.

    A sync is ``begin(version)``, any number of ``check_and_mark(name, tensor)`` (in any
    number of buckets), then ``finish()``. It catches the silent failures other stacks
    shipped: a tensor whose name matches no engine parameter (mapping bug; many engines'
    ``load_weights`` skip unknown names silently), a shape mismatch (TP shard sent instead
    of the full tensor, vocab padding rows kept), and an engine parameter that the sync
    never touched (a layer dropped by the PP gather).

    Tied parameters: ``aliases`` maps an alias name to the canonical name of the same
    storage (``{"lm_head.weight": "model.embed_tokens.weight"}`` for tied embeddings).
    Sending either name updates the canonical parameter; the alias is never reported as
    "never updated" on its own.

    Args:
        specs: canonical parameter name → :class:`ParamSpec` (full, unsharded HF shapes).
        aliases: alias name → canonical name; every target must be in ``specs``.
    """

    def __init__(self, specs: Mapping[str, ParamSpec], aliases: Optional[Mapping[str, str]] = None):
        self.specs = dict(specs)
        self.aliases = dict(aliases or {})
        for alias, target in self.aliases.items():
            if target not in self.specs:
                raise ValueError(f"alias {alias!r} points to {target!r}, which is not an engine parameter")
        self._updated: Optional[set[str]] = None
        self.version: Optional[int] = None

    @property
    def in_progress(self) -> bool:
        return self._updated is not None

    def begin(self, version: int) -> None:
        """Start the sync of weight ``version`` (an int >= 0). A sync left unfinished is discarded."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"weight version must be an int >= 0, got {version!r}")
        self._updated = set()
        self.version = version

    def resolve(self, name: str) -> str:
        """Canonical engine parameter name for ``name`` (alias → target)."""
        return self.aliases.get(name, name)

    def check_and_mark(self, name: str, tensor: torch.Tensor) -> str:
        """Validate one incoming tensor and record it as updated; returns the canonical name.

        Raises:
            RuntimeError: no sync in progress (call ``begin`` first).
            KeyError: ``name`` matches no engine parameter (with close names as a hint).
            ValueError: ``tensor``'s shape differs from the engine parameter's.
        """
        if self._updated is None:
            raise RuntimeError("update_weights: no weight sync in progress; call begin(version) first")
        canonical = self.resolve(name)
        spec = self.specs.get(canonical)
        if spec is None:
            tail = name.rsplit(".", 2)[-2:]
            hints = [n for n in self.specs if n.endswith(".".join(tail))][:3]
            raise KeyError(f"update_weights: tensor {name!r} matches no engine parameter"
                           + (f" (similar: {hints})" if hints else "")
                           + "; check the Megatron→HF name mapping")
        if tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)} but the engine "
                             f"parameter {canonical!r} has shape {tuple(spec.shape)} (a TP shard or padded vocab "
                             "rows sent instead of the full HF tensor?)")
        self._updated.add(canonical)
        return canonical

    def abort(self) -> None:
        """Discard the sync in progress (after an error); the next ``begin`` starts afresh."""
        self._updated = None

    def updated(self, name: str) -> bool:
        """Whether ``name`` (or the parameter it aliases) was updated in the sync in progress."""
        return self._updated is not None and self.resolve(name) in self._updated

    def missing(self) -> list[str]:
        """Canonical names not updated so far in this sync (sorted)."""
        if self._updated is None:
            return []
        return sorted(set(self.specs) - self._updated)

    def finish(self) -> int:
        """End the sync; returns its version.

        Raises:
            RuntimeError: no sync in progress, or engine parameters never updated (named).
        """
        if self._updated is None:
            raise RuntimeError("finish_weight_update: no weight sync in progress")
        missing = self.missing()
        self._updated = None
        if missing:
            shown = ", ".join(missing[:10]) + (f" ... (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            raise RuntimeError(f"weight sync to version {self.version} left {len(missing)} engine parameter(s) "
                               f"never updated: {shown}")
        return self.version


# HF checkpoint names of a transformers-5 fused expert block, per model_type: (block name in the
# checkpoint, gate, up, down). transformers fuses ``experts.{e}.<gate|up>`` into
# ``mlp.experts.gate_up_proj`` [E, 2F, H] (gate rows first) and ``experts.{e}.<down>`` into
# ``mlp.experts.down_proj`` [E, H, F] on load, and splits them back on save
# (transformers/conversion_mapping.py, "qwen2_moe" — shared by qwen3_moe — and "mixtral", which
# also renames ``block_sparse_moe.`` to ``mlp.``). SGLang loads the per-expert names.
_FUSED_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj"),  # conversion_mapping.py: "deepseek_v2" -> "qwen2_moe"
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "glm4_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),  # conversion_mapping.py: "glm4_moe" -> "qwen2_moe"
}
# Buffers that are weights: a router's score-correction bias (DeepSeek-V3's aux-loss-free balancing,
# transformers ``DeepseekV3TopkRouter.e_score_correction_bias``, a buffer kept in fp32) decides routes,
# so the sync must fill it and the tracker must count it like a parameter.
_WEIGHT_BUFFERS = (".e_score_correction_bias",)


def checkpoint_parameters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A causal LM's parameters under their HF checkpoint names, in module order, tied
    parameters under every name (``named_parameters(remove_duplicate=False)``).

    Dense models: the parameters themselves. A transformers-5 MoE model (``qwen3_moe``,
    ``qwen2_moe``, ``mixtral``) holds each layer's experts fused in 3-D parameters; each of those
    is listed instead as its per-expert checkpoint tensors, views into it
    (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` = ``gate_up_proj[e, :F]``, ``up_proj`` =
    ``gate_up_proj[e, F:]``, ``down_proj`` = ``down_proj[e]``; Mixtral's
    ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, and its router ``block_sparse_moe.gate.weight``).
    Copying into a view writes the fused parameter, so a weight sync by checkpoint name fills
    it, and a tracker over these names counts every expert. Buffers that decide routes
    (:data:`_WEIGHT_BUFFERS`: DeepSeek-V3's ``mlp.gate.e_score_correction_bias``) are listed too,
    after the parameters.
    """
    config = getattr(module, "config", None)
    names = _FUSED_EXPERT_NAMES.get(getattr(config, "model_type", None))
    out: list[tuple[str, torch.Tensor]] = []
    buffers = [(n, b) for n, b in module.named_buffers() if n.endswith(_WEIGHT_BUFFERS)]
    for name, p in list(module.named_parameters(remove_duplicate=False)) + buffers:
        if names is None or ".mlp." not in name:
            out.append((name, p))
            continue
        block, gate, up, down = names
        prefix, _, leaf = name.rpartition(".")
        ckpt_prefix = prefix.replace(".mlp", "." + block, 1)
        if prefix.endswith(".mlp.experts") and leaf == "gate_up_proj" and p.dim() == 3:
            f = p.shape[1] // 2
            for e in range(p.shape[0]):
                out.append((f"{ckpt_prefix}.{e}.{gate}.weight", p[e, :f]))
                out.append((f"{ckpt_prefix}.{e}.{up}.weight", p[e, f:]))
        elif prefix.endswith(".mlp.experts") and leaf == "down_proj" and p.dim() == 3:
            for e in range(p.shape[0]):
                out.append((f"{ckpt_prefix}.{e}.{down}.weight", p[e]))
        else:
            out.append((f"{ckpt_prefix}.{leaf}", p))
    return out


def specs_from_module(module: torch.nn.Module) -> tuple[dict[str, ParamSpec], dict[str, str]]:
    """``(specs, aliases)`` of a module's parameters for :class:`WeightSyncTracker`, under
    their HF checkpoint names (:func:`checkpoint_parameters`: an MoE model's experts one by one).

    Each tensor is listed once under its first name; later names of the same tensor
    (tied ``lm_head.weight`` → ``model.embed_tokens.weight``) become aliases. Buffers
    (e.g. rotary ``inv_freq``) are not weights and are not synced.
    """
    specs: dict[str, ParamSpec] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, p in checkpoint_parameters(module):  # held in the list: no id is reused during the loop
        if id(p) in first_name:  # tied: the same Parameter under a second name (expert views are distinct)
            aliases[name] = first_name[id(p)]
        else:
            first_name[id(p)] = name
            specs[name] = ParamSpec(tuple(p.shape), p.dtype)
    return specs, aliases


def hf_param_specs(config: Any) -> tuple[dict[str, ParamSpec], dict[str, str]]:
    """Parameter specs of the HF causal LM described by ``config`` (a transformers
    ``PretrainedConfig``), built on the meta device (no memory, no download). Used by
    engines whose model lives in another process (SGLang) to check a sync before sending."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return specs_from_module(model)
