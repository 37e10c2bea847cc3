"""Compiles rlx's accelerator programs for a GPU or TPU that is not there (the real XLA:TPU +
Mosaic, or XLA:GPU + Triton compilers, run on this machine), at the shapes of real models.

    python benchmarks/aot_compile.py --target v5e|v6e|h100|a100 [--tokens 4096,16384]
    python benchmarks/aot_compile.py --target v5e|v6e|h100|a100 --cost
    python benchmarks/aot_compile.py --target v5e|v6e|h100|a100 --lora [--devices 1,8]

Needs the target's jaxlib plugin at the same version as jax (``pip install -e ".[aot-tpu]"``
or ``".[aot-cuda]"``, in a venv of its own) and JAX_PLATFORMS=cpu. It proves that a program
lowers and fits (shared memory, VMEM, device memory); it says nothing about speed.

Prints JSON: one entry per program: the fused log-prob forward and value_and_grad for each
implementation at each model width and token count; the learner's whole update step (GRPO,
bf16 activations, fp32 params, the Pallas loss, full remat) for a Qwen2.5-0.5B-shaped model
on 1 device and FSDP over 8; the engine's decode step on 1 device. Each is "ok" with the
per-device argument, output and temp memory in MiB, or "failed" with the first line of the
compiler's error.

``--cost``: how much of the target the programs would use, per device: the memory traffic read
from the optimized HLO (``rlx.hlo_traffic``: every kernel reads its operands and writes its
results once; on a TPU also XLA's own bytes accessed, which count on-chip VMEM accesses too)
and XLA's flops (on a GPU, whose compile-only client has no cost analysis, XLA's generic count
of the same HLO), against the ideal for the same work:

- decode (per token for each of 64 slots, in the engine's 16-token chunk, attending to a
  cache filled to 1024 and to 2048 of 2048 positions) for Qwen2.5-0.5B and 7B shapes on one
  device: the ideal reads the weights once and the filled part of the KV cache once; its flops
  are 2 per weight per token plus attention's 4 per cached key per head;
- the learner's GRPO update step (2 mini-batches, 16 rows of 1024 tokens, full remat) for a
  Qwen2.5-0.5B shape on one device (compiled at 2 and 4 layers and scaled to 24: every layer
  costs the same): the ideal does 8 flops per matmul weight per token (6 without remat) plus
  attention's, and reads and writes the weights and optimizer state once per optimizer update.

``--lora``: the memory LoRA saves. The GRPO learner step (bf16 activations, full remat, the
Pallas loss, 16 rows of 1024 tokens in 2 mini-batches) for Qwen2.5-7B and Llama-3-8B shapes,
FSDP over ``--devices`` (default: 1 for a GPU, 1 and 8 for v5e, 8 for v6e), compiled three
ways: full fine-tuning (float32 params and Adam state), and LoRA at rank 16 on every projection
(float32 adapters and their Adam state) on a bfloat16 base and on a float32 one. Per device:
argument, output and temp memory in GiB, their sum, and whether it fits the target's memory.

Each row has ideal/HLO bytes and ideal/XLA flops (1.0: no excess; 0.5: the program moves twice
what it must), the roofline time at the target's published peaks (``rlx/targets/peaks.json``):
the larger of the flops at peak FLOP/s and the HLO bytes at peak bandwidth, and the four
operations that move the most (their JAX op name, count, share). The learner step runs its
log-prob loss as XLA here, so that the cost analysis sees all of it (a Pallas kernel is a
custom call that XLA does not cost).
"""

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_WORKER_ID", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import numpy as np  # noqa: E402

from rlx.aot import (MEMORY_GIB, PLATFORM, compile_one, devices,  # noqa: E402
                     learner_program, peaks, placed as _placed)
from rlx.aot import decode_program as aot_decode_program  # noqa: E402
from rlx.config import (AlgorithmConfig, ArchConfig, DataConfig, LoraConfig,  # noqa: E402
                        ModelConfig, OptimizerConfig, RolloutConfig, RunConfig, TrainerConfig)
from rlx.kernels.fused_logprobs import reference_logprobs, xla_logprobs  # noqa: E402
from rlx.kernels.pallas_logprobs import pallas_logprobs  # noqa: E402
from rlx.mesh import MESH_AXES  # noqa: E402
from rlx.models import Transformer  # noqa: E402
from rlx.unroll import unrolled  # noqa: E402
from rlx.rollout.engine import Engine, _generate_chunk, _generate_one  # noqa: E402

# (name, model width D, vocabulary V) of real models
MODELS = [("qwen2.5-0.5b", 896, 151936), ("qwen2.5-1.5b", 1536, 151936),
          ("qwen2.5-7b", 3584, 152064), ("llama-3-8b", 4096, 128256)]
QWEN_05B = ArchConfig(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
                      rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=32768)
LLAMA_3_8B = ArchConfig(family="llama", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rope_theta=5e5, tie_word_embeddings=False,
                        max_position_embeddings=8192)
QWEN_7B = ArchConfig(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, qkv_bias=True,
                     rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=32768)


def logprob_programs(target: str, tokens: list[int]):
  """(name, fn, args) of the fused log-prob forward and value_and_grad, per implementation."""
  variant = "tpu" if PLATFORM[target] == "tpu" else "gpu"
  impls = {
      "pallas": lambda h, u, t, m: pallas_logprobs(h, u, t, m, variant=variant),
      "xla": lambda h, u, t, m: tuple(jnp.where(m, x, 0.0) for x in xla_logprobs(h, u, t)),
      "reference": lambda h, u, t, m: tuple(jnp.where(m, x, 0.0)
                                            for x in reference_logprobs(h, u, t)),
  }
  for model, width, vocab in MODELS:
    for count in tokens:
      args = (jax.ShapeDtypeStruct((count, width), jnp.bfloat16),
              jax.ShapeDtypeStruct((width, vocab), jnp.bfloat16),
              jax.ShapeDtypeStruct((count,), jnp.int32), jax.ShapeDtypeStruct((count,), bool))
      for impl, fn in impls.items():
        def loss(h, u, t, m, fn=fn):
          logprob, entropy = fn(h, u, t, m)
          return jnp.sum(logprob) + 0.01 * jnp.sum(entropy)

        yield f"{model}/T={count}/{impl}/forward", fn, args
        yield f"{model}/T={count}/{impl}/value_and_grad", jax.value_and_grad(loss, (0, 1)), args


def learner_step(target: str, count: int, tokens_per_row: int = 1024, rows: int = 16):
  """The learner's update step for a Qwen2.5-0.5B-shaped model, FSDP over ``count`` devices:
  (jitted step, abstract args), as ``rlx.aot.learner_program`` builds it for a run."""
  mesh = jax.sharding.Mesh(np.array(devices(target, count)).reshape(1, count, 1), MESH_AXES)
  group = 8
  config = RunConfig(model=ModelConfig(arch=QWEN_05B, dtype="bfloat16", remat="full"),
                     rollout=RolloutConfig(max_prompt_len=tokens_per_row // 2,
                                           max_new_tokens=tokens_per_row // 2, group_size=group),
                     data=DataConfig(prompts_per_step=rows // group),
                     algorithm=AlgorithmConfig(name="grpo"),
                     optimizer=OptimizerConfig(learning_rate=1e-6),
                     trainer=TrainerConfig(mini_batches=2))
  return learner_program(config, mesh)


LORA_ARMS = {"full, fp32 params": ("float32", 0), "LoRA r=16, bf16 base": ("bfloat16", 16),
             "LoRA r=16, fp32 base": ("float32", 16)}


def lora_table(target: str, counts: list[int]) -> list[dict]:
  """Per-device memory of the 7B/8B GRPO learner step, full fine-tuning against LoRA."""
  budget = MEMORY_GIB[target]
  rows = []
  for model, arch in (("qwen2.5-7b", QWEN_7B), ("llama-3-8b", LLAMA_3_8B)):
    for count in counts:
      mesh = jax.sharding.Mesh(np.array(devices(target, count)).reshape(1, count, 1), MESH_AXES)
      for arm, (param_dtype, rank) in LORA_ARMS.items():
        config = RunConfig(
            model=ModelConfig(arch=arch, dtype="bfloat16", param_dtype=param_dtype, remat="full",
                              logprob_impl="pallas", lora=LoraConfig(rank=rank, alpha=2.0 * max(rank, 1))),
            rollout=RolloutConfig(max_prompt_len=512, max_new_tokens=512, group_size=8),
            data=DataConfig(prompts_per_step=2), algorithm=AlgorithmConfig(name="grpo"),
            optimizer=OptimizerConfig(learning_rate=1e-6), trainer=TrainerConfig(mini_batches=2))
        result = compile_one(*learner_program(config, mesh), None, PLATFORM[target])
        row = {"model": model, "target": f"{target}-{count}", "arm": arm, "status": result["status"]}
        if result["status"] == "ok":
          gib = {k: round(result[f"{k}_mib"] / 1024, 2) for k in ("argument", "output", "temp")}
          # outputs alias the donated state: the peak is the arguments plus the temporaries
          total = round(gib["argument"] + gib["temp"], 2)
          row.update(gib, total_gib=total, fits=total <= budget)
        else:
          row.update(error=result["error"], fits=False)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
  return rows


def decode_step(target: str, slots: int = 64, max_len: int = 2048, steps: int = 1,
                arch: ArchConfig = QWEN_05B, attend_len: int | None = None):
  """The engine's decode (every slot ``steps`` tokens, attending to the first ``attend_len``
  positions of the cache, None: all) for a model of ``arch`` on one device: (jitted step,
  abstract args). As ``Engine.generate`` does it: a per-layer cache (GPU) is as long as
  ``attend_len``, a stacked one (TPU) ``max_len`` long with attention limited to it."""
  device = devices(target)[0]
  transformer = Transformer(arch, jnp.bfloat16, "fused", "none")
  engine = Engine(transformer, max_slots=slots, max_len=max_len, max_prompt_len=1024,
                  platform=PLATFORM[target])
  params = jax.eval_shape(lambda: transformer.init(jax.random.key(0), jnp.bfloat16))
  state = jax.eval_shape(engine.init_decode_state)
  if engine.cache_layout == "per_layer" and attend_len is not None:
    state, attend_len = jax.eval_shape(lambda s: engine.resize(s, attend_len), state), None
  placed = jax.sharding.SingleDeviceSharding(device)
  args = (transformer, _placed(params, placed), _placed(state, placed))
  if steps == 1:
    return _generate_one, args + (max_len, attend_len)
  return _generate_chunk, args + (steps, max_len, attend_len)


def _matmul_weights(arch: ArchConfig) -> int:
  """Weights a token multiplies through: every layer's projections and the unembedding (the
  embedding lookup is no matmul)."""
  d, f, e = arch.hidden_size, arch.intermediate_size, arch.head_dim
  attention = d * e * (arch.num_heads * 2 + arch.num_kv_heads * 2)
  return arch.num_layers * (attention + 3 * d * f) + d * arch.vocab_size


def _param_count(arch: ArchConfig) -> int:
  transformer = Transformer(arch, jnp.bfloat16, "fused", "none")
  shapes = jax.eval_shape(lambda: transformer.init(jax.random.key(0), jnp.bfloat16))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def ideal_decode(arch: ArchConfig, slots: int, attend: int) -> dict:
  """One token per slot: weights (bf16) read once, the filled cache (bf16 keys and values of
  every layer) read once; 2 flops per matmul weight per token, 4 per cached key per query
  head (scores and the weighted sum)."""
  cache = arch.num_layers * slots * attend * 2 * arch.num_kv_heads * arch.head_dim * 2
  flops = slots * (2 * _matmul_weights(arch)
                   + 4 * arch.num_layers * arch.num_heads * arch.head_dim * attend)
  return {"bytes": 2 * _param_count(arch) + cache, "flops": flops}


def ideal_learner(arch: ArchConfig, rows: int, length: int, updates: int, epochs: int,
                  remat: bool) -> dict:
  """The update step: 6 flops per matmul weight per token (8 with full remat: the forward
  again), plus causal attention's (4 per key per head forward, on average half the row), on
  every position of every row, each epoch; fp32 weights and Adam's two moments read and
  written once per optimizer update."""
  tokens = rows * length * epochs
  passes = 4 if remat else 3
  attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * (length / 2)
  flops = tokens * (2 * passes * _matmul_weights(arch) + passes * attention)
  return {"bytes": updates * 2 * 3 * 4 * _param_count(arch), "flops": flops}


def _learner_by_layers(target: str) -> dict:
  """The learner step's cost at Qwen2.5-0.5B's 24 layers, from compiles at 2 and 4 (unrolled,
  every layer costs the same; compiling 24 unrolled layers with full remat takes most of an
  hour on 2 cores): cost(24) = cost(2) + 11 * (cost(4) - cost(2))."""
  mesh = jax.sharding.Mesh(np.array(devices(target, 1)).reshape(1, 1, 1), MESH_AXES)
  results = {}
  for layers in (2, 4):
    arch = dataclasses.replace(QWEN_05B, num_layers=layers)
    config = RunConfig(model=ModelConfig(arch=arch, dtype="bfloat16", remat="full",
                                         logprob_impl="xla", logprob_chunk=1024),
                       rollout=RolloutConfig(max_prompt_len=512, max_new_tokens=512,
                                             group_size=8),
                       data=DataConfig(prompts_per_step=2),
                       algorithm=AlgorithmConfig(name="grpo"),
                       optimizer=OptimizerConfig(learning_rate=1e-6),
                       trainer=TrainerConfig(mini_batches=2))
    with unrolled():
      results[layers] = compile_one(*learner_program(config, mesh), None, PLATFORM[target],
                                    with_cost=True)
    if results[layers]["status"] != "ok":
      return results[layers]
  two, four = results[2], results[4]
  scaled = {}
  for key in ("flops", "bytes", "hlo_bytes", "hlo_bytes_cheapest"):
    if two[key] is not None:  # XLA's bytes: None on a GPU
      scaled[key] = two[key] + (QWEN_05B.num_layers - 2) * (four[key] - two[key]) / 2
  return dict(four, **scaled, temp_mib=None, loops=max(two["loops"], four["loops"]))


DECODE_STEPS = 16  # the engine's tokens per dispatch (rollout.decode_steps)


def _per_token(result: dict) -> None:
  """A decode chunk's HLO bytes as bytes per token: the loop body's (one token) plus
  1/DECODE_STEPS of what runs once per chunk."""
  if result["status"] == "ok":
    for suffix in ("", "_cheapest"):
      loop = result["hlo_loop_bytes" + suffix]
      result["hlo_bytes" + suffix] = loop + (result["hlo_bytes" + suffix] - loop) / DECODE_STEPS


def _tensor_parallel_decode(target: str, arch: ArchConfig, chips: int):
  """The engine's decode chunk for a model too large for one chip, its kv heads split over
  ``chips`` (the engine's tensor axis), the whole 2048-position cache: a ``--cost`` row, per
  chip, against 1/``chips`` of the ideal."""
  mesh = jax.sharding.Mesh(np.array(devices(target, chips)).reshape(1, 1, chips), MESH_AXES)
  config = RunConfig(model=ModelConfig(arch=arch, dtype="bfloat16"),
                     rollout=RolloutConfig(max_prompt_len=1024, max_new_tokens=1024,
                                           max_slots=64, decode_steps=DECODE_STEPS))
  with unrolled():
    result = compile_one(*aot_decode_program(config, mesh), None, PLATFORM[target],
                         with_cost=True)
  _per_token(result)
  ideal = {key: value / chips for key, value in ideal_decode(arch, 64, 2048).items()}
  return (f"qwen2.5-7b/decode 64 slots, cache 2048/2048, tensor-parallel over {chips} chips "
          "(per chip)", result, ideal)


def cost_table(target: str) -> list[dict]:
  """The efficiency rows of ``--cost`` (see the module docstring)."""
  peak, platform = peaks(target), PLATFORM[target]
  measured = []  # (name, compile_one's result with the cost, the ideal)
  for model, arch in (("qwen2.5-0.5b", QWEN_05B), ("qwen2.5-7b", QWEN_7B)):
    for attend in (1024, 2048):
      # The engine's chunk of DECODE_STEPS tokens, its layers unrolled: the loop over the
      # tokens is left, and the HLO bytes per token are its body's plus 1/DECODE_STEPS of
      # what runs once per chunk (XLA's count has the body once and the rest once).
      with unrolled():
        result = compile_one(*decode_step(target, arch=arch, attend_len=attend,
                                          steps=DECODE_STEPS), None, platform, with_cost=True)
      _per_token(result)
      measured.append((f"{model}/decode 64 slots, cache {attend}/2048", result,
                       ideal_decode(arch, 64, attend)))
  if peaks(target)["hbm_gib"] < 2 * 15.3:  # 7B's bf16 weights and a cache: tensor-parallel
    measured.append(_tensor_parallel_decode(target, QWEN_7B, chips=4))
  measured.append(("qwen2.5-0.5b/learner step, 16x1024 tokens", _learner_by_layers(target),
                   ideal_learner(QWEN_05B, 16, 1024, updates=2, epochs=1, remat=True)))
  rows = []
  for name, result, ideal in measured:
    row = {"program": name, "status": result["status"]}
    if result["status"] == "ok" and result["hlo_bytes"] > 0:
      flop_s = result["flops"] / peak["bf16_flops"]
      byte_s = result["hlo_bytes"] / peak["hbm_bytes_per_s"]
      row.update({
          "ideal_gb": round(ideal["bytes"] / 1e9, 3),
          "hlo_gb": round(result["hlo_bytes"] / 1e9, 3),
          "ideal_over_hlo_bytes": round(ideal["bytes"] / result["hlo_bytes"], 3),
          # the sampler's top-p branch (a sort of the vocabulary) left out: what decoding
          # without top-k / top-p (RL's default) moves
          "hlo_gb_no_top_p": round(result["hlo_bytes_cheapest"] / 1e9, 3),
          "ideal_over_hlo_bytes_no_top_p": round(ideal["bytes"] / result["hlo_bytes_cheapest"], 3),
          # XLA's own count (None for a GPU compiled without one); on a TPU it also counts
          # the on-chip (VMEM) accesses of the kernels
          "xla_gb": None if result["bytes"] is None else round(result["bytes"] / 1e9, 3),
          "ideal_over_xla_bytes": (None if not result["bytes"] else
                                   round(ideal["bytes"] / result["bytes"], 3)),
          "xla_gflop": round(result["flops"] / 1e9, 1),
          "ideal_gflop": round(ideal["flops"] / 1e9, 1),
          "ideal_over_xla_flops": round(ideal["flops"] / max(result["flops"], 1.0), 3),
          "roofline_ms": round(max(flop_s, byte_s) * 1e3, 3),
          "bound": "memory" if byte_s > flop_s else "compute",
          "temp_mib": result["temp_mib"],
          # loops left in the program: XLA counts their bodies once, so the figures are
          # lower bounds where this is not 0
          "loops_left": result["loops"],
          "top_ops": result["top_ops"]})
    else:
      row["error"] = result.get("error", "no cost analysis")
    print(f"{name}: {row}", file=sys.stderr, flush=True)
    rows.append(row)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", required=True, choices=sorted(PLATFORM))
  parser.add_argument("--tokens", default="4096,16384")
  parser.add_argument("--only", default="", help="run the programs whose name contains this")
  parser.add_argument("--cost", action="store_true",
                      help="the efficiency table: XLA's flops and bytes against the ideal")
  parser.add_argument("--lora", action="store_true",
                      help="the 7B/8B learner step's memory, full fine-tuning against LoRA")
  parser.add_argument("--devices", default="",
                      help="--lora: device counts (default 1 for GPUs, 1,8 for v5e, 8 for v6e)")
  args = parser.parse_args()
  if PLATFORM[args.target] == "cuda":
    jax.config.update("jax_pallas_use_mosaic_gpu", False)  # the kernels are written for Triton
  if args.cost:
    print(json.dumps({"target": args.target, "peaks": peaks(args.target),
                      "programs": cost_table(args.target)}, indent=2))
    return
  if args.lora:
    counts = ([int(c) for c in args.devices.split(",")] if args.devices else
              {"v5e": [1, 8], "v6e": [8]}.get(args.target, [1]))
    print(json.dumps({"target": args.target, "memory_gib": MEMORY_GIB[args.target],
                      "rows": lora_table(args.target, counts)}, indent=2))
    return
  device, platform = devices(args.target)[0], PLATFORM[args.target]
  results = {}

  def record(name, fn, program_args, on_device):
    if args.only and args.only not in name:
      return
    results[name] = compile_one(fn, program_args, device if on_device else None, platform)
    print(f"{name}: {results[name]}", file=sys.stderr, flush=True)

  for name, fn, program_args in logprob_programs(args.target, [int(t) for t in args.tokens.split(",")]):
    record(name, fn, program_args, on_device=True)
  for count in (1, 8):
    name = f"qwen2.5-0.5b/learner_update_step/{count}_devices"
    if not args.only or args.only in name:
      record(name, *learner_step(args.target, count), on_device=False)
  for steps, name in ((1, "decode_step"), (16, "decode_chunk16")):
    record(f"qwen2.5-0.5b/{name}/1_device", *decode_step(args.target, steps=steps), on_device=False)
  failed = sum(r["status"] != "ok" for r in results.values())
  print(json.dumps({"target": args.target, "device": str(device.device_kind), "failed": failed,
                    "programs": results}, indent=2))


if __name__ == "__main__":
  main()
