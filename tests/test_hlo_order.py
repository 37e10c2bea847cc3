"""Collectives that devices could meet in different orders (``rlx.hlo_order``): the checker on
hand-written programs, and rlx's warm-up and update steps on a colocated 2-device CPU mesh,
where XLA:CPU deadlocked when the fused log-prob loop held an all-reduce beside the backward
pass's independent one."""

import dataclasses

import jax
import numpy as np
import pytest

from rlx import aot, cli, hlo_order, update
from rlx.mesh import make_meshes
from rlx.models import build_model
from rlx.trainer.setup.warmup import sft_optimizer, sft_step
from tests.trainer import tiny

LOOP_BESIDE_ALL_REDUCE = """\
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[4] get-tuple-element(%p), index=1
  %r = f32[4]{0} all-reduce(%v), channel_id=1, to_apply=%add, metadata={op_name="jit(f)/loop/psum"}
  ROOT %t = (s32[], f32[4]) tuple(%i, %r)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4], b: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4] parameter(0)
  %b = f32[4] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]) tuple(%zero, %a)
  %w = (s32[], /*index=1*/f32[4]) while(%init), condition=%cond, body=%body
  %out = f32[4] get-tuple-element(%w), index=1
  %other = f32[4]{0} all-reduce(%SOURCE), channel_id=2, to_apply=%add
  ROOT %t = (f32[4], f32[4]) tuple(%out, %other)
}
"""


def test_a_loop_with_a_collective_beside_an_independent_one_is_found():
  found = hlo_order.hazards(LOOP_BESIDE_ALL_REDUCE.replace("%SOURCE", "%b"))
  assert len(found) == 1 and "while w" in found[0] and "all-reduce other" in found[0], found
  assert "all-reduce of jit(f)/loop/psum" in found[0]  # what the loop holds, by its JAX op


def test_a_collective_that_waits_for_the_loop_is_ordered():
  assert hlo_order.hazards(LOOP_BESIDE_ALL_REDUCE.replace("%SOURCE", "%out")) == []


def test_a_loop_without_collectives_is_no_hazard():
  text = LOOP_BESIDE_ALL_REDUCE.replace("%SOURCE", "%b").replace(
      "all-reduce(%v), channel_id=1, to_apply=%add", "negate(%v)")
  assert hlo_order.hazards(text) == []


def _agent_config(*overrides):
  """The agent config's own model and lengths, colocated on 2 CPU devices: the setting that
  deadlocked in its warm-up."""
  config = tiny.config("agent_calc", "--config.mesh.mode=colocated", "--config.mesh.cpu_devices=2",
                       *overrides)
  loaded = cli.load_config_file(str(tiny.ROOT / "configs" / "agent_calc.py"))
  return dataclasses.replace(config, model=loaded.model)  # its real size, not the tiny one


def _sft_step_text(config, rows_given: bool) -> str:
  meshes = make_meshes(config.mesh, jax.devices()[:2])
  assert meshes.learning.size == 2
  rules = config.mesh.logical_axis_rules
  model = build_model(config.model, meshes.learning, rules)
  batch = config.trainer.warmup_sft_batch
  rows = update.batch_sharding(meshes.learning, rules, batch) if rows_given else None
  optimizer = sft_optimizer(1e-3, 10)
  step = sft_step(model.transformer, optimizer, rows)
  length = config.rollout.max_prompt_len + config.rollout.max_new_tokens
  tokens = np.zeros((batch, length), np.int32)
  mask = np.ones((batch, length), bool)
  return step.lower(model.params, optimizer.init(model.params), tokens, mask,
                    mask).compile().as_text()


LOGPROB_OPS = ("cd,dv->cv", "td,dv->tv", "td,tv->dv")  # the fused log-prob kernel's dots


def _logprob_hazards(text: str) -> list[str]:
  return [line for line in hlo_order.hazards(text) if any(op in line for op in LOGPROB_OPS)]


def test_the_warm_up_step_keeps_the_log_prob_loops_free_of_collectives():
  """With the rows given, the log-prob kernel runs per device: its loops hold no collective.
  Without them XLA's partitioner all-reduces each chunk's logits inside the loop, beside the
  backward pass's independent all-reduce of recomputed logits: the pair (channels 8 and 9)
  the deadlocked colocated runs waited at."""
  config = _agent_config()
  assert _logprob_hazards(_sft_step_text(config, rows_given=True)) == []
  unordered = _logprob_hazards(_sft_step_text(config, rows_given=False))
  assert len(unordered) == 1 and "cd,dv->cv" in unordered[0] and "td,dv->tv" in unordered[0]


@pytest.mark.parametrize("packed", [False, True])
def test_the_update_step_keeps_the_log_prob_loops_free_of_collectives(packed):
  config = _agent_config()
  mesh = make_meshes(config.mesh, jax.devices()[:2]).learning
  rows = config.samples_per_step // config.trainer.mini_batches // 2 if packed else None
  fn, args = aot.learner_program(config, mesh, rows)
  assert _logprob_hazards(fn.trace(*args).lower().compile().as_text()) == []
