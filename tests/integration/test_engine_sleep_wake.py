"""No rollout ever samples from invalid weights through the trainer's order of calls.

SGLang's ``release_memory_occupation`` without a CPU backup unmaps the weights and
``resume_memory_occupation`` maps the memory back without its contents. The scripted
engine here is an ``HFEngine`` whose ``sleep`` really destroys the weights it releases
(they become NaN), and which records every call. It runs under the real
``DAPOTrainer.fit`` (world of one, tiny random Llama with SmolLM2's tokenizer) with
``val_before_train`` and a validation after every step, in three variants:

* ``keeps``: ``sleep(keep_weights=True)`` keeps the weights (SGLang's KV-cache-only release);
* ``forgets``: every sleep destroys them (an engine without a partial release), so the
  trainer must re-sync after each validation;
* ``skips``: dynamic sampling keeps no group (a random model solves no problem), so the
  step ends without an update or a sync, and the next wake finds destroyed weights.

The oracle of every ``generate`` is independent of the engine's own bookkeeping: all its
parameters are finite and equal to the actor's current weights exported to HF.

The same runs check that the trainer's sync path (its byte counter, the engine's checks, the
HF engine's loader) holds no tensor of the bridge's when it asks for the next one: the CPU
actor's kept bucket buffer, allocated by the first sync, serves every later bucket.
"""

import math
import os

import pytest
import torch

from dapo_megatron.platform import spawn

SMALL = [
    "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.val_before_train=true",
    "trainer.save_freq=-1", "buffer.train_batch_size=2", "buffer.n=2", "buffer.gen_batch_size=2",
    "buffer.max_num_gen_batches=2", "buffer.on_cap=train_on_kept", "actor.ppo_mini_batch_size=1",
    "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps=0",
    "rollout.response_length=6", "buffer.overlong.max_response_length=6", "buffer.overlong.overlong_buffer_len=2",
    "rollout.val_n=2", "rollout.val_max_prompts=2", "data.arithmetic.num_train_problems=16",
    "data.arithmetic.num_val_problems=4", "model.params_dtype=float32", "model.transformer_impl=local",
    "reward.num_workers=1", "tracking.use_mlflow=false",
    "rollout.update_weights_bucket_megabytes=1",  # several buckets per sync (the embedding alone is 6 MB)
]


VARIANTS = ("keeps", "forgets", "skips")


def _worker(hf_dir, out_dir):
    for variant in VARIANTS:  # one process for the three runs: imports dominate the cost
        os.makedirs(os.path.join(out_dir, variant))
        _run(hf_dir, os.path.join(out_dir, variant), variant)


def _run(hf_dir, out_dir, variant):
    import dapo_megatron.rollout.engines.factory as factory
    import dapo_megatron.trainer as trainer_mod
    from dapo_megatron.bridge import export_hf_state_dict
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rollout.engines.hf_engine import HFEngine

    events = []
    holder = {}

    class ForgetfulEngine(HFEngine):
        """HFEngine whose sleep() destroys the weights it releases (see the module docstring)."""

        honours_keep = variant != "forgets"

        def sleep(self, keep_weights=False):
            events.append(("sleep", keep_weights))
            if not (keep_weights and self.honours_keep):
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.fill_(float("nan"))  # the memory comes back without its contents
                self._weights_valid = False
            super().sleep(keep_weights)

        def wake_up(self):
            events.append(("wake",))
            super().wake_up()

        def update_weights(self, named_tensors, version, *, finish=True, digest=None):
            events.append(("sync", version))
            super().update_weights(named_tensors, version, finish=finish, digest=digest)

        def generate(self, prompt_ids, params, prompt_seeds=None):
            trainer = holder.get("trainer")
            want = export_hf_state_dict(trainer.actor.model_chunks, parallel=trainer.parallel) if trainer else None
            params_now = dict(self.model.named_parameters())
            finite = all(bool(torch.isfinite(p).all()) for p in params_now.values())
            current = want is not None and all(torch.equal(params_now[n], t) for n, t in want.items()
                                               if n in params_now)
            # the version the samples are stamped with: the actor's own (the trainer's step)
            fresh = trainer is None or self.weight_version == trainer.step
            events.append(("generate", finite, current, fresh))
            return super().generate(prompt_ids, params, prompt_seeds)

    def build(spec, hf_config):
        from transformers import AutoModelForCausalLM

        assert not spec.pretrained  # the trainer's engine: random weights until the first sync
        return ForgetfulEngine(AutoModelForCausalLM.from_config(hf_config), dtype=torch.float32, device="cpu",
                               eos_token_ids=list(spec.eos_token_ids))

    real_build = factory.build_engine
    factory.build_engine = build
    overrides = SMALL + [f"model.hf_path={hf_dir}", f"trainer.default_local_dir={out_dir}/run"]
    overrides.append(f"buffer.filter_groups={'true' if variant == 'skips' else 'false'}")
    cfg = load_config(DAPOConfig, None, overrides)
    parallel = init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    trainer = trainer_mod.DAPOTrainer(cfg, parallel)
    holder["trainer"] = trainer
    buffers, allocations = trainer.rollout.export_buffers, []
    real_bucket = buffers.bucket

    def counting_bucket(like, numel, capacity):
        before = buffers._bucket
        flat = real_bucket(like, numel, capacity)
        allocations.append(buffers._bucket is not before)
        return flat

    buffers.bucket = counting_bucket
    synced_before = sum(e[0] == "sync" for e in events)  # the first sync, at start-up, allocated the buffer
    last = trainer.fit()
    factory.build_engine = real_build
    syncs = sum(e[0] == "sync" for e in events) - synced_before
    torch.save({"events": events, "last": last, "allocations": allocations, "syncs": syncs},
               os.path.join(out_dir, "events.pt"))


@pytest.fixture(scope="module")
def tiny_hf_dir(smollm2_gguf, tmp_path_factory):
    from conftest import tiny_llama_with_smollm2_tokenizer_dir

    return tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf, tmp_path_factory.mktemp("tiny_hf"), hidden_size=32,
                                                 intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1)


def _compress(events):
    """Consecutive generate calls as one ``("generate", n)``."""
    out = []
    for e in events:
        if e[0] == "generate" and out and out[-1][0] == "generate":
            out[-1] = ("generate", out[-1][1] + 1)
        else:
            out.append(("generate", 1) if e[0] == "generate" else e)
    return out


@pytest.fixture(scope="module")
def runs(tiny_hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sleep_wake")
    spawn(_worker, 1, tiny_hf_dir, str(out))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_generate_on_invalid_weights_in_the_trainer_loop(runs, variant):
    res = torch.load(runs / variant / "events.pt")
    events = res["events"]
    gens = [e for e in events if e[0] == "generate"]
    assert gens and all(finite for _, finite, _, _ in gens), events
    assert all(current for _, _, current, _ in gens), "a rollout sampled from weights other than the actor's"
    assert all(fresh for *_, fresh in gens), "samples of the actor's weights stamped with an older version"
    G = ("generate",)
    flow = [(e[0],) if e[0] in ("wake", "generate") else e for e in _compress(events)]
    if variant == "keeps":  # validation keeps the weights; each step's sync restores what its sleep released
        assert flow == [("sync", 0), ("wake",), G, ("sleep", True),              # val_before_train
                        ("wake",), G, ("sleep", False), ("sync", 1),               # step 1
                        ("wake",), G, ("sleep", True),                             # validation 1
                        ("wake",), G, ("sleep", False), ("sync", 2),               # step 2
                        ("wake",), G, ("sleep", True)], flow                       # validation 2
    elif variant == "forgets":  # every sleep destroys the weights: the wake after a validation re-syncs
        assert flow == [("sync", 0), ("wake",), G, ("sleep", True),
                        ("wake",), ("sync", 0), G, ("sleep", False), ("sync", 1),
                        ("wake",), G, ("sleep", True),
                        ("wake",), ("sync", 1), G, ("sleep", False), ("sync", 2),
                        ("wake",), G, ("sleep", True)], flow
    else:  # no group kept: no update, but the step still syncs (the same weights relabelled as
        # version `step`), so the next step's samples are fresh and not corrected as stale
        assert res["last"]["actor/skipped_no_groups"] == 1.0
        assert flow == [("sync", 0), ("wake",), G, ("sleep", True),
                        ("wake",), G, ("sleep", False), ("sync", 1),
                        ("wake",), G, ("sleep", True),
                        ("wake",), G, ("sleep", False), ("sync", 2),
                        ("wake",), G, ("sleep", True)], flow
    assert math.isfinite(res["last"]["val/avg@2"])
    # every bucket of every later sync in the first sync's buffer: nothing on the way held the previous tensor
    assert res["syncs"] >= 2 and len(res["allocations"]) >= 2 * res["syncs"], res
    assert not any(res["allocations"]), res["allocations"]
