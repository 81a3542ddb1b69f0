"""Mixture-of-experts bridge on 4 gloo processes: the combined layouts TP=2 × EP=2 (experts
split over 2 expert-TP ranks inside each EP rank) and PP=2 × EP=2 (each stage's experts over
its 2 EP ranks, then the stage broadcast), for a tiny random Qwen3-MoE: logprobs equal
transformers' (fp32, <= 1e-5) on every pipeline, each DP (= EP) rank forwarding its own
sequences, and the export is the HF checkpoint bitwise on every rank. The 2-process layouts
and the other families are in test_bridge_moe_dist.py; the oracle is computed in the parent.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import hf_checkpoint_state, random_hf_model, tiny_moe_config
from dapo_megatron.platform import ParallelConfig, spawn

LAYOUTS = (("tp2_ep2", 2, 1, 2), ("pp2_ep2", 1, 2, 2))  # (name, TP, PP, EP); ETP = TP
SEQ = 16


def _worker(out_dir: str, cfg, state: dict, ids: dict) -> None:
    import torch.distributed as dist

    from dapo_megatron.bridge import export_hf_state_dict, load_hf_weights
    from dapo_megatron.models import build_gpt_model
    from dapo_megatron.platform import init_distributed
    from unit.bridge.test_bridge_moe_dist import _logprobs, _mismatches

    rank = int(os.environ["RANK"])
    res: dict = {"lp": {}, "export": {}, "dp": {}, "experts": {}}
    for layout, tp, pp, ep in LAYOUTS:
        par = init_distributed(ParallelConfig(tp, pp, ep), seed=5)
        model = build_gpt_model(cfg, parallel=par).eval()
        load_hf_weights(model, state, parallel=par)
        lp = _logprobs(model, ids[par.dp_rank], cfg.vocab_size, par)
        if lp is not None:
            res["lp"][layout] = lp
        res["dp"][layout] = par.dp_rank
        res["experts"][layout] = (par.ep_rank, [list(layer.mlp.local_expert_indices) for layer in model.decoder.layers])
        res["export"][layout] = _mismatches(export_hf_state_dict(model, bucket_bytes=4096, parallel=par), state)
    dist.barrier()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge_moe4")
    cfg = tiny_moe_config("qwen3_moe")
    hf = random_hf_model(cfg, seed=7)
    state = hf_checkpoint_state(hf, out / "hf")
    g = torch.Generator().manual_seed(2)
    ids = {d: torch.randint(0, 250, (2, SEQ), generator=g) for d in range(2)}  # DP rank d's sequences
    with torch.no_grad():
        ref = {d: torch.log_softmax(hf(x).logits.float()[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
               for d, x in ids.items()}
    spawn(_worker, 4, str(out), cfg, state, ids)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)], ref


@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_combined_layouts_match_transformers_and_export_bitwise(results4, layout):
    ranks, ref = results4
    producers = [r for r in ranks if layout in r["lp"]]
    # TP=2 × EP=2: all 4 ranks are last stages (2 TP ranks per DP rank); PP=2 × EP=2: the 2 of stage 1
    assert len(producers) == (4 if layout == "tp2_ep2" else 2)
    assert {r["dp"][layout] for r in producers} == {0, 1}
    for r in producers:
        assert (r["lp"][layout] - ref[r["dp"][layout]]).abs().max().item() <= 1e-5, layout
    for r in ranks:
        assert r["export"][layout] == [], (layout, r["export"][layout][:5])
        ep_rank, held = r["experts"][layout]
        assert all(experts == [2 * ep_rank, 2 * ep_rank + 1] for experts in held)
