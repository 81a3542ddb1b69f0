"""CPU compatibility layer, process-group setup and the console filters (docs/design.md §5)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from dapo_megatron.platform import ParallelConfig, spawn


def _run_isolated(code: str) -> str:
    """Run code in a fresh interpreter: activation is process-global."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_activate_rewrites_cuda_placements_and_type_strings():
    out = _run_isolated(
        """
        import torch
        from dapo_megatron.platform import cpu_compat
        assert cpu_compat.activate() is True and cpu_compat.activate() is True
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2, device=torch.device("cuda", 0)).cuda().to("cuda:0")
        print(x.device, y.device, torch.cuda.current_device())
        print(x.type(), x.bfloat16().type(), x.half().type(), torch.zeros(1, dtype=torch.int64).type())
        torch.cuda.manual_seed(7); a = torch.rand(2)
        torch.cuda.manual_seed(7); b = torch.rand(2)
        print(bool(torch.equal(a, b)))
        with cpu_compat.native_torch():  # the mode bypassed inside (the weight sync's hot loop), restored after
            print(torch.overrides._get_current_function_mode() is None, x.type())
        print(torch.overrides._get_current_function_mode() is cpu_compat._MODE, x.type())
        """
    )
    lines = out.strip().splitlines()
    assert lines[3:5] == ["True torch.FloatTensor", "True torch.cuda.FloatTensor"]
    assert lines[0] == "cpu cpu cpu"
    assert lines[1].split() == [
        "torch.cuda.FloatTensor",
        "torch.cuda.BFloat16Tensor",
        "torch.cuda.HalfTensor",
        "torch.LongTensor",
    ]
    assert lines[2] == "True"


def test_megatron_rng_tracker_forks_streams_on_cpu():
    out = _run_isolated(
        """
        import torch
        import torch.distributed as dist
        from dapo_megatron.platform import ParallelConfig, init_distributed
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        init_distributed(ParallelConfig(distributed_timeout_minutes=7.5), seed=3)
        # the key is every group's timeout, the world's (init_process_group) and megatron-core's
        print(sorted({pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                      for pg in dist.distributed_c10d._world.pg_map}))
        torch.manual_seed(0)
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            a = torch.rand(4)
        # the default stream is restored, the model-parallel stream advanced
        assert torch.equal(torch.get_rng_state(), before)
        with get_cuda_rng_tracker().fork():
            b = torch.rand(4)
        print(bool(torch.equal(a, b)))
        """
    )
    assert out.strip().splitlines() == ["[450.0]", "False"]


def test_parallel_config_rejects_bad_layouts():
    with pytest.raises(ValueError, match=r"^tensor_model_parallel_size=2 × pipeline_model_parallel_size=2 does "
                                         r"not divide the world size 2: launch torchrun with --nproc_per_node a "
                                         r"multiple of 4"):
        ParallelConfig(2, 2).check_world_size(2)
    ParallelConfig(2, 2).check_world_size(8)
    with pytest.raises(ValueError, match="^tensor_model_parallel_size=0 must be >= 1$"):
        ParallelConfig(0, 1).validate()
    with pytest.raises(ValueError, match="^pipeline_model_parallel_size=0 must be >= 1$"):
        ParallelConfig(1, 0).validate()
    with pytest.raises(ValueError, match=r"^distributed_timeout_minutes=0 must be > 0 \(minutes\)$"):
        ParallelConfig(distributed_timeout_minutes=0).validate()


def _train_three_steps(tp: int, init_sd=None):
    """Build the tiny GPT at TP=``tp`` (``init_sd``: TP=1 weights to load, or None for the
    seeded init), train 3 Adam steps (distributed optimizer, clipping) on fixed data; returns
    (initial full weights or None, losses, grad norms, the DDP-wrapped model, the layout)."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from dapo_megatron.platform import init_distributed
    from unit.actor.test_actor import _local_shards

    par = init_distributed(ParallelConfig(tp, 1), seed=5)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64, max_sequence_length=32,
        position_embedding_type="rope",
    )
    if init_sd is None:  # TP=1, DP=2: both ranks start from rank 0's weights
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        init_sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        shards = _local_shards(model, init_sd, cfg, par)
        for n, p in model.named_parameters():
            p.data.copy_(shards[n])
        init_sd = None
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0), [ddp]
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    pos = torch.arange(8).expand(2, 8)
    losses, norms = [], []
    for _ in range(3):
        opt.zero_grad()
        ddp.zero_grad_buffer()
        loss = ddp(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok
        losses.append(loss.item())
        norms.append(float(grad_norm))
    return init_sd, losses, norms, ddp, par


def _tp2_step(result_path: str) -> None:
    """TP=1 reference first (the 2 ranks as DP=2 replicas of the same batch: the DP mean of two
    equal gradients is exact), then TP=2 from the same initial weights in the same processes."""
    import torch.distributed as dist

    from unit.actor.test_actor import _weight_errors

    init_sd, ref_losses, ref_norms, ref, _ = _train_three_steps(tp=1)
    ref_sd = {n: p.detach().clone() for n, p in ref.module.named_parameters()}
    _, losses, norms, ddp, par = _train_three_steps(tp=2, init_sd=init_sd)
    errors = _weight_errors(ddp.module, ref_sd, ddp.module.config, par)
    moved = {n: float((ref_sd[n] - w).abs().max()) for n, w in init_sd.items()}
    gathered = [None, None]
    dist.all_gather_object(gathered, dict(losses=losses, norms=norms, errors=errors))
    if dist.get_rank() == 0:
        torch.save({"ranks": gathered, "tp": par.tp_size, "ref_losses": ref_losses,
                    "ref_norms": ref_norms, "moved": moved}, result_path)


@pytest.mark.dist
def test_tp2_train_steps_on_two_gloo_processes(tmp_path):
    """3 Adam steps at TP=2 give the TP=1 losses, grad norms and weights (each rank's shard)."""
    path = str(tmp_path / "out.pt")
    spawn(_tp2_step, 2, path)
    out = torch.load(path)
    assert out["tp"] == 2
    rank0, rank1 = out["ranks"]
    assert rank0["losses"] == rank1["losses"]  # TP ranks see the same (all-reduced) loss
    assert out["ref_losses"][-1] < out["ref_losses"][0]
    for r in (rank0, rank1):
        for got, want in zip(r["losses"] + r["norms"], out["ref_losses"] + out["ref_norms"]):
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)
        # lr 1e-2: 3 Adam steps move every tensor by 2.8e-2 to 3.0e-2 (max |dw|); the TP=2 shards
        # differ from TP=1 by <= 1.9e-6 (fp32 round-off in the gradients); a missing or wrong
        # gradient reduction moves elements by ~lr
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < 1e-5, (worst, r["errors"][worst])
    assert min(out["moved"].values()) > 1e-2


def test_cpu_grad_norm_accumulates_in_float64():
    """The CPU fallback of Megatron's grad-norm kernel is replaced by an fp64-accumulating one
    whose result equals an independent float64 norm (the fp32 torch.norm fallback is off by
    ~1e-5..1e-4 relative on tensors of this size)."""
    out = _run_isolated(
        """
        import math, torch
        from dapo_megatron.platform import cpu_compat
        cpu_compat.activate()
        from megatron.core.optimizer import clip_grads
        g = torch.Generator().manual_seed(0)
        ts = [torch.randn(3_000_000, generator=g) * 1e-3, torch.randn(577, 64, generator=g)]
        norm, _ = clip_grads.l2_norm_impl(2048 * 32, None, [ts], False)
        exact = math.sqrt(sum(float((t.double() ** 2).sum()) for t in ts))
        print(clip_grads.l2_norm_impl is cpu_compat._l2_norm_fp64, norm.dtype, abs(float(norm[0]) - exact) / exact)
        """
    )
    same, dtype, rel = out.split()
    assert same == "True" and dtype == "torch.float32"
    assert float(rel) < 1e-7


def test_non_leaf_grad_read_under_the_mode_is_silent_and_unchanged():
    """megatron's DistributedOptimizer reads ``.grad`` of its fp32 shard views (non-leaf)
    before assigning it: the same value as without the layer, and no UserWarning."""
    out = _run_isolated(
        """
        import warnings
        import torch
        from dapo_megatron.platform import cpu_compat

        def read(t):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                g = t.grad
            return g, len(caught)

        p = torch.nn.Parameter(torch.ones(6))
        print(read(p.view(-1)[2:5]))  # plain torch warns
        cpu_compat.activate(force=True)
        shard = p.view(-1)[2:5]  # what distrib_optimizer builds for an fp32 parameter
        print(read(shard))
        shard.grad = torch.full((3,), 0.5)
        print(read(shard)[0].tolist())
        kept = (p * 2).sum()
        kept.retain_grad()
        kept.backward()
        print(read(kept)[0].item(), read(p)[0].tolist())
        """
    )
    assert out.strip().splitlines() == ["(None, 1)", "(None, 0)", "[0.5, 0.5, 0.5]", "1.0 [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]"]


def test_console_hides_exactly_the_known_benign_warnings():
    import logging
    import warnings

    from dapo_megatron.platform import console

    def shown(text, category=UserWarning, module="megatron.core.optimizer"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert console.quiet_third_party(on_cpu=on_cpu, environ={}) is True
            warnings.warn_explicit(text, category, "f.py", 1, module=module)
        return len(caught)

    te = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    hint = ("When using async grad allreduce it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
    on_cpu = True
    assert shown(te) == 0
    assert shown(te, module="dapo_megatron.actor.actor") == 1  # our own code is never filtered
    assert shown("Something else is not installed", module="megatron.core.optimizer") == 1
    assert shown(te, category=DeprecationWarning) == 1
    assert shown(hint, module="megatron.core.tensor_parallel.layers") == 0
    assert shown("`torch.distributed.all_gather_into_tensor` is deprecated. Please use x", FutureWarning,
                 "torch.distributed.c10d_logger") == 0
    on_cpu = False  # a GPU run keeps the advice that can matter there
    assert shown(hint, module="megatron.core.tensor_parallel.layers") == 1 and shown(te) == 1
    assert shown("full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
                 module="megatron.core.transformer.transformer_config") == 0
    assert shown("absl.logging is not installed. Using logging.getLogger(__name__) instead.",
                 module="megatron.core.hyper_comm_grid") == 0
    assert shown("The argument order of load has been changed. Please check the document",
                 module="megatron.core.dist_checkpointing.strategies.torch") == 0
    assert shown("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in "
                 "a single process.", module="torch.distributed.checkpoint.utils") == 0
    assert shown("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
                 module="dapo_megatron.platform.cpu_compat") == 1  # on a GPU: cpu_compat is not active there
    assert shown("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
                 module="dapo_megatron.actor.actor") == 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert console.quiet_third_party(environ={"DAPO_SHOW_WARNINGS": "1"}) is False
        warnings.warn_explicit(te, UserWarning, "f.py", 1, module="megatron.core.optimizer")
    assert len(caught) == 1
    assert console.show_warnings({"DAPO_SHOW_WARNINGS": "0"}) is False

    on_cpu = True
    assert shown("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
                 module="dapo_megatron.platform.cpu_compat") == 0

    # the known-benign log records: dropped by their logger's filter, any other record of it kept
    console.quiet_third_party(on_cpu=True, environ={})
    for r in console.KNOWN_BENIGN_LOG_RECORDS:
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        log = logging.getLogger(r.logger)
        log.addHandler(handler)
        try:
            log.warning(r.message.replace("\\", "") + " and the rest of its text")
            log.warning("another warning")
        finally:
            log.removeHandler(handler)
        assert [rec.getMessage() for rec in records] == ["another warning"], r.logger

    saved = {n: logging.getLogger(n).level for n in console.QUIET_LOGGERS}
    try:
        console.quiet_third_party(on_cpu=True, environ={})
        log = logging.getLogger("megatron.core.distributed.param_and_grad_buffer")
        assert not log.isEnabledFor(logging.INFO) and log.isEnabledFor(logging.WARNING)
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


def test_console_filters_match_megatron_core_at_import():
    """The real import-time warnings and log records of megatron-core 0.19.2 and PyPI's (CUDA) torch
    on a CPU machine are the ones filtered."""
    code = """
        import sys  # Python's default warning filters, as in the main job
        if sys.argv[1] == "quiet":
            from dapo_megatron.platform.console import quiet_third_party
            quiet_third_party()
            assert "torch" not in sys.modules  # the CPU-only filters wait for torch's import (a tool's bad flag never loads it)
        import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs, megatron.core.hyper_comm_grid
        from megatron.core.transformer import TransformerConfig
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        import logging, torch.utils.cpp_extension as ext
        logging.getLogger(ext.__name__).warning("No CUDA runtime is found, using CUDA_HOME='/x'")  # its text
        logging.getLogger(ext.__name__).warning("another record")  # not filtered
        from megatron.core.models.gpt import gpt_model
        gpt_model.logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")  # its text
        """
    runs = {}
    for mode in ("quiet", "show"):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), mode], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mode] = out.stderr
    if torch.cuda.is_available():
        pytest.skip("the CPU-only entries are kept on a GPU machine")
    for text in ("Transformer Engine and Apex are not installed", "Apex is not installed. Falling back to Torch Norm",
                 "full scope is deprecated", "absl.logging is not installed", "No CUDA runtime is found",
                 "GPTModel IS DEPRECATED"):
        assert text in runs["show"] and text not in runs["quiet"], text
    assert "Warning" not in runs["quiet"], runs["quiet"][-2000:]
    assert runs["quiet"].strip().endswith("] another record"), runs["quiet"][-2000:]
    assert len(runs["quiet"].strip().splitlines()) == 1, runs["quiet"][-2000:]


def test_local_device_index_wraps_local_rank_over_visible_gpus(monkeypatch):
    """Slurm with one GPU per task: LOCAL_RANK counts the node's tasks, one device is visible."""
    from dapo_megatron.platform import device, local_device_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for local_rank, count, want in [("3", 1, 0), ("11", 8, 3), ("5", 8, 5), ("0", 2, 0)]:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        assert local_device_index() == want
        assert device() == torch.device("cuda", want)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        local_device_index()


def test_collective_device_follows_the_group_backend(monkeypatch):
    import dapo_megatron.platform.distributed as pdist

    monkeypatch.setattr(pdist, "device", lambda: torch.device("cuda", 2))
    monkeypatch.setattr(pdist, "group_backend", lambda group=None: "nccl")
    assert pdist.collective_device() == torch.device("cuda", 2)
    monkeypatch.setattr(pdist, "group_backend", lambda group=None: "gloo")
    assert pdist.collective_device() == torch.device("cpu")


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel may give a just-closed port again (three rollout servers started together got two
    the same): ``free_port`` skips the ports it handed out before."""
    import socket

    from dapo_megatron.platform import distributed

    given = iter([47001, 47001, 47002, 47001, 47002, 47003])  # what the kernel binds, in order

    class Kernel:
        def __init__(self, *args):
            self.port = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            assert address == ("127.0.0.1", 0)
            self.port = next(given)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(distributed, "_issued_ports", set())
    monkeypatch.setattr(socket, "socket", Kernel)
    assert [distributed.free_port() for _ in range(3)] == [47001, 47002, 47003]
    monkeypatch.setattr(distributed, "_issued_ports", {47001})
    given = iter([47001] * 100)
    with pytest.raises(RuntimeError, match="100 ports"):
        distributed.free_port()
