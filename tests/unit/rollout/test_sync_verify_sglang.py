"""Weight-sync verification (issue 39) into colocated SGLang engines, which cannot checksum what they
loaded: the verified sample is read back with ``get_weights_by_name`` and compared with the sender's
checksums, in the same sync. A TP=2 actor (2 gloo ranks) syncs into one SGLang engine per rank,
through the package's flattened buckets and SGLang's serializer (shared memory on CPU where a GPU
uses CUDA IPC) up to the ``sglang.Engine`` boundary, where the spy of ``test_sglang_engine.py``
decodes each payload as SGLang's TP worker does and answers ``get_weights_by_name`` from what the
worker loaded (``.float().tolist()``, as sglang ``models/llama.py`` does).

Faults, each with verification off (the sync as it was: accepted) and on (one error naming the
tensor, the engine and the version; the engine refuses to generate):

- one bucket acknowledged by the engine call but never applied (a dropped bucket);
- the payload buffer overwritten before the engine's worker copied it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dapo_megatron.platform import spawn

BUCKET = 20_000  # bytes: several buckets (test_engine_group_sync.py's size)


def _worker(model_dir: str, out_dir: str) -> None:
    import sys

    import torch.distributed as dist

    from dapo_megatron.bridge import iter_hf_weights
    from dapo_megatron.bridge.receiver import InvalidWeightsError
    from dapo_megatron.rollout.engines.engine import SamplingParams
    from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine
    from dapo_megatron.bridge.verify import SyncDigest
    from unit.rollout.test_engine_group_sync import _hf_source, _setup
    from unit.rollout.test_sglang_engine import _SpyEngine

    class ReadbackSpy(_SpyEngine):
        def get_weights_by_name(self, name, truncate_size=100):
            for call in reversed(self.loaded):  # what TP worker 0 holds now: its last load of the name
                for n, t in call[0]:
                    if n == name:
                        return t.float().tolist()[:truncate_size]
            return None

    model, hf_config, export, group, parallel = _setup(2, 1, 1, _hf_source("qwen2_bias"))
    sys.modules["sglang"].Engine = ReadbackSpy
    rank = dist.get_rank()
    res = {}
    for fault in ("dropped_bucket", "overwritten_payload"):
        for verify in (False, True):
            eng = SGLangEngine(model_dir, dtype="float32", tp_size=1, group=group, base_gpu_id=0)
            eng.update_bucket_bytes = BUCKET
            eng.engine_label = f"SGLangEngine of rank {rank}"
            real = eng._update_from_payloads
            calls = {"n": 0}

            def planted(payloads, real=real, calls=calls, eng=eng, fault=fault):
                k = calls["n"]
                calls["n"] += 1
                if k == 1 and fault == "dropped_bucket":
                    return None  # acknowledged, never applied
                if k == 1 and fault == "overwritten_payload":
                    eng._packer._buffer.fill_(0x3F)  # the next bucket's bytes, before the worker copied
                return real(payloads)

            eng._update_from_payloads = planted
            digest = SyncDigest(1, 1) if verify else None
            try:
                eng.update_weights(iter_hf_weights(model, parallel=parallel, bucket_bytes=BUCKET, digest=digest),
                                   version=1, digest=digest)
                error = None
            except RuntimeError as err:
                error = f"{type(err).__name__}: {err}"
            held = {}
            for call in eng.engine.loaded:
                held.update(dict(call[0]))
            wrong = sorted(n for n in export if n not in held or not torch.equal(held[n], export[n]))
            try:
                eng.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=1))
                refused = False
            except InvalidWeightsError:
                refused = True
            res[f"{fault}/{verify}"] = {"error": error, "wrong": wrong, "valid": eng.weights_valid,
                                        "version": eng.weight_version, "refused": refused,
                                        "calls": calls["n"], "order": list(export)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from conftest import tiny_hf_config

    d = tmp_path_factory.mktemp("verify_sglang")
    tiny_hf_config("qwen2_bias").save_pretrained(d / "model")
    out = d / "out"
    out.mkdir()
    spawn(_worker, 2, str(d / "model"), str(out))
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


@pytest.mark.dist
@pytest.mark.parametrize("fault", ["dropped_bucket", "overwritten_payload"])
def test_a_fault_between_the_flat_bucket_and_the_sglang_worker_is_caught_in_the_same_sync(results, fault):
    for rank, res in enumerate(results):
        before, after = res[f"{fault}/False"], res[f"{fault}/True"]
        assert before["calls"] >= 3, "several buckets"
        # unverified (the sync as it was): version 1 accepted and served, some tensors wrong
        assert before["error"] is None and before["valid"] and before["version"] == 1 and not before["refused"]
        assert before["wrong"], "the plant changed what the worker holds"
        # verified: one error naming the first wrong tensor in the sender's order, the engine, the version
        first = min(after["wrong"], key=after["order"].index)
        msg = after["error"]
        assert msg.startswith("WeightSyncVerifyError: weight sync to version 1: SGLangEngine of rank "
                              f"{rank} holds a different {first!r}"), msg
        assert not after["valid"] and after["refused"] and after["version"] == 0
