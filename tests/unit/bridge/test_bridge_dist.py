"""Bridge on 2 gloo processes: logprob parity with transformers at TP=1/TP=2/PP=2, bitwise
export (also to a consumer that keeps every tensor, and on a gloo without
``all_gather_into_tensor``), bucket memory reused only once released, TP=2 → torch_dist
checkpoint → PP=2 reload, and the errors of mismatched inputs.

All layouts and families run in ONE spawned 2-process world (the spawn costs more than the
tiny models). The oracle (transformers' logprobs and the HF state dict) is computed in the
parent; workers only report what Megatron produced, and the parent asserts.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY_FAMILIES, random_hf_model, tiny_hf_config
from dapo_megatron.platform import ParallelConfig, spawn

LAYOUTS = (("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2))
CKPT_CASES = ("llama_tied", "llama_untied", "qwen2_bias", "qwen3_qknorm", "llama_gqa3")


def megatron_logprobs(model, ids: torch.Tensor, vocab_size: int, par):
    """Logprobs of ids[:, 1:] under a (TP- and/or PP-sharded) GPTModel; returned on the last
    PP stage (None elsewhere). PP=2 forward by hand: stage 0 sends its hidden states."""
    import torch.distributed as dist

    from dapo_megatron.actor.logprobs import vocab_parallel_logprobs

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    pp, stage, group_ranks = par.pp_size, par.pp_rank, par.pp_ranks
    with torch.no_grad():
        if stage > 0:
            hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=group_ranks[stage - 1])
            model.set_input_tensor(hidden)
        out = model(ids, pos, None)
        if stage < pp - 1:
            dist.send(out.contiguous(), dst=group_ranks[stage + 1])
            return None
        return vocab_parallel_logprobs(out[:, :-1].float(), ids[:, 1:], vocab_size=vocab_size,
                                       tp_group=par.tp_group)


def _mismatches(exported: dict, reference: dict) -> list[str]:
    bad = [f"missing {k}" for k in reference if k not in exported]
    bad += [f"extra {k}" for k in exported if k not in reference]
    bad += [f"differs {k}" for k in reference if k in exported and not torch.equal(exported[k], reference[k])]
    return bad


def record_errors(attempts: dict) -> dict:
    """Run each ``attempts[key]()``; ``{key: None}`` where it returned, else ``"Type: message"``
    (the one line a user would read, which the tests check)."""
    errors = {}
    for key, fn in attempts.items():
        try:
            fn()
            errors[key] = None
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            errors[key] = f"{type(e).__name__}: {e}"
    return errors


def _worker(out_dir: str, cases: dict, ids: torch.Tensor) -> None:
    import torch.distributed as dist

    import dapo_megatron.bridge.weights as bridge_weights
    from dapo_megatron.bridge import (
        ExportBuffers,
        export_hf_state_dict,
        iter_hf_weights,
        load_hf_weights,
        load_model_checkpoint,
        read_checkpoint_meta,
        save_model_checkpoint,
    )
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import init_distributed

    rank = int(os.environ["RANK"])
    res: dict = {"lp": {}, "export": {}, "order": {}, "ckpt": {}, "ckpt_lp": {}, "errors": {}, "padded": {},
                 "storages": {}}
    for layout, tp, pp in LAYOUTS:
        par = init_distributed(ParallelConfig(tp, pp), seed=11)
        for name, (cfg, state) in cases.items():
            model = build_gpt_model(cfg, parallel=par).eval()
            load_hf_weights(model, state, parallel=par)
            lp = megatron_logprobs(model, ids, cfg.vocab_size, par)
            if lp is not None:
                res["lp"][(layout, name)] = lp
            res["padded"][(layout, name)] = (model.vocab_size, model.config.num_query_groups)
            # small buckets: several PP broadcasts per bucket and tensors larger than a bucket
            exported = export_hf_state_dict(model, bucket_bytes=8192, parallel=par)
            res["export"][(layout, name)] = _mismatches(exported, state)
            res["order"][(layout, name)] = list(exported)  # the yield order
            if layout == "pp2":  # one Megatron tensor per PP broadcast (bucket_bytes=None)
                unbucketed = {k: v.clone() for k, v in iter_hf_weights(model, parallel=par)}
                res["export"][("pp2-unbucketed", name)] = _mismatches(unbucketed, state)
            # a consumer that keeps every tensor without copying it, then a second call with the
            # same buffers: reuse must never overwrite what is still held
            buffers = ExportBuffers()
            kept = dict(iter_hf_weights(model, bucket_bytes=8192, parallel=par, buffers=buffers))
            for _, t in iter_hf_weights(model, bucket_bytes=8192, parallel=par, buffers=buffers):
                t.zero_()  # writes into the second call's memory only
                del t
            res["export"][(layout + "-kept", name)] = _mismatches(kept, state)
            # a consumer that drops each tensor: its buckets share one storage, across calls too
            storages, buffers = set(), ExportBuffers()
            for _ in range(2):
                for _, t in iter_hf_weights(model, bucket_bytes=8192, parallel=par, buffers=buffers):
                    storages.add(t.untyped_storage().data_ptr())
                    del t
            res["storages"][(layout, name)] = (len(storages), len({t.untyped_storage().data_ptr()
                                                                     for t in kept.values()}))
            del kept
            if layout == "tp2":  # a gloo without all_gather_into_tensor: all_gather into views
                bridge_weights._INTO_TENSOR_ON["gloo"] = False
                try:
                    res["export"][("tp2-all_gather", name)] = _mismatches(
                        export_hf_state_dict(model, bucket_bytes=8192, parallel=par), state)
                finally:
                    bridge_weights._INTO_TENSOR_ON.pop("gloo")

    # TP=2 save → PP=2 load → export
    par = init_distributed(ParallelConfig(2, 1), seed=12)
    for name in CKPT_CASES:
        cfg, state = cases[name]
        model = build_gpt_model(cfg, parallel=par)
        load_hf_weights(model, state, parallel=par)
        save_model_checkpoint(model, os.path.join(out_dir, f"ckpt_{name}"), cfg, parallel=par)
    par = init_distributed(ParallelConfig(1, 2), seed=13)
    for name in CKPT_CASES:
        cfg, state = cases[name]
        groups = read_checkpoint_meta(os.path.join(out_dir, f"ckpt_{name}"))["num_query_groups"]
        # fresh random init, different from the checkpoint; padded query groups as saved
        model = build_gpt_model(cfg, ModelConfig(query_groups_multiple=groups), parallel=par)
        before = _mismatches(export_hf_state_dict(model, parallel=par), state)
        load_model_checkpoint(model, os.path.join(out_dir, f"ckpt_{name}"))
        res["ckpt"][name] = (len(before), _mismatches(export_hf_state_dict(model, parallel=par), state))
        lp = megatron_logprobs(model.eval(), ids, cfg.vocab_size, par)  # also checks the last stage's tied copy
        if lp is not None:
            res["ckpt_lp"][name] = lp

    # mismatches must fail loudly, naming the tensor / field
    cfg, state = cases["qwen2_bias"]
    model = build_gpt_model(cfg, parallel=par)
    attempts = {
        "missing": lambda: load_hf_weights(model, {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, parallel=par),
        "unexpected": lambda: load_hf_weights(model, {**state, "model.layers.2.mlp.up_proj.weight": state["model.layers.1.mlp.up_proj.weight"]}, parallel=par),
        "shape": lambda: load_hf_weights(model, {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}, parallel=par),
        "ckpt_config": lambda: load_model_checkpoint(
            build_gpt_model(tiny_hf_config("qwen2_bias", intermediate_size=128), parallel=par), os.path.join(out_dir, "ckpt_qwen2_bias")),
        "ckpt_family": lambda: load_model_checkpoint(
            build_gpt_model(tiny_hf_config("llama_untied"), parallel=par), os.path.join(out_dir, "ckpt_qwen2_bias")),
        "not_a_ckpt": lambda: load_model_checkpoint(model, out_dir),
        "bucket_bytes": lambda: next(iter_hf_weights(model, bucket_bytes=0, parallel=par)),
        "ckpt_groups": lambda: load_model_checkpoint(build_gpt_model(tiny_hf_config("llama_gqa3"), parallel=par),
                                                     os.path.join(out_dir, "ckpt_llama_gqa3")),
    }
    # second line of defence: a model whose (forged) HF config passes the config check but
    # whose tensors are not all in the checkpoint (qwen2's qkv bias vs a llama save)
    forged = build_gpt_model(cfg, parallel=par)
    forged.hf_config = cases["llama_untied"][0]
    attempts["ckpt_missing_tensor"] = lambda: load_model_checkpoint(forged, os.path.join(out_dir, "ckpt_llama_untied"))
    # a parameter of the wrong shape on the last stage only: both stages raise, none waits in a broadcast
    misshapen = build_gpt_model(cfg, parallel=par)
    for pname, p in misshapen.named_parameters():
        if pname.endswith("final_layernorm.weight"):
            p.data = torch.zeros(3)
    attempts["export_shape"] = lambda: next(iter_hf_weights(misshapen, parallel=par))
    res["errors"].update(record_errors(attempts))
    dist.barrier()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_dist")
    cases, ref_lp = {}, {}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (2, 17), generator=g)
    ids[0, 3] = 249  # the last real token id, next to the padding rows
    for i, name in enumerate(TINY_FAMILIES):
        cfg = tiny_hf_config(name)
        hf = random_hf_model(cfg, seed=i)
        state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight")
        cases[name] = (cfg, state)
        with torch.no_grad():
            logits = hf(ids).logits.float()
        ref_lp[name] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    spawn(_worker, 2, str(out), cases, ids)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, ref_lp, cases


@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for name, _, _ in LAYOUTS])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logprob_parity_with_transformers(dist_results, layout, family):
    ranks, ref_lp, _ = dist_results
    got = [r["lp"][(layout, family)] for r in ranks if (layout, family) in r["lp"]]
    assert got, "no rank produced logprobs"
    for lp in got:  # TP ranks (and DP replicas at TP=1) must each match the oracle
        assert lp.shape == ref_lp[family].shape
        assert (lp - ref_lp[family]).abs().max().item() <= 1e-4


@pytest.mark.dist
def test_vocab_and_query_groups_are_padded_for_tp(dist_results):
    ranks, _, _ = dist_results
    # vocab 250, make_vocab_size_divisible_by 128: TP=1 → 256, TP=2 → multiple of 256 → 256
    assert ranks[0]["padded"][("tp1", "llama_tied")] == (256, 2)
    assert ranks[0]["padded"][("tp2", "llama_tied")] == (256, 2)
    # 3 KV groups: TP=2 adds one zero group; TP=1 / PP=2 keep 3
    assert ranks[0]["padded"][("tp2", "llama_gqa3")] == (256, 4)
    assert ranks[0]["padded"][("tp1", "llama_gqa3")] == (256, 3)
    assert ranks[0]["padded"][("pp2", "llama_gqa3")] == (256, 3)


@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for name, _, _ in LAYOUTS] + ["pp2-unbucketed", "tp2-all_gather"]
                         + [name + "-kept" for name, _, _ in LAYOUTS])
def test_export_is_bitwise_equal_on_every_rank(dist_results, layout):
    ranks, _, cases = dist_results
    for r in ranks:
        for family in TINY_FAMILIES:
            assert r["export"][(layout, family)] == [], (layout, family)


@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for name, _, _ in LAYOUTS])
def test_bucket_memory_is_reused_only_once_the_consumer_drops_it(dist_results, layout):
    ranks, _, _ = dist_results
    for r in ranks:
        for family in TINY_FAMILIES:
            dropped, kept = r["storages"][(layout, family)]
            assert dropped == 1, (layout, family)  # two calls, every bucket in the same memory
            assert kept > 1, (layout, family)  # a consumer that keeps tensors keeps each bucket's memory


@pytest.mark.dist
def test_export_order_is_fixed_and_identical_on_all_ranks(dist_results):
    ranks, _, cases = dist_results
    for family in TINY_FAMILIES:
        cfg, _ = cases[family]
        L = cfg.num_hidden_layers
        order = ranks[0]["order"][("tp1", family)]
        for layout, _, _ in LAYOUTS:
            for r in ranks:
                assert r["order"][(layout, family)] == order, (layout, family)
        # embedding first, layers in increasing order, final norm, then lm_head only if untied
        assert order[0] == "model.embed_tokens.weight"
        layer_of = [int(n.split(".")[2]) for n in order if n.startswith("model.layers.")]
        assert layer_of == sorted(layer_of) and set(layer_of) == set(range(L))
        tail = ["model.norm.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
        assert order[-len(tail):] == tail


@pytest.mark.dist
@pytest.mark.parametrize("family", CKPT_CASES)
def test_tp2_checkpoint_reloads_bitwise_at_pp2(dist_results, family):
    ranks, ref_lp, _ = dist_results
    for r in ranks:
        n_before, after = r["ckpt"][family]
        assert n_before > 0  # the fresh model really differed before loading
        assert after == []
    lps = [r["ckpt_lp"][family] for r in ranks if family in r["ckpt_lp"]]
    assert len(lps) == 1  # only the last PP stage has logits
    assert (lps[0] - ref_lp[family]).abs().max().item() <= 1e-4


@pytest.mark.dist
def test_mismatched_inputs_fail_naming_the_tensor_or_field(dist_results):
    ranks, _, _ = dist_results
    err = ranks[0]["errors"]
    assert err["missing"] and "model.layers.1.mlp.up_proj.weight" in err["missing"]
    assert err["unexpected"] and "model.layers.2.mlp.up_proj.weight" in err["unexpected"]
    assert err["shape"] and "model.layers.0.self_attn.k_proj.weight" in err["shape"] and "(16, 64)" in err["shape"]
    assert err["ckpt_config"] and "intermediate_size" in err["ckpt_config"]
    assert err["ckpt_family"] and "model_type" in err["ckpt_family"]
    assert err["not_a_ckpt"] and "not a dapo-megatron model checkpoint" in err["not_a_ckpt"]
    assert err["ckpt_groups"] and "query_groups_multiple=4" in err["ckpt_groups"]
    assert err["ckpt_missing_tensor"] and "linear_qkv.bias" in err["ckpt_missing_tensor"]
    assert err["bucket_bytes"] and "bucket_bytes must be a positive" in err["bucket_bytes"]
    for r in ranks:  # raised on both PP stages, naming the stage that holds the parameter
        shape_err = r["errors"]["export_shape"]
        assert shape_err and shape_err.startswith("ValueError: pipeline stage 1:") and \
            "'decoder.final_layernorm.weight' has shape (3,), the mapping expects (64,)" in shape_err, shape_err
