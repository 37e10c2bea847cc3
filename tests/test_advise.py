"""The deployment advisor: its model of each deployment from probed seconds, and a probe run
end to end on a tiny config."""

import json
import pathlib
import subprocess
import sys

import pytest

from rlx import cli
from rlx.advise import splits_to_probe
from rlx.advise.model import (Probe, _interpolate, advised_groups_in_flight, overlapped, predict, reasons,
                              stream_advice)
from tests.trainer import tiny

ROOT = pathlib.Path(__file__).parent.parent


def _probes(*, concurrent_slowdown: float, split_learn_s: float = 1.5):
  colocated = Probe("colocated", 2, 2, generate_s=1.0, learn_s=2.0, sync_s=0.01)
  split = Probe("split 1+1", 1, 1, generate_s=1.0, learn_s=split_learn_s, sync_s=0.01,
                generate_concurrent_s=1.0 * concurrent_slowdown,
                learn_concurrent_s=split_learn_s * concurrent_slowdown)
  return [colocated, split]


def test_a_slower_learner_makes_split_with_k_1_the_best_and_its_lag_k():
  predictions = predict(_probes(concurrent_slowdown=1.2), devices=2, batch=64, max_k=2)
  by_label = {p.label: p for p in predictions}
  assert predictions[0].label == "split 1+1, k=1"
  # generation's batch takes 1.2 s beside learning, which meanwhile does 1.2 / 1.2 = 1 s of its
  # 1.5 s; the last 0.5 s it runs alone
  assert predictions[0].samples_per_s == pytest.approx(64 / 1.7)
  assert predictions[0].policy_lag == 1.0 and by_label["split 1+1, k=2"].policy_lag == 2.0
  assert by_label["split 1+1, k=0"].samples_per_s == pytest.approx(64 / 2.5)  # turns: 1 + 1.5
  assert by_label["colocated (2 devices)"].samples_per_s == pytest.approx(64 / 3.0)
  assert by_label["colocated (2 devices)"].learning_busy_frac == pytest.approx(2 / 3)
  assert predictions[0].generation_busy_frac == pytest.approx(1.2 / 1.7)
  assert predictions[0].learning_busy_frac == 1.0
  assert predictions[0].overrides() == ["--config.mesh.mode=split",
                                        "--config.mesh.generation_devices=1",
                                        "--config.mesh.max_staleness=1"]
  lines = reasons(predictions[0], predictions, _probes(concurrent_slowdown=1.2))
  assert "learning is 1.50x slower" in lines[0] and "1.76x colocated" in lines[2]


def test_when_the_sides_slow_each_other_down_enough_colocated_wins():
  # one learning device is slower than two (3.2s in turns), and at once both crawl
  predictions = predict(_probes(concurrent_slowdown=2.0, split_learn_s=2.2), devices=2, batch=64)
  assert predictions[0].mode == "colocated" and predictions[0].policy_lag == 0
  assert "does not pay" in reasons(predictions[0], predictions, [])[-1]


def test_a_faster_learner_gives_a_lag_of_about_one_whatever_k():
  probes = [Probe("split 1+1", 1, 1, generate_s=2.0, learn_s=1.0, sync_s=0.0,
                  generate_concurrent_s=2.0, learn_concurrent_s=1.0)]
  predictions = predict(probes, devices=2, batch=10, max_k=3)
  assert [p.policy_lag for p in predictions if p.k >= 1] == [1.0, 1.0, 1.0]
  assert predictions[0].k == 1  # the same speed for every k >= 1: the least lag wins


def test_overlap_slows_both_sides_only_while_both_run():
  assert overlapped(1.0, 1.0, 1.0, 1.0) == (1.0, True)  # no interference: the slower side's time
  assert overlapped(1.0, 3.0, 2.0, 1.0) == (3.0, True)  # 2 s slowed generation, 1 s alone
  assert overlapped(1.0, 1.0, 2.0, 2.0)[0] == pytest.approx(2.0)  # both slowed all the way
  step, generation_first = overlapped(3.0, 1.0, 1.5, 2.0)  # learning done after 2 s, then 5/3 s
  assert not generation_first and step == pytest.approx(2.0 + (3.0 - 2.0 / 1.5))


def test_splits_not_probed_are_interpolated_as_a_power_law():
  assert _interpolate({2: 4.0, 4: 2.0}, 3) == pytest.approx(4.0 * (3 / 2) ** -1)
  assert _interpolate({2: 4.0, 4: 2.0}, 8) == pytest.approx(1.0)  # extrapolated
  assert _interpolate({4: 2.0}, 2) == pytest.approx(4.0)
  assert splits_to_probe(8) == [2, 4, 6] and splits_to_probe(2) == [1]
  probes = [Probe(f"split {g}+{8 - g}", g, 8 - g, generate_s=8.0 / g, learn_s=8.0 / (8 - g),
                  sync_s=0.0, generate_concurrent_s=8.0 / g, learn_concurrent_s=8.0 / (8 - g))
            for g in (2, 4, 6)]
  predictions = predict(probes, devices=8, batch=8, max_k=1)
  basis = {p.generation_devices: p.basis for p in predictions if p.k == 1}
  assert basis == {1: "interpolated", 2: "measured", 3: "interpolated", 4: "measured",
                   5: "interpolated", 6: "measured", 7: "interpolated"}
  assert predictions[0].generation_devices == 4  # balanced sides: the best overlap


def _agent_config(*overrides):
  return cli.apply_overrides(cli.load_config_file(str(ROOT / "configs/agent_calc.py")), [
      "--config.rollout.max_slots=64", "--config.rollout.group_size=8",
      "--config.data.prompts_per_step=8", *overrides])


def test_groups_in_flight_fill_the_slots_within_what_the_gate_admits():
  config = _agent_config()
  # in a slot a quarter of its life: 64 slots need 256 episodes, 32 groups of 8
  assert advised_groups_in_flight(config, 0.25, k=3) == 32
  assert advised_groups_in_flight(config, 0.25, k=2) == 24  # the gate admits 3 batches of 8 groups
  assert advised_groups_in_flight(config, 0.5, k=3) == 16
  assert advised_groups_in_flight(config, 1.0, k=3) == 8  # parked in their slots: one batch fills them
  assert advised_groups_in_flight(config, 0.0, k=1) == 16  # never in a slot: as many as admitted


def test_the_advisor_adds_continuous_admission_for_episodes_only():
  config = _agent_config("--config.env.release_slots=true")
  split = Probe("split 1+1", 1, 1, generate_s=2.0, learn_s=1.0, sync_s=0.0,
                generate_concurrent_s=2.0, learn_concurrent_s=1.0, in_slot_frac=0.25)
  best = next(p for p in predict([split], devices=2, batch=64, max_k=3) if p.k == 1)
  # the slots need 32 groups: k=3 lets the gate admit them
  advice = stream_advice(config, best, [split], max_k=3)
  assert advice["overrides"] == ["--config.mesh.max_staleness=3",
                                 "--config.mesh.admission=continuous",
                                 "--config.mesh.groups_in_flight=32"]
  assert "25% of their life" in advice["reason"] and "256 episodes" in advice["reason"]
  capped = stream_advice(config, best, [split], max_k=2)  # k=2 admits 24 of the 32
  assert capped["k"] == 2 and capped["groups_in_flight"] == 24
  assert "k=2 lets the gate admit 24" in capped["reason"] and "raise --max-k" in capped["reason"]
  assert "raise --max-k" in stream_advice(config, best, [split], max_k=1)["reason"]
  single_turn = cli.apply_overrides(config, ["--config.env.name="])
  assert stream_advice(single_turn, best, [split]) is None
  synchronous = next(p for p in predict([split], devices=2, batch=64) if p.k == 0)
  assert stream_advice(config, synchronous, [split]) is None


def test_the_advisor_probes_a_tiny_config_end_to_end(tmp_path):
  out = tmp_path / "advise.json"
  result = subprocess.run(
      [sys.executable, "-m", "rlx.advise", "--config", "configs/dapo_split.py", "--devices", "2",
       "--steps", "1", "--out", str(out), "--workdir", str(tmp_path / "probe"), *tiny.OVERRIDES,
       "--config.algorithm.dynamic_sampling=false", "--config.trainer.compile_cache="],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "recommended:" in result.stdout and "--config.mesh.mode=" in result.stdout
  written = json.loads(out.read_text())
  assert [p["name"] for p in written["probes"]] == ["colocated", "split 1+1"]
  assert all(p["generate_s"] > 0 and p["learn_s"] > 0 for p in written["probes"])
  assert written["probes"][1]["generate_concurrent_s"] > 0
  assert {p["label"] for p in written["predictions"]} == {
      "colocated (2 devices)", "split 1+1, k=0", "split 1+1, k=1", "split 1+1, k=2"}
  assert written["recommended"]["label"] == written["predictions"][0]["label"]


def test_the_advisor_refuses_one_device(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "rlx.advise", "--config", "configs/dapo_split.py", "--devices", "1",
       "--out", str(tmp_path / "a.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2 and "--devices must be >= 2" in result.stderr
