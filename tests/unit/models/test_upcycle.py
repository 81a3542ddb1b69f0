"""tools/upcycle_moe.py on tiny random Llamas: the upcycled Mixtral, loaded back by
transformers, gives the dense model's logits (fp32), its router really routes (tokens reach
different experts), the config carries the attention / RoPE / tied-embedding fields, and bad
input is one line with exit status 2. The Megatron import of an upcycled model at EP = 1 and
EP = 2 is in tests/unit/bridge/test_bridge_moe_dist.py (its spawned world)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from conftest import REPO, random_hf_model, tiny_hf_config

TOOLS = os.path.join(REPO, "tools")


def _tool():
    if TOOLS not in sys.path:  # the tool imports its sibling convert_* tools, as when run as a script
        sys.path.insert(0, TOOLS)
    spec = importlib.util.spec_from_file_location("upcycle_moe", os.path.join(TOOLS, "upcycle_moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rc(tool, argv) -> int:
    """The exit status of ``tool.main(argv)`` (argparse's usage errors exit through SystemExit)."""
    try:
        return tool.main(argv)
    except SystemExit as e:
        return e.code


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    # tied embeddings, plain RoPE of another theta
    "tied": lambda: tiny_hf_config("llama_tied"),
    # untied, 3 KV groups of 6 heads (SmolLM2's GQA shape), llama3 RoPE scaling, explicit head_dim
    "untied_llama3": lambda: tiny_hf_config("llama_gqa3", rope_parameters=LLAMA3_ROPE, head_dim=16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_upcycled_mixtral_gives_the_dense_logits(tmp_path, case):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = CASES[case]()
    dense = random_hf_model(cfg, seed=7)
    dense.save_pretrained(tmp_path / "dense")
    assert _tool().main(["--hf", str(tmp_path / "dense"), "--out", str(tmp_path / "moe"), "--num-experts", "4",
                         "--top-k", "2", "--router-init-std", "0.5", "--seed", "3"]) == 0
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    mc = moe.config
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert (mc.num_local_experts, mc.num_experts_per_tok, mc.intermediate_size) == (4, 2, cfg.intermediate_size)
    for k in ("tie_word_embeddings", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
              "vocab_size", "num_hidden_layers"):
        assert getattr(mc, k) == getattr(dense.config, k), k
    assert mc.sliding_window is None and mc.router_jitter_noise == 0.0

    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))  # past 16: llama3 scaling
    with torch.no_grad():
        want = dense(ids).logits
        out = moe(ids, output_router_logits=True)
    assert (out.logits - want).abs().max().item() <= 1e-5, case
    # the router routes: over the 80 tokens of layer 0, the top-2 pairs are not all one pair,
    # and every expert is somebody's choice (random router weights break the symmetry)
    top2 = out.router_logits[0].topk(2, dim=-1).indices.sort(-1).values
    assert len({tuple(p) for p in top2.tolist()}) > 1
    assert set(top2.flatten().tolist()) == {0, 1, 2, 3}

    # the file: each expert the dense MLP (w1 gate, w3 up, w2 down), routers of the given std
    saved = load_file(tmp_path / "moe" / "model.safetensors")
    src = dense.state_dict()
    for layer in range(cfg.num_hidden_layers):
        for e in range(4):
            for dense_leaf, leaf in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                assert torch.equal(saved[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{leaf}.weight"],
                                   src[f"model.layers.{layer}.mlp.{dense_leaf}.weight"])
        router = saved[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        assert router.shape == (4, cfg.hidden_size) and 0.4 < router.std().item() < 0.6
    assert not any(".mlp." in k for k in saved)
    assert ("lm_head.weight" in saved) == (not cfg.tie_word_embeddings)


def test_same_seed_same_routers_other_seed_other_routers():
    from dapo_megatron.models.upcycle import upcycle_config, upcycle_state_dict

    cfg = tiny_hf_config("llama_tied")
    state = random_hf_model(cfg, seed=1).state_dict()
    mc = upcycle_config(cfg, 4, 2)
    a, b, c = (upcycle_state_dict(state, mc, 0.02, seed=s) for s in (5, 5, 6))
    name = "model.layers.1.block_sparse_moe.gate.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


@pytest.mark.parametrize("args,message", [
    (["--num-experts", "2", "--top-k", "3"], "--top-k 3 is above --num-experts 2"),
    (["--num-experts", "0", "--top-k", "1"], "argument --num-experts: 0 must be >= 1"),
    (["--num-experts", "4", "--top-k", "2", "--router-init-std", "-1"], "argument --router-init-std: -1.0 must be >= 0"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, args, message):
    cfg = tiny_hf_config("llama_tied")
    random_hf_model(cfg).save_pretrained(tmp_path / "dense")
    capsys.readouterr()  # save_pretrained's progress bar
    rc = _rc(_tool(), ["--hf", str(tmp_path / "dense"), "--out", str(tmp_path / "moe"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "moe")


def test_bad_models_are_one_line(tmp_path, capsys):
    tool = _tool()
    tiny = tiny_hf_config("qwen2_bias")  # q/k/v bias: Mixtral's attention cannot hold it
    random_hf_model(tiny).save_pretrained(tmp_path / "qwen2")
    capsys.readouterr()  # save_pretrained's progress bar
    cases = [
        (["--hf", str(tmp_path / "qwen2")], "model_type='qwen2': upcycling maps a Llama model onto Mixtral"),
        (["--hf", str(tmp_path / "nowhere")], "is not a directory"),
        (["--hf", str(tmp_path / "qwen2"), "--gguf-file", "x.gguf"], "--gguf-file 'x.gguf' is not in --hf"),
    ]
    for args, message in cases:
        assert _rc(tool, [*args, "--out", str(tmp_path / "moe"), "--num-experts", "2", "--top-k", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("upcycle_moe: error: ") and message in err and err.count("\n") == 1, err
    # a dense checkpoint without one layer's MLP tensor: named
    from dapo_megatron.models.upcycle import upcycle_config, upcycle_state_dict

    cfg = tiny_hf_config("llama_tied")
    state = random_hf_model(cfg).state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: missing"):
        upcycle_state_dict(state, upcycle_config(cfg, 2, 1), 0.02)
