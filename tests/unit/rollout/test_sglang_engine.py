"""SGLang engine pieces that need no GPU: request building, response parsing, bucketing,
metadata order, error reporting, and the colocated engine at its sglang boundary (the fake
``sglang`` of tests/fake_sglang).
"""

import json

import pytest
import torch

import sglang_reference
from dapo_megatron.bridge.buckets import bucket_metadata, dtype_from_name, dtype_name, iter_buckets
from dapo_megatron.bridge.servers import distributed_update_request
from dapo_megatron.rollout.engines.engine import SamplingParams
from dapo_megatron.rollout.engines.sglang_engine import check_result
from dapo_megatron.rollout.engines.sglang_io import build_generate_request, parse_generate_output


# ------------------------------------------------------------------ bucketing
def named(sizes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [(f"t{i}", torch.zeros(s, dtype=d)) for i, (s, d) in enumerate(zip(sizes, dtypes))]


def test_iter_buckets_bounds_and_order():
    items = named([10, 10, 10, 30, 5, 5], [torch.float32, torch.bfloat16, torch.float32, torch.float32,
                                            torch.bfloat16, torch.float32])
    bytes_ = [40, 20, 40, 120, 10, 20]
    buckets = list(iter_buckets(iter(items), bucket_bytes=64))
    names = [[n for n, _ in b] for b in buckets]
    assert [n for b in names for n in b] == [n for n, _ in items], "order kept, nothing dropped, no dtype grouping"
    for b in buckets:
        size = sum(bytes_[int(n[1:])] for n, _ in b)
        assert size <= 64 or len(b) == 1, "only a single oversized tensor may exceed the bound"
    assert names == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [n for n, *_ in bucket_metadata(buckets[0])] == ["t0", "t1"]
    assert bucket_metadata(buckets[0])[1] == ("t1", (10,), torch.bfloat16)


def test_iter_buckets_is_lazy():
    pulled = []

    def gen():
        for i in range(6):
            pulled.append(i)
            yield (f"t{i}", torch.zeros(4))  # 16 bytes each

    it = iter_buckets(gen(), bucket_bytes=32)
    first = next(it)
    assert [n for n, _ in first] == ["t0", "t1"] and pulled == [0, 1], "at most one bucket held"


def test_iter_buckets_errors():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named([1]), 0))
    with pytest.raises(ValueError, match=r"\(str, torch.Tensor\) pairs"):
        list(iter_buckets([("a", [1, 2])], 10))


def test_dtype_names_roundtrip():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert dtype_from_name(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("Tensor")


# ------------------------------------------------------------------ requests / responses
def test_generate_request_rows_and_seeds():
    p = SamplingParams(n=3, temperature=0.9, top_p=0.7, top_k=-1, max_new_tokens=5, stop_token_ids=(2, 9), seed=4)
    req = build_generate_request([[1, 2, 3], [4]], p)
    assert req["input_ids"] == [[1, 2, 3]] * 3 + [[4]] * 3
    assert req["return_logprob"] is True
    sps = req["sampling_params"]
    assert len(sps) == 6
    assert all(sp["max_new_tokens"] == 5 and sp["temperature"] == 0.9 and sp["top_p"] == 0.7 and sp["top_k"] == -1
               and sp["stop_token_ids"] == [2, 9] and sp["no_stop_trim"] is True for sp in sps)
    seeds = [sp["sampling_seed"] for sp in sps]
    assert len(set(seeds)) == 6, "every response row needs its own seed"
    assert seeds == [sp["sampling_seed"] for sp in build_generate_request([[1, 2, 3], [4]], p)["sampling_params"]]
    assert "sampling_seed" not in build_generate_request([[1]], SamplingParams(seed=None))["sampling_params"][0]
    json.dumps(req)  # the payload is plain JSON
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]"):
        build_generate_request([[]], p)


def sglang_item(ids, logprobs, reason, with_output_ids=True):
    fr = {"type": reason, "matched": ids[-1]} if reason == "stop" else {"type": reason, "length": len(ids)}
    if reason == "abort":
        fr = {"type": "abort", "message": "client disconnected"}
    item = {"text": "", "meta_info": {"finish_reason": fr, "prompt_tokens": 3, "completion_tokens": len(ids),
                                      "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs)]}}
    if with_output_ids:
        item["output_ids"] = list(ids)
    return item


def test_parse_generate_output():
    items = [sglang_item([5, 2], [-0.5, -0.25], "stop"), sglang_item([7, 7, 7], [-1.0, -2.0, -3.0], "length"),
             sglang_item([9], [-0.125], "stop", with_output_ids=False), sglang_item([4, 4], [0.0, -1.5], "length")]
    out = parse_generate_output(items, num_prompts=2, n=2)
    assert out[0][0] == ([5, 2], [-0.5, -0.25], "stop", None)  # routes: not asked for
    assert out[0][1] == ([7, 7, 7], [-1.0, -2.0, -3.0], "length", None)
    assert out[1][0].response_ids == [9] and out[1][1].finish_reason == "length"
    with pytest.raises(RuntimeError, match="3 outputs, expected 2 prompts x n=2"):
        parse_generate_output(items[:3], 2, 2)
    with pytest.raises(RuntimeError, match="row 1 finished with 'abort': client disconnected"):
        parse_generate_output([items[0], sglang_item([1], [-1.0], "abort")], 1, 2)
    bad = sglang_item([1, 2], [-1.0, -1.0], "stop")
    del bad["meta_info"]["output_token_logprobs"]
    with pytest.raises(RuntimeError, match="return_logprob=True"):
        parse_generate_output([bad], 1, 1)
    bad = sglang_item([1, 2], [-1.0, -1.0], "stop")
    bad["output_ids"] = [1, 2, 3]
    with pytest.raises(RuntimeError, match="disagree"):
        parse_generate_output([bad], 1, 1)


def test_check_result():
    check_result((True, "ok"), "x")
    check_result({"success": True}, "x")
    check_result(None, "x")
    with pytest.raises(RuntimeError, match="SGLang update_weights_from_tensor failed: no param foo"):
        check_result((False, "no param foo"), "update_weights_from_tensor")
    with pytest.raises(RuntimeError, match="/flush_cache failed: busy"):
        check_result({"success": False, "message": "busy"}, "/flush_cache")


def test_distributed_update_request_keeps_bucket_order():
    bucket = [("b", torch.zeros(2, 3, dtype=torch.bfloat16)), ("a", torch.zeros(4)), ("c", torch.zeros(1, dtype=torch.float16))]
    req = distributed_update_request(bucket_metadata(bucket), "g")
    assert req == {"names": ["b", "a", "c"], "dtypes": ["bfloat16", "float32", "float16"],
                   "shapes": [[2, 3], [4], [1]], "group_name": "g", "flush_cache": False}


# ------------------------------------------------------------------ the offline engine at its sglang boundary
class _FlushCacheReqOutput:
    """sglang 0.5.11 ``managers/io_struct.py`` FlushCacheReqOutput: ``success``, ``message``."""

    def __init__(self, success, message=""):
        self.success, self.message = success, message


class _SpyEngine:
    """Stands at the ``sglang.Engine`` boundary: records the constructor kwargs and every
    control call, and answers in SGLang's result forms (sglang 0.5.11 ``entrypoints/engine.py``:
    update_weights_from_tensor -> (success, message), flush_cache -> FlushCacheReqOutput,
    release/resume_memory_occupation -> None)."""

    instances = []
    tensor_bucket = None  # SGLang's tensor_bucket module when installed (tests/sglang_reference.py)

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        self.flush_result = _FlushCacheReqOutput(True)
        self.loaded = []  # per update call: per TP worker, the (name, tensor) it loaded
        self.tensor_bucket = _SpyEngine.tensor_bucket
        _SpyEngine.instances.append(self)

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append(("generate", len(input_ids)))
        return [sglang_item([7, 2], [-0.5, -0.25], "stop") for _ in input_ids]

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        # load_format="flattened_bucket": one serialized bucket per TP worker, decoded as SGLang's worker does
        assert load_format == "flattened_bucket" and len(named_tensors) == self.kwargs["tp_size"]
        per_rank = [sglang_reference.worker_load(p, self.tensor_bucket) for p in named_tensors]
        self.calls.append(("update_weights_from_tensor", [n for n, _ in per_rank[0]], flush_cache))
        self.loaded.append(per_rank)
        return True, "Succeeded to update model weights."

    def flush_cache(self):
        self.calls.append(("flush_cache",))
        return self.flush_result

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def shutdown(self):
        self.calls.append(("shutdown",))

    # the asynchronous boundary (sglang 0.5.11): Engine.loop, Engine.async_generate(..., rid=),
    # Engine.tokenizer_manager.abort_request(rid=). The scheduler stand-in samples one token per
    # event-loop tick (token = 4 + position % 9, logprob -position / 100) and finishes an aborted
    # request with the tokens it has, as FINISH_ABORT does.
    @property
    def loop(self):
        import asyncio

        if not hasattr(self, "_loop"):
            self._loop = asyncio.new_event_loop()
        return self._loop

    @property
    def tokenizer_manager(self):
        spy = self

        class _TokenizerManager:
            def abort_request(self, rid="", abort_all=False):
                spy.calls.append(("abort_request", rid))
                spy.aborted.add(rid)

        return _TokenizerManager()

    aborted: set = set()

    async def async_generate(self, input_ids, sampling_params, return_logprob, rid):
        import asyncio

        self.calls.append(("async_generate", list(input_ids), dict(sampling_params), return_logprob, rid))
        ids, lps = [], []
        stops = set(sampling_params.get("stop_token_ids", []))
        while True:
            if any(rid.startswith(a) for a in self.aborted):  # the scheduler matches rid prefixes
                return sglang_item(ids, lps, "abort") if ids else {
                    "text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
            await asyncio.sleep(0.001 * (1 + len(input_ids) % 3))
            position = len(input_ids) + len(ids)
            ids.append(4 + position % 9)
            lps.append(-position / 100)
            if ids[-1] in stops:
                return sglang_item(ids, lps, "stop")
            if len(ids) >= sampling_params["max_new_tokens"]:
                return sglang_item(ids, lps, "length")


@pytest.fixture()
def fake_sglang(monkeypatch):
    """A ``sglang`` module whose ``Engine`` is :class:`_SpyEngine`, with the fake SGLang's
    ``sglang.srt.server_args`` (the pinned field list in 0.5.23's msgspec form) where no real
    SGLang imports."""
    import sys
    import types

    from dapo_megatron.bridge import flat_bucket

    flat_bucket._sglang_metadata_class.cache_clear()
    _SpyEngine.tensor_bucket = sglang_reference.install_tensor_bucket(monkeypatch.setitem)
    mod = sys.modules.get("sglang") if _SpyEngine.tensor_bucket is not None else None
    mod = mod or types.ModuleType("sglang")  # SGLang's real tensor_bucket, if any, hangs below this stub
    monkeypatch.setitem(sys.modules, "sglang", mod)
    monkeypatch.setattr(mod, "Engine", _SpyEngine, raising=False)
    monkeypatch.setattr(mod, "__version__", "0.5.23", raising=False)
    sglang_reference.install_server_args(monkeypatch.setitem)  # the pinned ServerArgs (0.5.23's form)
    _SpyEngine.instances.clear()
    yield mod
    flat_bucket._sglang_metadata_class.cache_clear()


@pytest.fixture()
def tiny_model_dir(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, tie_word_embeddings=True).save_pretrained(tmp_path)
    return str(tmp_path)


def _full_weights(model_dir):
    from transformers import AutoConfig

    from dapo_megatron.bridge.receiver import hf_param_specs

    specs, _ = hf_param_specs(AutoConfig.from_pretrained(model_dir))
    return [(n, torch.zeros(s.shape)) for n, s in specs.items()]


def test_trainer_places_each_ranks_engine_on_its_own_gpu(fake_sglang, tiny_model_dir, monkeypatch):
    """torchrun sets no CUDA_VISIBLE_DEVICES: the engine of local rank r must get base_gpu_id r
    (r % the visible GPUs under Slurm), and every key reaches sglang.Engine as configured."""
    from types import SimpleNamespace

    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.rollout.engines.factory import build_engine, training_engine_spec

    cfg = load_config(DAPOConfig, None, [f"model.hf_path={tiny_model_dir}", "model.params_dtype=bf16",
                                         "rollout.name=sglang", "rollout.gpu_memory_utilization=0.45",
                                         "rollout.deterministic=true", "rollout.engine_kwargs.load_format=dummy",
                                         "rollout.engine_kwargs.random_seed=7"])
    tok = SimpleNamespace(eos_token_id=2)
    hf = SimpleNamespace(eos_token_id=2)
    seen = {}
    for local_rank, visible in [("0", 8), ("3", 8), ("7", 8), ("3", 1)]:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setattr(torch.cuda, "device_count", lambda v=visible: v)
        eng = build_engine(training_engine_spec(cfg, tok, hf))
        seen[(local_rank, visible)] = eng.engine.kwargs["base_gpu_id"]
        assert eng.engine.kwargs == {
            "model_path": tiny_model_dir, "dtype": "bfloat16", "tp_size": 1, "mem_fraction_static": 0.45,
            "enable_memory_saver": True, "base_gpu_id": int(local_rank) % visible,
            "enable_deterministic_inference": True, "load_format": "dummy", "random_seed": 7,
            "disable_prefill_cuda_graph": True}
        assert not eng.weights_valid, "load_format=dummy: random weights until the first sync"
    assert seen == {("0", 8): 0, ("3", 8): 3, ("7", 8): 7, ("3", 1): 0}


def test_engine_kwargs_are_checked_against_sglang_arguments(fake_sglang, tiny_model_dir, monkeypatch):
    import sys
    import types
    from dataclasses import make_dataclass

    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform.sglang_server_args import MANAGED_ENGINE_ARGS, check_engine_kwargs, engine_argument_names
    from dapo_megatron.platform.sglang_server_args import SERVER_ARGS_FIELDS

    base = [f"model.hf_path={tiny_model_dir}", "rollout.name=sglang"]
    with pytest.raises(ValueError, match=r"rollout\.engine_kwargs\.load_fromat is not an sglang\.Engine argument"
                                         r".*0\.5\.23.*did you mean load_format"):
        load_config(DAPOConfig, None, base + ["rollout.engine_kwargs.load_fromat=dummy"])
    with pytest.raises(ValueError, match=r"rollout\.engine_kwargs\.mem_fraction_static is set by dapo-megatron "
                                         r"from rollout\.gpu_memory_utilization"):
        load_config(DAPOConfig, None, base + ["rollout.engine_kwargs.mem_fraction_static=0.3"])
    with pytest.raises(ValueError, match=r"rollout\.engine_kwargs=\{'load_format': 'dummy'\} apply to the 'sglang' engine"):
        load_config(DAPOConfig, None, [f"model.hf_path={tiny_model_dir}", "rollout.engine_kwargs.load_format=dummy"])
    # every argument this package passes is a field of the pinned ServerArgs
    assert set(MANAGED_ENGINE_ARGS) <= SERVER_ARGS_FIELDS
    assert {"load_format", "random_seed", "enable_weights_cpu_backup", "skip_tokenizer_init"} <= SERVER_ARGS_FIELDS
    # where sglang imports, its real ServerArgs is the reference
    srt = types.ModuleType("sglang.srt")
    sa = types.ModuleType("sglang.srt.server_args")
    sa.ServerArgs = make_dataclass("ServerArgs", [("model_path", str), ("brand_new_flag", bool)])
    monkeypatch.setitem(sys.modules, "sglang.srt", srt)
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", sa)
    names, source = engine_argument_names()
    assert names == {"model_path", "brand_new_flag"} and source == "sglang 0.5.23 ServerArgs"
    assert check_engine_kwargs({"brand_new_flag": True}) == {"brand_new_flag": True}
    with pytest.raises(ValueError, match="load_format is not an sglang.Engine argument"):
        check_engine_kwargs({"load_format": "dummy"})


def test_dtype_aliases_map_to_sglang_names():
    from dapo_megatron.rollout.engines.sglang_engine import sglang_dtype

    assert [sglang_dtype(d) for d in ("bf16", "fp16", "fp32", "bfloat16", torch.bfloat16, torch.float32)] == [
        "bfloat16", "float16", "float32", "bfloat16", "bfloat16", "float32"]
    with pytest.raises(ValueError, match="not an SGLang dtype"):
        sglang_dtype(torch.int8)


def test_sleep_wake_sync_order_and_weight_validity(fake_sglang, tiny_model_dir):
    """The tags and order of release / resume / update / flush handed to sglang.Engine, and
    weights_valid through sleep (weights released: invalid until a sync), sleep(keep_weights)
    and a sync into a sleeping engine."""
    from dapo_megatron.bridge.receiver import InvalidWeightsError
    from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine

    eng = SGLangEngine(tiny_model_dir, base_gpu_id=0, update_bucket_mb=1)
    spy = eng.engine
    weights = _full_weights(tiny_model_dir)
    p = SamplingParams(max_new_tokens=2)
    assert eng.weights_valid and len(eng.generate([[1, 2]], p)) == 1

    spy.calls.clear()
    eng.sleep()  # everything released, no CPU backup: the weights are gone
    assert spy.calls == [("release", ["cuda_graph", "weights", "kv_cache"])] and not eng.weights_valid
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[1]], p)
    eng.wake_up()
    assert spy.calls[-1] == ("resume", ["cuda_graph", "weights", "kv_cache"])
    with pytest.raises(InvalidWeightsError, match="not valid"):
        eng.generate([[1]], p)
    eng.update_weights(weights, version=1)
    assert eng.weights_valid and spy.calls[-1] == ("flush_cache",) and eng.generate([[1]], p)

    spy.calls.clear()
    eng.sleep(keep_weights=True)  # KV cache and CUDA graphs only: the weights survive
    eng.wake_up()
    assert spy.calls == [("release", ["cuda_graph", "kv_cache"]), ("resume", ["cuda_graph", "kv_cache"])]
    assert eng.weights_valid

    spy.calls.clear()
    eng.sleep()
    eng.update_weights(weights, version=2)  # the trainer syncs while the engine sleeps
    assert eng.weights_valid and eng.is_asleep
    eng.wake_up()
    ops = [c[0] for c in spy.calls]
    assert spy.calls[1] == ("resume", ["weights"]), "weights mapped back before the first bucket"
    assert ops == ["release", "resume"] + ["update_weights_from_tensor"] * (len(ops) - 4) + ["resume", "flush_cache"]
    assert spy.calls[-2] == ("resume", ["cuda_graph", "kv_cache"])
    assert all(c[2] is False for c in spy.calls if c[0] == "update_weights_from_tensor"), "one flush per sync"
    assert eng.weight_version == 2

    # a failed flush (FlushCacheReqOutput.success=False) is an error carrying SGLang's message
    spy.flush_result = _FlushCacheReqOutput(False, "Another flush_cache is already in progress.")
    with pytest.raises(RuntimeError, match="flush_cache failed: Another flush_cache is already in progress"):
        eng.update_weights(weights, version=3)


def test_async_rows_submit_poll_abort_at_the_sglang_boundary(fake_sglang, tiny_model_dir):
    """Each row is one async_generate task with prompt + prefix, its remaining budget and its own
    seed, under a fixed-width rid; abort() aborts every rid in flight and returns the partial
    outputs; an aborted output that already ends on a stop token counts as stopped."""
    from dapo_megatron.rollout.engines.engine import RowRequest, sample_seed
    from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine

    eng = SGLangEngine(tiny_model_dir, base_gpu_id=0)
    spy = eng.engine
    spy.aborted = set()
    p = SamplingParams(max_new_tokens=40, stop_token_ids=(12,), seed=3)
    short = SamplingParams(max_new_tokens=2, seed=3)
    eng.submit([RowRequest("a", [1, 2], short, 7, 0), RowRequest("b", [1, 2, 3], p, 7, 1, prefix_ids=[5, 6]),
                RowRequest("c", [1], SamplingParams(max_new_tokens=40, seed=3), 8, 0)])
    calls = [c for c in spy.calls if c[0] == "async_generate"]
    assert calls == [] and eng.num_in_flight == 3, "tasks start when the loop runs (poll / abort)"
    done = eng.poll(max_tokens=1)
    calls = {c[4]: c for c in spy.calls if c[0] == "async_generate"}
    assert len(calls) == 3 and len({len(r) for r in calls}) == 1, "fixed-width rids"
    by_prompt = {tuple(c[1]): c for c in calls.values()}
    b = by_prompt[(1, 2, 3, 5, 6)]  # the continued row: its prefix follows the prompt
    assert b[2]["max_new_tokens"] == 38 and b[2]["sampling_seed"] == sample_seed(3, 7, 1) and b[3] is True
    assert by_prompt[(1, 2)][2]["sampling_seed"] == sample_seed(3, 7, 0)
    assert [(r.key, r.response_ids, r.finish_reason) for r in done] == [("a", [6, 7], "length")]
    out = {r.key: r for r in eng.abort()}
    assert eng.num_in_flight == 0 and sorted(out) == ["b", "c"]
    assert {c[1] for c in spy.calls if c[0] == "abort_request"} == set(calls) - {by_prompt[(1, 2)][4]}
    assert out["c"].finish_reason == "abort" and out["c"].response_ids[:2] == [5, 6]
    assert out["c"].logprobs[:2] == [-0.01, -0.02] and out["c"].version == eng.weight_version
    assert out["b"].finish_reason in ("abort", "stop")  # 12 is a stop id, reached at position 8
    assert out["b"].response_ids[0] == 4 + 5 % 9


def test_aborted_output_that_already_finished():
    from dapo_megatron.rollout.engines.engine import RowRequest
    from dapo_megatron.rollout.engines.sglang_io import parse_row_output

    row = RowRequest("k", [1], SamplingParams(max_new_tokens=5, stop_token_ids=(9,)), 0, 0, prefix_ids=[4, 4])
    item = lambda ids: sglang_item(ids, [-0.5] * len(ids), "abort") if ids else {
        "meta_info": {"finish_reason": {"type": "abort"}}}
    assert parse_row_output(item([5, 9]), row, 2).finish_reason == "stop"
    assert parse_row_output(item([5, 2]), row, 2, eos_token_ids=frozenset({2})).finish_reason == "stop"
    assert parse_row_output(item([5, 6, 7]), row, 2).finish_reason == "length"  # 2 + 3 = the 5-token budget
    assert parse_row_output(item([5]), row, 2) == ("k", [5], [-0.5], "abort", 2, None)
    assert parse_row_output(item([]), row, 2) == ("k", [], [], "abort", 2, None)


def test_cpu_weight_backup_keeps_weights_valid_across_sleep(fake_sglang, tiny_model_dir):
    from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine

    eng = SGLangEngine(tiny_model_dir, base_gpu_id=0, engine_kwargs={"enable_weights_cpu_backup": True})
    assert eng.engine.kwargs["enable_weights_cpu_backup"] is True
    eng.sleep()
    eng.wake_up()
    assert eng.weights_valid and eng.generate([[1]], SamplingParams(max_new_tokens=2))
    no_saver = SGLangEngine(tiny_model_dir, base_gpu_id=0, enable_memory_saver=False)
    with pytest.raises(RuntimeError, match="memory saver"):
        no_saver.sleep()


def test_check_result_reads_every_sglang_result_form():
    check_result(_FlushCacheReqOutput(True), "flush_cache")
    with pytest.raises(RuntimeError, match="flush_cache failed: busy"):
        check_result(_FlushCacheReqOutput(False, "busy"), "flush_cache")
    with pytest.raises(RuntimeError, match=r"flush_cache failed: \(SGLang gave no message"):
        check_result(_FlushCacheReqOutput(False), "flush_cache")
    with pytest.raises(RuntimeError, match="unexpected result"):
        check_result(["not", "a", "result"], "x")


def test_error_messages_of_each_endpoint_format():
    from dapo_megatron.platform.http import sglang_error_message

    # sglang 0.5.11 http_server.py: weight-update endpoints, _create_error_response, FastAPI 422, /flush_cache
    assert sglang_error_message(b'{"success": false, "message": "shape mismatch"}') == "shape mismatch"
    assert sglang_error_message(b'{"error": {"message": "not idle"}}') == "not idle"
    assert "field required" in sglang_error_message(b'{"detail": [{"msg": "field required"}]}')
    assert sglang_error_message(b"Another flush_cache is already in progress.") == \
        "Another flush_cache is already in progress."
    assert sglang_error_message(b"") == "(empty response body)"


def test_engine_starts_after_the_allocator_cache_is_emptied(fake_sglang, tiny_model_dir, monkeypatch):
    """Issue 18 item 6: SGLang sizes its KV pool from the memory free when it starts, so the
    colocated engine hands the allocator's cached blocks back (synchronize, empty_cache) before
    sglang.Engine is built, in the trainer's path and in tools/eval.py's."""
    from types import SimpleNamespace

    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.rollout.engines.factory import build_engine, training_engine_spec

    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    real_init = _SpyEngine.__init__
    monkeypatch.setattr(_SpyEngine, "__init__", lambda self, **kw: (events.append("Engine"), real_init(self, **kw))[1])
    cfg = load_config(DAPOConfig, None, [f"model.hf_path={tiny_model_dir}", "rollout.name=sglang"])
    build_engine(training_engine_spec(cfg, SimpleNamespace(eos_token_id=2), SimpleNamespace(eos_token_id=2)))
    assert events == ["synchronize", "empty_cache", "Engine"]
