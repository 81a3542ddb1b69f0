"""What a receiving HF model holds, and the check of one weight sync against it.

The receiving side of the bridge's stream: a causal LM's parameters under their HF checkpoint names
(:func:`checkpoint_parameters`: a transformers-5 MoE model's fused experts listed one by one), their
shapes and dtypes (:class:`ParamSpec`, :func:`specs_from_module`, :func:`hf_param_specs` on the meta
device for a model in another process), and :class:`WeightSyncTracker`, which every engine and the
server sync use to refuse an unknown name or a wrong shape and to name every parameter a sync never
updated. Used by the rollout engines, the server sync (:mod:`.servers`) and ``dapo-rollout-server``.
:class:`WeightReceiver` is the receiving protocol every rollout engine inherits (``update_weights``:
the tracker, the checksums of :mod:`.verify`, weight validity and version); an engine keeps only how
it loads a stream.

Design: docs/design.md §1 step 7 (weight sync) and §1.1.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch
from transformers import AutoModelForCausalLM

from dapo_megatron.bridge.buckets import iter_buckets
from dapo_megatron.bridge.verify import SyncDigest, Timer, WeightSyncVerifyError, digest_dtype


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


class InvalidWeightsError(RuntimeError):
    """``generate`` was called while the engine's weights are not valid (see
    :attr:`WeightReceiver.weights_valid`)."""


def _validated_named_tensor(item: Any) -> tuple[str, torch.Tensor]:
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)):
        raise ValueError("update_weights: named_tensors must yield (hf_name: str, tensor: torch.Tensor) pairs, "
                         f"got {type(item).__name__}")
    return item


class WeightReceiver(abc.ABC):
    """The receiving end of a weight sync, which every rollout engine
    (:class:`~dapo_megatron.rollout.engines.engine.RolloutEngine`) inherits: the engine keeps only
    how it loads a stream, the protocol around it is the bridge's.

    A receiver implements :meth:`_param_specs` (parameter list of the receiving model) and one of
    :meth:`_load_bucket` (copy a list of validated full tensors into the model) or
    :meth:`_load_stream` (consume the whole validated stream); :meth:`update_weights` checks every
    tensor against the list (:class:`WeightSyncTracker`), verifies the sender's checksums
    (:mod:`~dapo_megatron.bridge.verify`) and sets :attr:`weight_version` once the sync is complete.

    Weight validity (:attr:`weights_valid`): the receiver knows whether the weights it would
    generate with are those of :attr:`weight_version`. They are not during a sync (partly
    loaded) or after an aborted one, after a ``sleep`` that released them without a
    backup (SGLang's ``release_memory_occupation`` unmaps the memory; ``resume`` maps it
    back without its contents), and before the first sync of an engine started without
    real weights (SGLang ``load_format="dummy"``). ``generate`` raises
    :class:`InvalidWeightsError` while they are invalid; a caller re-syncs
    (``update_weights``) after a ``wake_up`` that left them invalid, or sleeps with
    ``keep_weights=True`` where the weights must survive.
    """

    #: bucket size used by ``update_weights`` (bytes); engines may override.
    update_bucket_bytes: int = 512 * 2**20

    #: True where ``update_weights`` copies each tensor into the engine's own memory in this process
    #: before asking for the next, and neither writes into it nor hands it to another process: the
    #: sender may then pass views of the actor's parameters themselves
    #: (:func:`dapo_megatron.bridge.iter_hf_weights` with ``param_views``). False for engines that
    #: pack tensors into payloads for other processes (a CUDA-IPC handle of a view would share the
    #: actor's parameter memory with them).
    copies_on_load: bool = False

    def __init__(self):
        self._weight_version = 0
        self._tracker: Optional[WeightSyncTracker] = None
        self._weights_valid = True

    # ---- weight validity ----------------------------------------------------------
    @property
    def weights_valid(self) -> bool:
        """True when the engine holds the complete weights of :attr:`weight_version`
        (see the class docstring for when they are not)."""
        return self._weights_valid

    def _require_valid_weights(self) -> None:
        """Raise :class:`InvalidWeightsError` unless :attr:`weights_valid` (every ``generate``)."""
        if not self._weights_valid:
            raise InvalidWeightsError(
                f"{type(self).__name__}.generate: the engine's weights are not valid (released by sleep() "
                "without a backup, or a weight sync is unfinished or was aborted); call update_weights() with "
                "the full set first")

    # ---- weight sync --------------------------------------------------------------
    def _check_can_load(self) -> None:
        """Raise ``RuntimeError`` if new weights must not be loaded now (an engine: rows in flight)."""

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine generates with (0 = as loaded)."""
        return self._weight_version

    @abc.abstractmethod
    def _param_specs(self) -> tuple[dict[str, ParamSpec], dict[str, str]]:
        """``(specs, aliases)`` of the engine model, see :class:`WeightSyncTracker`."""

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Copy validated full tensors (canonical or alias HF names) into the engine; called by
        the default :meth:`_load_stream` only."""
        raise NotImplementedError(f"{type(self).__name__} implements neither _load_bucket nor _load_stream")

    def _load_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a stream of validated full tensors: by default in buckets of
        ``update_bucket_bytes`` through :meth:`_load_bucket`. Engines that pack buckets
        themselves (SGLang's flattened buckets, :mod:`dapo_megatron.rollout.engines.engine_group`)
        override this instead."""
        for bucket in iter_buckets(named_tensors, self.update_bucket_bytes):
            self._load_bucket(bucket)

    def _on_sync_finished(self) -> None:
        """Hook after a complete sync (e.g. flush a prefix cache)."""

    def _weight_tracker(self) -> WeightSyncTracker:
        if self._tracker is None:
            specs, aliases = self._param_specs()
            self._tracker = WeightSyncTracker(specs, aliases)
        return self._tracker

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                       finish: bool = True, digest: Optional[SyncDigest] = None) -> None:
        """Load new weights by HF parameter name.

        Args:
            named_tensors: ``(hf_name, full_tensor)`` pairs (any dtype: cast to the engine's),
                consumed lazily and loaded in buckets of ``update_bucket_bytes``.
            version: weight version (trainer step) these tensors belong to, int >= 0.
            finish: end the sync after this call (checks that every parameter was updated).
                With False, more calls for the same version follow, then
                :meth:`finish_weight_update`.
            digest: the sender's checksums of this sync (the bridge fills it while the stream is
                read, :mod:`~dapo_megatron.bridge.verify`): after loading, and before the version is set, the engine
                compares what it loaded (:meth:`_loaded_checksums`) and fails the sync on any
                difference, a stale bucket, or a sent tensor it never received.

        Raises:
            KeyError: a name matches no engine parameter. ValueError: a shape differs.
            RuntimeError: (at finish) engine parameters never updated; or a partial sync
                of a different version is in progress. WeightSyncVerifyError: what the engine
                loaded differs from what was sent (the engine's weights are then invalid).
            On any error the buckets before the offending tensor are already loaded (as in
            SGLang): call :meth:`abort_weight_update` and re-send the full set.
        """
        self._check_can_load()
        tracker = self._weight_tracker()
        if tracker.in_progress and tracker.version != version:
            raise RuntimeError(f"update_weights(version={version}) while the sync of version {tracker.version} "
                               "is unfinished; call finish_weight_update() first")
        if not tracker.in_progress:
            tracker.begin(version)
        self._weights_valid = False  # partly loaded until finish_weight_update()

        def checked():
            for item in named_tensors:
                name, tensor = _validated_named_tensor(item)
                del item
                tracker.check_and_mark(name, tensor)
                yield name, tensor
                del tensor  # before the next is produced: the bridge reuses memory nobody holds

        self._sync_digest = digest  # engines that checksum as they load read it (HFEngine)
        try:
            self._load_stream(checked())
        finally:
            self._sync_digest = None
        if digest is not None:
            error = self.verify_loaded(digest, tracker)
            if error is not None:
                self.abort_weight_update()
                raise WeightSyncVerifyError(error)
        if finish:
            self.finish_weight_update()

    _sync_digest: Optional[SyncDigest] = None  # during update_weights: the sync's digest

    #: names this engine's errors use for itself (e.g. "HFEngine on rank 3")
    engine_label: str = ""

    def _where(self) -> str:
        return self.engine_label or type(self).__name__

    def _loaded_checksums(self, names: list[str], dtype: torch.dtype,
                          readback_elements: Optional[int] = None) -> dict[str, Optional[int]]:
        """The receiver's checksum (:func:`~dapo_megatron.bridge.verify.checksum`) of each named
        tensor as the engine holds it now, read as ``dtype`` (the sent dtype); None where the engine
        does not hold it. Engines that can read their weights override it; the default cannot verify
        (None for all). ``readback_elements``: the digest's
        (:attr:`~dapo_megatron.bridge.verify.SyncDigest.readback_elements`): an engine that reads
        back checksums each tensor's head rows within it, as the sender did; None for the in-process
        engines, which checksum whole tensors."""
        raise NotImplementedError(f"{type(self).__name__} cannot read back its weights for verification")

    def verify_loaded(self, digest: SyncDigest, tracker: Optional[WeightSyncTracker] = None) -> Optional[str]:
        """Compare what the engine loaded with the sender's digest; the first failure's message, or
        None. Checks, in order: a stale or misordered bucket the bridge saw, a sent tensor the
        engine's sync never received (``tracker``), then each checksummed tensor."""
        where = self._where()
        if digest.errors:
            return f"{digest.errors[0]} (engine {where})"
        if tracker is not None and tracker.in_progress:
            unseen = [n for n in digest.sent if not tracker.updated(n)]
            if unseen:
                return (f"weight sync to version {digest.version}: {where} never received {unseen[0]!r} "
                        f"({len(unseen)} sent tensor(s) in all), which the trainer sent")
        names = [n for n in digest.sent if n in digest.sums]
        if not names:
            return None
        with Timer(digest):
            loaded = self._loaded_checksums(names, digest_dtype(digest), digest.readback_elements)
            for name in names:
                if name not in loaded:  # the engine cannot compare it (a narrower dtype)
                    continue
                error = digest.mismatch(name, loaded[name], where)
                if error is not None:
                    return error
        return None

    def abort_weight_update(self) -> None:
        """Discard an unfinished sync after an error. The engine's weights are then partly
        updated: re-send the full set before generating again."""
        if self._tracker is not None:
            self._tracker.abort()
        self._weights_valid = False

    def finish_weight_update(self) -> int:
        """End the current sync: raise ``RuntimeError`` naming every engine parameter that was
        never updated; otherwise set and return ``weight_version`` (the weights are valid)."""
        version = self._weight_tracker().finish()
        self._on_sync_finished()
        self._weight_version = version
        self._weights_valid = True
        return version
