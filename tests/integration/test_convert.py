"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py as a user runs them:
under torchrun (TP=2) and as one plain process, on a tiny model and on SmolLM2 (GGUF)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, random_hf_model, tiny_hf_config

TO_MEGATRON = os.path.join(REPO, "tools", "convert_hf_to_megatron.py")
TO_HF = os.path.join(REPO, "tools", "convert_megatron_to_hf.py")


def _start(args: list[str], nproc: int = 1) -> subprocess.Popen:
    """The tool ``args`` started (``nproc`` > 1: under torchrun), its output captured (:func:`_wait`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _wait(proc: subprocess.Popen, timeout: int = 300) -> subprocess.CompletedProcess:
    """A :func:`_start` process finished, as ``subprocess.run`` returns it (killed and raising
    ``TimeoutExpired`` after ``timeout`` seconds, as ``subprocess.run`` does)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    return _wait(_start(args, nproc), timeout)


def _load_safetensors_dir(path: str) -> dict:
    from dapo_megatron.bridge import SafetensorsSource

    src = SafetensorsSource(path)
    return {k: src[k] for k in src}


@pytest.mark.dist
def test_tiny_model_round_trip_tp2_torchrun_then_plain_export(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config("llama_gqa3")  # 3 KV groups: the TP=2 checkpoint holds a zero 4th group
    hf = random_hf_model(cfg, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    out = _run([TO_MEGATRON, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--tp", "2"], nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    out = _run([TO_HF, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2")])
    assert out.returncode == 0, out.stderr[-3000:]
    umask = os.umask(0)
    os.umask(umask)  # the mode a plain open() gives, not safetensors' 0600
    assert os.stat(tmp_path / "hf2" / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask
    src, back = _load_safetensors_dir(str(tmp_path / "hf")), _load_safetensors_dir(str(tmp_path / "hf2"))
    assert sorted(back) == sorted(src)
    for k in src:
        assert torch.equal(back[k], src[k]), k
    assert back["model.embed_tokens.weight"].shape[0] == 250  # no vocab-padding rows
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


@pytest.mark.dist
def test_moe_round_trip_ep2_torchrun_then_plain_export(tmp_path):
    """A Qwen2-MoE (routed experts, shared expert and its gate) saved with its experts over 2 EP
    ranks reloads at EP=1 (torch_dist reshards the experts) and exports the HF checkpoint
    bitwise: every expert under its own name; transformers reloads it to the same logits."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_moe_config

    hf = random_hf_model(tiny_moe_config("qwen2_moe"), seed=6)
    hf.save_pretrained(tmp_path / "hf")
    out = _run([TO_MEGATRON, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--ep", "2"], nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EP=2" in out.stdout
    out = _run([TO_HF, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2")])
    assert out.returncode == 0, out.stderr[-3000:]
    src, back = _load_safetensors_dir(str(tmp_path / "hf")), _load_safetensors_dir(str(tmp_path / "hf2"))
    assert sorted(back) == sorted(src)
    assert sum(".mlp.experts." in k for k in src) == 2 * 4 * 3  # layers × experts × (gate, up, down)
    for k in src:
        assert torch.equal(back[k], src[k]), k
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf.eval()(ids).logits)
    out = _run([TO_MEGATRON, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt3"), "--ep", "3"], nproc=1)
    assert out.returncode != 0 and "--ep 3" in out.stderr and "torchrun --nproc_per_node=3" in out.stderr


def test_bad_inputs_stop_the_tools_with_the_name(tmp_path):
    """Every input error: one line on stderr, exit status 2, no traceback, nothing written."""
    cfg = tiny_hf_config("qwen2_bias")
    hf = random_hf_model(cfg, seed=4)
    state = {k: v for k, v in hf.state_dict().items() if k != "model.layers.0.self_attn.v_proj.bias"}
    hf.save_pretrained(tmp_path / "hf", state_dict=state)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)

    def one_line(out, prog: str, *parts: str) -> str:
        assert out.returncode == 2, out.stderr[-3000:]
        (line,) = out.stderr.splitlines()
        assert line.startswith(f"{prog}: error: ") and all(p in line for p in parts), line
        return line

    # The three errors found after torch loads (a model built to meet the missing tensor; the
    # checkpoint checks' modules) take seconds each: they run side by side (none writes anything),
    # the flag errors (no torch) meanwhile, each checked as before.
    heavy = [_start([TO_MEGATRON, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]),
             _start([TO_HF, "--ckpt", str(tmp_path / "hf"), "--out", str(tmp_path / "x")]),
             _start([TO_HF, "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "x")])]
    try:
        out = _run([TO_MEGATRON, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--tp", "2"])
        one_line(out, "convert_hf_to_megatron", "torchrun --nproc_per_node=2")
        line = one_line(_run([TO_MEGATRON, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--tp",
                              "0"]), "convert_hf_to_megatron")
        assert line == "convert_hf_to_megatron: error: argument --tp: 0 must be >= 1 (see --help)"
        one_line(_run([TO_MEGATRON, "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "ckpt")]),
                 "convert_hf_to_megatron", "--hf", "is not a directory")
        one_line(_run([TO_HF, "--ckpt", str(tmp_path / "hf"), "--out", str(tmp_path / "x"), "--pp", "0"]),
                 "convert_megatron_to_hf", "argument --pp: 0 must be >= 1")
        one_line(_wait(heavy[0]), "convert_hf_to_megatron", "model.layers.0.self_attn.v_proj.bias")
        assert not (tmp_path / "ckpt").exists()
        one_line(_wait(heavy[1]), "convert_megatron_to_hf", "not a dapo-megatron model checkpoint")
        one_line(_wait(heavy[2]), "convert_megatron_to_hf", "holds no complete checkpoint")
        assert not (tmp_path / "x").exists()
    finally:
        for proc in heavy:  # a failed check leaves none running
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def _architectures(model_dir) -> list:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("architectures")


@pytest.mark.slow
def test_smollm2_gguf_converts_both_ways(smollm2_gguf, smollm2_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, fname = smollm2_gguf
    out = _run([TO_MEGATRON, "--hf", path, "--gguf-file", fname, "--out", str(tmp_path / "ckpt")], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # a GGUF file's config names no model class; SGLang and vLLM pick it from config.json (issue 36 item 9)
    assert _architectures(tmp_path / "ckpt") == ["LlamaForCausalLM"]
    out = _run([TO_HF, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _architectures(tmp_path / "hf") == ["LlamaForCausalLM"]
    ref, back = _load_safetensors_dir(smollm2_hf_dir), _load_safetensors_dir(str(tmp_path / "hf"))
    assert sorted(back) == sorted(ref) and "lm_head.weight" not in back  # tied: embedding once
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 3
    assert torch.equal(model.lm_head.weight, ref["model.embed_tokens.weight"])
    # the GGUF's tokenizer as smollm2_hf_dir saved it (converting the GGUF vocabulary again costs seconds)
    text = "Compute 7 + 12. Reply with just the number."
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(smollm2_hf_dir)(text)["input_ids"]


def test_sharded_safetensors_output_reads_back(tmp_path):
    import importlib.util

    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("convert_megatron_to_hf", TO_HF)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cfg = tiny_hf_config("qwen3_qknorm")
    hf = random_hf_model(cfg, seed=5)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    cfg.save_pretrained(tmp_path)
    files = tool.write_safetensors(state, str(tmp_path), shard_bytes=40_000)
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    back = _load_safetensors_dir(str(tmp_path))
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.model.layers[1].self_attn.q_norm.weight, state["model.layers.1.self_attn.q_norm.weight"])


def _te_style_checkpoint_worker(hf_dir, ckpt_dir):
    """A checkpoint as the Transformer Engine spec writes it: the same keys as the local spec
    (megatron-core's local spec maps its norms to TE's fused names), FP8 metadata payloads in
    every ``_extra_state`` object, and ``transformer_impl: transformer_engine`` in the meta."""
    import json

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from dapo_megatron.bridge import load_hf_weights, open_hf_source
    from dapo_megatron.bridge.dist_ckpt import META_FILE, model_sharded_state_dict, write_model_meta
    from dapo_megatron.models import ModelConfig, build_gpt_model, load_hf_config
    from dapo_megatron.platform import init_distributed

    par = init_distributed()
    hf_config = load_hf_config(hf_dir)
    model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=par)
    load_hf_weights(model, open_hf_source(hf_dir), strict=True, parallel=par)
    sharded = model_sharded_state_dict(model)
    extra = [v for v in sharded["model"].values() if isinstance(v, ShardedObject)]
    assert extra and all(o.key.endswith("._extra_state") for o in extra)
    keys = {v.key for v in sharded["model"].values()}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys  # TE's fused-norm name
    for o in extra:  # TE keeps serialized FP8 scaling state here (the local spec: None)
        o.data = torch.frombuffer(bytearray(b"fp8 amax history and scales"), dtype=torch.uint8).clone()
    os.makedirs(ckpt_dir)
    dist_checkpointing.save(sharded, ckpt_dir, sharded_strategy=("torch_dist", 1))
    write_model_meta(ckpt_dir, model, hf_config)
    path = os.path.join(ckpt_dir, META_FILE)
    meta = json.load(open(path))
    assert meta["transformer_impl"] == "local"  # what this model was built with
    meta["transformer_impl"] = "transformer_engine"  # what a TE-spec save records
    json.dump(meta, open(path, "w"))


def test_transformer_engine_checkpoint_converts_to_hf_without_te(tmp_path):
    from dapo_megatron.platform import spawn

    hf = random_hf_model(tiny_hf_config("qwen2_bias"), seed=5)
    hf.save_pretrained(tmp_path / "hf")
    spawn(_te_style_checkpoint_worker, 1, str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    out = _run([TO_HF, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "saved with the Transformer Engine spec; loading it with the local spec" in out.stdout
    src, back = _load_safetensors_dir(str(tmp_path / "hf")), _load_safetensors_dir(str(tmp_path / "back"))
    assert sorted(back) == sorted(src)
    for k in src:
        assert torch.equal(back[k], src[k]), k
