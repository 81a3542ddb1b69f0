"""The rollout layout: which engines exist, which ranks feed them, which prompts each one samples.

Two layouts of the rollout side, both independent of the actor's TP × PP × DP:

* colocated (``rollout.mode: colocated``): the world is cut into rollout groups of
  ``rollout.tensor_model_parallel_size`` consecutive ranks on one node
  (:func:`dapo_megatron.platform.parallel_dims.rollout_groups`); each group owns one engine
  spanning its GPUs, created by the group's first rank (its leader);
* server (``rollout.mode: server``): ``rollout.server_urls`` name SGLang servers started by
  the user, each with its own TP size; engine ``e`` is driven by trainer rank ``e``.

Every function here is pure (no process group, no GPU) so the trainer, the parallel-state
object and the tests share one definition.

Design: docs/design.md §2 (the rollout layout).
"""

from __future__ import annotations

from typing import Any

from dapo_megatron.platform.parallel_config import ROLLOUT_TP_KEY, rollout_groups


def check_rollout_tp_fits_model(hf_config: Any, rollout_tp: int, key: str = ROLLOUT_TP_KEY) -> None:
    """Raise unless an SGLang engine of ``rollout_tp`` GPUs can shard this model.

    SGLang's rules (sglang 0.5.11 ``srt/models/llama.py`` ``LlamaAttention.__init__`` and
    ``srt/models/qwen2.py`` ``Qwen2Attention.__init__``; ``srt/layers/linear.py``
    ``MergedColumnParallelLinear`` divides its output by TP with ``divide``, which asserts):

    * the attention heads divide by TP (``total_num_heads % tp_size == 0``);
    * KV heads: ``num_kv_heads % tp == 0`` when ``num_kv_heads >= tp`` (partitioned), else
      ``tp % num_kv_heads == 0`` (each KV head replicated on ``tp / num_kv_heads`` GPUs);
    * the MLP's intermediate size divides by TP.

    SGLang would fail the same way, but inside its scheduler processes minutes into the run
    and with a bare ``AssertionError``; this names the key and the sizes that would work.

    Raises:
        ValueError: naming ``key``, the model's sizes and the valid rollout TP sizes up to 16.
    """
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    ffn = int(hf_config.intermediate_size)

    def fits(tp: int) -> bool:
        kv_ok = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
        return heads % tp == 0 and kv_ok and ffn % tp == 0

    if isinstance(rollout_tp, bool) or not isinstance(rollout_tp, int) or rollout_tp < 1:
        raise ValueError(f"{key}={rollout_tp!r} must be an int >= 1")
    if not fits(rollout_tp):
        valid = [tp for tp in range(1, 17) if fits(tp)]
        raise ValueError(
            f"{key}={rollout_tp} cannot shard this model in SGLang: it has {heads} attention heads, "
            f"{kv_heads} KV heads and an MLP of {ffn}; the rollout TP must divide the heads and the MLP size, "
            f"and divide or be a multiple of the KV heads. Valid sizes up to 16: {valid}")


def engine_share(num_items: int, num_engines: int, engine_index: int) -> list[int]:
    """The items (prompts) engine ``engine_index`` samples: ``engine_index::num_engines``.

    Round-robin so that every engine gets the same count ± 1 whatever the order of the
    items. Which engine samples an item does not change its responses: each response is
    seeded from the item's global index (:func:`~dapo_megatron.rollout.engines.engine.sample_seed`),
    so the rollout is the same at any number of engines.

    Raises:
        ValueError: ``num_engines`` < 1 or ``engine_index`` outside ``[0, num_engines)``.
    """
    if num_engines < 1 or not 0 <= engine_index < num_engines:
        raise ValueError(f"engine_index={engine_index} must be in [0, num_engines={num_engines})")
    return list(range(engine_index, num_items, num_engines))


def rollout_engines(rank: int, world_size: int, *, mode: str = "colocated", rollout_tp: int = 1,
                    num_servers: int = 0, one_driver: bool = False) -> tuple[int, "int | None"]:
    """``(number of engines, index of the engine this rank drives or None)``.

    colocated: engine ``e`` is rollout group ``e``
    (:func:`~dapo_megatron.platform.parallel_dims.rollout_groups`), driven by its leader
    ``e * rollout_tp``; server: engine ``e`` is ``rollout.server_urls[e]``, driven by rank
    ``e``; with ``one_driver`` (``async_training``: rank 0's controller sends the training
    rows to every server over HTTP) there may be more servers than ranks, and the engines are
    the first ``min(num_servers, world_size)`` (they serve validation). Prompts go to engines
    by :func:`engine_share`; a rank that drives none generates nothing.
    """
    if mode == "server":
        check_rollout_layout(world_size, 1, mode="server", num_servers=num_servers, one_driver=one_driver)
        return min(num_servers, world_size), (rank if rank < num_servers else None)
    check_rollout_layout(world_size, rollout_tp)
    return world_size // rollout_tp, (rank // rollout_tp if rank % rollout_tp == 0 else None)


def check_rollout_layout(world_size: int, rollout_tp: int, ranks_per_node: "int | None" = None, *,
                         mode: str = "colocated", num_servers: int = 0, one_driver: bool = False) -> None:
    """Raise unless the rollout layout fits a launch of ``world_size`` ranks,
    ``ranks_per_node`` of them per node (torchrun's ``LOCAL_WORLD_SIZE``; None: unknown).

    colocated: :func:`~dapo_megatron.platform.parallel_dims.rollout_groups`'s rules (the
    rollout TP divides the world size and the ranks per node: SGLang's TP workers of one
    engine are local processes), checked when the config is loaded; server: at most
    ``world_size`` servers (server ``e`` is driven by rank ``e``), or any number >= 1 with
    ``one_driver`` (``async_training``: rank 0's controller drives them all).

    Raises:
        ValueError: naming ``rollout.tensor_model_parallel_size`` or ``rollout.server_urls``.
    """
    if mode == "server":
        if one_driver and num_servers >= 1:
            return
        if not 1 <= num_servers <= world_size:
            raise ValueError(f"rollout.server_urls lists {num_servers} servers; a launch of {world_size} trainer "
                             f"ranks drives 1..{world_size} (server e is driven by rank e)")
        return
    if (ranks_per_node is not None and isinstance(rollout_tp, int) and not isinstance(rollout_tp, bool)
            and rollout_tp > ranks_per_node):
        raise ValueError(f"{ROLLOUT_TP_KEY}={rollout_tp} exceeds a node ({ranks_per_node} ranks per node): one "
                         "engine's GPUs must be on one node; use at most the GPUs of a node, or rollout.mode=server")
    rollout_groups(world_size, ranks_per_node or world_size, rollout_tp)
