"""The MoE routers' own losses (load balancing, z-loss) in the actor's gradient and metrics.

megatron-core attaches the routers' auxiliary losses to the router output with
``MoEAuxLossAutoScaler`` (``transformer/moe/moe_utils.py:284``): their gradient enters the
backward as ``aux · MoEAuxLossAutoScaler.main_loss_backward_scale``, a process-wide scale that
``schedules.forward_step_calc_loss`` sets at every micro-batch from ``config.moe_grad_scale_func``
(``pipeline_parallel/schedules.py:258-262, 353-361``). With ``calculate_per_token_loss`` (which
the actor needs for its own loss, and which :func:`~dapo_megatron.models.config.hf_to_transformer_config`
sets *before* the routers are built, ``router.py:72``) each router attaches
``aux · n_local · |TP·CP|`` (``router.py:604-618``; the z-loss likewise, ``router.py:656-665``),
``n_local`` the rows the router saw, and expects the gradients to be divided by the global token
count afterwards. The actor's ``finalize_model_grads`` divides by nothing (its DAPO loss is
already divided by the global loss-token count), so the division is the scale here:

    L_moe = Σ_{d, m} (n_{d,m} / N_route) · (α · Σ_l aux_{d,m,l} + β · Σ_l z_{d,m,l})

``n_{d,m} = B·T`` the rows micro-batch ``m`` of DP rank ``d`` feeds the routers (padding
included: megatron-core's loss covers them), ``N_route = Σ_{d,m} n_{d,m}``, ``aux`` the Switch
loss of that micro-batch (``moe_utils.switch_load_balancing_loss_func``), ``z`` its z-loss, ``α``
``moe_aux_loss_coeff``, ``β`` ``moe_z_loss_coeff``. This is megatron-core's intended
``1 / (micro-batches × DP)`` mean (its comment at ``router.py:605``) weighted by each
micro-batch's size; with equal micro-batches the two are the same. Without the scale the
loss was ``Σ_{d,m} aux_{d,m}``: micro-batches × DP times too strong (issue 36, item 2).
Under PP the scale is read in the backward of earlier micro-batches (1F1B), so it must be the
same for the whole step: :meth:`MoELossScale.begin_step` sets it before the schedule runs.

The metrics ``moe/load_balancing_loss`` and ``moe/z_loss`` are the same token-weighted means
(without ``α``, ``β``; averaged over layers), of the values megatron-core's tracker records at
each router call (``router.py:590``, ``moe_logging.py``): forward hooks read the tracker's
per-layer entry before and after the call and weight the difference by the call's rows, on
the device, once per call that attaches the loss (training, grad enabled: also the recomputed
forward under activation recompute, where the loss is attached, never the no-grad first pass).

Design: docs/design.md §3.4.
"""

from __future__ import annotations

from typing import Optional

import torch

from .routing_replay import moe_routers

METRIC_NAMES = {"load_balancing_loss": "moe/load_balancing_loss", "z_loss": "moe/z_loss"}


class MoELossScale:
    """The MoE auxiliary-loss scale and metrics of one model chunk (module docstring).

    Args:
        model: this rank's model chunk (megatron-core routers inside; none: inactive).
        config: the shared ``TransformerConfig``; its ``moe_grad_scale_func`` is installed.
        grad_scale_func: the optimizer's ``scale_loss`` (fp16's dynamic loss scale; megatron-core
            falls back to it only without ``moe_grad_scale_func``, ``schedules.py:258``).

    Raises:
        ValueError: routers built without ``calculate_per_token_loss`` (they would attach the
            plain per-micro-batch loss, which this scale does not fit).
    """

    def __init__(self, model, config, grad_scale_func=None):
        self.routers = moe_routers(model)
        self.config = config
        self.grad_scale_func = grad_scale_func
        self._scale: Optional[torch.Tensor] = None
        if not self.routers:
            return
        stale = [r.layer_number for r in self.routers if not r.calculate_per_token_loss]
        if stale:
            raise ValueError(
                f"MoE routers of layers {stale} were built with calculate_per_token_loss=False: megatron-core "
                "fixes the auxiliary-loss form when it builds them (router.py), so the flag must be set in the "
                "TransformerConfig before the model is built (dapo_megatron.models.build_gpt_model does)")
        self.num_layers = config.num_layers
        self.names = [n for n, on in (("load_balancing_loss", bool(config.moe_aux_loss_coeff)),
                                      ("z_loss", bool(config.moe_z_loss_coeff))) if on]
        self.tp_cp = self.routers[0].tp_cp_group.size()
        dev = next(self.routers[0].parameters()).device
        self.sums = torch.zeros(2, self.num_layers, dtype=torch.float64, device=dev)  # Σ value · weight
        self._before: dict[int, torch.Tensor] = {}
        config.moe_grad_scale_func = self._moe_grad_scale
        self._handles = []
        if self.names:
            for r in self.routers:
                self._handles.append(r.register_forward_pre_hook(self._pre))
                self._handles.append(r.register_forward_hook(self._post))

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def begin_step(self, num_route_tokens: int) -> None:
        """Before a training schedule: ``N_route`` (the rows all micro-batches of all DP ranks feed
        the routers) fixes the scale of the whole step."""
        if self.active:
            dev = self.sums.device
            scale = torch.ones(1, device=dev)
            if self.grad_scale_func is not None:
                scale = self.grad_scale_func(scale)
            self._scale = (scale / max(int(num_route_tokens), 1)).reshape(1)

    def _moe_grad_scale(self):
        # megatron-core asks at every micro-batch (schedules.py:353), forward-only schedules too
        # (compute_logprobs: the routers are in eval mode and attach no loss, router.py:789): 1 there
        if self._scale is None:
            return torch.ones(1, device=self.sums.device)
        return self._scale

    def _tracker(self):
        # megatron-core here, not at the top: the config loads actor/ without it
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        return get_moe_metrics_tracker().metrics

    @staticmethod
    def _attaches(router) -> bool:
        # the router attaches (and records) its losses only then (router.py:789, 643)
        return router.training and torch.is_grad_enabled()

    def _pre(self, router, args):
        if self._attaches(router):
            m, layer = self._tracker(), router.layer_number - 1
            self._before[layer] = torch.stack([
                m[n].values[layer].detach().double().clone() if n in m else torch.zeros((), dtype=torch.float64,
                                                                                         device=self.sums.device)
                for n in ("load_balancing_loss", "z_loss")]).to(self.sums.device)

    def _post(self, router, args, output):
        layer = router.layer_number - 1
        before = self._before.pop(layer, None)
        if before is None or not self._attaches(router):
            return
        m = self._tracker()
        rows = output[1].shape[0]  # routing_map [n_local, E]
        for i, n in enumerate(("load_balancing_loss", "z_loss")):
            if n in m:
                delta = m[n].values[layer].detach().double().to(self.sums.device) - before[i]
                # balancing: each TP·CP rank records its share of the micro-batch's loss (global f,
                # local P; moe_utils.py:82-95), summed over the group: weight n_local · |TP·CP|;
                # z-loss: each rank records its own tokens' mean (router.py:673): weight n_local
                self.sums[i, layer] += delta * (rows * (self.tp_cp if i == 0 else 1))

    def pop_sums(self) -> torch.Tensor:
        """``[2, L]`` float64 (device): Σ value · rows since the last call, then zeroed. Summed over
        TP (sequence parallelism), PP and DP and divided by ``N_route``: the metrics."""
        out = self.sums.clone()
        self.sums.zero_()
        self._scale = None
        # megatron-core's tracker only accumulates (its report() clears it, megatron/training does):
        # cleared here, so the per-call differences stay exact in its float32 entries
        for n, e in self._tracker().items() if self.active else ():
            if n in ("load_balancing_loss", "z_loss"):
                e.values.zero_()
        return out

    def metrics(self, sums: torch.Tensor, num_route_tokens: int) -> dict[str, float]:
        """The metrics from the reduced :meth:`pop_sums` (a CPU tensor): mean over layers of the
        token-weighted per-layer means."""
        out = {}
        for i, n in enumerate(("load_balancing_loss", "z_loss")):
            if n in self.names:
                out[METRIC_NAMES[n]] = float(sums[i].sum()) / max(num_route_tokens, 1) / self.num_layers
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
