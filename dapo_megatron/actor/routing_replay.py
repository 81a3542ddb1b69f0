"""Routing replay, the actor side: megatron-core's routers follow the engine's routes (R3).

With ``actor.routing_replay: rollout`` every micro-batch the actor forwards (the old-logprob
pass and the training forward) routes each token through exactly the experts the rollout engine
routed it to (``Sample.routes``, :mod:`dapo_megatron.rollout.engines.routes`), so the actor
differentiates the network that sampled the tokens. Without it a token whose router scores
are nearly tied between two experts can be routed differently by the actor (other kernels,
other batch, bf16): its logprob is then that of another network, and the importance ratio
of the whole sequence moves with it (Megatron-LM #4168: GRPO on Qwen3-30B-A3B collapses).

Mechanism: megatron-core 0.16.1's own router replay
(``megatron/core/transformer/moe/router_replay.py``): a model built with
``TransformerConfig.moe_enable_routing_replay`` gives each ``TopKRouter`` a ``RouterReplay``
(``router.py``, ``TopKRouter.__init__``), whose ``get_replay_topk`` replaces the top-k of
``moe_utils.topk_routing_with_score_function`` in ``REPLAY_FORWARD`` mode: the experts are the
target indices, their probabilities the router's own scores gathered there (softmax over the
replayed k logits, or the full softmax's values with ``moe_router_pre_softmax``), so the
gradient still reaches the router weights. :class:`RoutingReplay` sets each router's target
indices (``RouterReplay.set_target_indices``) right before a micro-batch's forward and clears
them (``clear_indices``) right after; the routers are taken from the model itself (not from
``RouterReplay.global_router_replay_instances``, which holds every model ever built in the
process), each matched to its layer by ``router.layer_number`` (1-based, global: a PP stage
sets its own layers). verl (``verl/utils/megatron/router_replay_utils.py``) and slime replay
through the same class.

Activation recompute (``recompute_granularity: full`` or ``selective`` of the MoE layer):
a checkpointed layer runs its router once without grad in the forward and again in the
backward, after the forwards of later micro-batches (1F1B). A forward pre-hook
(:meth:`RoutingReplay._choose_action`) queues the micro-batch's routes in the first pass and
switches the recomputed call to megatron-core's ``REPLAY_BACKWARD``, which takes them in
order (verl's router-replay utils do the same with that queue); the observer counts the first
pass only. The actor empties the queues before each schedule and checks after it that all were
taken (:meth:`RoutingReplay.end_schedule`).

The routes of a micro-batch (:func:`micro_batch_routes`): int64 ``[S · B, L, K]`` in
megatron-core's ``[S, B]`` token order (the router flattens its ``[S, B, H]`` input), every
token of every sample where :func:`~dapo_megatron.actor.packing.pack_samples` placed it, a
shared prompt once; positions without an engine route (padding, each sample's last token,
which feeds no label) get valid experts spread over all ``E`` (row ``j`` of ``[S · B]``:
``(j · K + i) mod E``, :func:`fill_routes`), so the dispatcher (all-to-all over EP) moves them
like any token and no expert (no EP rank) receives every padded position. With sequence parallelism the router sees this TP rank's
``S / TP`` rows, so the rank's contiguous slice is set. Every rank sets routes for the
micro-batches it forwards and makes no collective of its own: EP = 2 works as without replay
(the plan gives every DP rank the same number of forwards).

Metrics (:class:`RouteStats`, forward hooks on the routers, pooled over every forward since
the last :meth:`RoutingReplay.pop_metrics`, over the engine-routed tokens, i.e. the real
tokens but each sample's last). The hooks only add device tensors (masked sums, no boolean
indexing, ``nonzero``, ``bincount`` or ``.cpu()``, which wait for the GPU): the host reads
the counters once per step, in ``pop_metrics``.

- ``moe/route_agreement``: share of the engine's ``(token, layer, expert)`` choices that the
  actor's own router, ``topk(router logits)``, also makes (1: the actor would route every token
  as the engine did; the gap R3 closes); ``moe/route_exact_frac``: share of ``(token, layer)``
  with the same expert set.
- ``moe/expert_load_max/l{l}``: layer ``l``'s busiest expert's share of the routed
  ``(token, expert)`` pairs, times E (1: balanced, E: every token to one expert), from the
  routes the forward used.
- ``moe/aux_loss`` (mean over layers) and ``moe/aux_loss/l{l}``: the Switch load-balancing loss
  ``E · Σ_e f_e P_e`` without its coefficient (``moe_utils.switch_load_balancing_loss_func``: f
  the share of the router's own top-k choices per expert, P the mean router probability), here
  over the pooled engine-routed tokens rather than per micro-batch.

Design: docs/design.md §2.1 (routing replay).
"""

from __future__ import annotations

import contextlib

from typing import Optional, Sequence

import torch

from dapo_megatron.platform.distributed import collective_device
from dapo_megatron.rollout.engines.routes import num_route_tokens

from .config import ROUTING_REPLAY_MODES


def moe_routers(model) -> list:
    """megatron-core ``TopKRouter`` s of ``model`` (a chunk, possibly wrapped in DDP /
    ``Float16Module``), in layer order; empty for a dense model. Recognised by their
    ``gating`` method and ``router_replay`` attribute (``moe/router.py``)."""
    found = [m for m in model.modules() if hasattr(m, "gating") and hasattr(m, "router_replay")
             and hasattr(m, "layer_number")]
    return sorted(found, key=lambda m: m.layer_number)


def fill_routes(num_rows: int, num_layers: int, topk: int, num_experts: int) -> torch.Tensor:
    """int64 ``[num_rows, L, K]``: row ``j`` routed to experts ``(j · K + i) mod E``, ``i < K``
    (``K`` distinct experts when ``K <= E``), the same in every layer. The route of positions the
    engine did not route: round-robin over all experts, so each expert (and each EP rank, which
    holds ``E / EP`` consecutive experts) gets an even share of the padding."""
    j = torch.arange(num_rows, dtype=torch.long)[:, None] * topk + torch.arange(topk, dtype=torch.long)
    return (j % num_experts)[:, None, :].expand(num_rows, num_layers, topk)


def micro_batch_routes(mb, *, num_layers: int, topk: int, num_experts: int,
                       device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine routes of one micro-batch in megatron-core's token order.

    Args:
        mb: a :class:`~dapo_megatron.actor.micro_batch.MicroBatch` (its ``samples`` and ``batch``);
            every sample's ``routes`` is ``[P + R - 1, L, K]``.
        num_layers, topk, num_experts: the model's ``L``, ``K`` and ``E``.
        device: where the result goes (default: the batch's).

    Returns:
        ``(routes, routed)``: int64 ``[S · B, L, K]`` (row ``s · B + b`` is token ``s`` of packed
        row ``b``; ``S`` = the batch's ``T``) and bool ``[S · B]``, True where the route is the
        engine's (False: padding and each sample's last token, filled by :func:`fill_routes`).

    Raises:
        ValueError: a sample without routes, or with routes of another shape.
    """
    b = mb.batch
    B, T = b.input_ids.shape
    # [S · B] order: row s · B + b is (b, s) of the [B, T] view
    out = fill_routes(T * B, num_layers, topk, num_experts).reshape(T, B, num_layers, topk).transpose(0, 1).clone()
    routed = torch.zeros(B, T, dtype=torch.bool)
    for i, s in enumerate(mb.samples):
        P, R = b.prompt_lens[i], b.response_lens[i]
        n = num_route_tokens(P, R)
        r = getattr(s, "routes", None)
        if r is None or tuple(r.shape) != (n, num_layers, topk):
            raise ValueError(f"sample {i} of the micro-batch: routes {None if r is None else tuple(r.shape)}, need "
                             f"[{n}, {num_layers}, {topk}] (prompt {P} + response {R} - 1 tokens × layers × top-k); "
                             "actor.routing_replay=rollout needs an engine that records routes (rollout.name=hf or "
                             "sglang, colocated)")
        r = r.long()
        row, start = b.response_start(i)
        o = b.offsets[i]
        out[row, o:o + min(P, n)] = r[:P]
        routed[row, o:o + min(P, n)] = True
        if R > 1:
            out[row, start:start + R - 1] = r[P:]
            routed[row, start:start + R - 1] = True
    dev = b.input_ids.device if device is None else device
    return (out.transpose(0, 1).reshape(T * B, num_layers, topk).to(dev),
            routed.t().reshape(T * B).to(dev))


def _sp_slice(x: torch.Tensor, config, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's rows of ``[S · B, ...]`` under sequence parallelism (contiguous ``S / TP``
    sequence rows, ``tensor_parallel.scatter_to_sequence_parallel_region``); all rows otherwise."""
    if not getattr(config, "sequence_parallel", False) or tp_size == 1:
        return x
    n = x.shape[0] // tp_size
    return x[tp_rank * n:(tp_rank + 1) * n]


class RouteStats:
    """Per-layer sums behind the routing metrics (module docstring), float64 on the routers'
    device; :meth:`add` enqueues device work only (no host synchronisation).

    Attributes (``L`` layers, ``E`` experts): ``table`` ``[3 + 3E, L]``: ``tokens`` engine-routed
    tokens seen, ``agree`` sum over them of ``|own ∩ engine| / K``, ``exact`` tokens with the same
    set, ``used [E]`` / ``own [E]`` expert counts of the routes used / of the router's own top-k,
    ``prob [E]`` summed router probabilities.
    """

    def __init__(self, num_layers: int, num_experts: int, device=None):
        self.L, self.E = num_layers, num_experts
        self.table = torch.zeros(3 + 3 * num_experts, num_layers, dtype=torch.float64, device=device)

    def add(self, layer: int, used_map: torch.Tensor, own: torch.Tensor, probs: torch.Tensor,
            engine: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> None:
        """One router call: ``used_map`` bool ``[N, E]`` the routes it used (its ``routing_map``),
        ``own`` / ``engine`` int64 ``[N, K]`` the router's own top-k / the engine's experts,
        ``probs`` float ``[N, E]`` its softmax, ``mask`` bool ``[N]`` the engine-routed tokens
        (None: all). Masked sums, not boolean indexing: no ``nonzero``."""
        E, t = self.E, self.table
        w = (torch.ones(used_map.shape[0], dtype=torch.float64, device=used_map.device) if mask is None
             else mask.to(torch.float64))
        wc = w[:, None]
        own_hot = torch.zeros(own.shape[0], E, dtype=torch.bool, device=own.device).scatter_(1, own, True)
        col = t[:, layer]  # a view: the in-place adds below land in the table
        col[0] += w.sum()
        if engine is not None:
            eng_hot = torch.zeros_like(own_hot).scatter_(1, engine, True)
            col[1] += ((own_hot & eng_hot).sum(1).double() * w).sum() / own.shape[1]
            col[2] += ((own_hot == eng_hot).all(dim=1).double() * w).sum()
        col[3:3 + E] += (used_map.double() * wc).sum(0)
        col[3 + E:3 + 2 * E] += (own_hot.double() * wc).sum(0)
        col[3 + 2 * E:] += (probs.detach().double() * wc).sum(0)

    def metrics(self) -> dict[str, float]:
        """The metrics of the module docstring (layers without tokens left out); reads the table
        on the host (once per step)."""
        t, E = self.table.cpu(), self.E
        out: dict[str, float] = {}
        n = t[0]
        seen = (n > 0).nonzero().squeeze(1).tolist()
        if not seen:
            return out
        total = float(n[seen].sum())
        out["moe/route_agreement"] = float(t[1, seen].sum()) / total
        out["moe/route_exact_frac"] = float(t[2, seen].sum()) / total
        aux = []
        for layer in seen:
            used, own, prob = t[3:3 + E, layer], t[3 + E:3 + 2 * E, layer], t[3 + 2 * E:, layer]
            out[f"moe/expert_load_max/l{layer}"] = float(used.max() / used.sum() * E)
            k = float(own.sum()) / float(n[layer])
            a = float(E * ((own / (n[layer] * k)) * (prob / n[layer])).sum())
            out[f"moe/aux_loss/l{layer}"] = a
            aux.append(a)
        out["moe/aux_loss"] = sum(aux) / len(aux)
        return out


class RoutingReplay:
    """Replays engine routes into a megatron-core model's routers and measures its routing.

    Args:
        model: this rank's model chunk (built with ``routing_replay=True`` when ``replay``).
        replay: set the routers' target indices before each forward (``REPLAY_FORWARD``).
        observe: forward hooks on the routers collect :class:`RouteStats` (and, with
            ``keep``, each call's used / own routes in :attr:`records`).
        tp_rank, tp_size: this rank's TP position (sequence parallelism slices the routes).
        keep: keep per-call records ``{"layer", "used", "own", "routed"}`` (tests).

    Raises:
        ValueError: a dense model (no MoE router), or ``replay`` on a model built without
            ``moe_enable_routing_replay``.
    """

    def __init__(self, model, *, replay: bool, observe: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 keep: bool = False):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("actor.routing_replay=rollout needs a mixture-of-experts model (megatron-core "
                             "TopKRouter layers); this model is dense: set actor.routing_replay=off")
        cfg = self.routers[0].config
        if replay and any(r.router_replay is None for r in self.routers):
            raise ValueError("actor.routing_replay=rollout: the model was built without "
                             "moe_enable_routing_replay; build it with build_gpt_model(..., routing_replay=True)")
        self.config, self.replay, self.keep = cfg, replay, keep
        self.num_layers, self.topk, self.num_experts = cfg.num_layers, cfg.moe_router_topk, cfg.num_moe_experts
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = next(self.routers[0].parameters()).device
        self.stats = RouteStats(self.num_layers, self.num_experts, device=self.device)
        self.records: list[dict] = []
        self._current: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._own = False  # inside own_routing(): the routers route on their own, nothing observed
        if replay:
            # megatron-core here, not at the top: the config loads actor/ (its ActorConfig) without it
            from megatron.core.transformer.moe.router_replay import RouterReplayAction  # megatron-core: after quiet_third_party

            for r in self.routers:
                r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self._handles = [r.register_forward_hook(self._observe) for r in self.routers] if observe else []
        if replay:
            self._handles += [r.register_forward_pre_hook(self._choose_action) for r in self.routers]

    def begin(self, mb) -> None:
        """Before ``mb``'s forward: its routes (:func:`micro_batch_routes`) become every local
        router's target indices (replay), and the observer's reference. Samples without routes:
        an error with ``replay``, no reference (own routing only) without."""
        have = all(getattr(s, "routes", None) is not None for s in mb.samples)
        if not have and not self.replay:
            self._current = None
            return
        routes, routed = micro_batch_routes(mb, num_layers=self.num_layers, topk=self.topk,
                                            num_experts=self.num_experts)
        routes = _sp_slice(routes, self.config, self.tp_rank, self.tp_size)
        routed = _sp_slice(routed, self.config, self.tp_rank, self.tp_size)
        self._current = (routes.to(self.device), routed.to(self.device))
        if self.replay:
            for r in self.routers:
                # set directly, not with set_target_indices (which also queues it for a recompute):
                # _choose_action queues it only for a call that will be recomputed
                r.router_replay.target_topk_idx = self._current[0][:, r.layer_number - 1]

    @contextlib.contextmanager
    def own_routing(self):
        """Forwards inside route on the routers' own choice and are neither replayed nor observed:
        for a sequence no engine routed (the weight-sync probe, ``rollout/rollout.py``). Replay
        resumes on exit."""
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def end(self) -> None:
        """After the forward: the routers' forward targets cleared; the routes queued for a
        recomputed forward stay until the micro-batch's backward takes them."""
        if self.replay:
            for r in self.routers:
                r.router_replay.target_topk_idx = None
        self._current = None

    def begin_schedule(self) -> None:
        """Before a forward-backward schedule: no routes queued from an earlier one."""
        if self.replay:
            for r in self.routers:
                r.router_replay.replay_backward_list = []

    def end_schedule(self) -> None:
        """After the schedule: every queued route was replayed by a recomputed forward.

        Raises:
            RuntimeError: routes left (a recompute path that did not run the router again:
                its backward would have routed on its own); the queues are emptied.
        """
        left = {r.layer_number: len(r.router_replay.replay_backward_list) for r in self.routers} if self.replay else {}
        self.begin_schedule()
        if any(left.values()):
            raise RuntimeError(f"routing replay: routes queued for a recomputed forward were never replayed "
                               f"(layer: count {left}); this activation-recompute setting is not supported with "
                               "actor.routing_replay=rollout")

    @staticmethod
    def _recomputing() -> bool:
        """True inside the backward (the autograd engine runs a graph task): a router called
        there runs the recomputed forward of an activation checkpoint."""
        return torch._C._current_graph_task_id() != -1

    def _choose_action(self, router, args) -> None:
        """Router forward pre-hook: which routes this call replays (megatron-core 0.19.2
        ``moe/router_replay.py``, ``RouterReplay.get_replay_topk``):

        - the recomputed forward of an activation checkpoint (megatron-core's reentrant
          ``tensor_parallel.checkpoint``, ``tensor_parallel/random.py``, runs the first forward
          without grad and the same function again, with grad, in the backward):
          ``REPLAY_BACKWARD`` takes the oldest queued routes of this router. The schedule runs
          the backwards of the micro-batches in the order of their forwards (1F1B too), and
          each layer's recomputations in that order, so the queue gives each its own routes;
        - a training forward without grad (the first pass of a checkpointed layer, whose router
          runs again in the backward): ``REPLAY_FORWARD`` of the micro-batch's routes, queued
          for that recompute (``replay_backward_list``, as ``set_target_indices`` does);
        - otherwise (evaluation, a layer that is not recomputed): ``REPLAY_FORWARD``, nothing queued.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction  # megatron-core: after quiet_third_party

        rr = router.router_replay
        if self._own:
            rr.clear_router_replay_action()  # moe_utils.topk_routing_with_score_function: its own top-k
            return
        if router.training and torch.is_grad_enabled() and self._recomputing():
            if not rr.replay_backward_list:
                raise RuntimeError(f"routing replay: layer {router.layer_number} is recomputed in the backward but "
                                   "no routes were queued for it (its first forward ran with grad enabled: a "
                                   "non-reentrant checkpoint is not supported)")
            rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            return
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        if rr.target_topk_idx is None:
            raise RuntimeError(f"routing replay: layer {router.layer_number} forwarded outside begin()/end()")
        if router.training and not torch.is_grad_enabled():
            rr.replay_backward_list.append(rr.target_topk_idx)

    def _observe(self, router, args, output) -> None:
        """Router forward hook: the routes it used (``routing_map``), its own top-k of the
        logits (``gating`` again, no grad) and its softmax, summed on the device over the
        engine-routed tokens (:meth:`RouteStats.add`: no host synchronisation)."""
        if self._own or self._recomputing():  # the recomputed forward of a checkpoint: counted in its first pass
            return
        hidden = args[0]
        _, routing_map = output
        with torch.no_grad():
            logits = router.gating(hidden).reshape(-1, self.num_experts).float()
            probs = torch.softmax(logits, dim=-1)
            cfg = self.config
            if cfg.moe_router_score_function == "softmax" and not cfg.moe_router_num_groups:
                own = torch.topk(logits, self.topk, dim=-1).indices
            else:  # DeepSeek-V3: sigmoid + the score-correction bias, grouped top-k; DeepSeek-V2: softmax over
                # all experts, grouped top-k (megatron-core's own choice)
                # megatron-core here, not at the top: the config loads actor/ (its ActorConfig) without it
                from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

                own = topk_routing_with_score_function(
                    logits, self.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
                    num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
                    score_function=cfg.moe_router_score_function, expert_bias=router.expert_bias,
                    dense_output=True)[1]
        layer = router.layer_number - 1
        if self._current is None:
            mask, engine = None, None
        else:
            routes, mask = self._current
            engine = routes[:, layer]
        if self.keep:  # tests only: each row's experts (ascending) on the host
            self.records.append({"layer": layer, "used": routing_map.nonzero()[:, 1].view(-1, self.topk).cpu(),
                                 "own": own.cpu(), "routed": None if mask is None else mask.cpu()})
        self.stats.add(layer, routing_map, own, probs, engine, mask)

    def pop_metrics(self, parallel=None, groups: Sequence[str] = ()) -> dict[str, float]:
        """The metrics since the last call (module docstring), their sums all-reduced over the
        ``groups`` of ``parallel`` (``ParallelDims`` group names: ``"dp"``, ``"pp"`` with PP > 1,
        ``"tp"`` with sequence parallelism): a collective over them, every rank calls it at the
        same point. ``parallel`` None: this rank's sums only."""
        table = self.stats.table
        for name in groups if parallel is not None else ():
            table = table.to(collective_device(parallel.group(name)))
            parallel.all_reduce(table, name)
        self.stats.table = table
        out = self.stats.metrics()  # the one host read of the step
        self.stats = RouteStats(self.num_layers, self.num_experts, device=self.device)
        return out

    def remove(self) -> None:
        """Remove the observer hooks and stop replaying (the routers route on their own)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.replay:
            for r in self.routers:
                r.router_replay.clear_indices()
                r.router_replay.clear_router_replay_action()


__all__ = ["ROUTING_REPLAY_MODES", "RouteStats", "RoutingReplay", "fill_routes", "micro_batch_routes", "moe_routers"]
