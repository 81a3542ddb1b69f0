"""Every config key with a constrained domain is checked when the config loads.

:data:`DOMAINS` lists, for each such key, values outside its domain (each must be rejected by
:func:`load_config` with one line that begins with the dotted key) and one value inside it
(accepted). :data:`FREE` lists the keys that take every value of their type, each with the
reason. Together they must cover every leaf key of :class:`DAPOConfig`, so a new key fails
:func:`test_every_key_is_classified` until it is put in one table (with its check, for
:data:`DOMAINS`); and a key whose docstring states a domain (``>= 1``, ``"a" or "b"``, ...)
cannot hide in :data:`FREE` (:func:`test_a_key_whose_doc_states_a_domain_has_a_check`).
No model is loaded: these are :func:`load_config` calls only.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf

from dapo_megatron.config import ConfigError, DAPOConfig, documented_keys, load_config
from dapo_megatron.config.loader import _leaf_keys, _section_type, _unwrap_optional

BASE = ["model.hf_path=/models/x"]  # the one key without a usable default
SERVER = ["rollout.name=sglang", "rollout.mode=server", "rollout.server_urls=[http://h:30000]"]
STREAM = ["rollout.streaming=true"]
FP8 = ["model.fp8=e4m3", "model.transformer_impl=transformer_engine"]


@dataclass
class Case:
    """``bad``: values the key must reject; ``good``: a value it accepts. ``ctx`` is set before
    both (the other keys that make the key's check apply), ``good_ctx`` before ``good`` only.
    ``key``: the override's key when it differs (an entry below a dict field)."""

    bad: list
    good: object
    ctx: list[str] = field(default_factory=list)
    good_ctx: list[str] = field(default_factory=list)
    key: str | None = None
    want: object = None  # the loaded value of ``good`` where the loader maps it (YAML's ``on``)


DOMAINS: dict[str, Case] = {
    # model
    "model.hf_path": Case(["null"], "/models/y"),
    "model.gguf_file": Case(["''"], "m.gguf"),
    "model.params_dtype": Case(["float8", "int8", "''"], "bfloat16"),
    "model.moe_router_bias_update_rate": Case(["-0.1", ".nan"], 0.0),
    "model.make_vocab_size_divisible_by": Case([0, -128], 64),
    "model.transformer_impl": Case(["foo", "te"], "local"),
    "model.fp8": Case(["e5m2", "fp8"], "hybrid", good_ctx=["model.transformer_impl=transformer_engine"]),
    "model.fp8_recipe": Case(["foo", "current"], "tensorwise"),
    "model.first_last_layers_bf16": Case(["true"], "true", ctx=FP8, good_ctx=["model.fp8_recipe=tensorwise"]),
    "model.num_layers_at_start_in_bf16": Case([-1], 2),
    "model.num_layers_at_end_in_bf16": Case([-1], 2),
    "model.query_groups_multiple": Case([0, -2], 4),
    "model.moe_token_dispatcher_type": Case(["flex", "all_to_all"], "allgather"),
    "model.moe_router_load_balancing_type": Case(["aux", "sinkhorn"], "seq_aux_loss"),
    "model.moe_aux_loss_coeff": Case([-0.01], 0.0),
    "model.moe_grouped_gemm": Case(["true"], "false", ctx=["model.transformer_impl=local"]),
    # parallel
    "parallel.tensor_model_parallel_size": Case([0, -1], 2),
    "parallel.pipeline_model_parallel_size": Case([0], 2),
    "parallel.expert_model_parallel_size": Case([0, -2], 2),
    "parallel.expert_tensor_parallel_size": Case([0], 1),
    "parallel.distributed_timeout_minutes": Case([0, -1], 0.05),
    # data
    "data.max_prompt_length": Case([0, -5], 256),
    "data.prompt_key": Case(["''"], "messages"),
    "data.seed": Case([-1], 7),
    "data.arithmetic.num_train_problems": Case([0], 10),
    "data.arithmetic.num_val_problems": Case([0], 10),
    "data.arithmetic.min_operand": Case([21], 2),
    "data.arithmetic.max_operand": Case([0], 30),
    "data.arithmetic.operators": Case(["[^]", "[]"], "['+','-','*','/']"),
    "data.arithmetic.style": Case(["fancy"], "word"),
    "data.arithmetic.template": Case(["'Compute {a}.'", "'Compute {a} {op} {b} {c}.'", "'{a} {b} {'"],
                                     "'What is {a} {op} {b}?'"),
    # rollout
    "rollout.name": Case(["vllm"], "sglang"),
    "rollout.mode": Case(["remote"], "server", good_ctx=SERVER[:1] + SERVER[2:]),
    "rollout.tensor_model_parallel_size": Case([0], 2),
    "rollout.server_urls": Case(["[h:30000]", "[http://h:1,http://h:1]"], "[http://h:1,http://h:2]", ctx=SERVER[:2]),
    "rollout.server_timeout_s": Case([0, -1], 30),
    "rollout.server_silence_timeout_s": Case([0, -1], 120),
    "rollout.temperature": Case([0, -1], 0.7),
    "rollout.top_p": Case([0, 2, -0.5], 0.9),
    "rollout.top_k": Case([0, -2], 50),
    "rollout.response_length": Case([0], 1024, good_ctx=["buffer.overlong.max_response_length=1024",
                                                          "buffer.overlong.overlong_buffer_len=256"]),
    "rollout.update_weights_bucket_megabytes": Case([0], 256),
    "rollout.gpu_memory_utilization": Case([0, 1, 1.5, -0.1], 0.8),
    "rollout.val_n": Case([0], 4),
    "rollout.val_temperature": Case([0, -1], 0.6),
    "rollout.val_top_p": Case([0, 1.5], 1.0),
    "rollout.val_max_prompts": Case([-1], 10),
    "rollout.deterministic": Case(["true"], "true", good_ctx=["rollout.name=sglang"]),
    "rollout.partial_rollout": Case(["true"], "true", good_ctx=STREAM),
    # enable needs a factory, a factory needs enable (the factory itself is imported where the rollout is built)
    "rollout.multi_turn.enable": Case(["true"], "true", good_ctx=["rollout.multi_turn.trajectory=pkg.mod:Factory"]),
    "rollout.multi_turn.trajectory": Case(["pkg.mod:Factory"], "pkg.mod:Factory",
                                          good_ctx=["rollout.multi_turn.enable=true"]),
    "rollout.multi_turn.format": Case(["xml", "json"], "hermes"),
    "rollout.multi_turn.code_block_language": Case(["'py thon'", "''"], "python3"),
    "rollout.multi_turn.tool_name": Case(["''"], "run_python"),
    "rollout.multi_turn.max_assistant_turns": Case([0, -1], 2),
    "rollout.multi_turn.max_tool_response_length": Case([0], 1024),
    "rollout.multi_turn.tool_response_truncate_side": Case(["top", "both"], "left"),
    "rollout.multi_turn.tool_response_template": Case(["'no output here'", "'{output}{output}'"],
                                                      "'<out>{output}</out>'"),
    # sandbox (the tool programs')
    "sandbox.wall_timeout_s": Case([0, -1.0], 2.5),
    "sandbox.cpu_time_limit_s": Case([0], 3),
    "sandbox.memory_limit_mb": Case([63, 0], 256),
    "sandbox.output_limit_bytes": Case([0], 4096),
    "sandbox.tmp_size_mb": Case([0], 8),
    "sandbox.max_concurrent": Case([0], 8),
    "sandbox.python": Case(["/no/such/python"], "/usr/bin/python3"),
    "rollout.stream_poll_tokens": Case([0], 8),
    "rollout.check_weight_update_period": Case([0, -1], 1),
    "rollout.check_weight_update_readback_elements": Case([-1], 0),
    "rollout.weight_probe_tolerance": Case([-0.1], 0.05),
    "rollout.engine_kwargs": Case(["1"], "true", ctx=["rollout.name=sglang"], key="rollout.engine_kwargs.no_such_arg"),
    # buffer
    "buffer.train_batch_size": Case([0, 16], 64),  # 16: fewer than actor.ppo_mini_batch_size=32
    "buffer.n": Case([0, 1], 4),
    "buffer.gen_batch_size": Case([0], 256),
    "buffer.max_num_gen_batches": Case([0], 3),
    "buffer.filter_metric": Case(["loss"], "score"),
    "buffer.on_cap": Case(["ignore"], "train_on_kept"),
    "buffer.overlong.max_response_length": Case([0, 5000], 1024, good_ctx=["rollout.response_length=1024",
                                                                          "buffer.overlong.overlong_buffer_len=256"]),
    "buffer.overlong.overlong_buffer_len": Case([0, 30000], 1024),
    "buffer.overlong.penalty_factor": Case([-1], 0.5),
    "buffer.prompt_skip.zero_variance_visits": Case([0], 3),
    "buffer.prompt_skip.skip_probability": Case([1, -0.1], 0.9),
    "buffer.max_staleness": Case([-1], 0),
    # algorithm
    "algorithm.adv_eps": Case([-1, 0], 1e-5),
    # actor
    "actor.ppo_mini_batch_size": Case([0, 1024, 24], 16),  # 1024 > buffer.train_batch_size; 24 does not divide 512
    "actor.ppo_epochs": Case([0], 2),
    "actor.ppo_max_token_len_per_gpu": Case([0], 8192),
    "actor.clip_ratio_low": Case([1.5, -0.1, 1], 0.1),
    "actor.clip_ratio_high": Case([-1, -0.01], 0.4),
    "actor.clip_ratio_c": Case([1, 0.5], 3),
    "actor.loss_agg_mode": Case(["seq-mean"], "seq-mean-token-mean"),
    "actor.old_logprob_source": Case(["actor"], "rollout"),
    "actor.rollout_is": Case(["seq"], "sequence"),
    "actor.rollout_is_threshold": Case([0, -1], 5),
    "actor.rollout_is_scope": Case(["some"], "all"),
    "actor.rollout_rs": Case(["seq", "token"], "token", good_ctx=["actor.rollout_rs_threshold=2"]),
    "actor.rollout_rs_threshold": Case([1, 0.5], 2),
    "actor.rollout_rs_threshold_lower": Case([0, -1, 3], 0.5, ctx=["actor.rollout_rs_threshold=2"]),
    "actor.micro_batch_layout": Case(["sbhd"], "bshd"),
    "actor.shared_prompt": Case(["maybe"], "on", want="on"),
    "actor.routing_replay": Case(["r3", "on"], "rollout"),
    "actor.optim.lr": Case([0, -1], 1e-5),
    "actor.optim.lr_warmup_steps": Case([-1, 1600], 10),  # 1600 = the run's optimizer updates (100 × 16)
    "actor.optim.lr_warmup_init": Case([-1, 1.0], 1e-7),
    "actor.optim.lr_decay_style": Case(["exp"], "cosine"),
    "actor.optim.min_lr": Case([-1, 1], 1e-7),
    "actor.optim.weight_decay": Case([-0.1], 0),
    "actor.optim.betas": Case(["[0.9,1.0]", "[1.5,0.9]", "[-0.1,0.9]"], "[0.8,0.95]"),
    "actor.optim.eps": Case([0, -1], 1e-6),
    "actor.optim.clip_grad": Case([-1], 0.5),
    # reward
    "reward.num_workers": Case([0, -1], 2),
    "reward.timeout_s": Case([0, -1], 10),
    # trainer
    "trainer.project_name": Case(["''", "' '"], "p"),
    "trainer.experiment_name": Case(["''", "' '"], "e"),
    "trainer.total_training_steps": Case([0, -1], 5),
    "trainer.save_freq": Case([0, -2], 10),
    "trainer.test_freq": Case([0, -2], 10),
    "trainer.seed": Case([-1], 7),
    "trainer.default_local_dir": Case(["''"], "/tmp/run"),
    "trainer.resume_mode": Case(["''", "/nonexistent/checkpoints/step_3"], "disable"),
    "trainer.max_ckpt_to_keep": Case([0, -1], 3),
    # tracking
    "tracking.tracking_uri": Case(["''"], "sqlite:////tmp/mlflow.db"),
    "tracking.run_id": Case(["''"], "0123456789abcdef0123456789abcdef"),
    "tracking.http_max_retries": Case([-1], 3),
    "tracking.http_timeout_s": Case([0, -1], 10),
    "tracking.metrics_file": Case(["''", "logs/m.jsonl"], "m.jsonl"),
    # async_training
    "async_training.enable": Case(["true"], "true", good_ctx=SERVER),  # true needs rollout.mode=server
    "async_training.trigger_parameter_sync_step": Case([0, -1, 3], 2, ctx=["async_training.enable=true", *SERVER],
                                                       good_ctx=["buffer.max_staleness=1"]),  # 3 > eta + 1 = 2
}

FREE: dict[str, str] = {
    "model.pad_query_groups": "bool: pad or raise",
    "model.extra_transformer_config": "TransformerConfig fields: checked against megatron-core's dataclass at "
                                      "launch (DAPOConfig.check_inputs: importing megatron-core takes seconds)",
    "data.train_files": "paths: their existence is checked at launch (DAPOConfig.check_inputs); empty = arithmetic",
    "data.val_files": "paths: as data.train_files",
    "data.skip_invalid_rows": "bool",
    "data.shuffle": "bool",
    "data.arithmetic.allow_negative": "bool",
    "data.arithmetic.system_prompt": "any text, or null",
    "rollout.streaming": "bool: every layout (colocated TP = 1, rollout-TP groups, servers) streams",
    "rollout.check_weight_update": "bool: every transport verifies (docs/design.md §1.1); off observes nothing",
    "rollout.check_weight_update_readback": "bool: off leaves SGLang receivers the structural checks only",
    "rollout.weight_probe": "bool: engines that cannot score take part in the actor's side only",
    "buffer.filter_groups": "bool (its need for buffer.n >= 2 is buffer.n's check)",
    "buffer.overlong.enable": "bool",
    "buffer.overlong_filter": "bool",
    "algorithm.norm_adv_by_std_in_grpo": "bool",
    "actor.entropy_coeff": "any finite weight (a negative one penalises entropy; finiteness: the NaN test)",
    "actor.use_packed_seq_params": "bool or null (auto)",
    "trainer.val_before_train": "bool",
    "tracking.use_mlflow": "bool",
    "buffer.prompt_skip.enable": "bool: batch, streamed and async admissions skip alike",
    "sandbox.bwrap": "an executable's name or path: found (and probed) when the tool trajectory starts its pool",
    "sandbox.allow_unsandboxed": "bool: honoured only where bwrap cannot run, with a warning",
}


def _leaves() -> dict[str, object]:
    """Dotted key -> type of every leaf of DAPOConfig (sections excluded)."""
    return {k: tp for k, tp in _leaf_keys(DAPOConfig).items() if _section_type(tp) is None}


def _load(*overrides) -> DAPOConfig:
    return load_config(DAPOConfig, None, [*BASE, *overrides])


def test_every_key_is_classified():
    leaves = set(_leaves())
    assert not set(DOMAINS) & set(FREE), sorted(set(DOMAINS) & set(FREE))
    unclassified = sorted(leaves - set(DOMAINS) - set(FREE))
    assert not unclassified, (f"new config keys {unclassified}: add each to DOMAINS (with its check in the "
                              "section's validate) or to FREE (with the reason it takes any value of its type)")
    stale = sorted((set(DOMAINS) | set(FREE)) - leaves)
    assert not stale, f"keys that no longer exist: {stale}"


# a docstring that states a domain: a comparison with a number, a range, or a list of choices
_DOMAIN_WORDS = re.compile(r"(>=|<=|>|<|≥|≤)\s*-?\d|\bin [\[(]|\bone of\b|\"[\w-]+\" or \"|``\"[\w-]+\"`` or")


# FREE keys whose docs match the pattern for another quantity's bound
_DOC_BOUND_IS_ANOTHER = {
    "data.arithmetic.allow_negative": "'>= 0' is the answer's",
    "trainer.val_before_train": "'> 0' is trainer.test_freq's",
}


def test_a_key_whose_doc_states_a_domain_has_a_check():
    docs = {k.key: k.doc for k in documented_keys(DAPOConfig)}
    stated = {k for k in FREE if _DOMAIN_WORDS.search(docs[k]) and k not in _DOC_BOUND_IS_ANOTHER}
    assert not stated, f"these FREE keys' docs state a domain, so they need a check and a DOMAINS entry: {stated}"
    # the pattern is not vacuous: it finds the domain in docs of keys that have one
    for key in ("rollout.top_k", "buffer.max_num_gen_batches", "model.params_dtype", "buffer.prompt_skip.skip_probability"):
        assert _DOMAIN_WORDS.search(docs[key]), key


def _domain_cases():
    for key, case in DOMAINS.items():
        for value in case.bad:
            yield pytest.param(key, case, value, id=f"{key}={value}")


@pytest.mark.parametrize("key,case,value", list(_domain_cases()))
def test_out_of_domain_value_is_rejected_naming_the_key(key, case, value):
    with pytest.raises(ConfigError) as err:
        _load(*case.ctx, f"{case.key or key}={value}")
    msg = str(err.value)
    assert "\n" not in msg, msg
    # the dotted key itself, or its section's path first and the field within the message (a check
    # between two fields of one section: "data.arithmetic.min_operand=1 must be <= max_operand=0")
    section, _, leaf = key.rpartition(".")
    named = (msg.startswith(case.key or key) or f"{key}=" in msg or f"'{key}'" in msg
             or (msg.startswith(f"{section}.") and f"{leaf}=" in msg))
    assert named, f"the error does not name {key}: {msg}"


@pytest.mark.parametrize("key", sorted(DOMAINS))
def test_in_domain_value_is_accepted(key):
    case = DOMAINS[key]
    if key == "rollout.engine_kwargs":  # an entry below the dict field (SGLang's list, or the pinned one)
        cfg = _load(*case.ctx, "rollout.engine_kwargs.enable_weights_cpu_backup=true")
        assert cfg.rollout.engine_kwargs == {"enable_weights_cpu_backup": True}
        return
    cfg = _load(*case.ctx, *case.good_ctx, f"{key}={case.good}")
    got = cfg
    for part in key.split("."):
        got = getattr(got, part)
    want = case.want
    if want is None:  # the override's value as the loader parses it
        want = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={case.good}"]))["v"]
    assert (list(got) if isinstance(got, tuple) else got) == want, (key, got, want)


def _float_keys():
    for key, tp in _leaves().items():
        inner, _ = _unwrap_optional(tp)
        if inner is float:
            yield key


@pytest.mark.parametrize("key", sorted(_float_keys()))
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_float_key_rejects_nan_and_infinity(key, value):
    ctx = DOMAINS[key].ctx if key in DOMAINS else []
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=(nan|inf|-inf) must be a finite number"):
        _load(*ctx, f"{key}={value}")


def test_the_issue_examples_are_rejected_before_any_model_loads():
    """The values of issue 23 item 1, each one line naming the key and the domain."""
    cases = {
        "actor.clip_ratio_low=1.5": "actor.clip_ratio_low=1.5 must be in [0, 1)",
        "actor.clip_ratio_low=-0.1": "actor.clip_ratio_low=-0.1 must be in [0, 1)",
        "actor.clip_ratio_high=-1": "actor.clip_ratio_high=-1.0 must be >= 0",
        "rollout.temperature=0": "rollout.temperature=0.0 must be > 0",
        "rollout.top_p=2": "rollout.top_p=2.0 must be in (0, 1]",
        "reward.num_workers=0": "reward.num_workers=0 must be >= 1",
        "model.params_dtype=float8": "model.params_dtype='float8' must be one of",
        "model.transformer_impl=foo": "model.transformer_impl='foo' must be one of",
        "algorithm.adv_eps=-1": "algorithm.adv_eps=-1.0 must be > 0",
    }
    for override, start in cases.items():
        with pytest.raises(ConfigError) as err:
            _load(override)
        assert str(err.value).startswith(start), (override, str(err.value))


def test_defaults_and_examples_still_load():
    cfg = _load()
    assert cfg.actor.clip_ratio_low == 0.2 and math.isfinite(cfg.algorithm.adv_eps)
    assert typing.get_type_hints(type(cfg))  # the schema resolves


def test_async_training_keys_point_to_ours_and_check_their_context():
    """verl's fraction-of-a-batch staleness is rejected with a pointer to buffer.max_staleness (η in
    versions); async needs server mode; the stale-engine pi_old warns only where staleness can occur."""
    with pytest.raises(ConfigError) as err:
        _load(*SERVER, "async_training.enable=true", "async_training.staleness_threshold=0.1")
    msg = str(err.value)
    assert msg.startswith("config key 'async_training.staleness_threshold'") and "buffer.max_staleness" in msg, msg
    assert "\n" not in msg
    with pytest.raises(ConfigError, match=r"^async_training.enable=true needs rollout.mode=server"):
        _load("async_training.enable=true")
    # prompt skipping runs in every admission; rollout.partial_rollout is the one key of partial
    # rollouts, its null default true under async only; the removed async key points to it
    for skip in (["rollout.streaming=true", "buffer.prompt_skip.enable=true"], ["buffer.prompt_skip.enable=true"]):
        assert _load(*SERVER, "async_training.enable=true", *skip).buffer.prompt_skip.enable
    assert [_load(*SERVER, *a, *p).partial_rollout for a in ([], ["async_training.enable=true"])
            for p in ([], ["rollout.partial_rollout=false"], ["rollout.partial_rollout=true", *STREAM])] == \
        [False, False, True, True, False, True]
    with pytest.raises(ConfigError) as err:
        _load(*SERVER, "async_training.enable=true", "async_training.partial_rollout=false")
    msg = str(err.value)
    assert msg.startswith("config key 'async_training.partial_rollout'") and "rollout.partial_rollout" in msg, msg
    with pytest.raises(ConfigError, match=r"^async_training.trigger_parameter_sync_step=2 applies to "):
        _load("async_training.trigger_parameter_sync_step=2")
    # evaluation at sync points only: the servers hold the actor's weights at a sync step
    sync2 = [*SERVER, "async_training.enable=true", "buffer.max_staleness=1", "async_training.trigger_parameter_sync_step=2"]
    assert _load(*sync2, "trainer.test_freq=4", "trainer.total_training_steps=10").async_training.enable
    assert _load(*sync2, "trainer.test_freq=-1", "trainer.total_training_steps=9").async_training.enable
    for bad in (["trainer.test_freq=3", "trainer.total_training_steps=12"],
                ["trainer.test_freq=4", "trainer.total_training_steps=9"]):
        with pytest.raises(ConfigError, match=r"^trainer.test_freq=\d+ and trainer.total_training_steps=\d+ must be "
                                              r"multiples of async_training.trigger_parameter_sync_step=2"):
            _load(*sync2, *bad)
    bypass = ["actor.old_logprob_source=rollout"]
    assert _load(*SERVER, "async_training.enable=true", "buffer.max_staleness=0", *bypass).warnings() == []
    assert _load(*SERVER, *bypass).warnings() == []  # synchronous: the engine's policy is the actor's
    (warning,) = _load(*SERVER, "async_training.enable=true", "buffer.max_staleness=1", *bypass).warnings()
    assert warning.startswith("actor.old_logprob_source=rollout with async_training and buffer.max_staleness=1")
