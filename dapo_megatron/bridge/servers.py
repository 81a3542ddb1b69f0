"""The weight sync into separate SGLang servers (``rollout.mode: server``; SGLang's own or
``dapo-rollout-server``): what they are and the broadcast into them over one NCCL group per
pipeline stage (EP owner), the bridge's stream sent bucket by bucket.

The servers (``rollout.server_urls``; the trainer's side of server mode is
:class:`~dapo_megatron.rollout.engines.server_sync.ServerRollout`): every server's
``GET /server_info`` (its resolved ``ServerArgs`` as a dict; sglang 0.5.23
``entrypoints/http_server.py:863``, ``utils/common.py:3584``) gives its TP size and flags
(:func:`query_server`). Every HTTP call has a timeout, so a dead, hung or unreachable server
stops the sync with an error naming its URL instead of hanging it.

Weights (:class:`ServerWeightSender`, one per pipeline stage): the stage's sender (its DP-0,
TP-0 rank) is rank 0 of a process group that every TP worker of every server joins
(server ``e``'s worker ``i`` as rank ``rank_offsets[e] + i``,
:func:`server_rank_offsets`; ``POST /init_weights_update_group``).
Each bucket of the stage's own tensors (TP-gathered by the bridge, no pipeline broadcast) is
announced to every server with ``POST /update_weights_from_distributed`` (names, dtypes,
shapes in bucket order, ``load_format="flattened_bucket"``, ``flush_cache=False``), then
broadcast from rank 0 as ONE flat ``uint8`` buffer: the server allocates the same
``FlattenedTensorBucket`` from the announced metadata and receives into it
(``model_executor/model_runner.py`` ``_update_bucketed_weights_from_distributed``), so the
buffer must be packed exactly as that bucket is, which
:class:`~dapo_megatron.bridge.flat_bucket.FlatBucketPacker` does.

Expert parallelism (EP > 1): an SGLang server receives every bucket from rank 0 of the named group
(``broadcast(src=0)`` in ``_update_bucketed_weights_from_distributed``), so each EP owner of a stage
(the expert-TP rank 0 of each EP rank of expert-data-parallel rank 0) is rank 0 of a group of its
own, ``dapo_weights_pp<s>_ep<e>`` (EP rank 0's is ``dapo_weights_pp<s>``), and sends its own experts
in its turn, EP rank 0 with the non-expert tensors; no expert is gathered onto one rank
(:func:`~dapo_megatron.bridge.iter_hf_weights` with ``expert_owners``, :func:`~dapo_megatron.bridge.expert_turn`).

The stages (and, within a stage, its EP owners) send one after the other (stage 0 first), never at once: a server handles one
update request at a time (while paused its tokenizer manager holds ``is_pause_cond`` for the
whole update, ``managers/tokenizer_control_mixin.py`` ``update_weights_from_distributed``),
so with two stages sending concurrently server A could be inside stage 0's broadcast waiting
for server B while B is inside stage 1's waiting for A: a deadlock until the timeout. The
servers are the bottleneck either way (each of their workers receives every byte).

Around a sync (:func:`sync_servers`): generation is paused (``POST /pause_generation``, mode
``abort``: nothing finishes on half-updated weights; the trainer's own rollout is over by
then), and after the last stage the prefix cache is flushed and generation continues
(``/flush_cache``, ``/continue_generation``). A change of members (asynchronous training's
fault handling) destroys the old group on every server (``/destroy_weights_update_group``) before
forming the new one. SGLang >= 0.5.6 has every endpoint used here (re-read in 0.5.23).

Design: docs/design.md §2 (server mode) and §2.2.
"""

from __future__ import annotations

import inspect
import logging
import socket
import time
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from dapo_megatron.platform import collectives, free_port
from dapo_megatron.platform.http import BackgroundCall, each_server, http_get, http_post
from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single

from .buckets import dtype_name
from .flat_bucket import FlatBucketPacker
from .receiver import WeightSyncTracker
from .verify import SyncDigest, Timer, digest_dtype, readback_checksum, readback_names, readback_shape

NamedTensor = tuple[str, torch.Tensor]
logger = logging.getLogger("dapo_megatron.rollout")


@dataclass(frozen=True)
class ServerInfo:
    """One SGLang server as its ``/server_info`` describes it."""

    url: str
    tp_size: int
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    enable_deterministic_inference: bool = False
    version: str = "?"


def query_server(url: str, timeout_s: float) -> ServerInfo:
    """``GET /server_info`` of one server.

    Raises:
        RuntimeError: the server is unreachable or does not answer in time (naming the URL),
            or it was launched with ``--dp-size`` / ``--pp-size`` > 1 (its workers would not all
            join the weight-update group as ``rank_offset + tp_rank``: launch one server per
            replica instead).
    """
    info = http_get(url, "/server_info", timeout_s)
    if not isinstance(info, dict) or "tp_size" not in info:
        raise RuntimeError(f"SGLang server {url}: /server_info gave no tp_size ({str(info)[:200]}); is it an SGLang "
                           "server (python -m sglang.launch_server)?")
    for key in ("dp_size", "pp_size"):
        if int(info.get(key) or 1) != 1:
            raise RuntimeError(f"SGLang server {url} runs with {key}={info[key]}: rollout.mode=server needs one "
                               "server per replica (--tp-size only); start several servers instead")
    return ServerInfo(url=url, tp_size=int(info["tp_size"]),
                      enable_memory_saver=bool(info.get("enable_memory_saver", False)),
                      enable_weights_cpu_backup=bool(info.get("enable_weights_cpu_backup", False)),
                      enable_deterministic_inference=bool(info.get("enable_deterministic_inference", False)),
                      version=str(info.get("version", "?")))


def local_address_towards(url: str) -> str:
    """This host's IP address on the route to ``url``'s host: the address the server's workers
    can reach the weight-update group's store at (no packet is sent: a UDP ``connect`` only
    picks the route)."""
    host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def server_rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Ranks of the SGLang servers in one weight-update group: ``(rank_offsets, world_size)``.

    The trainer's sender is rank 0; server ``e``'s TP workers take ranks
    ``rank_offsets[e] .. rank_offsets[e] + tp_sizes[e] - 1`` (SGLang's worker joins as
    ``rank_offset + tp_rank``: sglang 0.5.11 ``model_executor/model_runner.py``
    ``init_weights_update_group``), so one broadcast from rank 0 reaches every server.

    Raises:
        ValueError: an empty list or a TP size below 1.
    """
    if not tp_sizes or any(int(t) < 1 for t in tp_sizes):
        raise ValueError(f"server TP sizes must be a non-empty list of ints >= 1, got {list(tp_sizes)}")
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += int(tp)
    return offsets, next_rank


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta = timedelta(minutes=10)):
    """Create a process group outside the default one (trainer rank 0 + engine workers).

    The same construction SGLang's ``init_weights_update_group`` uses on its side (a TCP
    store, ``PrefixStore(group_name)``, ``_new_process_group_helper``), so both ends meet.
    Works with ``"nccl"`` (GPU) and ``"gloo"`` (CPU tests).

    The store is built here, not by ``rendezvous(init_method)``: under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE=True``) ``rendezvous`` makes every rank, rank 0 included,
    a client of a store it expects the elastic agent to host (torch
    ``distributed/rendezvous.py`` ``_create_c10d_store``), so nobody would serve the port and
    the servers' workers would time out connecting. Rank 0 hosts it, as ``rendezvous`` does
    outside torchrun (``TCPStore(..., is_master=rank == 0, multi_tenant=True)``).
    """
    parsed = urllib.parse.urlparse(init_method)
    if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
        raise ValueError(f"init_method={init_method!r} must be tcp://host:port")
    store = TCPStore(parsed.hostname, parsed.port, world_size, rank == 0, timeout=timeout, multi_tenant=True)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    opts = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **opts)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def distributed_update_request(meta: Sequence[tuple[str, Sequence[int], torch.dtype]], group_name: str, *,
                               flush_cache: bool = False, load_format: Optional[str] = None,
                               weight_version: Optional[str] = None) -> dict:
    """The ``/update_weights_from_distributed`` body of one bucket (sglang 0.5.23
    ``managers/io_struct.py`` ``UpdateWeightsFromDistributedReqInput``): names, dtypes and shapes
    in exactly the order its tensors are then broadcast (``meta``: ``(name, shape, dtype)`` per
    tensor, :func:`~dapo_megatron.bridge.buckets.bucket_metadata`), the group, and the optional
    ``load_format`` (``"flattened_bucket"``: ONE broadcast of the flat buffer) and
    ``weight_version`` (the servers report it per output, ``meta_info.weight_version``)."""
    request = {"names": [name for name, _, _ in meta], "dtypes": [dtype_name(dt) for _, _, dt in meta],
               "shapes": [list(shape) for _, shape, _ in meta], "group_name": group_name}
    if load_format is not None:
        request["load_format"] = load_format
    request["flush_cache"] = flush_cache
    if weight_version is not None:
        request["weight_version"] = weight_version
    return request


class _NamedFailure(RuntimeError):
    """A failed weight-sync bucket whose message already names the servers."""


class ServerWeightSender:
    """Rank 0 of one pipeline stage's weight-update group with every TP worker of every server.

    Args:
        servers: the servers (:func:`query_server`), in ``rollout.server_urls`` order.
        stage: this sender's pipeline stage (names the group: ``dapo_weights_pp<stage>``).
        device: device of the flat buffers (this rank's GPU for NCCL, ``cpu`` for gloo).
        timeout_s: bound on every HTTP call and on every broadcast.
        bucket_bytes: bucket size in bytes.
        group_suffix: appended to the group's name: a group over another set of servers needs
            a name of its own (torch refuses to create a process group under a used name).
        expert_turn: the EP rank whose experts this sender sends (0: also every non-expert tensor
            of the stage); its group is ``dapo_weights_pp<stage>_ep<expert_turn>`` when > 0.
    """

    def __init__(self, servers: Sequence[ServerInfo], stage: int, *, device: torch.device | str,
                 timeout_s: float, bucket_bytes: int, group_suffix: str = "", expert_turn: int = 0):
        self.servers = list(servers)
        self.stage = stage
        self.expert_turn = int(expert_turn)
        self.group_name = f"dapo_weights_pp{stage}{f'_ep{expert_turn}' if expert_turn else ''}{group_suffix}"
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.packer = FlatBucketPacker(bucket_bytes, self.device)
        self.rank_offsets, self.world_size = server_rank_offsets([s.tp_size for s in self.servers])
        self.group = None
        self.backend: Optional[str] = None
        self.bytes_sent = 0
        self.weight_version: Optional[str] = None  # sent with every bucket when set (sync_servers)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def init_group(self, master_address: Optional[str] = None, master_port: Optional[int] = None,
                   backend: Optional[str] = None) -> None:
        """Create the group: every server is asked to join (``/init_weights_update_group``, at once)
        while this rank joins as rank 0; both sides meet at a TCP store on ``master_address``.

        Args:
            master_address: this host's address as the servers reach it; None:
                :func:`local_address_towards` the first server.
            master_port: a free port on it; None: one picked here.
            backend: ``"nccl"`` (default with CUDA) or ``"gloo"``.
        """
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.backend = backend
        master_address = master_address or local_address_towards(self.servers[0].url)
        master_port = master_port or free_port()
        calls = [BackgroundCall(http_post, s.url, "/init_weights_update_group",
                       {"master_address": master_address, "master_port": int(master_port), "rank_offset": off,
                        "world_size": self.world_size, "group_name": self.group_name, "backend": backend},
                       self.timeout_s)
                 for s, off in zip(self.servers, self.rank_offsets)]
        self.group = init_custom_process_group(backend, f"tcp://{master_address}:{master_port}", self.world_size, 0,
                                               self.group_name, timeout=timedelta(seconds=self.timeout_s))
        self._join(calls, "/init_weights_update_group")

    def _join(self, calls: list[BackgroundCall], what: str) -> list:
        deadline = time.monotonic() + self.timeout_s
        for server, call in zip(self.servers, calls):
            if not call.done.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"SGLang server {server.url}{what} did not answer within {self.timeout_s:g} s")
            if call.error is not None:
                raise call.error
        return [c.result for c in calls]

    def send(self, named_tensors: Iterable[NamedTensor]) -> list[tuple[str, tuple[int, ...]]]:
        """Send this stage's tensors, bucket by bucket, to every server. Returns the
        ``(name, shape)`` of every tensor sent, in order.

        Raises:
            RuntimeError: a server refused an update, died, or stalled (naming its URL); the
                broadcast is abandoned, not waited on for the process group's 30-minute timeout.
        """
        if self.group is None:
            raise RuntimeError("ServerWeightSender.send: call init_group() first")
        try:
            return self._send(named_tensors)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Give the group up after a failed sync. A broadcast that some server never joined stays
        pending, and shutting the process groups down at exit waits for it: an NCCL group is
        aborted here (``ncclCommAbort``, torch's ``_abort_process_group``); a gloo group's
        broadcast fails by itself after the group's timeout (``timeout_s``, set at
        :meth:`init_group`). The next sync needs :meth:`init_group` again (and servers that
        drop the group: restart them)."""
        if self.group is not None:
            if self.backend == "nccl":
                dist.distributed_c10d._abort_process_group(self.group)
            self.group = None

    def destroy(self) -> list[str]:
        """Give the group up on both ends: :meth:`abort` this rank's, then ask every server to
        destroy its own (``POST /destroy_weights_update_group`` with ``{"group_name"}``, all at
        once, each within ``timeout_s``; sglang 0.5.23 ``entrypoints/http_server.py:1420``,
        ``managers/io_struct.py:2146`` ``DestroyWeightsUpdateGroupReqInput``; the worker pops the
        group and ``torch.distributed.destroy_process_group`` s it,
        ``model_executor/model_runner_components/weight_updater.py:146``). Without it every
        server keeps one communicator (NCCL buffers on its GPUs) per group ever formed.

        Best effort: returns the failures, one ``"url: error"`` each (a dead server cannot
        answer, and holds no group once restarted; one that never joined answers 400 "does not
        exist")."""
        self.abort()

        def one(url):
            try:
                http_post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, self.timeout_s)
            except Exception as err:  # reported, not raised: see above
                return f"{url}: {err}"
            return None

        return [e for e in each_server(self.urls, one) if e is not None]

    def _send(self, named_tensors: Iterable[NamedTensor]) -> list[tuple[str, tuple[int, ...]]]:
        sent: list[tuple[str, tuple[int, ...]]] = []
        for bucket in self.packer.buckets(named_tensors):
            request = distributed_update_request([(e.name, e.shape, e.dtype) for e in bucket.entries], self.group_name,
                                                 load_format="flattened_bucket", weight_version=self.weight_version)
            calls = [BackgroundCall(http_post, url, "/update_weights_from_distributed", request, self.timeout_s)
                     for url in self.urls]
            try:
                work = collectives.broadcast(bucket.flat, src=0, group=self.group, async_op=True)
                self._wait(work, calls, bucket.names[0])
            except Exception as err:  # the transport's error names a socket, not a server
                if isinstance(err, _NamedFailure):
                    raise RuntimeError(str(err)) from None
                raise RuntimeError(self._broadcast_failure(calls, bucket.names[0], err)) from err
            for result, url in zip(self._join(calls, "/update_weights_from_distributed"), self.urls):
                if isinstance(result, dict) and result.get("success") is False:
                    raise RuntimeError(f"SGLang server {url} update_weights_from_distributed failed: "
                                       f"{result.get('message')}")
            sent += [(e.name, e.shape) for e in bucket.entries]
            self.bytes_sent += bucket.nbytes
            del bucket, work  # a bucket larger than the packer's is the bridge's own memory
        return sent

    def _broadcast_failure(self, calls: list[BackgroundCall], first: str, err: BaseException) -> str:
        """The message of a broadcast the transport failed (a peer reset the connection): the
        servers whose HTTP call failed or is unanswered (waited for up to ``timeout_s``), by URL."""
        deadline = time.monotonic() + self.timeout_s
        for call in calls:
            call.done.wait(max(0.0, deadline - time.monotonic()))
        bad = [f"{url}: {call.error}" if call.done.is_set() else f"{url}: no answer within {self.timeout_s:g} s"
               for url, call in zip(self.urls, calls) if not call.done.is_set() or call.error is not None]
        return (f"weight sync bucket starting at {first!r}, stage {self.stage}: the broadcast failed ({err}); "
                f"failed server(s): {'; '.join(bad) or 'none answered with an error: ' + ', '.join(self.urls)}")

    def _wait(self, work, calls: list[BackgroundCall], first: str) -> None:
        """Wait for the broadcast, watching the servers' HTTP calls: a server that answers with an
        error (or whose connection drops) will never take part, so stop at once, naming it."""
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            for server, call in zip(self.servers, calls):
                if call.done.is_set() and call.error is not None:
                    raise _NamedFailure(f"weight sync bucket starting at {first!r}, stage {self.stage}: {call.error}")
            if time.monotonic() > deadline:
                raise _NamedFailure(f"weight sync bucket starting at {first!r}, stage {self.stage}: the broadcast to "
                                    f"{self.urls} did not complete within {self.timeout_s:g} s")
            time.sleep(0.0005)
        work.wait()


def connect_servers(servers: Sequence[ServerInfo], *, stage: int, num_stages: int, is_sender: bool,
                    device: torch.device | str, timeout_s: float, bucket_bytes: int,
                    backend: Optional[str] = None, parallel: Optional[ParallelDims] = None,
                    group_suffix: str = "", expert_turn: int = 0, expert_turns: int = 1) -> Optional[ServerWeightSender]:
    """Create the weight-update group of every pipeline stage, stage by stage; collective over
    the world of ``parallel`` (None: a world of one).

    In turn ``s`` the sender of stage ``s`` (``is_sender``: its DP-0 TP-0 rank) asks every
    server to join ``dapo_weights_pp<s>`` and joins as rank 0; the others wait. One stage at a
    time because a server's scheduler takes one group init at a time and blocks in it until the
    group is complete (see the module docstring). ``group_suffix``: :class:`ServerWeightSender`'s.
    At EP > 1 (``expert_turns`` = EP) each stage has ``expert_turns`` senders, one per EP owner
    (``expert_turn``: this rank's), each forming its own group in turn ``stage · expert_turns + expert_turn``.

    Returns:
        this rank's :class:`ServerWeightSender`, or None off the senders.

    Raises:
        RuntimeError: on every rank, naming the server that did not join.
        ValueError: ``parallel`` is None in a world of more than one rank.
    """
    parallel = dims_or_single(parallel, "connect_servers")
    sender, error = None, None
    for turn in range(num_stages * expert_turns):
        if turn == stage * expert_turns + expert_turn and is_sender:
            try:
                sender = ServerWeightSender(servers, stage, device=device, timeout_s=timeout_s,
                                            bucket_bytes=bucket_bytes, group_suffix=group_suffix,
                                            expert_turn=expert_turn)
                sender.init_group(backend=backend)
            except Exception as err:
                error = (f"creating the weight-update group of pipeline stage {stage}"
                         f"{f', expert owner {expert_turn}' if expert_turns > 1 else ''}: {err}")
        errors = parallel.all_gather_objects(error, "world")
        if any(errors):
            raise RuntimeError("; ".join(e for e in errors if e))
    return sender


def pause_servers(urls: Sequence[str], timeout_s: float) -> None:
    """``POST /pause_generation`` (mode ``abort``) on every server."""
    each_server(list(urls), lambda url: http_post(url, "/pause_generation", {"mode": "abort"}, timeout_s))


def verify_servers(urls: Sequence[str], digest: SyncDigest, param_specs, timeout_s: float) -> Optional[str]:
    """Read the sync's checked tensors back from every server (``POST /get_weights_by_name`` with
    ``truncate_size`` = the rows: sglang 0.5.23 ``entrypoints/http_server.py`` -> the model class's
    ``get_weights_by_name``, ``.float().tolist()``; ``dapo-rollout-server`` answers the same) and
    compare their checksums with the senders'; all servers at once. Returns the first difference
    (in the servers' order, then the sender's), naming the tensor, the server and the version."""
    specs, aliases = param_specs
    names = readback_names(digest)
    dtype = digest_dtype(digest)
    if not names:
        return None

    def one(url):
        with Timer(digest):
            for name in names:
                # the head rows the sender checksummed (SyncDigest.checked_part): a large tensor read
                # whole as JSON would cost its size ~20 times over, per server
                shape = readback_shape(specs[aliases.get(name, name)].shape, digest.readback_elements)
                try:
                    values = http_post(url, "/get_weights_by_name",
                                       {"name": name, "truncate_size": shape[0] if shape else 1}, timeout_s)
                except Exception as err:  # a server that cannot answer is reported as holding nothing
                    logger.warning("SGLang server %s: /get_weights_by_name %r failed: %s", url, name, err)
                    values = None
                error = digest.mismatch(name, readback_checksum(values, dtype, shape), f"SGLang server {url}")
                if error is not None:
                    return error
        return None

    errors = each_server(urls, one)
    return next((e for e in errors if e), None)


def flush_and_continue(urls: Sequence[str], timeout_s: float) -> None:
    """``POST /flush_cache`` (plain-text answer) then ``/continue_generation`` on every server."""
    def one(url):
        http_post(url, "/flush_cache", None, timeout_s, text=True)
        http_post(url, "/continue_generation", {}, timeout_s)

    each_server(list(urls), one)


class _Turns:
    """A rank's part of the bridge stream cut into the expert turns of its stage: :meth:`take` ``(e)``
    yields the items of turn ``e`` (``turn_of(name)``; the stream lists the turns in order) and stops
    at the first item of a later turn, which it holds for the next call (pulling it fills its bucket,
    as every peer of that bucket's gathers does at the same point)."""

    def __init__(self, stream: Iterator[NamedTensor], turn_of):
        self.stream, self.turn_of = stream, turn_of
        self.head: Optional[NamedTensor] = next(stream, None)

    def take(self, turn: int) -> Iterator[NamedTensor]:
        while self.head is not None and self.turn_of(self.head[0]) <= turn:
            item, self.head = self.head, None
            yield item
            del item
            self.head = next(self.stream, None)


def sync_servers(stage_tensors: Optional[Iterable[NamedTensor]], *, sender: Optional[ServerWeightSender],
                 urls: Sequence[str], timeout_s: float, param_specs, version: int, coordinator: bool,
                 stage: int = 0, num_stages: int = 1, parallel: Optional[ParallelDims] = None,
                 digest: Optional[SyncDigest] = None, expert_turns: int = 1, turn_of=None) -> int:
    """One weight sync into the servers; collective over the world of ``parallel`` (None: a world
    of one).

    Args:
        stage_tensors: this rank's part of the bridge stream: the tensors of its pipeline stage
            on ranks that iterate the bridge (the stage's DP-0 TP ranks; their TP gathers are
            collective), None on the others.
        sender: this stage's :class:`ServerWeightSender` on its sending rank, else None (the
            rank only drives the bridge's collectives).
        urls: every server.
        param_specs: ``(specs, aliases)`` of the served model: after the stages sent, every rank
            checks that each parameter was sent once with its shape (the stages' names are
            all-gathered), so a tensor no stage sent is an error naming it, on every rank.
        version: the weight version (for the error messages).
        coordinator: the one rank that pauses, flushes and resumes the servers (rank 0).
        stage, num_stages: this rank's pipeline stage and the PP size: stage ``s`` sends in
            turn ``s`` (see the module docstring); a failed turn ends the sync for all.
        expert_turns, turn_of: EP > 1 (``expert_turns`` = EP): stage ``s``'s EP owner ``e`` sends in
            turn ``s · expert_turns + e`` the items ``turn_of(name) == e`` of its stream (its own
            experts; EP rank 0 every non-expert tensor too: :func:`~dapo_megatron.bridge.expert_turn`), through its own
            ``sender`` (``sender.expert_turn``); every other rank with a stream iterates its items
            of the turn (the gathers are collective). ``turn_of`` None: one turn per stage.
        digest: verification (:mod:`.verify`): the :class:`~dapo_megatron.bridge.verify.SyncDigest`
            the bridge filled on this rank's stream (its stage's checksums on the senders); the senders' checksums are
            all-gathered, and before generation continues the coordinator reads every checked
            tensor back from every server (``/get_weights_by_name``) and compares; a difference
            fails the sync naming the tensor, the server and the version, with the servers left
            paused (they do not serve that version).

    Returns:
        bytes this rank sent (0 off the senders).

    Raises:
        RuntimeError: on every rank, when any rank's sending failed (naming the server and the
            bucket) or the stages together left parameters unsent.
    """
    error = None
    if sender is not None:
        sender.bytes_sent = 0
        sender.weight_version = str(version)  # SGLang's UpdateWeightsFromDistributedReqInput.weight_version
    if coordinator:
        try:
            pause_servers(urls, timeout_s)
        except Exception as err:
            error = f"pausing generation before the weight sync: {err}"
    parallel = dims_or_single(parallel, "sync_servers")
    errors = parallel.all_gather_objects(error, "world")  # no stage sends into a server that is not paused
    if any(errors):
        raise RuntimeError(next(e for e in errors if e))
    sent: list[tuple[str, tuple[int, ...]]] = []
    # the bridge's export plan is collective over the PP group: every stage runs it (and gathers
    # its first bucket) before the turns, or stage 0 would wait in it for stages parked below
    turns = _Turns(iter(stage_tensors) if stage_tensors is not None else iter(()),
                   turn_of if turn_of is not None else (lambda name: 0))
    every_sent: list[tuple[str, tuple[int, ...]]] = []  # all stages' (name, shape)s, for the check below
    failed: list[str] = []
    for turn in range(num_stages * expert_turns):
        mine = turn // expert_turns == stage
        sent = []
        if mine:
            items = turns.take(turn % expert_turns)
            if sender is not None and sender.expert_turn == turn % expert_turns:
                try:
                    sent = sender.send(items)
                except Exception as err:
                    error = str(err)
            for item in items:  # after a failure (or off the sender): keep the bridge's TP gathers in step
                del item
        reports = parallel.all_gather_objects((sent, error), "world")
        every_sent += [item for part, _ in reports for item in part]
        failed = [e for _, e in reports if e]
        if failed:
            break  # later stages do not send into servers that failed; their streams are dropped
    del turns
    if not failed:
        tracker = WeightSyncTracker(*param_specs)
        tracker.begin(version)
        try:
            for name, shape in every_sent:
                tracker.check_and_mark(name, torch.empty(shape, device="meta"))
            tracker.finish()
        except (KeyError, ValueError, RuntimeError) as err:
            failed = [f"weight sync to version {version} (rollout.mode=server): {err}"]
    if digest is not None and not failed:
        mine = (dict(digest.sums), list(digest.errors)) if sender is not None else ({}, [])
        every = parallel.all_gather_objects(mine, "world")
        digest.sums = {n: v for sums, _ in every for n, v in sums.items()}
        digest.sent = [name for name, _ in every_sent]
        stale = [e for _, errs in every for e in errs]
        if stale:
            failed = [stale[0]]
        elif coordinator:
            error = verify_servers(urls, digest, param_specs, timeout_s)
            failed = [error] if error else []
    if coordinator and not failed:
        try:
            flush_and_continue(urls, timeout_s)
        except Exception as err:
            failed = [f"resuming generation after the weight sync: {err}"]
    failed = parallel.broadcast_object(failed, "world", src=0)
    if failed:
        raise RuntimeError("; ".join(failed))
    return sender.bytes_sent if sender is not None else 0
