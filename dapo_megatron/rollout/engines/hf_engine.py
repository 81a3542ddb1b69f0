"""Rollout engine on Hugging Face transformers: the CPU default and a small-GPU option.

:class:`HFEngine` owns the model (loaded from a path, a GGUF file or a module), its memory around
training (``sleep`` / ``wake_up``), its weights (each synced tensor copied into its parameter as it
arrives, checksummed for the verification) and the weight probe's ``score``. Generation is
:class:`~dapo_megatron.rollout.engines.hf_batch.RowBatch`'s own sampling loop with continuous
batching (:mod:`.hf_batch`: the exact distribution each token is drawn from, its logprob, the
per-row seeds), fed with the engine's rules: a row's generator (``sample_seed``, advanced past its
prefix) and its stop ids (the model's EOS ids and the row's ``stop_token_ids``).

Design: docs/design.md §2.3 and §3.7 (streamed rounds).
"""

from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence, Union

import torch
from transformers import AutoModelForCausalLM

from dapo_megatron.bridge.receiver import ParamSpec, checkpoint_parameters, specs_from_module
from dapo_megatron.bridge.verify import Timer, as_sent, checksum_tensor, digest_dtype, read_checksums
from dapo_megatron.bridge.weights import load_targets
from dapo_megatron.platform.cpu_compat import native_torch
from dapo_megatron.rollout.engines.engine import (
    Completion,
    GenerationOutput,
    RolloutEngine,
    RowRequest,
    RowResult,
    SamplingParams,
    eos_ids,
    match_stop_string,
    resolve_prompt_seeds,
    validate_prompt_ids,
)
from dapo_megatron.rollout.engines.hf_batch import RowBatch
from dapo_megatron.rollout.engines.routes import HFRouteRecorder


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
        eos = set(eos_token_ids) if eos_token_ids is not None else \
            eos_ids(getattr(self.model, "generation_config", None), getattr(self.model, "config", None))
        if not eos:
            raise ValueError("HFEngine: the model config names no eos_token_id; pass eos_token_ids=[...]")
        self.eos_token_ids = frozenset(int(t) for t in eos)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else min(self.eos_token_ids))
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.num_threads = num_threads
        self._asleep = False
        # the generation loop (hf_batch.py): rows seeded and stopped by this engine's rules
        self.rows = RowBatch(self.model, device=self.device, pad_token_id=self.pad_token_id,
                             vocab_size=self.vocab_size,
                             routes=HFRouteRecorder(self.model) if record_routes else None,
                             generator_of=self._generator, stop_ids_of=self._stop_ids)
        self._loaded_sums: dict[str, Optional[torch.Tensor]] = {}  # the last sync's receiver checksums

    # ---- generation (the rows: hf_batch.RowBatch) -------------------------------------
    supports_async = True

    def set_stop_decoder(self, decode) -> None:
        """Give the engine ``decode(ids) -> str`` (the tokenizer's, special tokens kept), which rows
        with stop strings (``SamplingParams.stop``) need: the row's new tokens are matched after
        every sampled token (:meth:`matched_stop_string`)."""
        self.rows.decode = decode

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """:meth:`RolloutEngine.generate` as rows (:meth:`submit`, :meth:`poll`), each response with
        its own ``torch.Generator``: a response does not depend on the rest of the batch (up to the
        last bits of batched matmuls, which can flip a near-tie).

        Raises:
            ValueError: malformed ``prompt_ids``. RuntimeError: asleep, or rows in flight.
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
        """:meth:`RowBatch.submit <dapo_megatron.rollout.engines.hf_batch.RowBatch.submit>`, awake only."""
        if self._asleep:
            raise RuntimeError("HFEngine.submit called while asleep; call wake_up() first")
        self._require_valid_weights()
        self.rows.submit(rows)

    @property
    def num_in_flight(self) -> int:
        return self.rows.num_in_flight

    @torch.inference_mode()
    def poll(self, max_tokens: Optional[int] = None) -> list[RowResult]:
        """:meth:`RowBatch.poll <dapo_megatron.rollout.engines.hf_batch.RowBatch.poll>`, awake only."""
        if self._asleep:
            raise RuntimeError("HFEngine.poll called while asleep; call wake_up() first")
        self._require_valid_weights()
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1 or None")
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        return self.rows.poll(max_tokens, self.weight_version)

    def abort(self, keys: Optional[Iterable] = None) -> list[RowResult]:
        """:meth:`RowBatch.abort <dapo_megatron.rollout.engines.hf_batch.RowBatch.abort>`."""
        return self.rows.abort(keys, self.weight_version)

    def running_rows(self) -> dict:
        """:meth:`RowBatch.running_rows <dapo_megatron.rollout.engines.hf_batch.RowBatch.running_rows>`."""
        return self.rows.running_rows()

    @property
    def records_routes(self) -> bool:
        """Whether the engine records routes (``record_routes``)."""
        return self.rows.routes is not None

    # ---- the rows' rules (a subclass may change them: dapo-rollout-server's ServerEngine) --------
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
        """:func:`~dapo_megatron.rollout.engines.engine.match_stop_string` with the engine's decoder
        (:meth:`set_stop_decoder`): the engine ends a row on it, ``dapo-rollout-server`` names the
        match with it."""
        return match_stop_string(stops, tokens, self.rows.decode)


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
        if self.rows.routes is not None:
            self.rows.routes.clear()
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
        # mode, a few hundred torch calls per sync skip its Python (a no-op off CPU); the bridge may receive
        # a tensor straight into its parameter (load_targets: the copy below is then onto itself, a no-op)
        with native_torch(), load_targets(params):
            for name, tensor in named_tensors:
                params[name].copy_(tensor)  # casts dtype and moves device (also while asleep on CPU)
                del tensor  # before the next one is produced
                if digest is not None and name in digest.sums:  # this sync checks it (the trailer came first)
                    with Timer(digest):
                        loaded = as_sent(held[name], dtype) if name in held else None
                        self._loaded_sums[name] = None if loaded is None else checksum_tensor(loaded)
