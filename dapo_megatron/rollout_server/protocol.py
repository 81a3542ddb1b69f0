"""``dapo-rollout-server``'s engine (the HF engine with per-row seeds) and its ``/generate``
request: every field of SGLang's ``GenerateReqInput`` / ``SamplingParams`` checked (the free ones
read, the others only at their defaults), one clear ``BadRequest`` naming the key otherwise
(:mod:`dapo_megatron.rollout_server`).

Design: docs/design.md §2.2 (server mode on CPU).
"""

import logging
import random
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dapo_megatron.rollout.engines.engine import RowRequest, SamplingParams
from dapo_megatron.rollout.engines.hf_engine import HFEngine

logger = logging.getLogger("dapo_rollout_server")

#: The SGLang release whose HTTP API this server follows.
SGLANG_API_VERSION = "0.5.11"

#: sampling_params keys with their SGLang defaults (``sampling/sampling_params.py``) that the HF
#: engine cannot honour otherwise: any other value is refused.
_FIXED_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                   "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
                   "structural_tag": None, "stop_regex": None, "custom_params": None,
                   "logit_bias": None}
_FREE_SAMPLING = {"max_new_tokens", "stop", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
                  "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval"}
#: GenerateReqInput fields accepted at these values only (any other value is refused).
_FIXED_REQUEST = {"text": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
                  "top_logprobs_num": None, "token_ids_logprob": None, "return_hidden_states": False,
                  "lora_path": None, "session_params": None, "custom_logit_processor": None}
_FREE_REQUEST = {"input_ids", "sampling_params", "return_logprob", "rid", "logprob_start_len", "stream",
                 "return_text_in_logprobs", "log_metrics", "priority", "routing_key", "extra_key", "no_logs",
                 "custom_labels", "conversation_id", "background", "require_reasoning", "modalities",
                 "routed_dp_rank", "data_parallel_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                 "return_routed_experts", "routed_experts_start_len"}


class BadRequest(ValueError):
    """A request the server refuses: answered 400 with this message."""


# ---------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class ServerRow(RowRequest):
    """One row of a ``/generate`` request. ``key`` is its rid; ``prompt_ids`` its whole input.

    Attributes:
        sampling_seed: the row's seed (the request's ``sampling_seed``, else one drawn by the server).
        ignore_eos: the model's EOS ids do not end the row (``stop_token_ids`` still do).
    """

    sampling_seed: int = 0
    ignore_eos: bool = False


class ServerEngine(HFEngine):
    """:class:`~dapo_megatron.rollout.engines.hf_engine.HFEngine` with the server's row semantics:
    position-keyed draws (module docstring) and per-row ``ignore_eos``."""

    def _generator(self, req: ServerRow) -> torch.Generator:
        g = torch.Generator(device=self.device).manual_seed(req.sampling_seed)
        for _ in range(len(req.prompt_ids) + len(req.prefix_ids)):  # one draw per position before the first
            torch.rand(1, dtype=torch.float64, device=self.device, generator=g)
        return g

    def _stop_ids(self, req: ServerRow) -> frozenset:
        stops = frozenset(req.params.stop_token_ids)
        return stops if req.ignore_eos else self.eos_token_ids | stops


# ---------------------------------------------------------------------------- requests
def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}")
    return value


def _as_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key} must be a number, got {value!r}")
    return float(value)


@dataclass
class RowSpec:
    """What the response of one row needs besides the engine's output."""

    rid: str
    max_new_tokens: int
    return_logprob: bool
    no_stop_trim: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    return_routed_experts: bool = False
    stream_interval: Optional[int] = None  # sampling_params.stream_interval (None: the server's --stream-interval)


def parse_stop(value: Any, key: str, decodes_text: bool) -> tuple[str, ...]:
    """``sampling_params.stop`` → the row's stop strings: None, ``""`` or ``[]`` is none; a string
    is one (SGLang's ``SamplingParams.normalize`` makes a str a one-element list).

    Raises:
        BadRequest: not a string or a list of non-empty strings, or stop strings on a server
            without a tokenizer (``--skip-tokenizer-init``: nothing to match the text with).
    """
    if value is None or value == "" or value == []:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(t, str) and t for t in stops):
        raise BadRequest(f"{key}.stop must be a string or a list of non-empty strings, got {str(value)[:80]}")
    if not decodes_text:
        raise BadRequest(f"{key}.stop={stops!r} needs the server's tokenizer to match the text: launch "
                         "dapo-rollout-server without --skip-tokenizer-init")
    return tuple(stops)


def parse_sampling_params(sp: Any, key: str, vocab_size: int, rng: random.Random, *,
                          decodes_text: bool = False) -> tuple[SamplingParams, dict]:
    """One row's ``sampling_params`` → ``(SamplingParams, extras)``; ``extras`` holds
    ``max_new_tokens`` (may be 0), ``ignore_eos``, ``sampling_seed`` and the text options.
    ``decodes_text``: the server has a tokenizer, so ``stop`` strings are served (:func:`parse_stop`).

    Raises:
        BadRequest: an unknown key, a value outside SGLang's ranges (``SamplingParams.verify``), or
            a feature the HF engine does not have, naming ``key.<field>``.
    """
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise BadRequest(f"{key} must be a JSON object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - _FREE_SAMPLING - set(_FIXED_SAMPLING))
    if unknown:
        raise BadRequest(f"{key} has unknown field(s) {unknown}; accepted: {sorted(_FREE_SAMPLING | set(_FIXED_SAMPLING))}")
    for name, default in _FIXED_SAMPLING.items():
        value = sp.get(name, default)
        if value is not None and value != default:
            raise BadRequest(f"{key}.{name}={value!r} is not supported by dapo-rollout-server (only {default!r}): "
                             "the HF engine samples with temperature / top_p / top_k only"
                             + ("; expand the n rows client side" if name == "n" else ""))
    max_new = _as_int(sp.get("max_new_tokens", 128), f"{key}.max_new_tokens")
    if max_new < 0:
        raise BadRequest(f"{key}.max_new_tokens must be at least 0, got {max_new}")
    def given(name, default):  # SGLang reads an explicit null as the default
        return default if sp.get(name) is None else sp[name]

    temperature = _as_float(given("temperature", 1.0), f"{key}.temperature")
    top_p = _as_float(given("top_p", 1.0), f"{key}.top_p")
    top_k = _as_int(given("top_k", -1), f"{key}.top_k")
    if temperature < 0:
        raise BadRequest(f"{key}.temperature must be non-negative, got {temperature}")
    if temperature < 1e-6:  # SGLang's SamplingParams: greedy
        temperature, top_k = 1.0, 1
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"{key}.top_p must be in (0, 1], got {top_p}")
    if top_k < 1 and top_k != -1:
        raise BadRequest(f"{key}.top_k must be -1 (disable) or at least 1, got {top_k}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
                                          for t in stops):
        raise BadRequest(f"{key}.stop_token_ids must be a list of token ids in [0, {vocab_size}), got {stops!r}")
    seed = sp.get("sampling_seed")
    if seed is None:
        seed = rng.getrandbits(63)
    seed = _as_int(seed, f"{key}.sampling_seed")
    if not 0 <= seed < 2**64:
        raise BadRequest(f"{key}.sampling_seed must be in [0, 2**64), got {seed}")
    params = SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max(1, max_new),
                            stop_token_ids=tuple(stops), seed=None,
                            stop=parse_stop(sp.get("stop"), key, decodes_text))
    extras = {"max_new_tokens": max_new, "ignore_eos": bool(sp.get("ignore_eos", False)), "sampling_seed": seed % 2**63,
              "no_stop_trim": bool(sp.get("no_stop_trim", False)),
              "skip_special_tokens": bool(sp.get("skip_special_tokens", True)),
              "spaces_between_special_tokens": bool(sp.get("spaces_between_special_tokens", True))}
    interval = sp.get("stream_interval")
    if interval is not None and _as_int(interval, f"{key}.stream_interval") < 1:
        raise BadRequest(f"{key}.stream_interval must be at least 1, got {interval}")
    extras["stream_interval"] = interval
    return params, extras


def parse_generate(body: Any, vocab_size: int, context_length: int, rng: random.Random, *,
                   records_routes: bool = False, decodes_text: bool = False
                   ) -> tuple[bool, list[ServerRow], list[RowSpec]]:
    """A ``/generate`` body → ``(single, rows, specs)`` (``single``: answer one dict, not a list).
    ``decodes_text``: the server has a tokenizer (stop strings are served).

    Raises:
        BadRequest: naming the field: no ``input_ids``, an empty or out-of-vocabulary row, a row
            longer than the context, a ``rid`` list of the wrong length or with duplicates, an
            unsupported field (text input, streaming, top logprobs, prompt logprobs...).
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the /generate body must be a JSON object (GenerateReqInput), got {type(body).__name__}")
    unknown = sorted(set(body) - _FREE_REQUEST - set(_FIXED_REQUEST))
    if unknown:
        raise BadRequest(f"/generate got unknown field(s) {unknown} (sglang {SGLANG_API_VERSION} GenerateReqInput)")
    for name, default in _FIXED_REQUEST.items():
        if body.get(name, default) not in (default, None):
            raise BadRequest(f"/generate {name}={repr(body[name])[:80]} is not supported by dapo-rollout-server: "
                             + ("send input_ids (tokenize client side)" if name == "text" else
                                "only token-id requests are served"))
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest(f"stream must be true or false, got {body['stream']!r}")
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("/generate needs input_ids (a list of token ids, or a list of such lists for a batch)")
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"input_ids must be a non-empty list, got {str(ids)[:80]}")
    single = not isinstance(ids[0], list)
    batch = [ids] if single else ids
    for i, row in enumerate(batch):
        where = "input_ids" if single else f"input_ids[{i}]"
        if not isinstance(row, list) or not row:
            raise BadRequest(f"{where} must be a non-empty list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in row):
            bad = [t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size][:5]
            raise BadRequest(f"{where} holds {bad} outside the vocabulary [0, {vocab_size})")
    lp_start = body.get("logprob_start_len")
    if lp_start not in (None, -1) and not (isinstance(lp_start, int) and all(lp_start >= len(r) for r in batch)):
        raise BadRequest(f"logprob_start_len={lp_start!r}: prompt logprobs are not served (use -1: output tokens only)")
    n = len(batch)
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != n:
            raise BadRequest(f"sampling_params has {len(sps)} entries for {n} rows of input_ids")
    else:
        sps = [sps] * n
    ret_lp = body.get("return_logprob") or False
    ret_lp = ret_lp if isinstance(ret_lp, list) else [ret_lp] * n
    if len(ret_lp) != n:
        raise BadRequest(f"return_logprob has {len(ret_lp)} entries for {n} rows of input_ids")
    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise BadRequest(f"return_routed_experts must be true or false, got {routed!r}")
    if routed and not records_routes:
        raise BadRequest("return_routed_experts=true needs the server launched with --enable-return-routed-experts")
    # SGLang's routed_experts_start_len (sglang 0.5.23 managers/io_struct.py:264-268 GenerateReqInput: "Absolute
    # start position for returned routings; response covers [routed_experts_start_len, seqlen - 1). Must be in
    # [0, prompt_tokens]. 0 = full sequence"): one int for the whole batch (GenerateReqInput.__getitem__ copies it to
    # every row); the rows are sliced where the finished request's routes are gathered
    # (managers/scheduler_components/batch_result_processor.py _maybe_collect_routed_experts, capturer.get_topk(...,
    # start_len=req.routed_experts_start_len)). A continued row asks for its routes from where its sample's end.
    routes_start = body.get("routed_experts_start_len", 0)
    if isinstance(routes_start, bool) or not isinstance(routes_start, int):
        raise BadRequest(f"routed_experts_start_len must be an integer, got {routes_start!r}")
    bad = [i for i, row in enumerate(batch) if not 0 <= routes_start <= len(row)]
    if bad:
        raise BadRequest(f"routed_experts_start_len={routes_start} must be in [0, prompt_tokens] (row {bad[0]} has "
                         f"{len(batch[bad[0]])} input tokens)")
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [rid] if single else [f"{rid}_{i}" for i in range(n)]  # io_struct.py _normalize_rid
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != n:
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing "
                             f"({len(rid)} rids, {n} rows).")
        rids = list(rid)
    else:
        raise BadRequest("The rid should be a string or a list of strings.")
    if len(set(rids)) != len(rids):
        dup = sorted({r for r in rids if rids.count(r) > 1})
        raise BadRequest(f"Duplicate request IDs detected within the request: {dup}")
    rows, specs = [], []
    for i, (row, sp) in enumerate(zip(batch, sps)):
        key = "sampling_params" if not isinstance(body.get("sampling_params"), list) else f"sampling_params[{i}]"
        params, ex = parse_sampling_params(sp, key, vocab_size, rng, decodes_text=decodes_text)
        if len(row) >= context_length:
            raise BadRequest(f"The input ({len(row)} tokens) is longer than the model's context length "
                             f"({context_length} tokens).")
        if len(row) + ex["max_new_tokens"] > context_length:
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_length} "
                             f"tokens: {len(row)} input tokens + max_new_tokens={ex['max_new_tokens']}; lower "
                             "max_new_tokens or the prompt length")
        rows.append(ServerRow(key=rids[i], prompt_ids=tuple(row), params=params, prompt_seed=0,
                              routes_start=routes_start, sampling_seed=ex["sampling_seed"],
                              ignore_eos=ex["ignore_eos"]))
        specs.append(RowSpec(rids[i], ex["max_new_tokens"], bool(ret_lp[i]), ex["no_stop_trim"],
                             ex["skip_special_tokens"], ex["spaces_between_special_tokens"], routed,
                             ex["stream_interval"]))
    return single, rows, specs


