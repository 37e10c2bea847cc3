"""The Llama / Qwen2 / Qwen3 transformer, Hugging Face checkpoints and tokenizers."""

from rlx.models.model import (Model, build_model, from_pretrained, init_model, param_shardings,
                              save_pretrained)
from rlx.models.safetensors_io import CheckpointError
from rlx.models.tokenizer import Tokenizer, builtin_tokenizer, load_tokenizer
from rlx.models.transformer import Transformer, logical_axes, param_shapes

__all__ = [
    "CheckpointError", "Model", "Tokenizer", "Transformer", "build_model", "builtin_tokenizer", "from_pretrained",
    "init_model", "load_tokenizer", "logical_axes", "param_shapes", "param_shardings",
    "save_pretrained",
]
