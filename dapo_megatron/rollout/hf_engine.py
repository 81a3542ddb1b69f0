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

Batching: prompts are left-padded and prefilled once each; the KV cache is then repeated
``n`` times (``Cache.batch_repeat_interleave``) so the ``n`` samples of a prompt share
one prefill. Rows that finished are dropped from the batch (``Cache.batch_select_indices``)
when at least a quarter of the batch is done, which shortens the tail of long generations.
Position ids are computed from the attention mask so that left padding does not shift
RoPE positions: a padded row produces the same logits as the unpadded prompt.
"""

from __future__ import annotations

import inspect
import os
from typing import Optional, Sequence, Union

import torch

from dapo_megatron.rollout.engine import (
    Completion,
    GenerationOutput,
    ParamSpec,
    RolloutEngine,
    SamplingParams,
    resolve_prompt_seeds,
    sample_seed,
    specs_from_module,
    validate_prompt_ids,
)


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
        update_bucket_mb: bucket size (MiB) of ``update_weights``.
        num_threads: ``torch.set_num_threads`` for CPU generation; None leaves it.

    Raises:
        ValueError: no EOS id is known and none is given.
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
        update_bucket_mb: int = 256,
        num_threads: Optional[int] = None,
    ):
        super().__init__()
        self.device = torch.device(device)
        self.dtype = dtype
        if isinstance(model_or_path, torch.nn.Module):
            model = model_or_path
        else:
            from transformers import AutoModelForCausalLM

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
        self.update_bucket_bytes = int(update_bucket_mb) * 2**20
        self.num_threads = num_threads
        self._asleep = False
        # transformers 5.x renamed forward's ``past_key_values`` to ``cache``; support both
        forward_params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"

    # ---- generation ---------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """Sample ``params.n`` responses per prompt; see the module docstring for the exact
        distribution. Returns ``outputs[i][j]`` = j-th :class:`Completion` of prompt i.

        Reproducible: every response has its own ``torch.Generator`` seeded with
        :func:`~dapo_megatron.rollout.engine.sample_seed` ``(params.seed, prompt_seeds[i], j)``,
        so a response depends on its prompt, its seed and the weights, not on the rest of
        the batch (up to the last bits of batched matmuls, which can flip a near-tie).

        Raises:
            ValueError: malformed ``prompt_ids`` (empty prompt, id outside the vocabulary).
            RuntimeError: the engine is asleep (call ``wake_up()``).
            InvalidWeightsError: a weight sync is unfinished or was aborted.
        """
        if self._asleep:
            raise RuntimeError("HFEngine.generate called while asleep; call wake_up() first")
        self._require_valid_weights()
        validate_prompt_ids(prompt_ids, self.vocab_size)
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        n, dev = params.n, self.device
        stop_ids = torch.tensor(sorted(self.eos_token_ids | set(params.stop_token_ids)), device=dev)
        seeds = resolve_prompt_seeds(prompt_ids, prompt_seeds)
        gens: Optional[list[torch.Generator]] = None  # one per response row (i * n + j)
        if params.seed is not None:
            gens = [torch.Generator(device=dev).manual_seed(sample_seed(params.seed, ps, j))
                    for ps in seeds for j in range(params.n)]

        # prefill each distinct prompt once, left-padded
        num_prompts = len(prompt_ids)
        max_len = max(len(p) for p in prompt_ids)
        input_ids = torch.full((num_prompts, max_len), self.pad_token_id, dtype=torch.long, device=dev)
        attn = torch.zeros((num_prompts, max_len), dtype=torch.long, device=dev)
        for i, p in enumerate(prompt_ids):
            input_ids[i, max_len - len(p):] = torch.tensor(p, dtype=torch.long, device=dev)
            attn[i, max_len - len(p):] = 1
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})  # the cache is filled in place
        logits = out.logits[:, -1, :]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            attn = attn.repeat_interleave(n, dim=0)
            pos = pos.repeat_interleave(n, dim=0)
        next_pos = pos[:, -1] + 1

        num_rows = num_prompts * n
        tokens = torch.full((num_rows, params.max_new_tokens), self.pad_token_id, dtype=torch.long)
        logps = torch.zeros((num_rows, params.max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(num_rows, dtype=torch.long)
        stopped = torch.zeros(num_rows, dtype=torch.bool)
        active = torch.arange(num_rows)  # original row index of each batch row
        alive = torch.ones(num_rows, dtype=torch.bool)  # batch row still generating

        for step in range(params.max_new_tokens):
            z = process_logits(logits, params.temperature, params.top_p, params.top_k)
            logp_all = torch.log_softmax(z, dim=-1)
            probs = logp_all.exp()
            if gens is None:
                tok = torch.multinomial(probs, 1).squeeze(-1)
            else:  # each row draws from its own stream (finished rows draw too: streams stay aligned)
                tok = sample_rows(probs, [gens[r] for r in active.tolist()])
            tok_logp = logp_all.gather(-1, tok[:, None]).squeeze(-1)
            tok_cpu, tok_logp_cpu = tok.cpu(), tok_logp.float().cpu()
            rows = active[alive]  # finished rows that are still in the batch record nothing
            tokens[rows, step] = tok_cpu[alive]
            logps[rows, step] = tok_logp_cpu[alive]
            lengths[rows] = step + 1
            hit = torch.isin(tok_cpu, stop_ids.cpu()) & alive
            stopped[active[hit]] = True
            alive &= ~hit
            if step + 1 == params.max_new_tokens or not alive.any():
                break
            if int((~alive).sum()) * 4 >= alive.numel():  # compact the batch when it pays
                keep = alive.nonzero().squeeze(-1)
                keep_dev = keep.to(dev)
                cache.batch_select_indices(keep_dev)
                active, alive = active[keep], alive[keep]
                tok, attn, next_pos = tok[keep_dev], attn[keep_dev], next_pos[keep_dev]
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                             use_cache=True, **{self._cache_kw: cache})
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        results: GenerationOutput = []
        for i in range(num_prompts):
            group = []
            for j in range(n):
                r = i * n + j
                L = int(lengths[r])
                group.append(Completion(tokens[r, :L].tolist(), logps[r, :L].tolist(),
                                        "stop" if bool(stopped[r]) else "length"))
            results.append(group)
        return results

    # ---- memory -------------------------------------------------------------------
    def sleep(self, keep_weights: bool = False) -> None:
        """Colocated mode: on CUDA, move the weights to CPU (unless ``keep_weights``) and
        ``torch.cuda.empty_cache()`` so the actor can use the memory (the KV cache lives
        only inside ``generate``). The weights are kept either way (:attr:`weights_valid`
        is unchanged). On CPU there is nothing to free: only the asleep flag is set."""
        if self._asleep:
            return
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

    @torch.no_grad()
    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in bucket:
            params[name].copy_(tensor)  # casts dtype and moves device (also while asleep on CPU)
