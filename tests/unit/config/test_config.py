"""Config mechanism: defaults < YAML < overrides, struct-mode errors, validation, docs."""

import enum
from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional

import pytest
import yaml

from dapo_megatron.config import (
    ConfigError,
    TrainerConfig,
    assert_all_documented,
    documented_keys,
    load_config,
    field_docs,
    to_flat_dict,
    to_yaml,
)


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass
class OptimSection:
    """Optimizer."""

    lr: float = 1e-6
    """peak learning rate."""
    weight_decay: float = 0.01
    """decoupled weight decay
    (AdamW), continued on a second line."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""

    def validate(self):
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")


@dataclass
class ActorSection:
    """Actor."""

    optim: OptimSection = field(default_factory=OptimSection)
    """optimizer settings."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """token-mean (DAPO) or seq-mean-token-mean (GRPO)."""
    precision: Precision = Precision.BF16
    """parameter dtype."""
    ppo_micro_batch_size: Optional[int] = None
    """micro-batch size in responses, or null for automatic."""


@dataclass
class RunSchema:
    """Sample root schema."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """loop settings."""
    actor: ActorSection = field(default_factory=ActorSection)
    """actor settings."""


def _write(tmp_path, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_yaml_then_overrides_in_order(tmp_path):
    path = _write(
        tmp_path,
        {"trainer": {"total_training_steps": 50, "save_freq": 10},
         "actor": {"optim": {"lr": 2e-6}, "precision": "FP32"}},
    )
    cfg = load_config(
        RunSchema, path,
        ["trainer.total_training_steps=3", "actor.optim.lr=1e-6", "actor.optim.betas=[0.8,0.95]",
         "actor.ppo_micro_batch_size=4", "actor.loss_agg_mode=seq-mean-token-mean"],
    )
    assert isinstance(cfg, RunSchema) and isinstance(cfg.actor.optim, OptimSection)
    assert cfg.trainer.total_training_steps == 3  # override beats YAML
    assert cfg.trainer.save_freq == 10  # YAML beats default
    assert cfg.trainer.test_freq == -1  # default kept
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.optim.betas == [0.8, 0.95]
    assert cfg.actor.precision is Precision.FP32
    assert cfg.actor.ppo_micro_batch_size == 4
    assert cfg.actor.loss_agg_mode == "seq-mean-token-mean"
    # later overrides win, null sets an Optional back to None
    cfg = load_config(RunSchema, None, ["actor.ppo_micro_batch_size=4", "actor.ppo_micro_batch_size=null"])
    assert cfg.actor.ppo_micro_batch_size is None
    assert load_config(RunSchema) == RunSchema()


def test_unknown_key_names_full_dotted_key_and_closest_match(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(RunSchema, None, ["trainer.total_steps=3"])
    msg = str(e.value)
    assert "'trainer.total_steps'" in msg and "did you mean 'trainer.total_training_steps'" in msg
    assert "override 'trainer.total_steps=3'" in msg
    path = _write(tmp_path, {"actor": {"optim": {"learning_rate": 1e-6}}})
    with pytest.raises(ConfigError, match=r"'actor\.optim\.learning_rate' \(from .*run\.yaml\)"):
        load_config(RunSchema, path)
    with pytest.raises(ConfigError, match="Valid keys of 'actor.optim': actor.optim.betas, actor.optim.lr"):
        load_config(RunSchema, path)
    with pytest.raises(ConfigError, match="'critic.lr'.*Valid keys: actor, trainer$"):
        load_config(RunSchema, None, ["critic.lr=1"])
    with pytest.raises(ConfigError, match="did you mean 'actor.optim.lr'.*Valid keys of 'actor': actor.loss_agg_mode"):
        load_config(RunSchema, None, ["actor.optimm.lr=1"])
    with pytest.raises(ConfigError, match=r"'actor\.optim' is a section \(OptimSection\), got the value 3"):
        load_config(RunSchema, None, ["actor.optim=3"])
    with pytest.raises(ConfigError, match=r"'actor\.optim' is a section .* \(from .*run\.yaml\)"):
        load_config(RunSchema, _write(tmp_path, {"actor": {"optim": 0.1}}))


def test_wrong_type_names_key_expected_type_and_value(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(RunSchema, None, ["trainer.total_training_steps=many"])
    msg = str(e.value)
    assert "'trainer.total_training_steps' expects int, got 'many' (str)" in msg
    path = _write(tmp_path, {"trainer": {"save_freq": 2.5}})
    with pytest.raises(ConfigError, match=r"'trainer\.save_freq' expects int, got 2\.5 \(float\)"):
        load_config(RunSchema, path)
    with pytest.raises(ConfigError, match="expects one of 'token-mean', 'seq-mean-token-mean', got 'sum'"):
        load_config(RunSchema, None, ["actor.loss_agg_mode=sum"])
    with pytest.raises(ConfigError, match=r"expects Precision \(one of FP32, BF16\)"):
        load_config(RunSchema, None, ["actor.precision=fp8"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(RunSchema, None, ["trainer.seed"])
    with pytest.raises(ConfigError, match="top level"):
        load_config(RunSchema, _write(tmp_path, [1, 2]))
    with pytest.raises(FileNotFoundError):
        load_config(RunSchema, str(tmp_path / "missing.yaml"))
    with pytest.raises(TypeError):
        load_config(dict)


def test_validate_runs_in_every_section_and_names_the_dotted_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^actor\.optim\.lr=-1\.0 must be > 0$"):
        load_config(RunSchema, None, ["actor.optim.lr=-1.0"])
    with pytest.raises(ValueError, match=r"^trainer\.save_freq=0 must be -1 \(never\) or >= 1"):
        load_config(RunSchema, None, ["trainer.save_freq=0"])
    with pytest.raises(ValueError, match=r"^trainer\.max_ckpt_to_keep=0 must be >= 1"):
        load_config(RunSchema, None, ["trainer.max_ckpt_to_keep=0"])
    with pytest.raises(ValueError, match=r"^trainer\.total_training_steps=0"):
        load_config(RunSchema, None, ["trainer.total_training_steps=0"])
    with pytest.raises(ValueError, match=r"^trainer\.resume_mode='/nonexistent/step_3' is neither"):
        load_config(RunSchema, None, ["trainer.resume_mode=/nonexistent/step_3"])
    # a TrainerConfig used as the root: no prefix
    with pytest.raises(ValueError, match=r"^seed=-1 must be >= 0$"):
        load_config(TrainerConfig, None, ["seed=-1"])


def test_real_schema_errors_begin_once_with_the_dotted_key():
    """Every section's message names the field relative to it; the loader adds the path once."""
    from dapo_megatron.config import DAPOConfig

    base = ["model.hf_path=/models/x"]
    for override, message in [
        ("buffer.n=1", "buffer.n=1: dynamic sampling (filter_groups) needs n >= 2"),
        ("buffer.overlong.overlong_buffer_len=30000", "buffer.overlong.overlong_buffer_len=30000 must be <= "
                                                      "max_response_length=20480"),
        ("parallel.pipeline_model_parallel_size=0", "parallel.pipeline_model_parallel_size=0 must be >= 1"),
        ("actor.optim.lr=0.0", "actor.optim.lr=0.0 must be > 0"),
        ("actor.ppo_epochs=0", "actor.ppo_epochs=0 must be >= 1"),
        ("rollout.name=vllm", "rollout.name='vllm' must be 'hf' or 'sglang'"),
        ("data.max_prompt_length=0", "data.max_prompt_length=0 must be a positive int"),
        ("data.arithmetic.style=poem", "data.arithmetic.style='poem' must be 'plain' or 'word'"),
        ("rollout.stream_poll_tokens=0", "rollout.stream_poll_tokens=0 must be >= 1"),
        ("buffer.prompt_skip.skip_probability=1.0", "buffer.prompt_skip.skip_probability=1.0 must be in [0, 1)"),
        # across sections: 100 steps × 1 epoch × 512/32 mini-batches = 1600 optimizer steps
        ("actor.optim.lr_warmup_steps=1600", "actor.optim.lr_warmup_steps=1600 must be smaller than the run's "
                                             "1600 optimizer steps"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(DAPOConfig, None, [*base, override])
        assert str(e.value).startswith(message), (override, str(e.value))
        key = override.split("=")[0]
        assert str(e.value).count(key.rpartition(".")[0] + ".") == 1, str(e.value)
    load_config(DAPOConfig, None, [*base, "actor.optim.lr_warmup_steps=1599"])


def test_streaming_loads_on_every_layout():
    """The streamed rollout drives every engine layout (rollout.streaming.EngineClient): one
    colocated engine per rank, rollout-TP groups and separate servers."""
    from dapo_megatron.config import DAPOConfig

    base = ["model.hf_path=/models/x", "rollout.name=sglang", "rollout.streaming=true"]
    for layout in ([], ["rollout.tensor_model_parallel_size=2"],
                   ["rollout.mode=server", "rollout.server_urls=[http://h:30000]"]):
        assert load_config(DAPOConfig, None, [*base, *layout]).rollout.streaming


def test_config_errors_prefixes_run_time_checks_once():
    from dapo_megatron.config import config_errors
    from dapo_megatron.platform import ParallelConfig

    with pytest.raises(ConfigError, match=r"^parallel\.tensor_model_parallel_size=2 × pipeline_model_parallel_size"
                                          r"=1 does not divide the world size 3"):
        with config_errors("parallel"):
            ParallelConfig(2, 1).check_world_size(3)
    with pytest.raises(ConfigError, match=r"^parallel\.x=1$"):  # already prefixed: unchanged
        with config_errors("parallel"):
            raise ValueError("parallel.x=1")


def test_validate_convention_is_enforced():
    @dataclass
    class NeedsArgs:
        a: int = 0
        """a."""

        def validate(self, world_size):
            pass

    @dataclass
    class ReturnsSelf:
        a: int = 0
        """a."""

        def validate(self):
            return self

    with pytest.raises(TypeError, match="NeedsArgs.validate must take no arguments"):
        load_config(NeedsArgs)
    with pytest.raises(TypeError, match="ReturnsSelf.validate must return None"):
        load_config(ReturnsSelf)


def test_trainer_config_run_dir_and_resume_path(tmp_path):
    cfg = load_config(TrainerConfig, None, ["project_name=p", "experiment_name=e"])
    assert cfg.run_dir == "runs/p/e" and cfg.resume_path is None
    ckpt = tmp_path / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    cfg = load_config(TrainerConfig, None, [f"default_local_dir={tmp_path}", f"resume_mode={ckpt}"])
    assert cfg.run_dir == str(tmp_path) and cfg.resume_path == str(ckpt)
    assert load_config(TrainerConfig, None, ["resume_mode=disable"]).resume_path is None


def test_yaml_and_flat_dict_round_trip(tmp_path):
    cfg = load_config(RunSchema, None, ["actor.precision=FP32", "trainer.seed=7", "actor.optim.lr=3e-6"])
    text = to_yaml(cfg)
    assert yaml.safe_load(text)["actor"]["precision"] == "FP32"
    path = tmp_path / "dump.yaml"
    path.write_text(text)
    assert load_config(RunSchema, str(path)) == cfg
    flat = to_flat_dict(cfg)
    assert flat["trainer.seed"] == 7
    assert flat["actor.optim.lr"] == 3e-6
    assert flat["actor.precision"] == "FP32"
    assert flat["actor.optim.betas"] == [0.9, 0.999]
    assert flat["trainer.default_local_dir"] is None
    # one entry per leaf field, none for sections
    leaves = [k.key for k in documented_keys(RunSchema) if k.default not in ("TrainerConfig", "ActorSection", "OptimSection")]
    assert sorted(flat) == sorted(leaves)


def test_documented_keys_lists_type_default_and_doc():
    docs = {k.key: k for k in documented_keys(RunSchema)}
    assert docs["actor.optim.weight_decay"].doc == "decoupled weight decay (AdamW), continued on a second line."
    assert docs["actor.optim.weight_decay"].type == "float" and docs["actor.optim.weight_decay"].default == 0.01
    assert docs["actor.ppo_micro_batch_size"].type == "int | None"
    assert docs["actor.loss_agg_mode"].type == "one of 'token-mean', 'seq-mean-token-mean'"
    assert docs["actor.precision"].default == "BF16"
    assert docs["actor.optim.betas"].type == "list[float]"
    assert docs["actor"].default == "ActorSection" and docs["actor"].doc == "actor settings."
    assert docs["trainer.max_ckpt_to_keep"].doc.startswith("keep only this many newest checkpoints")
    # depth first: each section's key, then its fields in declaration order
    assert [k for k in docs if not k.startswith("trainer.")] == [
        "trainer", "actor", "actor.optim", "actor.optim.lr", "actor.optim.weight_decay", "actor.optim.betas",
        "actor.loss_agg_mode", "actor.precision", "actor.ppo_micro_batch_size"]
    assert [k for k in docs if k.startswith("trainer.")] == [f"trainer.{n}" for n in TrainerConfig.__dataclass_fields__]


def test_assert_all_documented_passes_on_sample_and_lists_gaps():
    assert_all_documented(RunSchema)
    assert_all_documented(TrainerConfig)
    assert_all_documented(DictSchema)  # a subclass: the base's fields documented by the base's body

    @dataclass
    class Inner:
        """Inner."""

        a: int = 0
        """documented."""
        b: int = 0
        # a comment is not documentation

    @dataclass
    class Outer:
        """Outer.

        Attributes:
            c: the old Google-style entry no longer documents a key.
        """

        inner: Inner = field(default_factory=Inner)
        """documented section."""
        c: str = ""

    with pytest.raises(ValueError) as e:
        assert_all_documented(Outer)
    msg = str(e.value)
    assert "undocumented keys: inner.b, c." in msg and '"""what it does."""' in msg


def test_field_docs_read_the_literal_below_each_field_and_the_bases():
    @dataclass
    class Base:
        x: int = 0
        """from the base."""
        y: int = 0
        """replaced below."""

    @dataclass
    class Child(Base):
        y: int = 1
        """typed entry
        continued,   on one line."""
        z: int = 2
        w: int = 3
        """documents w, not z."""
        LIMIT = 4
        """not a field: no annotation."""

    assert field_docs(Child) == {
        "x": "from the base.",
        "y": "typed entry continued, on one line.",
        "w": "documents w, not z.",
    }
    assert field_docs(Base) == {"x": "from the base.", "y": "replaced below."}


def test_key_doc_prints_one_line():
    line = str({k.key: k for k in documented_keys(RunSchema)}["trainer.save_freq"])
    assert line.startswith("trainer.save_freq (int, default -1): save a checkpoint every")


# ---------------------------------------------------------------- dict fields: open mappings
@dataclass
class ModelSection:
    """Model."""

    name: str = "m"
    """model name."""
    extra: dict[str, Any] = field(default_factory=dict)
    """free-form TransformerConfig kwargs."""
    sizes: dict[str, int] = field(default_factory=lambda: {"base": 1})
    """named integer sizes."""
    tags: Optional[dict[str, str]] = None
    """optional mapping, None by default."""


@dataclass
class DictSchema(RunSchema):
    """The sample root plus a section holding dict fields."""

    model: ModelSection = field(default_factory=ModelSection)
    """model settings."""


def test_dict_field_takes_new_keys_from_yaml_and_overrides(tmp_path):
    path = _write(tmp_path, {"model": {"extra": {"recompute_granularity": "full", "recompute_num_layers": 1},
                                       "sizes": {"big": 7}}})
    cfg = load_config(DictSchema, path, ["model.extra.recompute_method=uniform", "model.extra.recompute_num_layers=2",
                                         "model.extra.nested.depth=3", "model.tags.owner=me"])
    assert cfg.model.extra == {"recompute_granularity": "full", "recompute_num_layers": 2,
                               "recompute_method": "uniform", "nested": {"depth": 3}}
    assert type(cfg.model.extra) is dict and type(cfg.model.extra["nested"]) is dict
    assert cfg.model.sizes == {"base": 1, "big": 7}  # YAML merges into the default mapping
    assert cfg.model.tags == {"owner": "me"}  # a None-valued Optional[dict] becomes a mapping
    # a whole mapping as one override value merges too
    cfg = load_config(DictSchema, None, ["model.extra={a: 1, b: [x, y]}"])
    assert cfg.model.extra == {"a": 1, "b": ["x", "y"]}
    # the schema's own default instance is untouched by earlier loads
    assert load_config(DictSchema) == DictSchema()
    assert DictSchema().model.extra == {}


def test_dict_field_values_are_typed_and_dataclass_fields_stay_strict(tmp_path):
    with pytest.raises(ConfigError, match=r"'model\.sizes\.big' expects the value type of model\.sizes "
                                          r"\(dict\[str, int\]\), got 'huge' \(str\)"):
        load_config(DictSchema, None, ["model.sizes.big=huge"])
    with pytest.raises(ConfigError, match=r"'model\.sizes\.big' expects .* \(from .*run\.yaml\)"):
        load_config(DictSchema, _write(tmp_path, {"model": {"sizes": {"big": "huge"}}}))
    # next to a dict field, the section is as strict as ever, from overrides and from YAML
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.extras\.a'.*did you mean 'model\.extra'"):
        load_config(DictSchema, None, ["model.extras.a=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.nam'"):
        load_config(DictSchema, _write(tmp_path, {"model": {"nam": "x", "extra": {"a": 1}}}))
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.optim\.lrr'"):
        load_config(DictSchema, None, ["model.extra.a=1", "actor.optim.lrr=1"])
    # the dict field itself must get a mapping
    with pytest.raises(ConfigError, match=r"'model\.extra'"):
        load_config(DictSchema, None, ["model.extra=3"])


def test_run_config_extra_transformer_config_reaches_transformer_config():
    """The real schema: ``model.extra_transformer_config`` accepts megatron-core
    TransformerConfig names and ``hf_to_transformer_config`` applies them."""
    from transformers import LlamaConfig

    from dapo_megatron.config import DAPOConfig
    from dapo_megatron.models import hf_to_transformer_config
    from dapo_megatron.platform import ParallelConfig

    cfg = load_config(DAPOConfig, None, [
        "model.hf_path=/models/x", "model.transformer_impl=local",
        "model.extra_transformer_config.recompute_granularity=full",
        "model.extra_transformer_config.recompute_method=uniform",
        "model.extra_transformer_config.recompute_num_layers=1",
    ])
    assert cfg.model.extra_transformer_config == {"recompute_granularity": "full", "recompute_method": "uniform",
                                                  "recompute_num_layers": 1}
    with pytest.raises(ConfigError, match="unknown config key 'model.hf_pth'"):
        load_config(DAPOConfig, None, ["model.hf_pth=/x"])
    hf = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tc = hf_to_transformer_config(hf, ParallelConfig(1, 1), cfg.model)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)
    plain = load_config(DAPOConfig, None, ["model.hf_path=/models/x", "model.transformer_impl=local"])
    assert hf_to_transformer_config(hf, ParallelConfig(1, 1), plain.model).recompute_granularity is None


@pytest.mark.parametrize("name,content,where,what", [
    ("syntax", b"trainer:\n  total_training_steps: 3\n  save_freq: [1,\n", "line 4, column 1",
     "did not find expected node content"),
    ("tab", b"trainer:\n\ttotal_training_steps: 3\n", "line 2, column 1", "tab: YAML indents with spaces only"),
    ("latin1", b'trainer:\n  project_name: "caf\xe9"\n', "line 2, column 21", "byte 0xe9 is not UTF-8"),
    ("dup", b"trainer:\n  save_freq: 3\n  save_freq: 4\n", "line 3, column 3", "found duplicate key save_freq"),
])
def test_bad_yaml_is_one_line_with_file_line_and_column(tmp_path, name, content, where, what):
    """Issue 23 item 2: a YAML file that does not parse names its file, line and column, in one
    line (no PyYAML / OmegaConf traceback text), with the fault."""
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(RunSchema, str(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}, {where}: ") and what in msg and "\n" not in msg, msg
    assert "<unicode string>" not in msg and "in \"" not in msg  # PyYAML's own mark lines are not repeated


@pytest.mark.parametrize("item,column", [("actor.optim.lr=[1,", 19), ("actor.optim.lr={x", 18),
                                         ("actor.optim.betas=[0.9, 0.99", 29)])
def test_malformed_override_is_one_line_with_its_column(item, column):
    with pytest.raises(ConfigError) as err:
        load_config(RunSchema, None, [item])
    msg = str(err.value)
    assert msg.startswith(f"override {item!r}, column {column}: the value is not valid YAML: "), msg
    assert "\n" not in msg and "<unicode string>" not in msg


def test_server_mode_takes_expert_parallelism():
    """Server mode at EP > 1 (each expert owner sends its own experts, issue 39 item 6) loads; it was
    refused while the sync read every expert from DP rank 0 alone."""
    from dapo_megatron.config import DAPOConfig

    base = ["model.hf_path=/models/x", "rollout.name=sglang", "rollout.mode=server",
            "rollout.server_urls=[http://h:30000]"]
    cfg = load_config(DAPOConfig, None, [*base, "parallel.expert_model_parallel_size=2"])
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.rollout.mode == "server"
