"""Turn a micro-batch of rollout :class:`~dapo_megatron.rollout.types.Sample` s into model inputs.

Two layouts, one :class:`PackedBatch`:

- **Packed (THD)**, the default: the ``n`` sequences ``prompt + response`` are
  concatenated into one row of ``T = sum_i (P_i + R_i)`` tokens (plus tail padding,
  see ``pad_to_multiple_of``). ``position_ids`` restart at 0 for every sequence and
  ``cu_seqlens = [0, L_0, L_0 + L_1, ...]`` (int32, ``[n + 1]``). Attention must not
  cross sequences:

  * on GPU with the Transformer Engine spec, pass :attr:`PackedBatch.packed_seq_params`
    (``megatron.core.packed_seq_params.PackedSeqParams(qkv_format="thd", ...)``);
  * on CPU with the local spec, megatron-core's ``DotProductAttention``
    asserts ``packed_seq_params is None`` (``transformer/dot_product_attention.py:153`` in
    0.19.2 and core_v0.16.1); its softmax (``FusedScaleMaskSoftmax``
    torch path) uses a given ``attention_mask`` *instead of* the causal one, applying
    ``masked_fill(mask, -10000)`` with **True = masked**. So we pass a block-diagonal
    causal ``attention_mask [1, 1, T, T]`` bool. ``exp(-10000 - max)`` is exactly 0 in
    fp32/bf16, so the result equals running each sequence alone (tested).

- **Padded (BSHD)**: ``[n, S]`` right-padded rows (``S = max L_i``, rounded up to
  ``pad_to_multiple_of``) with a causal + key-padding ``attention_mask [n, 1, S, S]``.

Labels are next tokens. The logprob of response token ``j`` of sample ``i`` comes
from the logits at position ``P_i + j - 1`` of that sequence (the position of the
token *before* it), so ``labels[start_i + P_i + j - 1] = response_ids[j]`` and
``response_mask`` is True exactly there. Every other label position holds token id
0 (a valid id; those positions are masked out of every loss).

Sequence parallelism (Megatron ``sequence_parallel=True``) splits the sequence
dimension across TP ranks, so ``T`` must be a multiple of TP: pass
``pad_to_multiple_of=TP`` (the actor does). FP8 GEMMs need the token count of every
GEMM input (``B * T``) to be a multiple of the FP8 alignment: pass ``align_tokens_to``;
with sequence parallelism the column-parallel GEMMs get the LOCAL shard ``[T / TP, B, H]``
(Transformer Engine checks it before its all-gather), whose ``(T / TP) * B`` must be a
multiple of ``align_local_tokens_to`` (see :mod:`dapo_megatron.actor.plan`). Padding tokens (id 0) form their own causal
block, have ``position_ids`` 0.., and are never in ``response_mask``, so they reach no
logprob, loss, token count or metric.

**Shared prompt** (``share_prompts=True``; Prefix Grouper, arXiv 2506.05433): the
samples of a micro-batch with identical ``prompt_ids`` (a GRPO group) form one
*segment* ``prompt, response_1, ..., response_G``: the prompt is encoded once. In the
attention mask a response's tokens see the whole prompt and their own response
(causally), never another response; its ``position_ids`` continue from the prompt
(``P, P+1, ...``), exactly as in its copied sequence ``prompt + response_k``. So every
hidden state of the segment equals the hidden state of the same token in the copied
form. Labels keep the convention "the slot of a response token is the row position
before it": for the 2nd..Gth non-empty response that slot is the last token of the
previous response (a position that predicts nothing in the copied form), while the
logits that predict the response's first token are the prompt's last position, shared
by all G responses; :attr:`PackedBatch.label_rows` maps each slot to the row whose
logits predict it. Segments always get an attention mask (THD: ``[1, 1, T, T]``; BSHD:
``[n_segments, 1, S, S]``), because neither Megatron's causal mask nor
``PackedSeqParams`` (one causal block per ``cu_seqlens`` segment) can express "see the
prompt, not the sibling responses".

Design: docs/design.md §1 step 6 (micro-batches) and §3.4 (token-level loss under any split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dapo_megatron.rollout.types import Sample


@dataclass
class PackedBatch:
    """Model inputs for one micro-batch plus the bookkeeping to map per-token values back.

    Attributes:
        layout: ``"thd"`` (packed, one row) or ``"bshd"`` (padded rows).
        input_ids: int64 ``[B, T]`` (``B = 1`` for thd, ``n`` for bshd).
        position_ids: int64 ``[B, T]``, 0 at the start of every sequence.
        labels: int64 ``[B, T]``, next-token ids at response label positions, 0 elsewhere.
        response_mask: bool ``[B, T]``, True at the label positions of response tokens
            (all samples, including overlong-filtered ones: logprobs are needed for them).
        loss_mask: bool ``[B, T]``, ``response_mask`` minus the samples with
            ``loss_mask_zero`` (overlong filtering) and minus each sample's context tokens
            (``Sample.response_mask`` 0: a multi-turn rollout's tool output, read as context in
            the forward and never trained on): the tokens that enter the loss.
        attention_mask: bool ``[B, 1, T, T]``, True = masked (Megatron convention), or
            None when the caller uses ``packed_seq_params`` (or the plain causal mask) instead.
        cu_seqlens: int32 ``[n_segments + 1]`` segment boundaries in the packed row (thd;
            excludes tail padding). For bshd: ``[0, L_0, L_0 + L_1, ...]`` too. Without shared
            prompts every sample is its own segment.
        seq_lens, prompt_lens, response_lens: per-sample ``L_i``, ``P_i``, ``R_i`` (``L_i``
            is the sample's length in the copied form, ``P_i + R_i``).
        rows, offsets: sample ``i`` lives in row ``rows[i]``; its segment starts at
            ``offsets[i]`` (without shared prompts it spans ``[offsets[i], offsets[i] + L_i)``).
        segment_lens: tokens of each segment (``P + sum R`` of its samples).
        num_padding: padding tokens added (thd: at the tail; bshd: in total).
        label_rows: int64 ``[B * T]``: for each flattened ``[B, T]`` label slot, the flattened
            row whose logits predict it; None when that is the slot itself (no shared prompt).
    """

    layout: str
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    prompt_lens: list[int]
    response_lens: list[int]
    rows: list[int]
    offsets: list[int]
    num_padding: int = 0
    segment_lens: list[int] = field(default_factory=list)
    label_rows: Optional[torch.Tensor] = None
    _label_slices: list[tuple[int, int, int]] = field(default_factory=list, repr=False)

    @property
    def num_samples(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """``B * T``: tokens the model processes, padding included."""
        return self.input_ids.numel()

    @property
    def num_copied_tokens(self) -> int:
        """``sum_i (P_i + R_i)``: real tokens of the copied form (every sample with its own prompt)."""
        return sum(self.seq_lens)

    @property
    def shares_prompts(self) -> bool:
        """True when some segment holds two or more non-empty responses after one prompt: the
        model must then use this batch's ``attention_mask`` and follow ``position_ids`` in RoPE."""
        return self.label_rows is not None

    @property
    def num_loss_tokens(self) -> int:
        """Response tokens that enter the loss (``loss_mask.sum()``)."""
        return int(self.loss_mask.sum())

    @property
    def packed_seq_params(self):
        """``PackedSeqParams(qkv_format="thd")`` for TE attention (thd only).

        The tail padding, if any, is an extra segment so that ``cu_seqlens[-1] == T``.
        """
        if self.layout != "thd":
            raise ValueError("packed_seq_params exists only for layout='thd'; bshd uses attention_mask")
        if self.shares_prompts:
            raise ValueError("a shared-prompt batch cannot be described by PackedSeqParams (one causal block per "
                             "segment); it needs its attention_mask")
        # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens
        if self.num_padding:
            cu = torch.cat([cu, cu.new_tensor([int(cu[-1]) + self.num_padding])])
        cu = cu.to(self.input_ids.device)
        max_len = int((cu[1:] - cu[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
        )

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values at label positions ``[B, T]`` -> list of per-sample ``[R_i]``.

        ``values[b, t]`` is the value for the label at ``t`` (e.g. a logprob from
        :func:`~dapo_megatron.actor.logprobs.vocab_parallel_logprobs`); the result
        ``[i][j]`` belongs to response token ``j`` of sample ``i``. Views, no copy.

        Raises:
            ValueError: ``values`` does not have the batch's ``[B, T]`` shape.
        """
        if tuple(values.shape[:2]) != tuple(self.input_ids.shape):
            raise ValueError(
                f"values shape {tuple(values.shape)} must start with the batch shape {tuple(self.input_ids.shape)}"
            )
        return [values[r, a:b] for r, a, b in self._label_slices]

    def response_start(self, i: int) -> tuple[int, int]:
        """``(row, t)``: sample ``i``'s first response token sits at ``[row, t]`` of the batch
        (its prompt at ``[row, offsets[i] : offsets[i] + P_i]``; with a shared prompt ``t`` is
        after the earlier responses of its segment)."""
        r, a, _ = self._label_slices[i]
        return r, a + 1

    def scatter_per_sample(self, per_sample: Sequence, *, dtype=torch.float32, fill: float = 0.0) -> torch.Tensor:
        """Inverse of :meth:`unpack`: per-sample ``[R_i]`` values -> ``[B, T]`` at label positions.

        Used for advantages (broadcast a scalar per sample with ``[A_i] * R_i``), old
        and rollout logprobs. Positions that are not response labels hold ``fill``.

        Args:
            per_sample: ``n`` sequences (tensor or list of floats) of length ``R_i``.
            dtype: output dtype (default float32).

        Raises:
            ValueError: wrong number of samples or a length that differs from ``R_i``.
        """
        if len(per_sample) != self.num_samples:
            raise ValueError(f"scatter_per_sample got {len(per_sample)} samples, the batch holds {self.num_samples}")
        out = torch.full(self.input_ids.shape, fill, dtype=dtype, device=self.input_ids.device)
        for i, ((r, a, b), vals) in enumerate(zip(self._label_slices, per_sample)):
            vals = torch.as_tensor(vals, dtype=dtype, device=out.device)
            if vals.shape != (b - a,):
                raise ValueError(
                    f"sample {i}: got {tuple(vals.shape)} values, expected [{b - a}] (one per response token)"
                )
            out[r, a:b] = vals
        return out


def _validate(samples: Sequence[Sample]) -> None:
    if len(samples) == 0:
        raise ValueError("a micro-batch needs at least one Sample")
    for i, s in enumerate(samples):
        if len(s.prompt_ids) == 0:
            raise ValueError(
                f"sample {i} has an empty prompt_ids: the first response token needs a preceding position"
            )


def _causal_block(mask: torch.Tensor, row: int, a: int, b: int) -> None:
    """Unmask the causal lower triangle of block [a, b) (mask is True = masked)."""
    n = b - a
    mask[row, 0, a:b, a:b] = ~torch.tril(torch.ones(n, n, dtype=torch.bool, device=mask.device))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def row_multiple(num_rows: int, pad_to_multiple_of: int = 1, align_tokens_to: int = 1,
                 align_local_tokens_to: int = 1) -> int:
    """The multiple a row length ``S`` is rounded up to in a ``[num_rows, S]`` batch.

    ``S`` must be a multiple of ``p = pad_to_multiple_of`` (sequence parallel splits ``S`` over
    ``p`` TP ranks), ``num_rows * S`` a multiple of ``align_tokens_to`` (the FP8 GEMM alignment
    of the whole token dimension, e.g. the weight-gradient GEMM's inner dimension) and the local
    shard's tokens ``num_rows * S / p`` a multiple of ``align_local_tokens_to`` (the GEMM input a
    TP rank quantizes before the sequence-parallel all-gather). With ``S = p * k`` the last two
    read ``num_rows * k ≡ 0 (mod m)``, ``m = lcm(local, align / gcd(p, align))``, so the smallest
    such ``S`` is a multiple of ``p * m / gcd(num_rows, m)``: returned (``p = 1``: the shard is
    the whole batch).
    """
    p = pad_to_multiple_of
    m = math.lcm(align_local_tokens_to, align_tokens_to // math.gcd(p, align_tokens_to))
    return p * (m // math.gcd(num_rows, m))


def prompt_segments(samples: Sequence[Sample], share_prompts: bool = True) -> list[list[int]]:
    """Sample indices grouped by identical ``prompt_ids`` (the segments of :func:`pack_samples`).

    Segments are in order of first appearance, their samples in the given order. With
    ``share_prompts=False`` every sample is its own segment. Grouping by the prompt tokens
    (not ``group_id``) is what makes sharing exact: two samples share only what is equal.
    """
    if not share_prompts:
        return [[i] for i in range(len(samples))]
    where: dict[tuple, int] = {}
    out: list[list[int]] = []
    for i, s in enumerate(samples):
        key = tuple(s.prompt_ids)
        if key in where:
            out[where[key]].append(i)
        else:
            where[key] = len(out)
            out.append([i])
    return out


def segment_length(samples: Sequence[Sample], segment: Sequence[int]) -> int:
    """Tokens of one segment: its prompt once plus every response."""
    return len(samples[segment[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in segment)


def padded_tokens(lengths: Sequence[int], *, layout: str, pad_to_multiple_of: int = 1,
                  align_tokens_to: int = 1, align_local_tokens_to: int = 1) -> int:
    """``B * T`` of :func:`pack_samples` for segments of these lengths (tokens the model computes)."""
    if layout == "thd":
        return _round_up(sum(lengths), row_multiple(1, pad_to_multiple_of, align_tokens_to, align_local_tokens_to))
    return len(lengths) * _round_up(max(lengths), row_multiple(len(lengths), pad_to_multiple_of, align_tokens_to,
                                                               align_local_tokens_to))


def pack_samples(
    samples: Sequence[Sample],
    *,
    layout: str = "thd",
    pad_to_multiple_of: int = 1,
    align_tokens_to: int = 1,
    align_local_tokens_to: int = 1,
    build_attention_mask: bool = True,
    share_prompts: bool = False,
    device: torch.device | str = "cpu",
) -> PackedBatch:
    """Build the model inputs of one micro-batch.

    Args:
        samples: the micro-batch; every ``prompt_ids`` non-empty.
        layout: ``"thd"`` (one packed row) or ``"bshd"`` (right-padded rows, one per segment).
        pad_to_multiple_of: round ``T`` (thd) / ``S`` (bshd) up to this multiple
            (the TP size when sequence parallelism is on).
        align_tokens_to: make ``B * T`` a multiple of this (the FP8 GEMM alignment, 1 = off),
            with the smallest row length that also keeps ``pad_to_multiple_of``
            (:func:`row_multiple`).
        align_local_tokens_to: make each sequence-parallel shard's ``B * T / pad_to_multiple_of``
            tokens a multiple of this (FP8 with sequence parallelism; 1 = off).
        build_attention_mask: build the bool mask (CPU / local spec). Set False on GPU
            with the TE spec and pass :attr:`PackedBatch.packed_seq_params` instead
            (an ``[T, T]`` mask is quadratic in memory), or for bshd rows that Megatron's
            causal mask serves. A batch that shares prompts always gets its mask.
        share_prompts: samples with identical ``prompt_ids`` share one encoding of the prompt
            (module docstring). False: the copied form, every sample its own segment.
        device: where the tensors live.

    Returns:
        A :class:`PackedBatch`.

    Raises:
        ValueError: empty micro-batch, empty prompt, unknown layout, bad multiple.
    """
    _validate(samples)
    if layout not in ("thd", "bshd"):
        raise ValueError(f"layout={layout!r} must be 'thd' (packed) or 'bshd' (padded)")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1 (TP size with sequence parallel)")
    if align_tokens_to < 1 or align_local_tokens_to < 1:
        raise ValueError(f"align_tokens_to={align_tokens_to} and align_local_tokens_to={align_local_tokens_to} "
                         "must be >= 1 (the FP8 alignments, 1 = off)")
    mult = dict(pad_to_multiple_of=pad_to_multiple_of, align_tokens_to=align_tokens_to,
                align_local_tokens_to=align_local_tokens_to)
    segments = prompt_segments(samples, share_prompts)
    plens = [len(s.prompt_ids) for s in samples]
    rlens = [len(s.response_ids) for s in samples]
    lens = [p + r for p, r in zip(plens, rlens)]
    seg_lens = [segment_length(samples, seg) for seg in segments]
    n, n_seg = len(samples), len(segments)
    shared = any(sum(1 for i in seg if rlens[i]) >= 2 for seg in segments)

    if layout == "thd":
        total = sum(seg_lens)
        T = _round_up(total, row_multiple(1, **mult))
        B, seg_rows = 1, [0] * n_seg
        seg_offs = [0]
        for L in seg_lens[:-1]:
            seg_offs.append(seg_offs[-1] + L)
        num_padding = T - total
    else:
        B = n_seg
        T = _round_up(max(seg_lens), row_multiple(B, **mult))
        seg_rows, seg_offs = list(range(n_seg)), [0] * n_seg
        num_padding = B * T - sum(seg_lens)

    input_ids = torch.zeros(B, T, dtype=torch.long)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    labels = torch.zeros(B, T, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    mask = torch.ones(B, 1, T, T, dtype=torch.bool) if (build_attention_mask or shared) else None
    label_rows = torch.arange(B * T) if shared else None
    label_slices: list = [None] * n
    rows, offsets = [0] * n, [0] * n
    for seg, r, o in zip(segments, seg_rows, seg_offs):
        P = plens[seg[0]]
        input_ids[r, o:o + P] = torch.tensor(samples[seg[0]].prompt_ids, dtype=torch.long)
        position_ids[r, o:o + P] = torch.arange(P)
        if mask is not None:
            _causal_block(mask, r, o, o + P)
        start, first = o + P, True  # start: where the next response goes
        for i in seg:
            R = rlens[i]
            rows[i], offsets[i] = r, o
            a, b = start - 1, start - 1 + R  # label slots: the row position before each token
            label_slices[i] = (r, a, b)
            if not R:
                continue
            input_ids[r, start:start + R] = torch.tensor(samples[i].response_ids, dtype=torch.long)
            position_ids[r, start:start + R] = torch.arange(P, P + R)  # continues from the prompt
            labels[r, a:b] = torch.tensor(samples[i].response_ids, dtype=torch.long)
            response_mask[r, a:b] = True
            if not samples[i].loss_mask_zero:
                if samples[i].response_mask is None:  # single-turn: every response token
                    loss_mask[r, a:b] = True
                else:
                    loss_mask[r, a:b] = torch.tensor(samples[i].loss_token_mask(), dtype=torch.bool)
            if mask is not None:
                mask[r, 0, start:start + R, o:o + P] = False  # the whole prompt
                _causal_block(mask, r, start, start + R)  # and its own response, causally
            if not first:  # its first token is predicted by the prompt's last position
                label_rows[r * T + a] = r * T + o + P - 1
            first = False
            start += R
    # padding: its own causal block(s), so no row of the softmax is fully masked
    if layout == "thd" and num_padding:
        position_ids[0, T - num_padding:] = torch.arange(num_padding)
        if mask is not None:
            _causal_block(mask, 0, T - num_padding, T)
    if layout == "bshd" and mask is not None:
        for r, L in enumerate(seg_lens):
            if L < T:
                _causal_block(mask, r, L, T)

    cu = torch.tensor([0] + list(torch.tensor(seg_lens).cumsum(0).tolist()), dtype=torch.int32)
    dev = torch.device(device)
    return PackedBatch(
        layout=layout,
        input_ids=input_ids.to(dev),
        position_ids=position_ids.to(dev),
        labels=labels.to(dev),
        response_mask=response_mask.to(dev),
        loss_mask=loss_mask.to(dev),
        attention_mask=mask.to(dev) if mask is not None else None,
        cu_seqlens=cu.to(dev),
        seq_lens=lens,
        prompt_lens=plens,
        response_lens=rlens,
        rows=rows,
        offsets=offsets,
        num_padding=num_padding,
        segment_lens=seg_lens,
        label_rows=label_rows.to(dev) if label_rows is not None else None,
        _label_slices=label_slices,
    )


def split_by_token_budget(samples: Sequence[Sample], max_token_len: int, *,
                          share_prompts: bool = False) -> list[list[Sample]]:
    """Cut a mini-batch into micro-batches of at most ``max_token_len`` tokens each.

    verl's ``ppo_max_token_len_per_gpu`` (dynamic batch size): samples are taken in
    order and a new micro-batch starts when the next sample would overflow the
    budget. Order is kept, so the result is deterministic and identical on every
    rank of a model-parallel group. A sample longer than the budget is an error
    (it could never fit).

    Args:
        samples: the mini-batch shard of this DP rank.
        max_token_len: token budget (prompt + response tokens) per micro-batch.
        share_prompts: count a prompt once per micro-batch (a sample whose ``prompt_ids``
            already appear in the current micro-batch costs only its response), as
            :func:`pack_samples` with ``share_prompts=True`` computes it.

    Returns:
        List of micro-batches (lists of Sample), none empty.

    Raises:
        ValueError: ``max_token_len < 1`` or a sample has more tokens than the budget.
    """
    if max_token_len < 1:
        raise ValueError(f"ppo_max_token_len_per_gpu={max_token_len} must be >= 1")
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    prompts: set[tuple] = set()
    used = 0
    for i, s in enumerate(samples):
        L = s.total_length
        if L > max_token_len:
            raise ValueError(
                f"sample {i} has {L} tokens (prompt {len(s.prompt_ids)} + response {len(s.response_ids)}) > "
                f"ppo_max_token_len_per_gpu={max_token_len}; raise it to at least the max prompt + response length"
            )
        key = tuple(s.prompt_ids) if share_prompts else None
        cost = len(s.response_ids) if key in prompts else L
        if cur and used + cost > max_token_len:
            out.append(cur)
            cur, used, prompts, cost = [], 0, set(), L
        cur.append(s)
        used += cost
        if share_prompts:
            prompts.add(key)
    if cur:
        out.append(cur)
    return out


def group_by_length(lengths: Sequence[int], *, pad_to_multiple_of: int = 1, align_tokens_to: int = 1,
                    align_local_tokens_to: int = 1, overhead_tokens: int = 64) -> list[list[int]]:
    """Cut a padded (BSHD) micro-batch into row groups of similar length, minimising padded work.

    A BSHD micro-batch of ``n`` rows costs about ``n * S`` token-slots in every linear layer
    (``S`` = longest row rounded up to :func:`row_multiple`), so one short response next to
    long ones wastes compute on padding. The indices are sorted by length (stable) and cut
    into contiguous groups minimising ``sum_k (n_k * S_k + overhead_tokens)`` (exact dynamic
    programme, ``O(n^2)``); ``overhead_tokens`` prices one extra forward/backward pass in
    token-slots, so groups are only split when that saves more padding than it costs.

    Args:
        lengths: ``L_i`` (prompt + response tokens, or a shared-prompt segment's tokens) of the
            micro-batch's rows, all >= 1.
        pad_to_multiple_of: the row-length multiple of :func:`pack_samples`.
        align_tokens_to: the ``B * S`` multiple of :func:`pack_samples` (FP8; 1 = off).
        align_local_tokens_to: the sequence-parallel shard's multiple of :func:`pack_samples`.
        overhead_tokens: cost of one more model call, in token-slots (>= 0).

    Returns:
        Index groups (into ``lengths``), each sorted by ascending length, groups in
        ascending length order; every index appears exactly once. Deterministic.

    Raises:
        ValueError: empty ``lengths``, a length < 1, or a negative ``overhead_tokens``.
    """
    if len(lengths) == 0:
        raise ValueError("group_by_length needs at least one length")
    if (min(lengths) < 1 or overhead_tokens < 0 or pad_to_multiple_of < 1 or align_tokens_to < 1
            or align_local_tokens_to < 1):
        raise ValueError(
            f"lengths must be >= 1 (got min {min(lengths)}), overhead_tokens >= 0 (got {overhead_tokens}), "
            f"pad_to_multiple_of >= 1 (got {pad_to_multiple_of}) and align_tokens_to >= 1 (got {align_tokens_to})"
        )
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [None] * n  # best[j]: min cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # last group = sorted rows i .. j-1, its longest row is j-1
            rows = j - i
            S = _round_up(lengths[order[j - 1]], row_multiple(rows, pad_to_multiple_of, align_tokens_to,
                                                               align_local_tokens_to))
            c = best[i] + rows * S + overhead_tokens
            if best[j] is None or c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
