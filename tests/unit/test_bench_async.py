"""benchmarks/bench_async.py: each arm's overrides load as the config they name, and the figures
it prints are computed from the metrics rows as its docstring says (hand-made rows, values
worked out by hand)."""

from __future__ import annotations


import pytest

from conftest import load_benchmark



def _bench():
    return load_benchmark("bench_async")


@pytest.mark.parametrize("arm,enable,eta,partial", [("S", False, 0, None), ("A0", True, 0, False),
                                                    ("A1", True, 1, False), ("A2", True, 2, True)])
def test_arm_overrides_load_as_the_arm_they_name(arm, enable, eta, partial, smollm2_gguf):
    from dapo_megatron.config import DAPOConfig, load_config

    bench = _bench()
    cfg = load_config(DAPOConfig, bench.CONFIG, [f"model.hf_path={smollm2_gguf[0]}", "parallel.tensor_model_parallel_size=1", "rollout.name=sglang",
                                                 "rollout.mode=server", "rollout.server_urls=[http://127.0.0.1:1]",
                                                 *bench.ARMS[arm]])
    assert cfg.async_training.enable is enable
    assert cfg.buffer.max_staleness == eta
    if partial is not None:
        assert cfg.partial_rollout is partial


def _rows(times, gens, steps_s, extra=None):
    rows = []
    for i, (t, g, s) in enumerate(zip(times, gens, steps_s)):
        rows.append({"step": i + 1, "time": t, "time/gen_s": g, "time/step_s": s, "rollout/gen_acc_mean": 0.1 * i,
                     "rollout/gen_reward_mean": -1 + 0.1 * i, **(extra[i] if extra else {})})
    rows.append({"step": len(times), "time": times[-1] + 1, "val/avg@4": 0.625, "val/pass@4": 0.75})
    return rows


def test_summarize_sync_run_medians_over_steps_after_the_first():
    bench = _bench()
    # step ends at 100, 130, 150, 175, 200: the s/step of steps 2..5 are 30, 20, 25, 25 -> median 25
    rows = _rows([100, 130, 150, 175, 200], [50, 12, 8, 10, 10], [60, 30, 20, 25, 25])
    out = bench.summarize(rows)
    assert out["s_per_step"] == 25
    assert out["gen_s"] == 10  # median of 12, 8, 10, 10
    # trainer idle in S: gen / step of steps 2..5 = 0.4, 0.4, 0.4, 0.4
    assert out["trainer_idle"] == pytest.approx(0.4)
    assert out["rollouter_idle"] == pytest.approx(0.6)
    assert out["gen_acc"] == pytest.approx(0.4) and out["gen_reward"] == pytest.approx(-0.6)
    assert out["val_avg"] == 0.625
    # ceiling from S's phases: gen 10, train 25 - 10 = 15 -> 25 / 15
    assert bench.ceiling(out) == pytest.approx(25 / 15)


def test_summarize_async_run_reads_the_controllers_ratios_and_staleness():
    bench = _bench()
    extra = [{"trainer/idle_ratio": r, "rollouter/idle_ratio": 1 - r, "train/staleness_mean": m,
              "train/staleness_max": x, "rollout/reprefill_ratio": p}
             for r, m, x, p in [(0.9, 0, 0, 0), (0.2, 0.5, 1, 0.1), (0.1, 1.0, 1, 0.3), (0.3, 0.75, 2, 0.2)]]
    rows = _rows([0, 10, 20, 32], [0, 0, 0, 0], [10, 10, 10, 12], extra)
    out = bench.summarize(rows)
    assert out["s_per_step"] == 10  # 10, 10, 12 -> 10
    assert out["trainer_idle"] == pytest.approx(0.2)  # steps 2..4: 0.2, 0.1, 0.3
    assert out["rollouter_idle"] == pytest.approx(0.8)
    assert out["staleness_mean"] == pytest.approx(0.75) and out["staleness_max"] == 2
    assert out["reprefill_ratio"] == pytest.approx(0.2)


def test_summarize_needs_three_training_steps():
    bench = _bench()
    with pytest.raises(ValueError, match=">= 3 training steps"):
        bench.summarize(_rows([0, 10], [1, 1], [5, 5]))
