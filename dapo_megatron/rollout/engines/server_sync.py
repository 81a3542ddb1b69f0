"""Server mode (``rollout.mode: server``) as one trainer rank sees it: :class:`ServerRollout`, the
trainer's engine over separate SGLang servers (SGLang's own or ``dapo-rollout-server``).

The user starts the servers (``python -m sglang.launch_server --model-path ... --tp-size k``,
possibly on other nodes); ``rollout.server_urls`` lists them. At start-up rank 0 asks every server
for its ``/server_info`` (:func:`~dapo_megatron.bridge.servers.query_server`); every step starts with
``GET /health`` of each (:func:`~dapo_megatron.rollout.engines.row_client.check_health`), and every
HTTP call has a timeout, so a dead, hung or unreachable server stops the step with an error naming
its URL instead of hanging it. Generation goes through the one HTTP row client
(:class:`~dapo_megatron.rollout.engines.row_client.RowClient`); the weights through the bridge's
server sync (:mod:`dapo_megatron.bridge.servers`: one weight-update group per pipeline stage and EP
owner, flattened buckets broadcast over NCCL, generation paused around it).

Design: docs/design.md §2 (server mode) and §2.2.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

import torch

from dapo_megatron.bridge import expert_turn
from dapo_megatron.bridge.servers import NamedTensor, ServerInfo, connect_servers, query_server, sync_servers
from dapo_megatron.bridge.verify import SyncDigest
from dapo_megatron.platform.http import each_server
from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single
from dapo_megatron.rollout.engines.engine import RowRequest, RowResult
from dapo_megatron.rollout.engines.layout import rollout_engines
from dapo_megatron.rollout.engines.row_client import RowClient, check_health

logger = logging.getLogger("dapo_megatron.rollout")


class ServerRollout:
    """``rollout.mode: server`` as one trainer rank sees it; build it on every rank (collective):
    rank 0's ``/server_info`` answers are broadcast, each stage's sender creates its weight-update
    group (:func:`connect_servers`), rank ``e`` drives server ``e`` for generation.

    The trainer treats it as its engine: :meth:`generate` on a driving rank, :meth:`sleep` /
    :meth:`wake_up` are nothing (the servers have GPUs of their own), :meth:`check_health`
    starts every step, :meth:`sync` sends the weights; the streamed rollout
    (:class:`~dapo_megatron.rollout.sampling.streaming.EngineClient`) submits, polls and aborts rows on
    the rank's server (:class:`~dapo_megatron.rollout.engines.row_client.RowClient`).

    Args:
        urls: ``rollout.server_urls``.
        param_specs: ``(specs, aliases)`` of the served model (the sync's completeness check).
        stage, num_stages: this rank's pipeline stage and the PP size.
        is_sender: this rank sends its stage's weights (DP rank 0 and TP rank 0).
        device: the senders' flat buffers (this rank's GPU: NCCL; CPU: gloo).
        timeout_s, silence_timeout_s, eos_token_ids: the row client's
            (:class:`~dapo_megatron.rollout.engines.row_client.RowClient`); ``timeout_s`` bounds the
            sync's HTTP calls too.
        bucket_bytes: ``rollout.update_weights_bucket_megabytes`` in bytes.
        backend: of the weight-update groups; None: NCCL on a CUDA device, else gloo.
        one_driver: ``async_training``: rank 0's controller sends the training rows to every
            server, so there may be more servers than ranks
            (:func:`~dapo_megatron.rollout.engines.layout.rollout_engines`).
        parallel: the run's layout (the world group of the rank-0 broadcasts and the sync's
            gathers); None: a world of one.
        record_routes: routing replay, ``(L, K, E)`` of the model: :meth:`generate` asks for
            ``return_routed_experts`` and every completion carries its routes (servers launched
            with ``--enable-return-routed-experts``, SGLang or dapo-rollout-server); None: off.
        expert_turns, expert_turn, num_experts: EP > 1 (``expert_turns`` = EP): each stage has one
            sender per EP owner (``is_sender`` with ``expert_turn`` = its EP rank) and the sync
            sends in turns (:func:`sync_servers`; ``num_experts``, the routed experts per layer,
            places each expert in its owner's turn: :func:`~dapo_megatron.bridge.expert_turn`).
    """

    def __init__(self, urls: Sequence[str], param_specs, *, stage: int, num_stages: int, is_sender: bool,
                 device: torch.device | str, timeout_s: float, silence_timeout_s: float, bucket_bytes: int,
                 backend: Optional[str] = None, eos_token_ids: Sequence[int] = (), one_driver: bool = False,
                 parallel: Optional[ParallelDims] = None, record_routes: Optional[tuple[int, int, int]] = None,
                 expert_turns: int = 1, expert_turn: int = 0, num_experts: int = 0):
        self.parallel = dims_or_single(parallel, "ServerRollout")
        self.urls = list(urls)
        self.record_routes = record_routes
        self.param_specs = param_specs
        self.stage, self.num_stages = int(stage), int(num_stages)
        self.timeout_s, self.silence_timeout_s = float(timeout_s), float(silence_timeout_s)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.rank = self.parallel.rank
        self.num_engines, self.engine_index = rollout_engines(self.rank, self.parallel.world_size, mode="server",
                                                              num_servers=len(self.urls), one_driver=one_driver)
        answer = None
        if self.rank == 0:
            try:
                answer = each_server(self.urls, lambda url: query_server(url, self.timeout_s))
            except RuntimeError as err:
                answer = f"rollout.server_urls: {err}"
        answer = self.parallel.broadcast_object(answer, "world", src=0)
        if isinstance(answer, str):
            raise RuntimeError(answer)
        self.servers: list[ServerInfo] = answer
        self.expert_turns, self.num_experts = int(expert_turns), int(num_experts)
        self._connect = dict(stage=stage, num_stages=num_stages, is_sender=is_sender, device=device,
                             expert_turn=expert_turn, expert_turns=expert_turns,
                             timeout_s=timeout_s, bucket_bytes=bucket_bytes, backend=backend, parallel=self.parallel)
        self.sender = connect_servers(self.servers, **self._connect)
        self.members = list(range(len(self.servers)))  # the servers the weight syncs go to (set_members)
        self._group_generation = 0
        self.weight_version = 0
        self.weights_valid = True  # the servers loaded their checkpoint; the first sync follows
        # this rank's server's rows (the HTTP row client over every server; this rank drives engine_index)
        self.client = RowClient(self.urls, silence_timeout_s=silence_timeout_s, timeout_s=timeout_s,
                                eos_token_ids=eos_token_ids, rid_prefix=f"dapo-{self.rank}",
                                routes_shape=record_routes)

    def _turn_of(self):
        if self.expert_turns == 1:
            return None
        return lambda name: expert_turn(name, self.num_experts, self.expert_turns)

    def check_health(self) -> None:
        """:func:`check_health` of every server from rank 0; every rank raises the same error."""
        error = None
        if self.rank == 0:
            try:
                check_health(self.urls, self.timeout_s)
            except RuntimeError as err:
                error = str(err)
        error = self.parallel.broadcast_object(error, "world", src=0)
        if error:
            raise RuntimeError(error)

    def generate(self, prompt_ids, params, prompt_seeds=None):
        """One streamed ``/generate`` request to this rank's server (a driving rank only), failed
        only when the server sends no byte for ``silence_timeout_s`` (:meth:`RowClient.generate
        <dapo_megatron.rollout.engines.row_client.RowClient.generate>`); see
        :meth:`~dapo_megatron.rollout.engines.engine.RolloutEngine.generate`."""
        self._check_can_generate()
        return self.client.generate(self.engine_index, prompt_ids, params, prompt_seeds,
                                    routes_shape=self.record_routes)

    def _check_can_generate(self) -> None:
        if self.engine_index is None:
            raise RuntimeError(f"rank {self.rank} drives no server (rollout.server_urls has {self.num_engines})")
        if not self.weights_valid:
            raise RuntimeError("the servers' weights are partly updated by a failed sync; a full sync must succeed "
                               "before generating")

    # ---- asynchronous rows (the streamed rollout): RowClient's rows on this rank's server --------
    supports_async = True

    @property
    def num_in_flight(self) -> int:
        """Rows submitted and not yet returned by :meth:`poll` or :meth:`abort`."""
        return self.client.num_in_flight

    def submit(self, rows: Sequence[RowRequest]) -> None:
        """:meth:`RowClient.submit <dapo_megatron.rollout.engines.row_client.RowClient.submit>` on
        this rank's server.

        Raises:
            RuntimeError: a rank that drives no server, or weights left invalid by a failed sync.
        """
        self._check_can_generate()
        self.client.submit(rows, self.engine_index)

    def poll(self, max_tokens: Optional[int] = None) -> list[RowResult]:
        """:meth:`RowClient.poll <dapo_megatron.rollout.engines.row_client.RowClient.poll>`
        (nothing on a rank that drives no server)."""
        return self.client.poll(max_tokens, self.weight_version)

    def abort(self) -> list[RowResult]:
        """:meth:`RowClient.abort <dapo_megatron.rollout.engines.row_client.RowClient.abort>`
        (nothing on a rank that drives no server)."""
        return self.client.abort(self.weight_version)

    def sleep(self, keep_weights: bool = False) -> None:
        """Nothing: the servers do not share the trainer's GPUs."""

    def wake_up(self) -> None:
        """Nothing (see :meth:`sleep`)."""

    def set_members(self, members: Sequence[int]) -> None:
        """Send the next weight syncs to the servers ``members`` only (indices into
        ``rollout.server_urls``; asynchronous training drops a failed server and takes one back
        that answers ``/health`` again); collective. Nothing happens when they are the members
        already; else the old group of every stage is destroyed on this side and on each of its
        servers that answers (:meth:`~dapo_megatron.bridge.servers.ServerWeightSender.destroy`),
        then created anew over the members, under a new name (``_m<k>``).

        Raises:
            ValueError: no member, or an index outside ``rollout.server_urls``.
            RuntimeError: on every rank, a member did not join (naming it).
        """
        members = sorted(int(e) for e in members)
        if not members or not all(0 <= e < len(self.servers) for e in members):
            raise ValueError(f"set_members({members}): needs at least one index in [0, {len(self.servers)}) "
                             "(rollout.server_urls)")
        if members == self.members:
            return
        if self.sender is not None:  # the old group, on this rank and on every server (issue 36 item 7)
            failed = self.sender.destroy()
            if failed:
                logger.warning("weight-update group %s not destroyed on: %s", self.sender.group_name,
                               "; ".join(failed))
        self._group_generation += 1
        self.members = members
        self.sender = connect_servers([self.servers[e] for e in members], group_suffix=f"_m{self._group_generation}",
                                      **self._connect)

    def sync(self, stage_tensors: Optional[Iterable[NamedTensor]], version: int,
             digest: Optional[SyncDigest] = None) -> int:
        """:func:`sync_servers` of this rank's part of the bridge stream; collective. Returns the
        bytes this rank sent. On failure the weights count as invalid and the error (naming the
        server) is raised on every rank. Only the :attr:`members` are paused, sent to, flushed
        and resumed."""
        self.weights_valid = False
        urls = [self.urls[e] for e in self.members]
        nbytes = sync_servers(stage_tensors, sender=self.sender, urls=urls, timeout_s=self.timeout_s,
                              param_specs=self.param_specs, version=version, coordinator=self.rank == 0,
                              stage=self.stage, num_stages=self.num_stages, parallel=self.parallel, digest=digest,
                              expert_turns=self.expert_turns, turn_of=self._turn_of())
        self.weight_version, self.weights_valid = version, True
        return nbytes
