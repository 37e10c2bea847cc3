"""The run report: figures and a summary page from metrics.jsonl, several runs overlaid,
controller events marked, clear errors."""

import json

import pytest

from rlx import report


def _workdir(path, name, mode, steps, *, control=False):
  path.mkdir()
  (path / "config.json").write_text(json.dumps(
      {"name": name, "mesh": {"mode": mode, "max_staleness": 2}, "algorithm": {"name": "dapo"}}))
  lines = []
  for step in range(1, steps + 1):
    row = {"step": step, "time/timestamp": 1000.0 + 6 * step, "time/step_s": 6.0,
           "reward/mean": step / steps, "policy/entropy": 1 - step / (2 * steps),
           "policy/kl_behaviour": 0.01, "policy/clip_frac_high": 0.02, "policy/clip_frac_low": 0.0,
           "rollout/policy_lag_mean": 1.0 if mode == "split" else 0.0,
           "rollout/policy_lag_max": 2 if mode == "split" else 0,
           "throughput/tokens_per_s": 900.0, "throughput/samples_per_s": 30.0}
    if mode == "split":
      row.update({"time/generation_busy_frac": 0.9, "time/learning_busy_frac": 0.6,
                  "rollout/version_span_max": 1 + step % 2})
    if control:
      row["control/k"] = 2 if step < 10 else 1
    if step % 10 == 0:
      row["eval/accuracy"] = 0.3 + step / 100
      row["rollout/mismatch_kl"] = step * 1e-9
    lines.append(json.dumps(row))
  (path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": ')  # a torn last line
  (path / "eval_initial.json").write_text(json.dumps({"eval/accuracy": 0.25, "step": 0}))
  (path / "samples.jsonl").write_text(json.dumps(
      {"step": steps, "group": 0, "prompt": "Sort 3 1 2", "response": "<answer>1 2 3</answer>",
       "reward": 1.0, "correct": True, "finish_reason": "stop"}) + "\n")
  return path


def test_report_overlays_runs_and_marks_controller_events(tmp_path):
  split = _workdir(tmp_path / "a", "dapo_split", "split", 40, control=True)
  colocated = _workdir(tmp_path / "b", "dapo_split", "colocated", 30)
  assert report.main([str(split), str(colocated), "--out", str(tmp_path / "out")]) == 0
  page = (tmp_path / "out" / "report.html").read_text()
  for figure in ("reward.png", "policy.png", "deployment.png", "throughput.png"):
    assert (tmp_path / "out" / figure).stat().st_size > 10_000  # a drawn figure, not a blank
    assert f'src="{figure}"' in page
  # same run names: told apart by workdir; the summary has both, with their numbers
  assert "dapo_split (a)" in page and "dapo_split (b)" in page
  assert "split (k = 2)" in page and "colocated" in page
  assert "step 10: control/k 2 -&gt; 1" in page
  row = report.summary(report.load(split))
  assert row["steps"] == 40 and row["controller events"] == 1
  assert row["wall clock (min)"] == pytest.approx(4.0)
  assert row["reward, last 10%"] == pytest.approx((37 + 38 + 39 + 40) / 4 / 40)
  assert row["held-out accuracy, last"] == pytest.approx(0.7)
  assert row["held-out accuracy, before RL"] == 0.25  # the step-0 baseline
  assert report.load(split).column("eval/accuracy")[0] == (0, 0.25)
  assert row["engine/learner KL (median)"] == pytest.approx(25e-9)  # steps 10, 20, 30, 40
  assert "2.5e-08" in page
  assert "<h2>Samples</h2>" in page and "&lt;answer&gt;1 2 3&lt;/answer&gt;" in page


def test_report_errors_name_the_problem(tmp_path, capsys):
  assert report.main([str(tmp_path / "missing")]) == 2
  assert "metrics.jsonl does not exist" in capsys.readouterr().err
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
  assert report.main([str(bad)]) == 2
  assert "line 2: not JSON" in capsys.readouterr().err


def test_the_lag_panel_draws_the_version_span_beside_the_lag(tmp_path, monkeypatch):
  drawn = []
  real = report._plot_series

  def plot(ax, run, key, *args, **kwargs):
    drawn.append(key)
    return real(ax, run, key, *args, **kwargs)

  monkeypatch.setattr(report, "_plot_series", plot)
  split = _workdir(tmp_path / "a", "dapo_split", "split", 20)
  assert report.main([str(split), "--out", str(tmp_path / "out")]) == 0
  lag = drawn.index("rollout/policy_lag_mean")
  assert "rollout/version_span_max" in drawn[lag:lag + 4]
