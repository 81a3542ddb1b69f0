"""Continuous batching of rows over a transformers causal LM: the HF engine's generation loop
(:class:`~dapo_megatron.rollout.engines.hf_engine.HFEngine` owns the model, its memory and its
weights; this module samples).

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

Batching (continuous): rows are admitted into one running batch whenever :meth:`RowBatch.poll`
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
continues where it stopped (the generator is the engine's: ``generator_of``).

Design: docs/design.md §2.3 and §3.7 (streamed rounds).
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Optional, Sequence

import torch
from transformers import DynamicCache

from dapo_megatron.rollout.engines.engine import RowRequest, RowResult, match_stop_string
from dapo_megatron.rollout.engines.routes import HFRouteRecorder, compact_routes, concat_routes, num_route_tokens


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


class RowBatch:
    """The rows of one model in flight: queued (:meth:`submit`), admitted and decoded together at
    every :meth:`poll`, stopped by :meth:`abort` (module docstring).

    Args:
        model: the transformers causal LM (its own device and dtype; in eval mode).
        device: the model's device (the batch's tensors and the generators live there).
        pad_token_id: id written into the left padding (never sampled, never returned).
        vocab_size: rows with an input id outside ``[0, vocab_size)`` are refused.
        routes: routing replay: the recorder of the model's routers, or None (no routes).
        generator_of: ``(RowRequest) -> torch.Generator | None``: a row's generator, already
            advanced past its prefix (the engine's seeding rule).
        stop_ids_of: ``(RowRequest) -> frozenset``: the token ids that end a row.

    Attributes:
        decode: ``decode(ids) -> str`` for rows with stop strings (the engine's
            ``set_stop_decoder``); None: such rows are refused.
    """

    def __init__(self, model: torch.nn.Module, *, device: torch.device, pad_token_id: int, vocab_size: int,
                 routes: Optional[HFRouteRecorder], generator_of: Callable[[RowRequest], Optional[torch.Generator]],
                 stop_ids_of: Callable[[RowRequest], frozenset]):
        self.model, self.device, self.pad_token_id, self.vocab_size = model, device, pad_token_id, vocab_size
        self.routes, self.generator_of, self.stop_ids_of = routes, generator_of, stop_ids_of
        self.decode = None
        self.queue: list[RowRequest] = []  # submitted, admitted at the next poll
        self.batch: Optional[_RunningBatch] = None
        # transformers 5.x renamed forward's ``past_key_values`` to ``cache``; support both
        forward_params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"

    def submit(self, rows: Sequence[RowRequest]) -> None:
        """Queue rows; they are admitted into the running batch at the next :meth:`poll`.

        Raises:
            ValueError: a duplicate key, stop strings without :attr:`decode`, a token id outside the
                vocabulary.
        """
        keys = {r.key for r in self.queue} | {row.req.key for row in (self.batch.rows if self.batch else [])
                                               if row.alive}
        for r in rows:
            if r.key in keys:
                raise ValueError(f"HFEngine.submit: row key {r.key!r} is already in flight")
            keys.add(r.key)
            if r.params.stop and self.decode is None:
                raise ValueError(f"HFEngine.submit: row {r.key!r} has stop strings {list(r.params.stop)} but the "
                                 "engine has no decoder to match them: call set_stop_decoder(tokenizer.decode)")
            bad = [t for t in r.prompt_ids + r.prefix_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"HFEngine.submit: row {r.key!r} holds token ids {bad[:5]} outside [0, {self.vocab_size})")
        self.queue.extend(rows)

    @property
    def num_in_flight(self) -> int:
        return len(self.queue) + (sum(1 for row in self.batch.rows if row.alive) if self.batch else 0)

    def poll(self, max_tokens: Optional[int], version: int) -> list[RowResult]:
        """Admit the queued rows, sample up to ``max_tokens`` tokens per row (None: until all rows
        stop) and return the rows that stopped, in the order they stopped (rows stopping at the
        same token in batch order), each with weight ``version``. Run it under
        ``torch.inference_mode()``."""
        finished: list[RowResult] = []
        if self.queue:
            rows, self.queue = self.queue, []
            finished.extend(self._admit(rows, version))
        steps = 0
        while self.batch is not None and (max_tokens is None or steps < max_tokens):
            finished.extend(self._decode_step(version))
            steps += 1
        return finished

    def abort(self, keys: Optional[Iterable], version: int) -> list[RowResult]:
        """Stop every queued and running row (only those whose key is in ``keys``, when given);
        returns each one's tokens so far (``"abort"``; none for a row not yet admitted). Rows
        not named keep going; a stopped row stays in the running batch, never sampled again,
        until the batch is compacted."""
        named = (lambda key: True) if keys is None else set(keys).__contains__
        out = [RowResult(r.key, [], [], "abort", version) for r in self.queue if named(r.key)]
        self.queue = [r for r in self.queue if not named(r.key)]
        if self.batch is not None:
            for row in self.batch.rows:
                if row.alive and named(row.req.key):
                    row.alive = False
                    out.append(RowResult(row.req.key, list(row.tokens), list(row.logprobs), "abort",
                                         version, self.row_routes(row)))
            if not any(row.alive for row in self.batch.rows):
                self.batch = None
        return out

    def running_rows(self) -> dict:
        """``{key: (tokens, logprobs)}`` of every row being decoded (admitted, not stopped): what
        each sampled so far (the engine's own lists: read them, do not keep them)."""
        if self.batch is None:
            return {}
        return {row.req.key: (row.tokens, row.logprobs) for row in self.batch.rows if row.alive}

    def row_routes(self, row: _Row) -> Optional[torch.Tensor]:
        """The row's routes over ``prompt + prefix + tokens`` minus the last token, from position
        ``row.req.routes_start`` on (compact), or None when routes are not recorded."""
        if self.routes is None:
            return None
        n = num_route_tokens(len(row.req.prompt_ids), len(row.req.prefix_ids) + len(row.tokens))
        with torch.inference_mode(False):  # a plain tensor: the actor indexes with it under autograd
            return compact_routes(concat_routes(row.routes)[row.req.routes_start:].clone(),
                                  num_tokens=max(0, n - row.req.routes_start), num_layers=self.routes.num_layers,
                                  topk=self.routes.topk, num_experts=self.routes.num_experts,
                                  what=f"HFEngine routes of row {row.req.key!r}")

    def _admit(self, reqs: list[RowRequest], version: int) -> list[RowResult]:
        """Prefill ``reqs`` (each distinct input once), merge them into the running batch;
        returns the rows that have nothing left to sample (a prefix that already ends the
        response)."""
        done, rows = [], []
        for r in reqs:
            stops = self.stop_ids_of(r)
            if r.budget <= 0 or (r.prefix_ids and r.prefix_ids[-1] in stops):
                done.append(RowResult(r.key, [], [], "length" if r.budget <= 0 else "stop", version))
            else:
                rows.append(_Row(r, self.generator_of(r), stops))
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
        if self.routes is not None:  # every input token's experts: [n_distinct, max_len, L, K], left-padded
            routes = self.routes.take(len(distinct), max_len)
            for row in rows:
                x = row.req.prompt_ids + row.req.prefix_ids
                row.routes = [routes[inputs[x], max_len - len(x):]]
        expand = torch.tensor([inputs[row.req.prompt_ids + row.req.prefix_ids] for row in rows], device=dev)
        if expand.numel() != len(distinct) or not bool((expand == torch.arange(len(distinct), device=dev)).all()):
            cache.batch_select_indices(expand)
            logits, attn, pos = logits[expand], attn[expand], pos[expand]
        new = _RunningBatch(rows, cache, attn, pos[:, -1] + 1, logits)
        self.batch = new if self.batch is None else self.batch.merge(new)
        return done

    def _decode_step(self, version: int) -> list[RowResult]:
        """Sample one token for every row of the running batch, record it, and run the model
        on the sampled tokens of the rows still going. Returns the rows that stopped."""
        b = self.batch
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
            elif row.req.params.stop and match_stop_string(row.req.params.stop, row.tokens, self.decode) is not None:
                reason = "stop"
            elif len(row.tokens) >= row.req.budget:
                reason = "length"
            else:
                continue
            row.alive = False
            finished.append(RowResult(row.req.key, row.tokens, row.logprobs, reason, version,
                                      self.row_routes(row)))
        alive = [row.alive for row in b.rows]
        if not any(alive):
            self.batch = None
            return finished
        if alive.count(False) * 4 >= len(alive):  # compact the batch when it pays
            keep = torch.tensor([i for i, a in enumerate(alive) if a], device=self.device)
            b.select(keep)
            tok = tok[keep]
        b.attn = torch.cat([b.attn, b.attn.new_ones((b.attn.shape[0], 1))], dim=-1)
        out = self.model(input_ids=tok[:, None], attention_mask=b.attn, position_ids=b.next_pos[:, None],
                         use_cache=True, **{self._cache_kw: b.cache})
        b.logits = out.logits[:, -1, :]
        if self.routes is not None:  # the experts of the token each row just sampled
            routes = self.routes.take(len(b.rows), 1)
            for i, row in enumerate(b.rows):
                if row.alive:
                    row.routes.append(routes[i])
        b.next_pos = b.next_pos + 1
        return finished
