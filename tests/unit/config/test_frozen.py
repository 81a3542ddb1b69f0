"""A loaded config is frozen: assigning a field raises FrozenConfigError naming the dotted key;
``dataclasses.replace`` builds a changed (unfrozen) copy; configs built in code stay mutable."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from dapo_megatron.config import DAPOConfig, FrozenConfigError, freeze, is_frozen, load_config
from dapo_megatron.data import resolve_data_files

BASE = ["model.hf_path=/models/x"]


def _sections(obj, path=""):
    """``(dotted path, section)`` of every dataclass instance of the tree, the root first."""
    yield path, obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{path}.{f.name}" if path else f.name)


def test_every_section_of_a_loaded_config_refuses_assignment_naming_its_key():
    cfg = load_config(DAPOConfig, None, BASE + ["actor.optim.lr=2e-6"])
    sections = list(_sections(cfg))
    assert len(sections) > 10 and all(is_frozen(s) for _, s in sections)
    for path, section in sections:
        name = dataclasses.fields(section)[0].name
        key = f"{path}.{name}" if path else name
        before = getattr(section, name)
        with pytest.raises(FrozenConfigError, match=rf"^{key}: the config is frozen after load_config"):
            setattr(section, name, before)
        assert getattr(section, name) == before
    with pytest.raises(FrozenConfigError) as err:
        cfg.actor.optim.lr = 1.0
    assert str(err.value).startswith("actor.optim.lr: ") and "actor.optim.lr=..." in str(err.value)
    assert "dataclasses.replace" in str(err.value) and isinstance(err.value, AttributeError)
    with pytest.raises(FrozenConfigError, match="^data.seed: .* deleting it is refused"):
        del cfg.data.seed
    assert cfg.actor.optim.lr == 2e-6 and cfg.data.seed == DAPOConfig().data.seed


def test_replace_builds_a_changed_unfrozen_copy_and_freeze_freezes_it_again():
    cfg = load_config(DAPOConfig, None, BASE)
    data = dataclasses.replace(cfg.data, seed=7)
    assert not is_frozen(data) and data.seed == 7 and cfg.data.seed != 7
    data.seed = 8  # a copy is the caller's to change
    root = freeze(dataclasses.replace(cfg, data=data))
    assert is_frozen(root) and is_frozen(root.data) and root.data.seed == 8
    with pytest.raises(FrozenConfigError, match="^data.seed: "):
        root.data.seed = 9
    assert root.trainer is cfg.trainer  # replace is shallow: the other sections are the loaded ones
    # the mark is no field: equal to the same config built in code, and kept by copies
    assert cfg == load_config(DAPOConfig, None, BASE) and cfg.data == dataclasses.replace(cfg.data)
    assert is_frozen(copy.deepcopy(cfg).actor.optim) and is_frozen(pickle.loads(pickle.dumps(cfg)).rollout)


def test_configs_built_in_code_stay_mutable_until_frozen():
    cfg = DAPOConfig()
    assert not any(is_frozen(s) for _, s in _sections(cfg))
    cfg.data.seed, cfg.actor.optim.lr = 5, 3e-6  # the class of a frozen instance: only marked ones refuse
    assert (cfg.data.seed, cfg.actor.optim.lr) == (5, 3e-6)
    freeze(cfg)
    with pytest.raises(FrozenConfigError, match="^trainer.total_training_steps: "):
        cfg.trainer.total_training_steps = 1
    with pytest.raises(TypeError, match="freeze expects a dataclass instance"):
        freeze({"a": 1})


def test_resolving_the_data_files_leaves_the_loaded_section_as_it_is(tmp_path):
    """As DAPOTrainer does: the embedded arithmetic task's files go into a copy of ``data``."""
    cfg = load_config(DAPOConfig, None, BASE + ["data.arithmetic.num_train_problems=4",
                                                "data.arithmetic.num_val_problems=2"])
    data = resolve_data_files(cfg.data, str(tmp_path))
    assert cfg.data.train_files == [] and cfg.data.val_files == [] and is_frozen(cfg.data)
    assert data.train_files == [str(tmp_path / "arithmetic_train.parquet")]
    assert data.val_files == [str(tmp_path / "arithmetic_val.parquet")]
    assert dataclasses.replace(data, train_files=[], val_files=[]) == cfg.data
