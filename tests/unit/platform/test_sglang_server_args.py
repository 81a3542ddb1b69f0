"""The SGLang server-args table (``platform/sglang_server_args.py``) is sglang 0.5.23's, and
nothing falls back to an older list silently (issue 34 item 3).

sglang 0.5.23's ``ServerArgs`` is a ``msgspec.Struct`` (``srt/server_args.py:551``), no dataclass:
the 0.5.11-era reader (``dataclasses.fields``) failed on it and fell back to the 0.5.11 list. The
fields named below were read in the 0.5.23 and 0.5.11 wheels (``arg_groups/fields/exec_.py``
``ExecGraph``, ``schedule.py``, ``parallel.py``; 0.5.11 ``server_args.py``)."""

from __future__ import annotations

import sys
import types
from dataclasses import make_dataclass

import pytest

import sglang_reference

from dapo_megatron.platform import sglang_server_args as sa

#: only in 0.5.23 (absent from 0.5.11's ServerArgs)
NEW_IN_0_5_23 = ("cuda_graph_backend_prefill", "disable_prefill_cuda_graph", "cuda_graph_max_bs_decode",
                 "attn_dp_size", "retraction_policy", "detokenizer_worker_num", "enable_tf32_matmul")
#: in 0.5.11's ServerArgs, removed by 0.5.23
GONE_IN_0_5_23 = ("disable_piecewise_cuda_graph", "piecewise_cuda_graph_max_tokens", "cuda_graph_max_bs",
                  "cuda_graph_bs", "torchao_config", "enable_nan_detection", "nsa_prefill_backend")


def _no_sglang(monkeypatch):
    """The CPU machine: ``import sglang`` fails."""
    monkeypatch.setitem(sys.modules, "sglang", None)
    monkeypatch.delitem(sys.modules, "sglang.srt", raising=False)
    monkeypatch.delitem(sys.modules, "sglang.srt.server_args", raising=False)


def test_the_pinned_table_is_sglang_0_5_23s(monkeypatch):
    _no_sglang(monkeypatch)
    names, source = sa.engine_argument_names()
    assert source == "sglang 0.5.23 ServerArgs (pinned list)" and len(names) == 546
    for name in NEW_IN_0_5_23:
        assert name in names
        assert sa.check_engine_kwargs({name: None}) == {name: None}
    for name in GONE_IN_0_5_23:
        assert name not in names
        with pytest.raises(ValueError, match=rf"rollout\.engine_kwargs\.{name} is not an sglang\.Engine argument "
                                             r"\(a field of sglang 0\.5\.23 ServerArgs"):
            sa.check_engine_kwargs({name: True})
    # the image installs the version the table was read from
    import os
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with open(os.path.join(repo, "docker", "constraints.txt")) as f:
        pins = dict(line.split("#")[0].strip().split("==") for line in f if line.split("#")[0].strip().count("==") == 1)
    assert pins["sglang"] == sa.SGLANG_VERSION


def _installed(monkeypatch, server_args_cls, version="9.9.9"):
    mod = types.ModuleType("sglang")
    mod.__version__ = version
    srt = types.ModuleType("sglang.srt")
    sargs = types.ModuleType("sglang.srt.server_args")
    sargs.ServerArgs = server_args_cls
    for name, m in (("sglang", mod), ("sglang.srt", srt), ("sglang.srt.server_args", sargs)):
        monkeypatch.setitem(sys.modules, name, m)


def test_the_installed_serverargs_is_read_in_each_form_and_an_unreadable_one_is_an_error(monkeypatch):
    # msgspec form (0.5.23): __struct_fields__, what msgspec.structs.fields reads
    _installed(monkeypatch, type("ServerArgs", (), {"__struct_fields__": ("model_path", "brand_new_flag")}))
    assert sa.engine_argument_names() == ({"model_path", "brand_new_flag"}, "sglang 9.9.9 ServerArgs")
    # dataclass form (<= 0.5.1x)
    _installed(monkeypatch, make_dataclass("ServerArgs", [("model_path", str), ("old_flag", bool)]))
    assert sa.engine_argument_names()[0] == {"model_path", "old_flag"}
    # a form nobody taught the reader: an error, never the pinned list
    _installed(monkeypatch, type("ServerArgs", (), {"__init__": lambda self, **kw: None}))
    with pytest.raises(RuntimeError, match=r"cannot read the fields of .*ServerArgs.*neither a msgspec\.Struct "
                                           r"nor a dataclass"):
        sa.check_engine_kwargs({"load_format": "dummy"})
    # installed but its server_args does not import: an error too
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", None)
    with pytest.raises(RuntimeError, match=r"sglang 9\.9\.9 is installed but sglang\.srt\.server_args does not import"):
        sa.engine_argument_names()


def test_the_fake_sglang_refuses_an_unknown_field_as_sglang_0_5_23_does(monkeypatch):
    """sglang 0.5.23 + msgspec 0.23, read on this machine from the wheel:
    ``ServerArgs(model_path="x", no_such_field=1)`` raises ``TypeError: Unexpected keyword argument
    'no_such_field'``; ``ServerArgs(tp_size=1)``: ``TypeError: Missing required argument 'model_path'``."""
    _no_sglang(monkeypatch)
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    fake = sglang_reference.install_server_args(monkeypatch.setitem)
    assert fake.__file__ == sglang_reference.FAKE_SERVER_ARGS
    with pytest.raises(TypeError, match=r"^Unexpected keyword argument 'no_such_field'$"):
        fake.ServerArgs(model_path="x", no_such_field=1)
    with pytest.raises(TypeError, match=r"^Unexpected keyword argument 'disable_piecewise_cuda_graph'$"):
        fake.ServerArgs(model_path="x", disable_piecewise_cuda_graph=True)
    with pytest.raises(TypeError, match=r"^Missing required argument 'model_path'$"):
        fake.ServerArgs(tp_size=1)
    args = fake.ServerArgs(model_path="x", disable_prefill_cuda_graph=True)
    assert args.disable_prefill_cuda_graph is True and args.tp_size == 1 and args.log_level == "info"
    # and the package reads the fake as it reads the real one
    assert sa.engine_argument_names() == (sa.SERVER_ARGS_FIELDS, "sglang ? ServerArgs")


def test_a_colocated_engine_runs_without_the_prefill_graph_that_the_memory_saver_cannot_hold():
    """Issue 36 item 4, sglang 0.5.23: the default prefill CUDA graph ("breakable") raises
    NotImplementedError under the memory saver with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 and, without
    that variable, stays resident through sleep; the colocated engine turns it off unless the user
    chose a prefill graph, and refuses the one choice that cannot start."""
    released, resident = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}, {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "0"}
    assert sa.colocated_graph_kwargs({}, True, released) == {"disable_prefill_cuda_graph": True}
    assert sa.colocated_graph_kwargs({"load_format": "dummy"}, True, {}) == {"disable_prefill_cuda_graph": True}
    assert sa.colocated_graph_kwargs({}, False, released) == {}  # no sleep (evaluation): SGLang's default
    assert sa.colocated_graph_kwargs({"cuda_graph_backend_prefill": "full"}, True, released) == {}
    assert sa.colocated_graph_kwargs({"disable_prefill_cuda_graph": False}, True, resident) == {}
    assert sa.colocated_graph_kwargs({"cuda_graph_backend_prefill": "breakable"}, True, resident) == {}
    with pytest.raises(ValueError, match=r"cuda_graph_backend_prefill=breakable: SGLang's breakable CUDA graph does "
                                         r"not start under the memory saver"):
        sa.colocated_graph_kwargs({"cuda_graph_backend_prefill": "breakable"}, True, released)
    assert all(k in sa.SERVER_ARGS_FIELDS for k in sa.PREFILL_GRAPH_ARGS)


def test_every_request_body_names_only_sglang_0_5_23_fields(monkeypatch):
    """The bodies the package sends (spied at ``http_post``) against 0.5.23's io_struct
    (tests/sglang_reference.py): SGLang's HTTP schema drops an unknown field without a word."""
    from dapo_megatron.bridge import servers
    from dapo_megatron.rollout.engines.engine import RowRequest, SamplingParams
    from dapo_megatron.rollout.engines.sglang_io import build_generate_request, build_row_request

    sent = []
    monkeypatch.setattr(servers, "http_post", lambda url, path, body, *a, **k: sent.append((path, body)))
    servers.pause_servers(["http://a"], 1)
    servers.flush_and_continue(["http://a"], 1)
    sender = servers.ServerWeightSender([servers.ServerInfo("http://a", 2)], 0, device="cpu", timeout_s=1,
                                        bucket_bytes=1 << 20)
    assert sender.destroy() == []
    assert [p for p, _ in sent] == ["/pause_generation", "/flush_cache", "/continue_generation",
                                    "/destroy_weights_update_group"]
    assert sent[0][1] == {"mode": "abort"} and sent[3][1] == {"group_name": "dapo_weights_pp0"}
    for path, body in sent:
        assert set(body or {}) <= sglang_reference.REQUEST_FIELDS[path], (path, body)
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=8, stop_token_ids=(7,), seed=1)
    for req in (build_generate_request([[1, 2, 3]], params, [4]),
                build_row_request(RowRequest(key=0, prompt_ids=[1, 2], params=params, prompt_seed=3, index=1,
                                             prefix_ids=[5]), "dapo-0-000001")):
        assert set(req) <= sglang_reference.GENERATE_FIELDS, req
        for sp in (req["sampling_params"] if isinstance(req["sampling_params"], list) else [req["sampling_params"]]):
            assert set(sp) <= sglang_reference.SAMPLING_FIELDS and sp["sampling_seed"] is not None, sp
