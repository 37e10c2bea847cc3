"""The policy model and its sampling: architecture, dtypes, the generation engine."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlx.config._checks import _check, _positive

DType = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchConfig:
  """Architecture of a decoder-only transformer (Llama / Qwen2 / Qwen3 family).

  Mirrors the fields of a Hugging Face ``config.json``; ``rlx.models`` reads one
  into this class and writes this class back out.
  """

  family: Literal["llama", "qwen2", "qwen3"] = "llama"
  """Model family; decides the Hugging Face architecture name and bias layout."""
  vocab_size: int = 512
  """Number of token ids."""
  hidden_size: int = 128
  """Width of the residual stream (D)."""
  intermediate_size: int = 384
  """Width of the SwiGLU MLP (F)."""
  num_layers: int = 4
  """Number of decoder layers (stacked and scanned)."""
  num_heads: int = 4
  """Number of query heads."""
  num_kv_heads: int = 2
  """Number of key/value heads (GQA when smaller than num_heads)."""
  head_dim: int = 32
  """Width of one attention head; independent of hidden_size (Qwen3)."""
  rope_theta: float = 10000.0
  """RoPE base frequency."""
  rope_scaling: Literal["none", "llama3", "linear"] = "none"
  """RoPE frequency scaling: 'llama3' (Llama 3.1+), 'linear', or none."""
  rope_factor: float = 1.0
  """Scaling factor of 'llama3' and 'linear' rope scaling."""
  rope_low_freq_factor: float = 1.0
  """'llama3' scaling: wavelengths above original_len / low_freq_factor are divided by rope_factor."""
  rope_high_freq_factor: float = 4.0
  """'llama3' scaling: wavelengths below original_len / high_freq_factor are kept."""
  rope_original_max_len: int = 8192
  """'llama3' scaling: the context length the model was pre-trained with."""
  rms_norm_eps: float = 1e-6
  """Epsilon of every RMSNorm."""
  qkv_bias: bool = False
  """Bias on the q, k and v projections (always on for Qwen2)."""
  o_bias: bool = False
  """Bias on the attention output projection."""
  qk_norm: bool = False
  """RMSNorm over each query and key head before RoPE (Qwen3)."""
  tie_word_embeddings: bool = True
  """Use the input embedding as the unembedding matrix."""
  max_position_embeddings: int = 4096
  """Longest sequence the model is meant for."""
  bos_token_id: int | None = None
  """Beginning-of-sequence id recorded in config.json."""
  eos_token_ids: tuple[int, ...] = ()
  """End-of-sequence ids recorded in config.json (Llama 3 instruct models have several)."""

  def __post_init__(self):
    _check(self.num_heads % self.num_kv_heads == 0, "model.arch.num_heads",
           f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      _check(getattr(self, name) > 0, f"model.arch.{name}", "must be positive")
    _check(self.head_dim % 2 == 0, "model.arch.head_dim", "must be even for RoPE")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections LoRA can adapt: attention's q, k, v, o and the MLP's gate, up, down."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """Low-rank adapters (LoRA): the base weights frozen, only the adapters trained, synced to
  the generator and checkpointed. Off while ``rank`` is 0."""

  rank: int = 0
  """Rank r of every adapter; 0 trains every parameter instead (full fine-tuning)."""
  alpha: float = 32.0
  """Scale numerator: the adapters add (alpha / rank) * x A B to each adapted projection."""
  targets: tuple[str, ...] = LORA_TARGETS
  """The projections that get an adapter, from q, k, v, o, gate, up, down."""
  dropout: float = 0.0
  """Dropout on the adapters' input in the learner's loss forward (never in generation, nor in
  the old policy's log-probs: with it, the first update's ratio is not exactly 1)."""
  path: str | None = None
  """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from
  instead of fresh adapters; its rank and targets must be these."""

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank if self.rank else 0.0

  def __post_init__(self):
    _check(self.rank >= 0, "model.lora.rank", "must be >= 0 (0 turns LoRA off)")
    _check(self.alpha > 0, "model.lora.alpha", "must be positive")
    _check(0 <= self.dropout < 1, "model.lora.dropout", "must be in [0, 1)")
    unknown = sorted(set(self.targets) - set(LORA_TARGETS))
    _check(not unknown and len(self.targets) > 0, "model.lora.targets",
           f"{unknown or 'empty'}: choose from {', '.join(LORA_TARGETS)}")
    _check(len(set(self.targets)) == len(self.targets), "model.lora.targets",
           "names a projection twice")
    _check(self.path is None or self.enabled, "model.lora.path",
           "an adapter to start from needs model.lora.rank > 0 (its rank)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Which policy model to train and how to run it."""

  path: str | None = None
  """Hugging Face model directory (config.json + safetensors). None builds `arch` with random weights."""
  arch: ArchConfig = dataclasses.field(default_factory=ArchConfig)
  """Architecture of the built-in model; ignored when `path` is set."""
  dtype: DType = "float32"
  """Dtype of activations and matmuls."""
  param_dtype: DType = "float32"
  """Dtype the parameters are stored in."""
  attention: Literal["auto", "fused", "reference"] = "auto"
  """Training attention: 'fused' is jax.nn.dot_product_attention (cuDNN flash on GPU when the mask allows), 'reference' plain einsum softmax, 'auto' picks fused."""
  remat: Literal["none", "full", "dots", "dots_no_batch"] = "full"
  """Activation checkpointing per layer: recompute everything ('full'), save matmul outputs ('dots', 'dots_no_batch'), or save all ('none')."""
  seed: int = 0
  """Seed of the random initialisation of the built-in model."""
  logprob_impl: Literal["auto", "reference", "xla", "pallas"] = "auto"
  """Fused log-prob/entropy implementation (rlx.kernels.fused_logprobs); 'auto' picks by backend."""
  logprob_chunk: int = 128
  """Tokens per chunk of the 'xla' fused log-prob path."""
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
  """Low-rank adapters: train these instead of every parameter (off by default)."""

  def __post_init__(self):
    _positive(self, "model", "logprob_chunk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """The generation engine and sampling."""

  max_slots: int = 16
  """Number of concurrent decode slots (continuous batching)."""
  max_prompt_len: int = 128
  """Longest prompt, in tokens; longer prompts are refused."""
  max_new_tokens: int = 64
  """Longest response, in tokens; responses that reach it finish with reason 'length'."""
  group_size: int = 8
  """Samples per prompt (the GRPO group, n)."""
  stop_strings: tuple[str, ...] = ()
  """Single-turn responses end at the token that completes the first of these strings (e.g. '["</answer>"]'): the rest is dropped before scoring and training, finish_reason 'stop'. The model's end-of-sequence tokens always stop it."""
  temperature: float = 1.0
  """Sampling temperature; 0 is greedy."""
  temperature_max: float = 1.5
  """Highest temperature the entropy-floor controller may raise sampling to (algorithm.entropy_floor, entropy_control='temperature')."""
  top_p: float = 1.0
  """Nucleus sampling mass; 1 disables it."""
  top_k: int = 0
  """Keep the k most likely tokens; 0 disables it."""
  decode_steps: int = 16
  """Tokens every slot decodes per dispatch (one host round trip per chunk); 1 is the single-step path. 16 was fastest in benchmarks/rollout_throughput.py."""
  min_decode_width: int = 0
  """The narrowest decode chunk: a chunk decodes only the leading slots that hold the decoding samples, rounded up to a power of two from this one (each width is one more program to compile); 0: an eighth of max_slots. A small model whose chunk costs what its slots compute gains from a low one when few samples decode at a time (multi-turn episodes away on slow tools); one whose chunk is bound by reading the weights does not."""
  cache_layout: str = "auto"
  """The KV cache's layout: 'stacked' (one array over the layers, read in place on TPU), 'per_layer' (one buffer per layer: XLA:GPU and XLA:CPU copy a layer's slice of a stacked array before a matmul reads it), or 'auto' (stacked on TPU, per-layer elsewhere). Per-layer decodes with a per-layer copy of the weights, made once per chunk: on a GPU it moves far less per token but needs the weights' size again in memory while decoding (Qwen2.5-7B on H100: 12.6 GB of temporaries, against 0.3 GB stacked); 'stacked' where memory is short."""

  def __post_init__(self):
    _check(self.cache_layout in ("auto", "stacked", "per_layer"), "rollout.cache_layout",
           f"must be one of 'auto', 'stacked', 'per_layer', not {self.cache_layout!r}")
    _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
    _check(self.temperature_max >= self.temperature, "rollout.temperature_max",
           f"must be >= rollout.temperature={self.temperature}")
    _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
    _check(0 <= self.min_decode_width <= self.max_slots, "rollout.min_decode_width",
           f"must be 0 (an eighth of the slots) .. max_slots={self.max_slots}")
    for name in ("max_slots", "max_prompt_len", "max_new_tokens", "group_size", "decode_steps"):
      _check(getattr(self, name) > 0, f"rollout.{name}", "must be positive")
    _check(all(isinstance(s, str) and s for s in self.stop_strings), "rollout.stop_strings",
           "must be non-empty strings, e.g. '[\"</answer>\"]'")
