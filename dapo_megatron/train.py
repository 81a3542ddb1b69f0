"""``dapo-train`` / ``python -m dapo_megatron.train``: the DAPO main job under torchrun.

Usage::

    torchrun --nproc_per_node=2 -m dapo_megatron.train --config examples/configs/dapo_smollm2_cpu.yaml \\
        trainer.total_training_steps=3 actor.optim.lr=1e-5

Every key of the YAML and of the dotted overrides is a field of
:class:`dapo_megatron.config.DAPOConfig`; ``--print-config`` shows the resolved tree and
``--list-keys`` every key with its type, default and documentation. ``--check-config``
checks everything that can be checked before a launch (the keys and values, the layout for
``--nnodes`` × ``--nproc-per-node`` processes, the model and data paths) in one process and
exits 0 or 2 with one line; the example launchers run it before torchrun, whose own report of
a failed worker is 40 lines and exit status 1.

Design: docs/design.md §1 (one training step) and §5.2 (entry points need a __main__ guard).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from dapo_megatron.config import ConfigError, DAPOConfig, documented_keys, load_config, to_yaml
from dapo_megatron.data import DatasetError
from dapo_megatron.platform.console import quiet_third_party
from dapo_megatron.platform.reaper import die_with_parent

_ENV_HELP = """environment:
  DAPO_SHOW_WARNINGS=1  print the third-party warnings and INFO logs that dapo-train hides
                        (the list and the reasons: dapo_megatron/platform/console.py)"""


def parse_args(argv=None) -> argparse.Namespace:
    """``--config``, ``--print-config``, ``--list-keys`` and the dotted overrides of ``argv``."""
    p = argparse.ArgumentParser(prog="dapo-train", description=__doc__.split("\n\n")[0], epilog=_ENV_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with DAPOConfig keys (optional)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--list-keys", action="store_true", help="list every config key with its doc and exit")
    p.add_argument("--check-config", action="store_true",
                   help="check the config, the launch layout and the model / data paths, print one line and exit "
                        "(status 0, or 2 on an error); the example launchers run it before torchrun")
    p.add_argument("--nnodes", type=int, default=None,
                   help="with --check-config: the nodes of the launch to check (torchrun's flag; default 1)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, dest="nproc_per_node",
                   help="with --check-config: processes per node (torchrun's flag; default: $LOCAL_WORLD_SIZE or "
                        "$WORLD_SIZE, else 1)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=3")
    args = p.parse_args(argv)
    if (args.nnodes is not None or args.nproc_per_node is not None) and not args.check_config:
        p.error("--nnodes / --nproc-per-node go with --check-config (under torchrun the launch sets the world)")
    for name in ("nnodes", "nproc_per_node"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def launch_world(args: argparse.Namespace) -> tuple[int, int | None]:
    """``(world size, ranks per node or None)`` to check: ``--nnodes`` × ``--nproc-per-node``
    when given (``--check-config``), else torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``
    (a plain ``python`` process: a world of one)."""
    if args.nproc_per_node is not None or args.nnodes is not None:
        per_node = args.nproc_per_node or 1
        return (args.nnodes or 1) * per_node, per_node
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun: the ranks of this node
    return int(os.environ.get("WORLD_SIZE", "1")), int(local) if local else None


RANK0_GRACE_S = 60.0  # how long a silent torchrun rank waits for rank 0 to print a config error


def _input_error(err: Exception, every_rank: bool = False) -> int:
    """Print bad input as one line without a traceback; the exit status is 2 (argparse's).

    A config error is the same on every rank: rank 0 alone prints it. An error met after
    start-up (a broken dataset row) may be met by some ranks only, so each that meets it
    prints it (``every_rank``), naming its rank when it is not rank 0.
    """
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"dapo-train: error: {err}", file=sys.stderr, flush=True)
    elif every_rank:
        print(f"dapo-train: error (rank {rank}): {err}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every worker as soon as one exits non-zero: a silent rank that exits
        # first would kill rank 0 before it prints. Rank 0 fails the same way within seconds,
        # and its exit ends this wait.
        time.sleep(RANK0_GRACE_S)
    return 2


def main(argv=None) -> int:
    """Run ``dapo-train`` on this rank; returns the exit status: 0 (also when the run is already
    done: one line, no model loaded), or 2 for a bad config, a launch that does not fit it or a
    missing model / data path (printed by rank 0 as one line, before ``torch.distributed``
    starts), a damaged / missing checkpoint (one line from rank 0) or a broken dataset
    (:func:`_input_error`). Rank 0 prints a start-up banner and an end-of-run summary
    (:mod:`dapo_megatron.run_dir`). Other errors propagate with their traceback."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: die with the agent (platform/reaper.py)
        die_with_parent(os.getppid())
    quiet_third_party()  # before anything imports megatron-core (its import-time warnings)
    args = parse_args(argv)
    if args.list_keys:
        for key in documented_keys(DAPOConfig):
            print(key)
        return 0
    try:
        cfg = load_config(DAPOConfig, args.config, args.overrides)
        if not args.print_config:  # before torch.distributed starts: one line from rank 0, exit status 2
            world, per_node = launch_world(args)
            cfg.check_world_size(world, per_node)
            cfg.check_inputs()
    except (ConfigError, FileNotFoundError) as err:
        return _input_error(err)
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    if args.check_config:
        for warning in cfg.warnings():
            print(f"dapo-train: warning: {warning}", flush=True)
        layout = f"{world} process(es)" + (f", {per_node} per node" if per_node else "")
        print(f"dapo-train: config ok ({args.config or 'defaults'}, {len(args.overrides)} override(s), {layout})",
              flush=True)
        return 0

    # the run's modules import torch and megatron-core: here, once the config is checked (a config check,
    # a bad key or --print-config is a torch-free process, ~2 s less: tests/unit/config/test_torch_free.py)
    # and quiet_third_party has silenced megatron-core's import warnings
    from dapo_megatron.checkpointing import CheckpointError
    from dapo_megatron.platform import destroy_distributed, init_distributed
    from dapo_megatron.platform.sglang_env import align_nccl_with_sglang_server
    from dapo_megatron.run_dir import banner, prepare_run_dir, summary
    from dapo_megatron.trainer import DAPOTrainer

    t0 = time.time()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("dapo_megatron.train")
    # colocated: ranks per engine; server mode: every rank is its own (trainer) rank of the rollout
    rollout_tp = cfg.rollout.tensor_model_parallel_size if cfg.rollout.mode == "colocated" else 1
    if cfg.rollout.mode == "server":  # before the first NCCL communicator: the servers' NCCL_CUMEM_ENABLE
        align_nccl_with_sglang_server()
    parallel = init_distributed(cfg.parallel, seed=cfg.trainer.seed, rollout_tp=rollout_tp)
    rank = parallel.rank
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        start = prepare_run_dir(cfg, parallel)  # file checks only: before any model loads
        if start.finished:  # nothing to train: say so now, not after a minute of model loading
            if rank == 0:
                print(f"dapo-train: {start.run_dir} is already done: its checkpoint of step {start.step} "
                      f"({start.checkpoint_dir}) reaches trainer.total_training_steps="
                      f"{cfg.trainer.total_training_steps}; raise it to train on, or set "
                      "trainer.resume_mode=disable to start a new run", flush=True)
            return 0
        if rank == 0:
            log.info("dapo-train\n%s", banner(cfg, parallel, start))
        trainer = DAPOTrainer(cfg, parallel, start)
        trainer.fit()
    except ConfigError as err:  # the same on every rank (e.g. the per-GPU memory estimate): rank 0 prints it
        return _input_error(err)
    except CheckpointError as err:  # a damaged or missing checkpoint: the same on every rank
        return _input_error(err)
    except DatasetError as err:  # e.g. a broken dataset row, met by some ranks only
        return _input_error(err, every_rank=True)
    finally:
        destroy_distributed()
    if rank == 0:
        uri = trainer.tracker.tracking_uri if cfg.tracking.use_mlflow else None
        log.info("%s", summary(trainer.run_dir, os.path.join(trainer.run_dir, cfg.tracking.metrics_file),
                               trainer.step, cfg.trainer.total_training_steps, time.time() - t0, uri))
    return 0


if __name__ == "__main__":  # megatron-core's checkpoint writer may spawn a child that re-imports __main__ (docs/design.md §5.2)
    sys.exit(main())
