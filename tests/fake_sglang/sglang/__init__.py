"""A fake ``sglang`` for CPU tests that behaves like sglang 0.5.23 at the PROCESS level.

Put ``tests/fake_sglang`` first on ``sys.path`` (only in a subprocess: it shadows any real
SGLang). Written from the pinned source (the sglang 0.5.23 wheel's ``sglang/srt/``; first from 0.5.11's):

* ``Engine(**kwargs)`` (``entrypoints/engine.py``): builds ``srt/server_args.py``'s ``ServerArgs``
  (the pinned fields of ``dapo_megatron.platform.sglang_server_args``; like 0.5.23's
  ``msgspec.Struct`` it refuses an unknown one with ``TypeError: Unexpected keyword argument``),
  registers ``atexit(self.shutdown)``, runs
  ``_set_envs_and_config`` (the same variables, SIGQUIT handler and ``spawn`` start method), and
  starts ``tp_size`` scheduler processes with ``multiprocessing`` (spawn: each inherits
  ``os.environ`` as it is at ``start()``) that do what ``model_runner.py``
  ``init_torch_distributed`` does first: ``init_process_group(init_method="tcp://127.0.0.1:
  <nccl_port>", world_size=tp_size, rank=tp_rank, timeout=dist_timeout)``, on gloo (CPU). The
  parent waits for every scheduler's ready message as ``_wait_for_scheduler_ready`` does (a
  scheduler that dies first is an error naming its rank); then a detokenizer process;
  ``get_all_child_pids()`` lists them.
* ``Engine.shutdown()``: ``kill_process_tree(os.getpid(), include_parent=False,
  wait_timeout=60)``, i.e. EVERY child of the process, as the real one.
* ``update_weights_from_tensor(named_tensors, load_format="flattened_bucket")``: entry ``i``
  goes to scheduler ``i`` (``managers/tp_worker.py``), which deserializes it (``ForkingPickler``
  bytes: CUDA-IPC handles on GPU, shared memory on CPU), views each tensor of the flat buffer
  by its metadata (``weight_sync/tensor_bucket.py`` ``reconstruct_tensors``) and copies it into
  its weights; answers ``(True, message)``. ``get_weights_by_name(name, truncate_size)`` reads a
  weight back from scheduler 0 (``model_runner.py``), as a list.

Test hooks (not SGLang's): ``Engine.scheduler_env`` holds, per scheduler, the variables of
:data:`sglang.srt.managers.scheduler.REPORTED_ENV` as that process saw them, and
``Engine.init_seconds`` how long each scheduler's ``init_process_group`` took.
"""

__version__ = "0.5.23"

from sglang.srt.entrypoints.engine import Engine  # noqa: E402,F401
