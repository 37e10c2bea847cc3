"""Test setup: 8 fake CPU devices for meshes (before JAX starts), and fixture paths."""

import pathlib

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture
def hf_dir():
  """Path of the tiny Hugging Face checkpoint of a family."""
  return lambda family: FIXTURES / "hf" / family
