"""Rollout engine on Hugging Face transformers: the CPU default and a small-GPU option.

Own sampling loop over ``model(input_ids, attention_mask, position_ids, past_key_values)``
(transformers 5.x), not ``model.generate``: we need the logprob of each sampled token under
exactly the distribution it was sampled from.

Per decode step, for every unfinished row:
  1. ``z = logits[:, -1, :].float() / temperature``
  2. top-k: keep the k largest ``z`` (ties at the k-th value kept), others ``-inf``
  3. top-p: keep the smallest set of most-likely tokens whose mass reaches ``top_p``
  4. sample ``y ~ softmax(z)`` with a ``torch.Generator`` seeded from ``params.seed``
     (one per response, inverse-CDF: :func:`sample_rows`)
  5. record ``log_softmax(z)[y]``

With ``top_p == 1`` and ``top_k == -1`` step 5 is ``log_softmax(logits / T)[y]``, which is
what the actor recomputes (``old_logprobs``). With top-p / top-k the rollout logprobs are
those of the truncated, renormalised distribution and are >= the actor's: the
rollout-vs-actor mismatch metric then measures that truncation, not a bug.

Batching (continuous): rows are admitted into one running batch whenever :meth:`HFEngine.poll`
is called, and leave it as they stop. Admitted rows are left-padded and prefilled together,
each distinct input once (the ``n`` rows of a fresh prompt share one prefill; a partial
rollout continued after its prefix has its own), and their KV cache is merged into the
running one: every layer's ``[B, heads, T, head_dim]`` key and value tensors (transformers
``cache_utils.DynamicLayer``, grown by concatenation along ``T``) are left-padded with zeros
to a common ``T`` under a zero attention mask and concatenated along ``B``. Rows that
finished are dropped from the batch (``Cache.batch_select_indices``) when at least a quarter
of it is done. Position ids come from the attention mask, so left padding does not shift
RoPE positions: a padded row produces the same logits as the unpadded prompt.

Why continuous batching and not sub-batch waves: the streaming rollout polls every engine
for ``rollout.stream_poll_tokens`` tokens per round; with admission at every poll a row's
completion round depends only on its own length and on the round it was submitted in, not on
which other rows share its engine, so the replicated keep/stop decisions are the same at any
TP/PP/DP layout. A wave would hold new rows back until the slowest row of the previous wave
stopped. On CPU the decode step costs about rows × GEMM work, so the merge (one copy of the
cache per admission) is cheap next to it.

Seeds: row ``j`` of a prompt draws from its own ``torch.Generator`` seeded with
``sample_seed(seed, prompt_seed, j)``, one float64 uniform per sampled token; a partial
rollout continued after ``k`` tokens first draws ``k`` uniforms, so its random stream
continues where it stopped.

Design: docs/design.md §2.3 and §3.7 (streamed rounds).
"""

from __future__ import annotations

import inspect
import os
from typing import Iterable, Optional, Sequence, Union

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from dapo_megatron.platform.cpu_compat import native_torch
from dapo_megatron.rollout.engines.engine import (
    Completion,
    GenerationOutput,
    ParamSpec,
    RolloutEngine,
    RowRequest,
    RowResult,
    SamplingParams,
    checkpoint_parameters,
    match_stop_string,
    resolve_prompt_seeds,
    specs_from_module,
    validate_prompt_ids,
)
from dapo_megatron.rollout.engines.routes import HFRouteRecorder, compact_routes, concat_routes, num_route_tokens
from dapo_megatron.rollout.engines.verify import Timer, as_sent, checksum_tensor, digest_dtype, read_checksums


def process_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p to next-token logits.

    Args:
        logits: ``[batch, vocab]`` float tensor.
        temperature: > 0; logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 = off. The most likely token is always kept.
        top_k: -1 = off, else keep the k largest (all tokens tied with the k-th are kept).

    Returns:
        ``[batch, vocab]`` float32 logits with removed tokens set to ``-inf``;
        ``log_softmax`` of it is the sampling distribution. (Order as in SGLang / vLLM:
        temperature, top-k, top-p.)
    """
    z = logits.float() / temperature
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        remove_sorted = mass_before >= top_p  # first token has mass_before 0 → always kept
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        z = z.masked_fill(remove, float("-inf"))
    return z


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Draw one token per row, row ``b`` using only ``generators[b]`` (inverse-CDF sampling).

    Each row consumes exactly one float64 uniform ``u ~ U[0, 1)`` from its own generator and
    returns the token ``i`` with ``cdf[i - 1] <= u * cdf[-1] < cdf[i]`` (``cdf`` = float64
    cumulative sum of the row), i.e. ``P(i) = probs[b, i] / sum(probs[b])``; a token of
    probability 0 is never returned. ``torch.multinomial(probs[b], 1, generator=g)`` draws
    from the same distribution but consumes ``V`` exponentials per row (49,152 for
    SmolLM2), a visible share of CPU generation time (benchmarks/README.md). A row's token depends only on its own
    probabilities and generator state, never on the other rows.

    Args:
        probs: ``[rows, V]`` non-negative float probabilities (unnormalised is fine), each
            row with a positive sum.
        generators: ``rows`` generators on ``probs.device``.

    Returns:
        int64 ``[rows]`` token ids on ``probs.device``.

    Raises:
        ValueError: the number of generators differs from the number of rows.
    """
    if len(generators) != probs.shape[0]:
        raise ValueError(f"sample_rows got {len(generators)} generators for {probs.shape[0]} rows (one per row)")
    u = torch.cat([torch.rand(1, dtype=torch.float64, device=probs.device, generator=g) for g in generators])
    cdf = probs.double().cumsum_(-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return tok.clamp_(max=probs.shape[-1] - 1)  # u * total < total already; guards rounding only


def _eos_ids(model) -> set[int]:
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


class _Row:
    """One row of the running batch: its request, generator, stop ids and what it sampled."""

    __slots__ = ("req", "generator", "stops", "tokens", "logprobs", "alive", "sampling", "routes")

    def __init__(self, req: RowRequest, generator: Optional[torch.Generator], stops: frozenset):
        self.req, self.generator, self.stops = req, generator, stops
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routes: list[torch.Tensor] = []  # routing replay: [n, L, K] chunks of the tokens forwarded
        self.alive = True
        self.sampling = (req.params.temperature, req.params.top_p, req.params.top_k)


class _RunningBatch:
    """The rows being decoded together: their KV cache, attention mask ``[B, T]`` (1 = real
    token), the position of each row's next input token ``[B]`` and its pending logits ``[B, V]``."""

    def __init__(self, rows: list[_Row], cache, attn: torch.Tensor, next_pos: torch.Tensor, logits: torch.Tensor):
        self.rows, self.cache, self.attn, self.next_pos, self.logits = rows, cache, attn, next_pos, logits

    @property
    def mixed_params(self) -> bool:
        """Rows with different temperature / top-p / top-k (processed row by row)."""
        return len({row.sampling for row in self.rows}) > 1

    def select(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (indices into the batch) and drop the others."""
        self.cache.batch_select_indices(keep)
        idx = keep.tolist()
        self.rows = [self.rows[i] for i in idx]
        self.attn, self.next_pos, self.logits = self.attn[keep], self.next_pos[keep], self.logits[keep]

    def merge(self, other: "_RunningBatch") -> "_RunningBatch":
        """This batch followed by ``other``, both left-padded to the longer one's cache length."""
        ta, tb = self.attn.shape[1], other.attn.shape[1]
        t = max(ta, tb)
        for la, lb in zip(self.cache.layers, other.cache.layers):
            if type(la).__name__ != "DynamicLayer" or type(lb).__name__ != "DynamicLayer":
                raise NotImplementedError(f"HFEngine continuous batching merges full-attention caches only "
                                          f"(cache_utils.DynamicLayer), not {type(la).__name__}")
            la.keys = torch.cat([_left_pad(la.keys, t - ta, dim=-2), _left_pad(lb.keys, t - tb, dim=-2)], dim=0)
            la.values = torch.cat([_left_pad(la.values, t - ta, dim=-2), _left_pad(lb.values, t - tb, dim=-2)], dim=0)
        self.attn = torch.cat([_left_pad(self.attn, t - ta, dim=-1), _left_pad(other.attn, t - tb, dim=-1)], dim=0)
        self.rows = self.rows + other.rows
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])
        return self


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` with ``width`` zeros prepended along ``dim``."""
    if width == 0:
        return x
    shape = list(x.shape)
    shape[dim] = width
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class HFEngine(RolloutEngine):
    """Rollout engine over a transformers causal LM.

    Args:
        model_or_path: a loaded ``PreTrainedModel`` (used as is, moved to ``device``/``dtype``),
            or a directory / hub-style path for ``AutoModelForCausalLM.from_pretrained``.
            A path to a ``.gguf`` file (or ``gguf_file=``) loads the GGUF de-quantised.
        dtype: parameter dtype (``torch.float32`` on CPU; ``torch.bfloat16`` on GPU).
        device: ``"cpu"`` or a CUDA device.
        gguf_file: file name inside ``model_or_path`` for GGUF checkpoints.
        eos_token_ids: token ids that end a response; default: the model's
            ``generation_config`` / ``config`` ``eos_token_id``.
        pad_token_id: id written into the padding of the batch (never sampled, never
            returned); default: the first EOS id, else 0.
        num_threads: ``torch.set_num_threads`` for CPU generation; None leaves it.
        record_routes: routing replay: record the experts every forwarded token was routed to
            (forward hooks on the routers, :class:`~dapo_megatron.rollout.engines.routes.HFRouteRecorder`:
            the prefill's routes of the prompt and prefix, then one row per decode step) and
            return them as ``RowResult.routes`` / ``Completion.routes``, ``[P + R - 1, L, K]``.

    Raises:
        ValueError: no EOS id is known and none is given; ``record_routes`` on a dense model.
    """

    def __init__(
        self,
        model_or_path: Union[str, os.PathLike, torch.nn.Module],
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        *,
        gguf_file: Optional[str] = None,
        eos_token_ids: Optional[list[int]] = None,
        pad_token_id: Optional[int] = None,
        num_threads: Optional[int] = None,
        record_routes: bool = False,
    ):
        super().__init__()
        self.device = torch.device(device)
        self.dtype = dtype
        if isinstance(model_or_path, torch.nn.Module):
            model = model_or_path
        else:
            path = os.fspath(model_or_path)
            if gguf_file is None and path.endswith(".gguf"):
                path, gguf_file = os.path.split(path)
            kwargs = {"gguf_file": gguf_file} if gguf_file else {}
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        eos = set(eos_token_ids) if eos_token_ids is not None else _eos_ids(self.model)
        if not eos:
            raise ValueError("HFEngine: the model config names no eos_token_id; pass eos_token_ids=[...]")
        self.eos_token_ids = frozenset(int(t) for t in eos)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else min(self.eos_token_ids))
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.num_threads = num_threads
        self._asleep = False
        self._queue: list[RowRequest] = []  # submitted, admitted at the next poll
        self._batch: Optional[_RunningBatch] = None
        # transformers 5.x renamed forward's ``past_key_values`` to ``cache``; support both
        forward_params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        self._routes: Optional[HFRouteRecorder] = HFRouteRecorder(self.model) if record_routes else None
        self._loaded_sums: dict[str, Optional[torch.Tensor]] = {}  # the last sync's receiver checksums
        self._stop_decode = None  # token ids -> text, for rows with stop strings (set_stop_decoder)

    # ---- generation ---------------------------------------------------------------
    supports_async = True

    def set_stop_decoder(self, decode) -> None:
        """Give the engine ``decode(ids) -> str`` (the tokenizer's, special tokens kept), which rows
        with stop strings (``SamplingParams.stop``) need: after every sampled token the text of the
        row's last few new tokens (4 per character of the longest stop string, + 4: a token of
        byte-fallback text may hold a quarter of a character) is searched for each stop string, and
        the first token that completes one ends the row with ``"stop"``, kept. An occurrence that
        straddles the row's prefix and its first new token is not seen (SGLang's check,
        ``Req._check_str_based_finish``, decodes the output's tail only, likewise)."""
        self._stop_decode = decode

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """Sample ``params.n`` responses per prompt; see the module docstring for the exact
        distribution. Returns ``outputs[i][j]`` = j-th :class:`Completion` of prompt i.

        Reproducible: every response has its own ``torch.Generator`` seeded with
        :func:`~dapo_megatron.rollout.engines.engine.sample_seed` ``(params.seed, prompt_seeds[i], j)``,
        so a response depends on its prompt, its seed and the weights, not on the rest of
        the batch (up to the last bits of batched matmuls, which can flip a near-tie).

        Raises:
            ValueError: malformed ``prompt_ids`` (empty prompt, id outside the vocabulary).
            RuntimeError: the engine is asleep (call ``wake_up()``) or has rows in flight.
            InvalidWeightsError: a weight sync is unfinished or was aborted.
        """
        self._require_idle("generate")
        validate_prompt_ids(prompt_ids, self.vocab_size)
        seeds = resolve_prompt_seeds(prompt_ids, prompt_seeds)
        self.submit([RowRequest((i, j), p, params, ps, j) for i, (p, ps) in enumerate(zip(prompt_ids, seeds))
                     for j in range(params.n)])
        done = {r.key: r for r in self.poll()}
        return [[Completion(done[(i, j)].response_ids, done[(i, j)].logprobs, done[(i, j)].finish_reason,
                            done[(i, j)].routes) for j in range(params.n)] for i in range(len(prompt_ids))]

    def submit(self, rows: Sequence[RowRequest]) -> None:
        """Queue rows; they are admitted into the running batch at the next :meth:`poll`.

        Raises:
            ValueError: a duplicate key, a token id outside the vocabulary.
            RuntimeError: the engine is asleep.
        """
        if self._asleep:
            raise RuntimeError("HFEngine.submit called while asleep; call wake_up() first")
        self._require_valid_weights()
        keys = {r.key for r in self._queue} | {row.req.key for row in (self._batch.rows if self._batch else [])
                                               if row.alive}
        for r in rows:
            if r.key in keys:
                raise ValueError(f"HFEngine.submit: row key {r.key!r} is already in flight")
            keys.add(r.key)
            if r.params.stop and self._stop_decode is None:
                raise ValueError(f"HFEngine.submit: row {r.key!r} has stop strings {list(r.params.stop)} but the "
                                 "engine has no decoder to match them: call set_stop_decoder(tokenizer.decode)")
            bad = [t for t in r.prompt_ids + r.prefix_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"HFEngine.submit: row {r.key!r} holds token ids {bad[:5]} outside [0, {self.vocab_size})")
        self._queue.extend(rows)

    @property
    def num_in_flight(self) -> int:
        return len(self._queue) + (sum(1 for row in self._batch.rows if row.alive) if self._batch else 0)

    @torch.inference_mode()
    def poll(self, max_tokens: Optional[int] = None) -> list[RowResult]:
        """Admit the queued rows, sample up to ``max_tokens`` tokens per row (None: until all
        rows stop) and return the rows that stopped, in the order they stopped (rows stopping
        at the same token in batch order).

        Raises:
            RuntimeError: the engine is asleep. InvalidWeightsError: invalid weights.
        """
        if self._asleep:
            raise RuntimeError("HFEngine.poll called while asleep; call wake_up() first")
        self._require_valid_weights()
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1 or None")
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        finished: list[RowResult] = []
        if self._queue:
            rows, self._queue = self._queue, []
            finished.extend(self._admit(rows))
        steps = 0
        while self._batch is not None and (max_tokens is None or steps < max_tokens):
            finished.extend(self._decode_step())
            steps += 1
        return finished

    def abort(self, keys: Optional[Iterable] = None) -> list[RowResult]:
        """Stop every queued and running row (only those whose key is in ``keys``, when given);
        returns each one's tokens so far (``"abort"``; none for a row not yet admitted). Rows
        not named keep going; a stopped row stays in the running batch, never sampled again,
        until the batch is compacted."""
        if keys is None:
            out = [RowResult(r.key, [], [], "abort", self.weight_version) for r in self._queue]
            if self._batch is not None:
                out.extend(RowResult(row.req.key, list(row.tokens), list(row.logprobs), "abort", self.weight_version,
                                     self._row_routes(row)) for row in self._batch.rows if row.alive)
            self._queue, self._batch = [], None
            return out
        keys = set(keys)
        out = [RowResult(r.key, [], [], "abort", self.weight_version) for r in self._queue if r.key in keys]
        self._queue = [r for r in self._queue if r.key not in keys]
        if self._batch is not None:
            for row in self._batch.rows:
                if row.alive and row.req.key in keys:
                    row.alive = False
                    out.append(RowResult(row.req.key, list(row.tokens), list(row.logprobs), "abort",
                                         self.weight_version, self._row_routes(row)))
            if not any(row.alive for row in self._batch.rows):
                self._batch = None
        return out

    def running_rows(self) -> dict:
        """``{key: (tokens, logprobs)}`` of every row being decoded (admitted, not stopped): what
        each sampled so far (the engine's own lists: read them, do not keep them)."""
        if self._batch is None:
            return {}
        return {row.req.key: (row.tokens, row.logprobs) for row in self._batch.rows if row.alive}

    @property
    def records_routes(self) -> bool:
        """Whether the engine records routes (``record_routes``)."""
        return self._routes is not None

    # ---- the running batch ---------------------------------------------------------
    def _row_routes(self, row: _Row) -> Optional[torch.Tensor]:
        """The row's routes over ``prompt + prefix + tokens`` minus the last token, from position
        ``row.req.routes_start`` on (compact), or None when routes are not recorded."""
        if self._routes is None:
            return None
        n = num_route_tokens(len(row.req.prompt_ids), len(row.req.prefix_ids) + len(row.tokens))
        with torch.inference_mode(False):  # a plain tensor: the actor indexes with it under autograd
            return compact_routes(concat_routes(row.routes)[row.req.routes_start:].clone(),
                                  num_tokens=max(0, n - row.req.routes_start), num_layers=self._routes.num_layers,
                                  topk=self._routes.topk, num_experts=self._routes.num_experts,
                                  what=f"HFEngine routes of row {row.req.key!r}")

    def _generator(self, req: RowRequest) -> Optional[torch.Generator]:
        """The row's generator, advanced past the draws of its prefix tokens (one per token)."""
        if req.seed is None:
            return None
        g = torch.Generator(device=self.device).manual_seed(req.seed)
        for _ in range(len(req.prefix_ids)):
            torch.rand(1, dtype=torch.float64, device=self.device, generator=g)
        return g

    def _stop_ids(self, req: RowRequest) -> frozenset:
        """Token ids that end the row: the model's EOS ids and the row's ``stop_token_ids``."""
        return self.eos_token_ids | set(req.params.stop_token_ids)

    def matched_stop_string(self, stops: Sequence[str], tokens: Sequence[int]) -> Optional[str]:
        """The first of ``stops`` found in the text of the last few of ``tokens`` (a row's new
        tokens; the window and decoder of :meth:`set_stop_decoder`), else None. The one rule of
        stop strings: the engine ends a row on it, ``dapo-rollout-server`` names the match with it.
        An earlier occurrence inside the window would have ended the row already, so any
        occurrence is the last token's."""
        return match_stop_string(stops, tokens, self._stop_decode)

    def _ends_on_stop_string(self, row: _Row) -> bool:
        """Whether the row's last token completes one of its stop strings (:meth:`set_stop_decoder`)."""
        return self.matched_stop_string(row.req.params.stop, row.tokens) is not None

    def _admit(self, reqs: list[RowRequest]) -> list[RowResult]:
        """Prefill ``reqs`` (each distinct input once), merge them into the running batch;
        returns the rows that have nothing left to sample (a prefix that already ends the
        response)."""
        done, rows = [], []
        for r in reqs:
            stops = self._stop_ids(r)
            if r.budget <= 0 or (r.prefix_ids and r.prefix_ids[-1] in stops):
                done.append(RowResult(r.key, [], [], "length" if r.budget <= 0 else "stop", self.weight_version))
            else:
                rows.append(_Row(r, self._generator(r), stops))
        if not rows:
            return done
        dev = self.device
        inputs: dict[tuple[int, ...], int] = {}
        for row in rows:
            inputs.setdefault(row.req.prompt_ids + row.req.prefix_ids, len(inputs))
        distinct = list(inputs)
        max_len = max(len(x) for x in distinct)
        input_ids = torch.full((len(distinct), max_len), self.pad_token_id, dtype=torch.long, device=dev)
        attn = torch.zeros((len(distinct), max_len), dtype=torch.long, device=dev)
        for i, x in enumerate(distinct):
            input_ids[i, max_len - len(x):] = torch.tensor(x, dtype=torch.long, device=dev)
            attn[i, max_len - len(x):] = 1
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})  # the cache is filled in place
        logits = out.logits[:, -1, :]
        if self._routes is not None:  # every input token's experts: [n_distinct, max_len, L, K], left-padded
            routes = self._routes.take(len(distinct), max_len)
            for row in rows:
                x = row.req.prompt_ids + row.req.prefix_ids
                row.routes = [routes[inputs[x], max_len - len(x):]]
        expand = torch.tensor([inputs[row.req.prompt_ids + row.req.prefix_ids] for row in rows], device=dev)
        if expand.numel() != len(distinct) or not bool((expand == torch.arange(len(distinct), device=dev)).all()):
            cache.batch_select_indices(expand)
            logits, attn, pos = logits[expand], attn[expand], pos[expand]
        new = _RunningBatch(rows, cache, attn, pos[:, -1] + 1, logits)
        self._batch = new if self._batch is None else self._batch.merge(new)
        return done

    def _decode_step(self) -> list[RowResult]:
        """Sample one token for every row of the running batch, record it, and run the model
        on the sampled tokens of the rows still going. Returns the rows that stopped."""
        b = self._batch
        z = torch.stack([process_logits(b.logits[i:i + 1], row.req.params.temperature, row.req.params.top_p,
                                        row.req.params.top_k)[0] for i, row in enumerate(b.rows)]) \
            if b.mixed_params else process_logits(b.logits, *b.rows[0].sampling)
        logp_all = torch.log_softmax(z, dim=-1)
        probs = logp_all.exp()
        gens = [row.generator for row in b.rows]
        if any(g is None for g in gens):
            tok = torch.multinomial(probs, 1).squeeze(-1)
        else:  # each row draws from its own stream (finished rows draw too; they are never read again)
            tok = sample_rows(probs, gens)
        tok_logp = logp_all.gather(-1, tok[:, None]).squeeze(-1)
        tok_cpu, tok_logp_cpu = tok.tolist(), tok_logp.float().tolist()
        finished = []
        for i, row in enumerate(b.rows):
            if not row.alive:
                continue
            row.tokens.append(tok_cpu[i])
            row.logprobs.append(tok_logp_cpu[i])
            if tok_cpu[i] in row.stops:
                reason = "stop"
            elif row.req.params.stop and self._ends_on_stop_string(row):
                reason = "stop"
            elif len(row.tokens) >= row.req.budget:
                reason = "length"
            else:
                continue
            row.alive = False
            finished.append(RowResult(row.req.key, row.tokens, row.logprobs, reason, self.weight_version,
                                      self._row_routes(row)))
        alive = [row.alive for row in b.rows]
        if not any(alive):
            self._batch = None
            return finished
        if alive.count(False) * 4 >= len(alive):  # compact the batch when it pays
            keep = torch.tensor([i for i, a in enumerate(alive) if a], device=self.device)
            b.select(keep)
            tok = tok[keep]
        b.attn = torch.cat([b.attn, b.attn.new_ones((b.attn.shape[0], 1))], dim=-1)
        out = self.model(input_ids=tok[:, None], attention_mask=b.attn, position_ids=b.next_pos[:, None],
                         use_cache=True, **{self._cache_kw: b.cache})
        b.logits = out.logits[:, -1, :]
        if self._routes is not None:  # the experts of the token each row just sampled
            routes = self._routes.take(len(b.rows), 1)
            for i, row in enumerate(b.rows):
                if row.alive:
                    row.routes.append(routes[i])
        b.next_pos = b.next_pos + 1
        return finished

    # ---- memory -------------------------------------------------------------------
    def sleep(self, keep_weights: bool = False) -> None:
        """Colocated mode: on CUDA, move the weights to CPU (unless ``keep_weights``) and
        ``torch.cuda.empty_cache()`` so the actor can use the memory (the KV cache lives
        only inside ``generate``). The weights are kept either way (:attr:`weights_valid`
        is unchanged). On CPU there is nothing to free: only the asleep flag is set."""
        if self._asleep:
            return
        self._require_idle("sleep")
        if self.device.type == "cuda":
            if not keep_weights:
                self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake_up(self) -> None:
        """Move the weights back to ``device`` (CUDA); weights are those of the last sync."""
        if not self._asleep:
            return
        if self.device.type == "cuda":
            self.model.to(self.device)  # a no-op when the weights stayed (keep_weights)
        self._asleep = False

    @property
    def is_asleep(self) -> bool:
        return self._asleep

    # ---- weight sync --------------------------------------------------------------
    def _param_specs(self) -> tuple[dict[str, ParamSpec], dict[str, str]]:
        """Unique parameters by first name; the tied ``lm_head.weight`` is an alias."""
        return specs_from_module(self.model)

    supports_score = True
    copies_on_load = True  # _load_stream: params[name].copy_(tensor), then the tensor is dropped

    @torch.no_grad()
    def score(self, ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
        """float32 CPU logprobs of ``ids[1:]``, each given the ids before it (one teacher-forced
        forward at ``temperature``): the weight probe's engine side. Generation state is untouched
        (no row, no cache, no draw; the route recorder's last calls are cleared)."""
        self._require_valid_weights()
        x = torch.tensor([list(ids)], device=self.device)
        logits = self.model(input_ids=x).logits[0, :-1].float() / temperature
        if self._routes is not None:
            self._routes.clear()
        return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].cpu()

    def _loaded_checksums(self, names: list[str], dtype, readback_elements=None) -> dict[str, Optional[int]]:
        """The checksums :meth:`_load_stream` took of each checked (whole: in process, nothing is read
        back, and the rollout's digest for this engine has ``readback_elements`` None) tensor right after loading it,
        while in cache, from the parameter looked up by checkpoint name in a map of its own, not
        the one the load wrote through (a wrong load map leaves that parameter without the sent
        bytes); None for one never loaded. A tensor left out could not be compared (a narrower
        engine dtype)."""
        held = read_checksums({n: v for n, v in self._loaded_sums.items() if v is not None})  # one host read
        out: dict[str, Optional[int]] = {}
        for n in names:
            if n not in self._loaded_sums:
                out[n] = None  # checked, sent, never loaded
            elif self._loaded_sums[n] is not None:
                out[n] = held[n]
        return out

    @torch.no_grad()
    def _load_stream(self, named_tensors) -> None:
        """Each tensor is copied into its parameter as it arrives: an in-process engine needs no
        bucket, and holding none lets the bridge reuse its bucket memory
        (:func:`dapo_megatron.bridge.iter_hf_weights`)."""
        # checkpoint names (an MoE model's experts are views into its fused expert parameters)
        pairs = checkpoint_parameters(self.model)  # one module traversal (~1 ms for an 8-layer MoE) for both maps
        params = dict(pairs)
        digest = self._sync_digest
        held = dict(pairs) if digest is not None else {}  # the verifier's own map
        dtype = digest_dtype(digest) if digest is not None else None
        self._loaded_sums = {}
        # the stream (and the bridge's generator it drives) names no CUDA device: without cpu_compat's
        # mode, a few hundred torch calls per sync skip its Python (a no-op off CPU)
        with native_torch():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)  # casts dtype and moves device (also while asleep on CPU)
                del tensor  # before the next one is produced
                if digest is not None and name in digest.sums:  # this sync checks it (the trailer came first)
                    with Timer(digest):
                        loaded = as_sent(held[name], dtype) if name in held else None
                        self._loaded_sums[name] = None if loaded is None else checksum_tensor(loaded)
