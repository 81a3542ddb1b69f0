"""``dapo-train`` / ``python -m dapo_megatron.train``: the DAPO main job under torchrun.

Usage::

    torchrun --nproc_per_node=2 -m dapo_megatron.train --config examples/configs/dapo_smollm2_cpu.yaml \\
        trainer.total_training_steps=3 actor.optim.lr=1e-5

Every key of the YAML and of the dotted overrides is a field of
:class:`dapo_megatron.config.DAPOConfig`; ``--print-config`` shows the resolved tree and
``--list-keys`` every key with its type, default and documentation.
"""

from __future__ import annotations

import argparse
import logging
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dapo-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with DAPOConfig keys (optional)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--list-keys", action="store_true", help="list every config key with its doc and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_training_steps=3")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from dapo_megatron.config import DAPOConfig, documented_keys, load_config, to_yaml

    args = parse_args(argv)
    if args.list_keys:
        for key in documented_keys(DAPOConfig):
            print(key)
        return 0
    cfg = load_config(DAPOConfig, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return 0

    import torch.distributed as dist

    from dapo_megatron.platform import destroy_distributed, init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    if dist.get_rank() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        DAPOTrainer(cfg).fit()
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":  # required: reward workers and checkpoint writers re-import __main__
    sys.exit(main())
