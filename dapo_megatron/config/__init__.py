"""Typed run configuration: dataclass schemas, YAML files and dotted CLI overrides.

* :mod:`.loader`: :func:`load_config` (OmegaConf, struct mode, errors that name the key),
  :func:`to_yaml`, :func:`to_flat_dict`, :class:`ConfigError`;
* :mod:`.frozen`: :func:`freeze`, :func:`is_frozen`, :class:`FrozenConfigError` (a loaded
  config is frozen: assigning a field raises, naming the key);
* :mod:`.docs`: :func:`documented_keys` (``dapo-train --list-keys``) and
  :func:`assert_all_documented`;
* :mod:`.run`: the root :class:`DAPOConfig`, whose fields are the sections, each defined
  beside the code it configures (``RolloutConfig`` in :mod:`dapo_megatron.rollout.config`,
  ``TrainerConfig`` in :mod:`.trainer`, ...), re-exported here.

Design: docs/design.md §1 (one training step: the config it reads).
"""

from .docs import KeyDoc, assert_all_documented, documented_keys, field_docs
from .frozen import FrozenConfigError, freeze, is_frozen
from .loader import ConfigError, config_errors, load_config, to_flat_dict, to_yaml
from .run import (
    ActorConfig,
    AlgorithmConfig,
    BufferConfig,
    DAPOConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TrackingConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "BufferConfig",
    "ConfigError",
    "DAPOConfig",
    "DataConfig",
    "FrozenConfigError",
    "KeyDoc",
    "ModelConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrackingConfig",
    "TrainerConfig",
    "assert_all_documented",
    "config_errors",
    "documented_keys",
    "field_docs",
    "freeze",
    "is_frozen",
    "load_config",
    "to_flat_dict",
    "to_yaml",
]
