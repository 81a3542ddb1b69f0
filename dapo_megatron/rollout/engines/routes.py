"""Routing replay, the rollout side: the experts each token was routed to, as the engine ran it.

An MoE engine routes every token it forwards through the top-k experts of every layer's
router. R3 (rollout routing replay, ``actor.routing_replay: rollout``) makes the actor's
forwards use exactly those experts (:mod:`dapo_megatron.actor.routing_replay`), so the actor's
logprobs and gradients are those of the network that sampled the tokens (Megatron-LM #4168:
GRPO on Qwen3-30B-A3B collapses without it).

The routes of one sample (``Sample.routes``), the one format every engine produces:

- shape ``[P + R - 1, L, K]``: token ``t`` of ``prompt_ids + response_ids`` (``t < P + R - 1``),
  layer ``l`` (0-based decoder layer), its ``K`` experts (global expert indices, in the router's
  top-k order). The last response token is sampled, never forwarded, so it has no route (it
  feeds no label either: every logprob the actor computes depends on tokens ``0 .. P + R - 2``
  only). SGLang's ``return_routed_experts`` has the same rows (``seqlen - 1`` tokens; sglang
  0.5.23 ``managers/scheduler_components/batch_result_processor.py:140-180``: rows
  ``[routed_experts_start_len, seqlen - 1)``, ``seqlen`` = prompt + output through the stop token;
  the package sends no ``routed_experts_start_len``, i.e. 0: the whole sequence, as
  ``managers/io_struct.py:264-268`` documents).
- dtype :func:`route_dtype`: ``torch.uint8`` for up to 256 experts, else ``torch.int16``
  (``K`` bytes per token and layer: Qwen3-30B-A3B, 48 layers × top-8 over 128 experts, is
  384 bytes per token).

Sources: transformers 5 ``Qwen3MoeTopKRouter`` / ``Qwen2MoeTopKRouter`` / ``MixtralTopKRouter``
(``forward`` returns ``(router_logits, router_scores, router_indices)``; the indices are
``torch.topk`` of the fp32 softmax of the logits); SGLang 0.5.23
``srt/state_capturer/routed_experts.py:166`` (``extract_routed_experts_from_meta_info``: the
int32 expert ids base64-encoded in ``meta_info["routed_experts"]``, row-major
``[seqlen - 1, num_layers, topk]``; int32 capture buffers, ``routed_experts.py:100-106``, sliced
to ``topk`` columns, ``:145-147``; encoded by ``managers/detokenizer_manager.py:432-448`` or
``managers/tokenizer_manager.py:2602-2609``; 0.5.11 had the same format in
``layers/moe/routed_experts_capturer.py``). ``meta_info["routed_experts_dtype"]`` (no SGLang
release sends it) names another dtype where a server does.

Design: docs/design.md §2.1 (routing replay).
"""

from __future__ import annotations

import base64
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

from dapo_megatron.models.config import moe_layout


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of routes over ``num_experts`` experts: uint8 up to 256, else int16.

    Raises:
        ValueError: ``num_experts`` outside ``1 .. 32768``.
    """
    if not 1 <= int(num_experts) <= 32768:
        raise ValueError(f"num_experts={num_experts} must be in 1 .. 32768 for routing replay")
    return torch.uint8 if num_experts <= 256 else torch.int16


class RoutesLayout(NamedTuple):
    """The routes a run carries (routing replay): every sample's ``routes`` is ``[n, num_layers,
    topk]`` of ``dtype`` (:func:`route_dtype` of ``num_experts``). Indexes as ``(L, K, dtype)``
    first, the form the step's data path reads (:func:`~dapo_megatron.rollout.plan.step_data.send_tokens`)."""

    num_layers: int
    topk: int
    dtype: torch.dtype
    num_experts: int

    @property
    def engine_shape(self) -> tuple[int, int, int]:
        """``(L, K, E)``: what an engine asked for routes records and checks (``record_routes``)."""
        return self.num_layers, self.topk, self.num_experts


def replay_routes_layout(routing_replay: str, hf_config) -> Optional[RoutesLayout]:
    """The :class:`RoutesLayout` of the routes a run carries (``actor.routing_replay: rollout`` on an
    MoE model), None when it carries none (``off``). Computed once, where the rollout is built
    (:func:`~dapo_megatron.rollout.build.build_rollout`): the engines get its ``engine_shape``,
    the rollout and the trainer's step data path the layout itself.

    Raises:
        ValueError: ``rollout`` on a dense model (naming ``actor.routing_replay``).
    """
    if routing_replay != "rollout":
        return None
    moe = moe_layout(hf_config)
    if moe is None:
        raise ValueError(f"actor.routing_replay=rollout needs a mixture-of-experts model; hf_config.model_type="
                         f"{getattr(hf_config, 'model_type', None)!r} is dense: set actor.routing_replay=off")
    return RoutesLayout(int(hf_config.num_hidden_layers), moe.topk, route_dtype(moe.num_experts), moe.num_experts)


def num_route_tokens(prompt_len: int, response_len: int) -> int:
    """Rows of a sample's routes: every token but the last (``P + R - 1``, at least 0)."""
    return max(prompt_len + response_len - 1, 0)


def routes_start_of(input_len: int, held_routes: Any) -> int:
    """``routed_experts_start_len`` of a row of ``input_len`` input tokens (prompt + the response so
    far) continued from a sample that holds ``held_routes``
    (``Sample.routes``, None or ``[n, L, K]``): ``n`` (its routes end there: a row continued
    after a weight sync asks only for the positions it forwards, so the earlier positions keep
    the routes of the version that forwarded them; a trajectory's next turn: the context's
    positions come from this row's prefill), 0 when it holds none (the whole sequence: a new
    row, a resumed partial one)."""
    return 0 if held_routes is None else min(int(held_routes.shape[0]), int(input_len))


def compact_routes(routes, *, num_tokens: int, num_layers: int, topk: int, num_experts: int,
                   what: str = "routes") -> torch.Tensor:
    """Check engine routes and store them compactly.

    Args:
        routes: ``[N, L, K]`` (or flat ``N * L * K``) integer expert indices, tensor or array,
            ``N >= num_tokens``; rows past ``num_tokens`` are dropped (an engine that also
            forwarded the last token).
        num_tokens: rows to keep (:func:`num_route_tokens`).
        num_layers, topk, num_experts: the model's ``L``, ``K`` and ``E``.
        what: the name used in errors.

    Returns:
        contiguous ``[num_tokens, L, K]`` of :func:`route_dtype` ``(num_experts)`` on CPU.

    Raises:
        ValueError: a shape that does not hold ``num_tokens`` rows of ``L × K``, or an index
            outside ``[0, num_experts)``.
    """
    t = torch.as_tensor(np.asarray(routes) if not isinstance(routes, torch.Tensor) else routes).cpu()
    if t.dim() == 1:
        if t.numel() % (num_layers * topk):
            raise ValueError(f"{what}: {t.numel()} values are not a multiple of layers × top-k = "
                             f"{num_layers} × {topk}")
        t = t.view(-1, num_layers, topk)
    if t.dim() != 3 or tuple(t.shape[1:]) != (num_layers, topk) or t.shape[0] < num_tokens:
        raise ValueError(f"{what}: shape {tuple(t.shape)}, need [>= {num_tokens}, {num_layers}, {topk}] "
                         "(tokens × layers × top-k)")
    t = t[:num_tokens].long()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
        raise ValueError(f"{what}: expert indices in [{int(t.min())}, {int(t.max())}], outside [0, {num_experts})")
    return t.to(route_dtype(num_experts)).contiguous()


# ----------------------------------------------------------------------------- across ranks
def route_words(num_tokens: int, num_layers: int, topk: int, dtype: torch.dtype) -> int:
    """int32 words that carry ``[num_tokens, L, K]`` routes of ``dtype`` (bytes rounded up to 4)."""
    nbytes = num_tokens * num_layers * topk * torch.empty(0, dtype=dtype).element_size()
    return -(-nbytes // 4)


def routes_to_words(routes: torch.Tensor) -> torch.Tensor:
    """The routes' bytes as int32 words (zero-padded to a multiple of 4 bytes), for the int32
    ``all_to_all_single`` of :func:`~dapo_megatron.rollout.plan.step_data.send_tokens`."""
    raw = routes.contiguous().view(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32)


def routes_from_words(words: torch.Tensor, num_tokens: int, num_layers: int, topk: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`routes_to_words`: ``[num_tokens, L, K]`` of ``dtype`` (a copy)."""
    n = num_tokens * num_layers * topk
    raw = words.contiguous().view(torch.uint8)[:n * torch.empty(0, dtype=dtype).element_size()]
    return raw.clone().view(dtype).view(num_tokens, num_layers, topk)


# ----------------------------------------------------------------------------- SGLang
_SGLANG_DTYPES = {"int32": np.int32, "int16": np.int16, "uint8": np.uint8, "uint16": np.uint16, "int64": np.int64}


def decode_sglang_routes(meta_info: dict, *, num_tokens: int, num_layers: int, topk: int, num_experts: int,
                         row: int = 0) -> torch.Tensor:
    """``meta_info["routed_experts"]`` of one SGLang output → compact ``[num_tokens, L, K]``.

    The payload is base64 of the row-major ``[seqlen - 1, L, K]`` expert ids, int32 unless
    ``meta_info["routed_experts_dtype"]`` names another (SGLang 0.5.23
    ``state_capturer/routed_experts.py:166`` ``extract_routed_experts_from_meta_info``); a plain
    nested list is accepted too.

    Raises:
        RuntimeError: the output carries no routes (the server was not launched with
            ``--enable-return-routed-experts``, or the request lacked ``return_routed_experts``).
        ValueError: see :func:`compact_routes`.
    """
    payload = meta_info.get("routed_experts") if isinstance(meta_info, dict) else None
    if payload is None:
        raise RuntimeError(f"SGLang output row {row} has no meta_info.routed_experts: launch SGLang with "
                           "enable_return_routed_experts (--enable-return-routed-experts) and request "
                           "return_routed_experts=True, or set actor.routing_replay=off")
    if isinstance(payload, str):
        name = meta_info.get("routed_experts_dtype") or "int32"
        if name not in _SGLANG_DTYPES:
            raise ValueError(f"SGLang output row {row}: routed_experts_dtype={name!r} is not one of "
                             f"{sorted(_SGLANG_DTYPES)}")
        flat = np.frombuffer(base64.b64decode(payload.encode("ascii")), dtype=_SGLANG_DTYPES[name])
    else:
        flat = np.asarray(payload, dtype=np.int64).reshape(-1)
    return compact_routes(flat.astype(np.int64), num_tokens=num_tokens, num_layers=num_layers, topk=topk,
                          num_experts=num_experts, what=f"SGLang output row {row} routed_experts")


def encode_sglang_routes(routes: torch.Tensor) -> str:
    """The inverse of :func:`decode_sglang_routes` for int32 payloads (SGLang's default wire
    format): base64 of the row-major int32 ids."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


# ----------------------------------------------------------------------------- transformers
def hf_routers_by_layer(model: torch.nn.Module) -> list[Optional[torch.nn.Module]]:
    """The top-k router of each decoder layer of a transformers MoE model, None for a dense
    layer among MoE ones (DeepSeek-V3's first ``first_k_dense_replace`` layers); empty for a
    dense model. A router is the ``gate`` of the layer's sparse MoE block (``mlp.gate`` in
    Qwen3-MoE / Qwen2-MoE / DeepSeek-V3, ``block_sparse_moe.gate`` / ``mlp.gate`` in Mixtral), whose
    forward returns ``(router_logits, router_scores, router_indices)`` (DeepSeek-V3's
    ``DeepseekV3TopkRouter``: ``(router_logits, topk_weights, topk_indices)``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        return []
    out: list[Optional[torch.nn.Module]] = []
    for layer in layers:
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "gate") or not hasattr(block, "experts"):
            block = getattr(layer, "block_sparse_moe", None)
        gate = getattr(block, "gate", None) if block is not None else None
        out.append(gate if gate is not None and hasattr(gate, "top_k") else None)
    return out if any(g is not None for g in out) else []


class HFRouteRecorder:
    """Records the expert indices of every router call of a transformers MoE model.

    Forward hooks on the routers of :func:`hf_routers_by_layer` keep ``router_indices`` (output 2, ``[B · T, K]``
    int64, the experts transformers actually used) of each call; :meth:`take` returns those of
    the last forward as ``[B, T, L, K]``. Works for prefill and decode forwards alike (the
    router sees the ``B · T`` new tokens of the call, row-major). ``L`` is every decoder layer:
    the rows of a dense layer among MoE ones (DeepSeek-V3's first layers) are 0, never read (the
    actor indexes the routes by its routers' ``layer_number``).

    Raises:
        ValueError: (construction) a model without MoE routers.
    """

    def __init__(self, model: torch.nn.Module):
        self.by_layer = hf_routers_by_layer(model)
        self.routers = [g for g in self.by_layer if g is not None]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE routers (a dense model): routing replay needs a "
                             "mixture-of-experts model; set actor.routing_replay=off")
        self.topk = int(self.routers[0].top_k)
        self.num_experts = int(getattr(self.routers[0], "num_experts", 0) or self.routers[0].weight.shape[0])
        self._calls: list[Optional[torch.Tensor]] = [None] * len(self.by_layer)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.by_layer) if r is not None]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self._calls[layer] = output[2].detach()
        return hook

    @property
    def num_layers(self) -> int:
        return len(self.by_layer)

    def take(self, batch: int, length: int) -> torch.Tensor:
        """The last forward's routes, int64 ``[batch, length, L, K]`` on CPU (then forgotten).

        Raises:
            RuntimeError: a layer's router did not run, or ran on another number of tokens.
        """
        calls, self._calls = self._calls, [None] * len(self.by_layer)
        for layer, c in enumerate(calls):
            if self.by_layer[layer] is None:
                continue
            if c is None or c.shape != (batch * length, self.topk):
                raise RuntimeError(f"router of layer {layer} recorded {None if c is None else tuple(c.shape)}, "
                                   f"expected [{batch * length}, {self.topk}]")
        like = next(c for c in calls if c is not None)
        calls = [like.new_zeros(like.shape) if c is None else c for c in calls]  # a dense layer: rows of 0
        return torch.stack([c.view(batch, length, self.topk) for c in calls], dim=2).cpu()

    def clear(self) -> None:
        """Forget the last forward's calls (a forward whose routes nobody takes)."""
        self._calls = [None] * len(self.by_layer)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def concat_routes(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Route chunks ``[n_i, L, K]`` (a prefill, then one row per decode step) as one tensor."""
    return torch.cat(list(parts), dim=0) if len(parts) > 1 else parts[0]
