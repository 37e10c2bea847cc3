"""The trusted evaluator of the ``code`` reward: Python's pure expressions over built-in values.

It decides an assert test in the trainer's own process, the program's values (the probes'
results, ``rlx.rewards.checker``) written in where the test called the program. It covers
constants, names, containers, arithmetic, comparisons, subscripts, ``math`` and a fixed set of
builtins, with bounds on what it builds (``MAX_SIZE``, powers, repetitions); anything else
raises ``NeedsSandbox`` and the test runs in a sandbox that holds no line of the program.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import math

from rlx.rewards.plain import Iterated

# modules a test may use without importing them (its program usually imports them); the
# trusted side uses the real module, never one the program defines under that name
TRUSTED_MODULES = ("math", "cmath", "re", "string", "collections", "itertools", "functools",
                   "heapq", "bisect", "fractions", "decimal", "statistics", "operator")
PROBE = "_rlx_probe_"
"""The name a probe's value has in a test (``_rlx_probe_<k>``)."""
MAX_SIZE = 10**6
"""Elements a sequence the evaluator builds may have."""


class NeedsSandbox(Exception):
  """A construct the trusted evaluator does not cover: the test runs in the second sandbox."""


@dataclasses.dataclass(frozen=True)
class Raised:
  """A probe that raised (or returned something that is not plain data) in the sandbox."""

  error: str
  bases: tuple[str, ...] = ()
  """The names of the exception's classes, its own first (``("MyError", "ValueError",
  "Exception", ...)``): a test that expects an exception catches it by any of them."""


def _bounded_range(*args):
  r = range(*args)
  if len(r) > MAX_SIZE:
    raise NeedsSandbox("a long range")
  return r


_CALLABLES = {name: getattr(builtins, name) for name in (
    "abs", "all", "any", "bool", "bytes", "chr", "dict", "divmod", "enumerate", "float",
    "frozenset", "int", "isinstance", "len", "list", "max", "min", "ord", "repr", "reversed",
    "round", "set", "sorted", "str", "sum", "tuple", "type", "zip", "complex", "iter",
    "next")}
_CALLABLES["range"] = _bounded_range
_VALUES = {"True": True, "False": False, "None": None}
_MATH = {name: getattr(math, name) for name in (
    "isclose", "fabs", "sqrt", "floor", "ceil", "isnan", "isinf", "isfinite", "log", "log2",
    "log10", "exp", "gcd", "hypot", "trunc", "inf", "nan", "pi", "e", "tau")}

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
           ast.Pow: lambda a, b: a ** b, ast.BitAnd: lambda a, b: a & b,
           ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b}
_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
            ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
            ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
            ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b}
_UNARY = {ast.Not: lambda a: not a, ast.USub: lambda a: -a, ast.UAdd: lambda a: +a,
          ast.Invert: lambda a: ~a}


def _size(value) -> int:
  return len(value) if isinstance(value, (str, bytes, list, tuple, set, frozenset, dict)) else 0


def _unpack(target: ast.AST, value, names: dict) -> None:
  """Binds an assignment's target (a name, or tuples and lists of them) to ``value``."""
  if isinstance(target, ast.Name):
    names[target.id] = value
  elif isinstance(target, (ast.Tuple, ast.List)) and not any(
      isinstance(e, ast.Starred) for e in target.elts):
    items = list(value)
    if len(items) != len(target.elts):
      raise ValueError("wrong number of values to unpack")
    for element, item in zip(target.elts, items):
      _unpack(element, item, names)
  else:
    raise NeedsSandbox("an assignment to a subscript or attribute")


def into(old, new):
  """``new``, the value after a call of a name the program took, written into ``old`` where
  both are the same kind of mutable container (the call changed that object, and every other
  name for it sees the change, as in Python); else ``new`` itself."""
  if type(old) is type(new) and isinstance(new, (list, bytearray)):
    old[:] = new
    return old
  if type(old) is type(new) and isinstance(new, (dict, set)):
    old.clear()
    old.update(new)
    return old
  return new


class Evaluator:
  """Runs a test's statements (asserts, assignments, expressions) over built-in values,
  ``PROBE<k>`` standing for the k-th probe's value and ``names`` for what the test bound."""

  def __init__(self, values: list, afters: list[dict]):
    self.probes = {f"{PROBE}{k}": (v if not isinstance(v, Iterated) else iter(v.items), after)
                   for k, (v, after) in enumerate(zip(values, afters))}
    self.names: dict = {}

  def run(self, module: ast.Module) -> bool:
    for statement in module.body:
      if isinstance(statement, ast.Assert):
        if not self.expr(statement.test):
          return False
      elif isinstance(statement, ast.Assign):
        value = self.expr(statement.value)
        for target in statement.targets:
          _unpack(target, value, self.names)
      elif isinstance(statement, ast.Expr):
        self.expr(statement.value)
      elif isinstance(statement, ast.Import) and all(
          a.name in TRUSTED_MODULES and a.asname is None for a in statement.names):
        continue  # the trusted modules are known by name
      elif not isinstance(statement, ast.Pass):
        raise NeedsSandbox(type(statement).__name__)
    return True

  def expr(self, node: ast.AST):
    if isinstance(node, ast.Constant):
      return node.value
    if isinstance(node, ast.Name):
      if node.id in self.probes:  # the program's value; the names it took, as it left them
        value, after = self.probes[node.id]
        for name, new in after.items():
          self.names[name] = into(self.names.get(name), new)
        if isinstance(value, Raised):
          raise ValueError(f"the program raised {value.error}")
        return value
      if node.id in self.names:
        return self.names[node.id]
      if node.id in _VALUES:
        return _VALUES[node.id]
      if node.id in _CALLABLES:
        return _CALLABLES[node.id]
      raise NeedsSandbox(node.id)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
      if any(isinstance(e, ast.Starred) for e in node.elts):
        raise NeedsSandbox("starred")
      items = [self.expr(e) for e in node.elts]
      return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
      if any(k is None for k in node.keys):
        raise NeedsSandbox("dict unpacking")
      return {self.expr(k): self.expr(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BoolOp):
      value = None
      for operand in node.values:
        value = self.expr(operand)
        if isinstance(node.op, ast.And) != bool(value):
          return value
      return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](self.expr(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = self.expr(node.left), self.expr(node.right)
      if isinstance(node.op, ast.Pow) and not (
          isinstance(right, (int, float)) and abs(right) <= 1000
          and (not isinstance(left, int) or abs(left).bit_length() <= 64)):
        raise NeedsSandbox("a large power")
      counts = [abs(x) for x in (left, right) if type(x) is int]
      if isinstance(node.op, ast.Mult) and counts and (
          max(_size(left), _size(right)) * counts[0] > MAX_SIZE):
        raise NeedsSandbox("a large repetition")
      return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Compare):
      left = self.expr(node.left)
      for op, comparator in zip(node.ops, node.comparators):
        right = self.expr(comparator)
        if not _COMPARE[type(op)](left, right):
          return False
        left = right
      return True
    if isinstance(node, ast.IfExp):
      return self.expr(node.body) if self.expr(node.test) else self.expr(node.orelse)
    if isinstance(node, ast.Subscript):
      value = self.expr(node.value)
      if isinstance(node.slice, ast.Slice):
        part = [None if p is None else self.expr(p)
                for p in (node.slice.lower, node.slice.upper, node.slice.step)]
        return value[slice(*part)]
      return value[self.expr(node.slice)]
    if isinstance(node, ast.Attribute):
      if (isinstance(node.value, ast.Name) and node.value.id == "math"
          and "math" not in self.names and node.attr in _MATH):
        return _MATH[node.attr]
      raise NeedsSandbox(f"attribute {node.attr}")
    if isinstance(node, ast.Call):
      function = self.expr(node.func)
      if any(isinstance(a, ast.Starred) for a in node.args) or any(
          k.arg is None for k in node.keywords):
        raise NeedsSandbox("unpacked arguments")
      args = [self.expr(a) for a in node.args]
      kwargs = {k.arg: self.expr(k.value) for k in node.keywords}
      return function(*args, **kwargs)
    raise NeedsSandbox(type(node).__name__)


def evaluate(module: ast.Module, values: list, afters: list[dict] | None = None) -> bool | None:
  """Whether the test ``module`` (its probes named ``PROBE<k>``) holds with the probes'
  ``values``: True or False, or None when it needs a construct this evaluator does not cover.
  A probe that raised, or an expression that raises, fails the test."""
  try:
    return bool(Evaluator(values, afters or [{} for _ in values]).run(module))
  except NeedsSandbox:
    return None
  except Exception:  # noqa: BLE001 - an assert whose expression raises fails, as in Python
    return False
