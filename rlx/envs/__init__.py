"""Environments and tools for multi-turn episodes (plain Python, no JAX): the contract
(``Environment``, ``Observation``), tool schemas from Python functions and the workers that run
calls (``ToolRunner``), tool-call parsers per model family, the token rendering of
observations, and the built-in ``calc`` and ``code`` environments."""

from rlx.envs.calls import FORMATS, MalformedCall, ToolCall, parse
from rlx.envs.contract import (Environment, Observation, check_env, load_agent, load_factory,
                                tools_of)
from rlx.envs.episode import COUNTS, Episode, Reply, Toolbox
from rlx.envs.render import Renderer
from rlx.envs.tools import ToolResult, ToolRunner, schema

__all__ = ["COUNTS", "Environment", "Episode", "FORMATS", "MalformedCall", "Observation",
           "Renderer", "Reply", "ToolCall", "ToolResult", "ToolRunner", "Toolbox", "check_env",
           "load_agent", "load_factory", "parse", "schema", "tools_of"]
