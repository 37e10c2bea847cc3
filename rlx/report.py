"""A run report: ``python -m rlx.report WORKDIR [WORKDIR ...] [--out DIR]``.

Reads each run's ``metrics.jsonl`` (and ``config.json`` for its name, mode and staleness
bound) and writes ``DIR/report.html`` with PNG figures beside it:

- reward and held-out accuracy against step and against wall-clock minutes;
- entropy, KL and clip fractions;
- policy lag (mean and max) with the staleness bound;
- the busy fraction of the generation and learning sides;
- tokens/s and samples/s;
- controller events (any ``control/*`` metric changing) as dotted vertical markers;
- a summary table.

Several workdirs overlay on the same axes, one colour per run. Noisy series are drawn thin
with a rolling mean on top. Needs matplotlib (the ``report`` extra). ``DIR`` defaults to
``WORKDIR/report`` for one run and ``./rlx-report`` for several.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import importlib.util
import json
import math
import pathlib
import statistics
import sys


class ReportError(ValueError):
  """A workdir that cannot be reported on, with what to do about it."""


@dataclasses.dataclass
class Run:
  """One run's metrics as columns (``None`` where a step did not record a key)."""

  label: str
  workdir: pathlib.Path
  config: dict
  rows: list[dict]
  initial: dict = dataclasses.field(default_factory=dict)
  """The held-out evaluation before RL (``eval_initial.json``): step 0 of the eval/* keys."""

  def column(self, key: str) -> list[tuple[float, float]]:
    """(step, value) for the steps that recorded ``key`` (step 0: before RL, for eval/*)."""
    before = [(0, self.initial[key])] if _finite(self.initial.get(key)) else []
    return before + [(r["step"], r[key]) for r in self.rows if _finite(r.get(key))]

  def minutes(self) -> dict[int, float]:
    """Wall-clock minutes since the first recorded step, by step."""
    stamps = [(r["step"], r["time/timestamp"]) for r in self.rows
              if _finite(r.get("time/timestamp"))]
    if stamps:
      first = stamps[0][1] - self.rows[0].get("time/step_s", 0.0)
      return {step: (stamp - first) / 60 for step, stamp in stamps}
    # older runs: add up the step times
    elapsed, out = 0.0, {}
    for r in self.rows:
      elapsed += r.get("time/step_s") or 0.0
      out[r["step"]] = elapsed / 60
    return out

  def has(self, key: str) -> bool:
    return any(_finite(r.get(key)) for r in self.rows)

  def events(self) -> list[tuple[int, str]]:
    """(step, 'control/k 2 -> 1') wherever a controller metric changed."""
    out, last = [], {}
    for r in self.rows:
      for key, value in r.items():
        if key.startswith("control/") and _finite(value):
          if key in last and value != last[key]:
            out.append((r["step"], f"{key} {last[key]:g} -> {value:g}"))
          last[key] = value
    return out


def _finite(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load(workdir: str | pathlib.Path) -> Run:
  """The metrics and config of one workdir."""
  workdir = pathlib.Path(workdir)
  path = workdir / "metrics.jsonl"
  if not path.is_file():
    raise ReportError(f"{path} does not exist: pass the --workdir of an rlx run "
                      "(with logging.jsonl=true)")
  rows, lines = [], path.read_text().splitlines()
  for number, line in enumerate(lines, 1):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if number < len(lines):  # a torn last line is a run still writing
        raise ReportError(f"{path}, line {number}: not JSON; the file is damaged") from None
  if not rows:
    raise ReportError(f"{path} has no steps yet")
  config_path = workdir / "config.json"
  config = json.loads(config_path.read_text()) if config_path.is_file() else {}
  initial_path = workdir / "eval_initial.json"
  try:
    initial = json.loads(initial_path.read_text()) if initial_path.is_file() else {}
  except json.JSONDecodeError:
    initial = {}
  return Run(label=config.get("name") or workdir.name, workdir=workdir, config=config, rows=rows,
             initial=initial)


def _labelled(runs: list[Run]) -> list[Run]:
  """Runs with unique labels (the workdir's name added where names clash)."""
  names = [r.label for r in runs]
  for run in runs:
    if names.count(run.label) > 1:
      run.label = f"{run.label} ({run.workdir.name})"
  return runs


def _rolling(values: list[float], window: int) -> list[float]:
  out, total = [], 0.0
  for i, value in enumerate(values):
    total += value
    if i >= window:
      total -= values[i - window]
    out.append(total / min(i + 1, window))
  return out


# --- figures ---------------------------------------------------------------------------------

def _plot_series(ax, run: Run, key: str, color, *, x: str = "step", style: str = "-",
                 label: str | None = None, smooth: bool = True):
  points = run.column(key)
  if not points:
    return False
  steps, values = zip(*points)
  if x == "minutes":
    minutes = run.minutes()
    steps = [minutes.get(s, math.nan) for s in steps]
  window = max(1, len(values) // 20) if smooth else 1
  name = label or run.label
  if window > 1:
    ax.plot(steps, values, style, color=color, alpha=0.25, linewidth=0.8)
    ax.plot(steps, _rolling(list(values), window), style, color=color, linewidth=1.8,
            label=f"{name} (mean of {window})")
  else:
    ax.plot(steps, values, style, color=color, linewidth=1.6, label=name,
            marker="o" if len(values) < 12 else None, markersize=3)
  return True


def _mark_events(ax, runs: list[Run], colors):
  for run, color in zip(runs, colors):
    for step, _ in run.events():
      ax.axvline(step, color=color, linestyle=":", linewidth=1.0, alpha=0.8)


def _finish(ax, title: str, xlabel: str, drew: bool):
  ax.set_title(title, fontsize=11)
  ax.set_xlabel(xlabel)
  ax.grid(True, alpha=0.3)
  if drew:
    ax.legend(fontsize=8, loc="best")
  else:
    ax.text(0.5, 0.5, "not recorded by these runs", ha="center", va="center",
            transform=ax.transAxes, color="gray")


def figures(runs: list[Run], out: pathlib.Path) -> list[tuple[str, str]]:
  """Writes the PNGs; returns (file name, caption) of each."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
  written = []

  def save(fig, name, caption):
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    written.append((name, caption))

  # reward and accuracy, by step and by wall clock
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
  for x, ax in zip(("step", "minutes"), axes):
    drew = False
    for run, color in zip(runs, colors):
      drew |= _plot_series(ax, run, "reward/mean", color, x=x, label=f"{run.label}: reward")
      drew |= _plot_series(ax, run, "eval/accuracy", color, x=x, style="--", smooth=False,
                           label=f"{run.label}: held-out accuracy")
    if x == "step":
      _mark_events(ax, runs, colors)
    _finish(ax, "Reward (solid) and held-out accuracy (dashed)",
            "step" if x == "step" else "wall clock (minutes)", drew)
  save(fig, "reward.png", "Training reward and held-out accuracy against step and wall clock.")

  # the policy: entropy, KL, clip fractions
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
  panels = [("Entropy", ["policy/entropy"]),
            ("KL", ["policy/kl_behaviour", "policy/kl"]),
            ("Clip fractions", ["policy/clip_frac_high", "policy/clip_frac_low"])]
  for ax, (title, keys) in zip(axes, panels):
    drew = False
    for run, color in zip(runs, colors):
      for key, style in zip(keys, ("-", "--")):
        drew |= _plot_series(ax, run, key, color, style=style, label=f"{run.label}: {key}")
    _mark_events(ax, runs, colors)
    _finish(ax, title, "step", drew)
  save(fig, "policy.png", "Policy entropy, KL (to the behaviour policy, and to the reference "
       "where there is one) and the fractions of clipped tokens.")

  # policy lag and busy fractions
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
  ax, drew = axes[0], False
  for run, color in zip(runs, colors):
    drew |= _plot_series(ax, run, "rollout/policy_lag_mean", color, smooth=False,
                         label=f"{run.label}: mean")
    drew |= _plot_series(ax, run, "rollout/policy_lag_max", color, style="--", smooth=False,
                         label=f"{run.label}: max")
    # with in-flight updates a row's tokens span versions: drawn beside the lag it adds to
    drew |= _plot_series(ax, run, "rollout/version_span_max", color, style=":",
                         smooth=False, label=f"{run.label}: versions within a row (max)")
    mesh = run.config.get("mesh", {})
    bound, threshold = mesh.get("max_staleness"), mesh.get("lag_threshold")
    if run.has("control/k"):  # the controller's effective bound, step by step
      drew |= _plot_series(ax, run, "control/k", color, style="-.", smooth=False,
                           label=f"{run.label}: effective k")
    elif mesh.get("mode") == "split" and bound is not None:
      ax.axhline(bound, color=color, linestyle="-.", linewidth=1.0,
                 label=f"{run.label}: bound k = {bound}")
    if threshold is not None:
      ax.axhline(threshold, color=color, linestyle=":", linewidth=1.2,
                 label=f"{run.label}: lag threshold {threshold}")
  _mark_events(ax, runs, colors)
  _finish(ax, "Policy lag (versions)", "step", drew)
  ax.set_ylim(-0.2, max(1.0, ax.get_ylim()[1]) + 0.3)
  ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  drew = False
  for run, color in zip(runs, colors):
    for side, style in (("generation", "-"), ("learning", "--")):
      # over the last 10 steps where the run recorded it, else cumulative since the start
      windowed = run.has(f"time/{side}_busy_frac_window")
      key = f"time/{side}_busy_frac" + ("_window" if windowed else "")
      drew |= _plot_series(axes[1], run, key, color, style=style,
                           label=f"{run.label}: {side}" + ("" if windowed else " (cumulative)"))
  axes[1].set_ylim(0, 1.05)
  _mark_events(axes[1], runs, colors)
  _finish(axes[1], "Busy fraction of each side", "step", drew)
  save(fig, "deployment.png", "Policy lag against the staleness bound (and, with in-flight "
       "updates, how many versions one row's tokens span), and how busy the generation and "
       "learning sides were.")

  # throughput
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
  for ax, key, title in ((axes[0], "throughput/tokens_per_s", "Response tokens/s"),
                         (axes[1], "throughput/samples_per_s", "Samples/s")):
    drew = False
    for run, color in zip(runs, colors):
      drew |= _plot_series(ax, run, key, color)
    _finish(ax, title, "step", drew)
  save(fig, "throughput.png", "Throughput of the whole loop.")

  if any(run.has("agent/turns_mean") for run in runs):  # multi-turn episodes
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    panels = [("Turns and tool calls per episode", ["agent/turns_mean", "agent/tool_calls_mean"]),
              ("Failed tool calls (per step)", ["agent/tool_errors", "agent/tool_timeouts",
                                                "agent/malformed_calls"]),
              ("Truncated episodes, slot occupancy", ["agent/truncated_frac",
                                                      "rollout/slot_occupancy"])]
    for ax, (title, keys) in zip(axes, panels):
      drew = False
      for run, color in zip(runs, colors):
        for key, style in zip(keys, ("-", "--", ":")):
          drew |= _plot_series(ax, run, key, color, style=style, label=f"{run.label}: {key}")
      _finish(ax, title, "step", drew)
    save(fig, "agents.png", "Multi-turn episodes: turns and tool calls per episode, failed calls "
         "(errors, timeouts, unreadable calls), truncated episodes and how busy the decode "
         "slots kept while episodes waited for their tools.")
  return written


# --- the summary and the page -----------------------------------------------------------------

def _mean_of_part(points: list[tuple[float, float]], first: bool,
                  fraction: float = 0.1) -> float | None:
  """Mean value over the first (or last) ``fraction`` of the points."""
  if not points:
    return None
  count = max(1, int(len(points) * fraction))
  return statistics.fmean(v for _, v in (points[:count] if first else points[-count:]))


def summary(run: Run) -> dict[str, object]:
  """One row of the summary table."""
  mesh = run.config.get("mesh", {})
  algorithm = run.config.get("algorithm", {}).get("name", "?")
  evals = run.column("eval/accuracy")
  throughput = [v for _, v in run.column("throughput/tokens_per_s")]
  lag = [v for _, v in run.column("rollout/policy_lag_mean")]
  mismatch = [v for _, v in run.column("rollout/mismatch_kl")]
  minutes = run.minutes()
  return {
      "run": run.label,
      "mode": mesh.get("mode", "?") + (f" (k = {mesh.get('max_staleness')})"
                                       if mesh.get("mode") == "split" else ""),
      "algorithm": algorithm,
      "steps": run.rows[-1]["step"],
      "wall clock (min)": max(minutes.values()) if minutes else None,
      "reward, first 10%": _mean_of_part(run.column("reward/mean"), first=True),
      "reward, last 10%": _mean_of_part(run.column("reward/mean"), first=False),
      "held-out accuracy, before RL": run.initial.get("eval/accuracy"),
      "held-out accuracy, last": evals[-1][1] if evals and evals[-1][0] > 0 else None,
      "tokens/s (median)": statistics.median(throughput) if throughput else None,
      "policy lag (mean)": statistics.fmean(lag) if lag else None,
      # the engine against the learner under the same weights: numerics, not staleness
      "engine/learner KL (median)": statistics.median(mismatch) if mismatch else None,
      "controller events": len(run.events()),
  }


def _cell(value) -> str:
  if value is None:
    return "–"
  if isinstance(value, float):
    return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
  return html.escape(str(value))


def page(runs: list[Run], images: list[tuple[str, str]]) -> str:
  rows = [summary(run) for run in runs]
  head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
  body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row.values()) + "</tr>"
                 for row in rows)
  events = "".join(f"<li>{html.escape(run.label)}, step {step}: {html.escape(text)}</li>"
                   for run in runs for step, text in run.events())
  figures_html = "".join(f'<figure><img src="{name}" alt="{html.escape(caption)}">'
                         f"<figcaption>{html.escape(caption)}</figcaption></figure>"
                         for name, caption in images)
  sources = "".join(f"<li>{html.escape(run.label)}: <code>{html.escape(str(run.workdir))}"
                    "</code></li>" for run in runs)
  return f"""<!doctype html>
<html><head><meta charset="utf-8">
<title>rlx report: {html.escape(', '.join(r.label for r in runs))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}
th {{ background: #f4f4f4; }} td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #555; font-size: 0.9em; }}
</style></head><body>
<h1>rlx report</h1>
<ul>{sources}</ul>
<h2>Summary</h2>
<table><tr>{head}</tr>{body}</table>
<h2>Controller events</h2>
{f"<ul>{events}</ul>" if events else "<p>None (no control/* metric changed).</p>"}
<h2>Figures</h2>
{figures_html}
{_samples_html(runs)}
{_episodes_html(runs)}
</body></html>
"""


def _tail_records(file: pathlib.Path, count: int) -> list[dict]:
  """The last ``count`` readable JSON lines of ``file`` (none when it is absent)."""
  if not file.is_file():
    return []
  records = []
  for line in file.read_text().splitlines()[-count:]:
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def _samples_html(runs: list[Run], count: int = 8) -> str:
  """A table of the last ``count`` samples of each run (its ``samples.jsonl``): what the
  model wrote, its reward and verdict."""
  rows = []
  for run in runs:
    for record in _tail_records(run.workdir / "samples.jsonl", count):
      cells = [run.label, record.get("step"), record.get("reward"),
               "yes" if record.get("correct") else "no", record.get("finish_reason")]
      rows.append("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in cells)
                  + f'<td style="text-align:left"><pre>{html.escape(str(record.get("prompt")))}'
                  f'</pre></td><td style="text-align:left"><pre>'
                  f'{html.escape(str(record.get("response")))}</pre></td></tr>')
  if not rows:
    return ""
  head = "".join(f"<th>{h}</th>" for h in ("run", "step", "reward", "correct", "ended",
                                            "prompt", "response"))
  return f"<h2>Samples</h2><table><tr>{head}</tr>{''.join(rows)}</table>"


def _episodes_html(runs: list[Run], count: int = 4) -> str:
  """The last ``count`` sample episodes of each run (its ``episodes.jsonl``): the model's
  sampled tokens in bold on a tinted background, the prompt and the environment's tokens plain."""
  parts = []
  for run in runs:
    for record in _tail_records(run.workdir / "episodes.jsonl", count):
      text = "".join(f'<b style="background:#e8f0ff">{html.escape(t)}</b>' if sampled
                     else html.escape(t) for t, sampled in record.get("segments", []))
      parts.append(f"<p>{html.escape(run.label)}, policy version {record.get('policy_version')}, "
                   f"reward {record.get('reward')}, {record.get('turns')} turn(s), "
                   f"{html.escape(str(record.get('finish_reason')))}:</p><pre>{text}</pre>")
  if not parts:
    return ""
  return ("<h2>Sample episodes</h2><p>Sampled tokens in bold; the prompt and the environment's "
          "tokens plain.</p>" + "".join(parts))


def write_report(workdirs: list[str | pathlib.Path],
                 out: str | pathlib.Path | None = None) -> pathlib.Path:
  """Writes ``report.html`` and its figures; returns the page's path."""
  runs = _labelled([load(w) for w in workdirs])
  if out is None:
    out = runs[0].workdir / "report" if len(runs) == 1 else pathlib.Path("rlx-report")
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  if importlib.util.find_spec("matplotlib") is None:
    raise ReportError("the report needs matplotlib: pip install 'rlx[report]'")
  images = figures(runs, out)
  path = out / "report.html"
  path.write_text(page(runs, images))
  return path


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m rlx.report",
                                   description="Plots and a summary of rlx runs, as an HTML page.")
  parser.add_argument("workdirs", nargs="+", help="workdirs of rlx runs (their metrics.jsonl)")
  parser.add_argument("--out", default=None,
                      help="folder of the report (default WORKDIR/report, or ./rlx-report for "
                      "several)")
  args = parser.parse_args(argv)
  try:
    path = write_report(args.workdirs, args.out)
  except ReportError as error:
    print(f"rlx.report: error: {error}", file=sys.stderr)
    return 2
  print(f"rlx.report: wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
