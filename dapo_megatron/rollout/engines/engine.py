"""The rollout-engine interface: sampling parameters, the row protocol and outputs.

An engine turns chat-templated prompt token ids into sampled responses with the per-token
logprobs of its sampling distribution, accepts new weights by Hugging Face parameter name
after every training step (the receiving protocol is the bridge's,
:class:`~dapo_megatron.bridge.receiver.WeightReceiver`), and in colocated mode frees its
accelerator memory while the actor trains (``sleep``) and takes it back for generation (``wake_up``).

Implementations: :class:`dapo_megatron.rollout.engines.hf_engine.HFEngine` (transformers, CPU
default) and :class:`dapo_megatron.rollout.engines.sglang_engine.SGLangEngine` (GPU).

Names follow verl's ``actor_rollout_ref.rollout`` and SGLang's sampling params.

Design: docs/design.md §2.3 (the engine API in the engines room).
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch

from dapo_megatron.bridge.receiver import WeightReceiver
from dapo_megatron.rollout.types import Group, Sample


@dataclass
class SamplingParams:
    """Sampling parameters of one ``generate`` call (SGLang / verl names).

    Attributes:
        n: responses per prompt (G, verl ``rollout.n``), >= 1.
        temperature: logits are divided by it, > 0. (Greedy decoding: ``top_k=1``.)
        top_p: nucleus mass in (0, 1]; 1.0 disables it.
        top_k: keep the k most likely tokens; -1 disables it (0 is rejected, as in SGLang
            it would be ambiguous).
        max_new_tokens: generation budget per response, >= 1. A response that reaches it
            without a stop token finishes with ``"length"`` (truncated).
        stop_token_ids: extra token ids that end a response (the engine always also stops
            on the model's EOS ids). The stop token is kept in the response.
        stop: stop strings (SGLang's ``stop``): a response ends with ``"stop"`` at the first
            sampled token whose decoded text completes one of them, that token kept (a tool
            call's end, :func:`dapo_megatron.tools.calls.stop_strings`). Matched on the text of
            the row's own new tokens (not its prompt or prefix); the HF engine needs a decoder
            (:meth:`HFEngine.set_stop_decoder <dapo_megatron.rollout.engines.hf_engine.HFEngine.set_stop_decoder>`).
        seed: seed of the sampler's random generator. The same prompts, params and weights
            give the same responses. ``None``: draw from the global RNG (not reproducible).

    Raises:
        ValueError: on any out-of-range field, naming it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1 (responses per prompt), got {self.n!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature!r}; "
                             "for greedy decoding use top_k=1")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1.0 = off), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        ids = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(t, str) or not t for t in stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        self.stop = stop
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")


class Completion(NamedTuple):
    """One sampled response.

    Attributes:
        response_ids: generated token ids, length R (the stop token included when the
            response ended on one; no padding).
        logprobs: logprob (nats) of each token of ``response_ids`` under the engine's
            sampling distribution, length R.
        finish_reason: ``"stop"`` (EOS / stop token) or ``"length"`` (hit max_new_tokens).
        routes: the experts every token but the last of ``prompt + response`` was routed to
            (``[P + R - 1, L, K]``, :mod:`~dapo_megatron.rollout.engines.routes`), from an
            engine asked to record them (routing replay); None otherwise.
    """

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routes: Optional[torch.Tensor] = None


#: ``generate``'s result: for each prompt, in input order, its ``n`` completions.
GenerationOutput = list[list[Completion]]


@dataclass(frozen=True)
class RowRequest:
    """One response to sample (or to continue) through the asynchronous interface.

    Attributes:
        key: the caller's id of the row (hashable), unique among the engine's rows in flight.
        prompt_ids: chat-templated prompt token ids.
        params: sampling parameters; ``n`` is ignored (one row), ``max_new_tokens`` is the
            budget of the WHOLE response, prefix included.
        prompt_seed: with ``index``, the row's seed ``sample_seed(params.seed, prompt_seed,
            index)``: the same stream as response ``index`` of ``generate(prompt_seeds=[...])``.
        index: the response's index ``j`` in its group.
        prefix_ids: response tokens already sampled (a partial rollout aborted at the end of
            a step): the engine continues after them, at the same place of the row's random
            stream, and returns only the new tokens.
        routes_start: routing replay: the first position of ``prompt + prefix`` whose route the
            row returns (``RowResult.routes`` covers ``[routes_start, P + prefix + new - 1)``),
            SGLang's ``routed_experts_start_len``. 0: every position (a new row). A row continued
            after a weight sync passes ``P + len(prefix) - 1``, the routes its sample holds, so the
            positions forwarded by the earlier version keep that version's routes
            (:meth:`~dapo_megatron.rollout.types.Sample.append_tokens`).
    """

    key: Any
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    prompt_seed: int
    index: int = 0
    prefix_ids: tuple[int, ...] = ()
    routes_start: int = 0

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "prefix_ids", tuple(int(t) for t in self.prefix_ids))
        if not self.prompt_ids:
            raise ValueError(f"RowRequest {self.key!r}: prompt_ids is empty")
        if self.index < 0:
            raise ValueError(f"RowRequest {self.key!r}: index={self.index} must be >= 0")
        if not 0 <= self.routes_start <= len(self.prompt_ids) + len(self.prefix_ids):
            raise ValueError(f"RowRequest {self.key!r}: routes_start={self.routes_start} must be in [0, "
                             f"{len(self.prompt_ids) + len(self.prefix_ids)}] (the input's length, as SGLang's "
                             "routed_experts_start_len)")

    @property
    def budget(self) -> int:
        """New tokens the row may still sample: ``max_new_tokens - len(prefix_ids)``."""
        return self.params.max_new_tokens - len(self.prefix_ids)

    @property
    def seed(self) -> Optional[int]:
        """The row's sampler seed (:func:`sample_seed`)."""
        return sample_seed(self.params.seed, self.prompt_seed, self.index)


class RowResult(NamedTuple):
    """What the engine sampled for one :class:`RowRequest`.

    Attributes:
        key: the request's key.
        response_ids: the NEW tokens (after the request's prefix).
        logprobs: their logprobs under the sampling distribution, nats.
        finish_reason: ``"stop"``, ``"length"`` (the whole response reached
            ``max_new_tokens``) or ``"abort"`` (stopped by :meth:`RolloutEngine.abort`: a
            partial response, to be continued or discarded).
        version: the engine's :attr:`~dapo_megatron.bridge.receiver.WeightReceiver.weight_version` that sampled them.
        routes: as :attr:`Completion.routes`, over ``prompt + prefix + response_ids`` from
            position ``RowRequest.routes_start`` on; None when not recorded.
    """

    key: Any
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    routes: Optional[torch.Tensor] = None


def match_stop_string(stops: Sequence[str], tokens: Sequence[int], decode) -> Optional[str]:
    """The first of ``stops`` found in the text (``decode(ids) -> str``) of the last few of
    ``tokens`` (a row's, or a turn's, tokens), else None: the one rule of stop strings
    (``SamplingParams.stop``). The window is 4 tokens per character of the longest stop string
    + 4 (a token of byte-fallback text may hold a quarter of a character). Checked after every
    sampled token, an earlier occurrence would have ended the row already, so any occurrence is
    the last token's (SGLang's ``Req._check_str_based_finish`` decodes the output's tail alike)."""
    if not stops or not tokens:
        return None
    window = 4 * max(len(t) for t in stops) + 4
    text = decode(list(tokens[-window:]))
    return next((t for t in stops if t in text), None)


def eos_ids(*sources: Any) -> set[int]:
    """The union of the ``eos_token_id`` of each source (a tokenizer, a ``config.json`` or
    ``generation_config.json`` config; an int, a list of ints or None each; a source that is None
    or has no such attribute adds nothing): the one reading of a model's stop ids, which the engine
    factory, the HF engine and the SGLang engine share."""
    ids: set[int] = set()
    for src in sources:
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update(int(t) for t in ([eos] if isinstance(eos, int) else eos))
    return ids


def sample_seed(seed: Optional[int], prompt_seed: int, sample: int) -> Optional[int]:
    """The sampler seed of response ``sample`` (0..n-1) of the prompt with ``prompt_seed``.

    Engines seed every response on its own, so a response depends only on its prompt,
    ``(seed, prompt_seed, sample)`` and the weights, not on which other prompts share the
    batch or on which rank generates it: the rollout of a run is the same at any TP/PP/DP
    layout (and on resume). ``prompt_seed`` defaults to the prompt's position in the
    ``generate`` call; the trainer passes a global prompt index. ``None`` stays ``None``
    (unseeded). Returns a 63-bit int (blake2b of the three numbers).
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{prompt_seed}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def validate_prompt_ids(prompt_ids: Sequence[Sequence[int]], vocab_size: Optional[int] = None) -> None:
    """Check ``generate``'s ``prompt_ids`` argument: a non-empty list of non-empty int lists.

    Raises:
        ValueError: naming the offending prompt index and the fix.
    """
    if isinstance(prompt_ids, torch.Tensor) or not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise ValueError("prompt_ids must be a non-empty list of token-id lists (one per prompt, no padding)")
    for i, p in enumerate(prompt_ids):
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompt_ids[{i}] must be a non-empty list of token ids, got {type(p).__name__} "
                             f"of length {len(p) if hasattr(p, '__len__') else '?'}; tokenize (and chat-template) first")
        bad = [t for t in p if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ValueError(f"prompt_ids[{i}] holds invalid token ids {bad[:5]} "
                             f"(need ints in [0, {vocab_size if vocab_size is not None else 'vocab_size'}))")


def resolve_prompt_seeds(prompt_ids: Sequence, prompt_seeds: Optional[Sequence[int]]) -> list[int]:
    """``prompt_seeds`` checked against ``prompt_ids`` (default: positions)."""
    if prompt_seeds is None:
        return list(range(len(prompt_ids)))
    seeds = [int(x) for x in prompt_seeds]
    if len(seeds) != len(prompt_ids):
        raise ValueError(f"prompt_seeds has {len(seeds)} entries for {len(prompt_ids)} prompts; pass one per prompt")
    return seeds


def completions_to_group(
    group_id: int,
    prompt_ids: list[int],
    completions: Sequence[Completion],
    *,
    prompt_index: int = -1,
    data_source: str = "",
    ground_truth: str = "",
    extra_info: Optional[dict[str, Any]] = None,
    version: Optional[int] = None,
) -> Group:
    """Wrap one prompt's completions into an ungraded :class:`Group` of :class:`Sample`.

    The grading fields (data_source, ground_truth, extra_info) come from the prompt's
    dataset row (DAPO schema) and are copied into every sample; ``version`` (the engine's
    weight version) is recorded as every sample's ``versions = [(0, version)]``.
    """
    samples = [
        Sample(prompt_ids=list(prompt_ids), response_ids=list(c.response_ids), rollout_logprobs=list(c.logprobs),
               finish_reason=c.finish_reason, group_id=group_id, prompt_index=prompt_index,
               data_source=data_source, ground_truth=ground_truth,
               extra_info=dict(extra_info) if extra_info is not None else None,
               versions=[] if version is None else [(0, int(version))], routes=c.routes)
        for c in completions
    ]
    return Group(group_id=group_id, samples=samples)


class RolloutEngine(WeightReceiver):
    """Abstract rollout engine.

    Subclasses implement :meth:`generate`, :meth:`sleep`, :meth:`wake_up`, and the receiving end of
    a weight sync that :class:`~dapo_megatron.bridge.receiver.WeightReceiver` asks for:
    ``_param_specs`` (parameter list of the receiving model) and one of ``_load_bucket`` (copy a
    list of validated full tensors into the engine) or ``_load_stream`` (consume the whole validated
    stream). The weight-sync protocol (``update_weights``, ``finish_weight_update``, weight validity
    and version: when the weights are not valid, ``generate`` raises
    :class:`~dapo_megatron.bridge.receiver.InvalidWeightsError`) is the bridge's, inherited.
    """

    # ---- generation ---------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """Sample ``params.n`` responses for each prompt.

        Args:
            prompt_ids: one list of chat-templated token ids per prompt (no padding).
            params: sampling parameters.
            prompt_seeds: one int per prompt: response j of prompt i is sampled with
                :func:`sample_seed` ``(params.seed, prompt_seeds[i], j)``; default the
                prompt positions ``0..len-1``.

        Returns:
            ``outputs[i][j]``: the j-th :class:`Completion` of prompt i.
        """

    # ---- asynchronous generation -------------------------------------------------------
    #: whether :meth:`submit` / :meth:`poll` / :meth:`abort` are implemented
    supports_async: bool = False

    def submit(self, rows: Sequence[RowRequest]) -> None:
        """Queue rows for generation; they start at the next :meth:`poll`. Each row is one
        response (n=1), continued after its ``prefix_ids`` if any.

        Raises:
            NotImplementedError: this engine has no asynchronous form (use
                ``rollout.streaming: false``).
        """
        raise NotImplementedError(f"{type(self).__name__} has no asynchronous generation (submit / poll / abort); "
                                  "set rollout.streaming: false")

    def poll(self, max_tokens: Optional[int] = None) -> list[RowResult]:
        """Advance generation and return the rows that finished (``"stop"`` / ``"length"``)
        since the last call, in the order they finished. ``max_tokens``: how far to advance,
        in sampled tokens per row (None: until every row in flight finishes)."""
        raise NotImplementedError(f"{type(self).__name__} has no asynchronous generation")

    def abort(self) -> list[RowResult]:
        """Stop every row in flight or queued; returns each one's tokens so far with
        finish reason ``"abort"`` (no tokens for rows that never started)."""
        raise NotImplementedError(f"{type(self).__name__} has no asynchronous generation")

    @property
    def num_in_flight(self) -> int:
        """Rows submitted and not yet returned by :meth:`poll` or :meth:`abort`."""
        return 0

    def _check_can_load(self) -> None:
        self._require_idle("update_weights")

    def _require_idle(self, what: str) -> None:
        if self.num_in_flight:
            raise RuntimeError(f"{type(self).__name__}.{what} with {self.num_in_flight} rows in flight; poll them to "
                               "the end or abort() them first (a row must not mix weights within one generation)")

    @abc.abstractmethod
    def sleep(self, keep_weights: bool = False) -> None:
        """Free accelerator memory while the actor trains (colocated mode): the KV cache (and
        CUDA graphs), and the weights too unless ``keep_weights``. Released weights that the
        engine cannot restore make :attr:`weights_valid` False until the next sync."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Take memory back before generating. The weights are those of the last sync only
        if :attr:`weights_valid` (check it, and re-sync when it is False)."""

    #: whether :meth:`score` is implemented (the weight probe's engine side)
    supports_score: bool = False

    def score(self, ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
        """float32 logprobs of ``ids[1:]`` under the engine's weights, each given the ids before it."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a sequence")
