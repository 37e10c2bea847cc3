"""The trusted half of the ``code`` reward: what the program is asked for, and the verdict.

The program under test never sees a test's expected result, and never judges itself. For
an assert test such as ``assert math.isclose(f(2), 1.41, rel_tol=1e-3)`` this module, in the
trainer's own process:

1. finds the *probes*, the sub-expressions that need the program (``f(2)``): maximal chains
   of calls, attributes and subscripts rooted at a name the test does not bind and that is
   neither a builtin nor a trusted module (``math``...). Those always mean Python's own, even
   where the program defines the same name;
2. sends only the probes (and the test's own statements they depend on, such as ``x = [3,
   1]``) to the sandbox, which runs the program and returns each probe's value as plain
   data: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` and lists, tuples, sets,
   frozensets and dicts of them, exact types only (``decode``). A value of any other type, a
   subclass included, is no value at all, and the test fails;
3. evaluates the test with the values in place, here, by a small evaluator of Python's
   pure expressions over those built-in values (``evaluate``). A test it does not cover (a
   loop, a comprehension...) runs, with the values written in as literals, in a second
   sandbox that holds no line of the program (``render``).

A program can therefore pass a test only by producing the right values: reaching the
harness, patching builtins or the assert machinery, objects with a custom ``__eq__``, or
printing what a passing run would print all leave the verdict where it was.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import math
import re

# modules a test may use without importing them (its program usually imports them); the
# trusted side uses the real module, never one the program defines under that name
TRUSTED_MODULES = ("math", "cmath", "re", "string", "collections", "itertools", "functools",
                   "heapq", "bisect", "fractions", "decimal", "statistics", "operator")
_BUILTINS = frozenset(dir(builtins))
_PROBE = "_rlx_probe_"
_MAX_DEPTH = 64
_MAX_SIZE = 10**6  # elements a sequence the evaluator builds may have


class UnsupportedTest(ValueError):
  """A test whose probes cannot be evaluated apart from it (e.g. ``f(x)`` inside a loop over
  ``x``): it cannot be checked without running the program's judge inside the program."""


class _NeedsSandbox(Exception):
  """A construct the trusted evaluator does not cover: the test runs in the second sandbox."""


@dataclasses.dataclass(frozen=True)
class Raised:
  """A probe that raised (or returned something that is not plain data) in the sandbox."""

  error: str


@dataclasses.dataclass
class AssertPlan:
  """One assert test, split into what the sandbox computes and what the trusted side checks."""

  module: ast.Module
  """The test, each probe replaced by the name ``_rlx_probe_<k>``."""
  probes: list[str]
  """The probes' source, evaluated in the program's namespace."""
  prelude: str
  """The test's statements the probes need (run before them, in the program's namespace)."""


def _bound_at_top(module: ast.Module) -> dict[str, list[int]]:
  """Names the test binds with top-level statements -> the indices of those statements."""
  bound: dict[str, list[int]] = {}
  for index, node in enumerate(module.body):
    names = []
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    for name in names:
      bound.setdefault(name, []).append(index)
  return bound


def _bound_inside(module: ast.Module) -> set[str]:
  """Names bound by loops, comprehensions, functions and handlers anywhere in the test."""
  names = set()
  for node in ast.walk(module):
    if isinstance(node, (ast.For, ast.comprehension)):
      names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    elif isinstance(node, ast.arguments):
      names.update(a.arg for a in node.posonlyargs + node.args + node.kwonlyargs)
      names.update(a.arg for a in (node.vararg, node.kwarg) if a is not None)
    elif isinstance(node, ast.ExceptHandler) and node.name:
      names.add(node.name)
    elif isinstance(node, ast.NamedExpr):
      names.add(node.target.id)
  return names


def _root(node: ast.AST) -> ast.AST:
  while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
    node = node.func if isinstance(node, ast.Call) else node.value
  return node


def plan_asserts(test: str) -> AssertPlan:
  """Splits an assert test into probes and the trusted check; raises
  ``UnsupportedTest`` when a probe needs a name the test binds inside a loop or function,
  and ``SyntaxError`` for a test that does not parse."""
  module = ast.parse(test)
  top = _bound_at_top(module)
  inside = _bound_inside(module)

  def is_program(name: str) -> bool:  # builtins and trusted modules are never the program's
    return not (name in top or name in inside or name in _BUILTINS or name in TRUSTED_MODULES)

  probes: list[str] = []
  needed: set[int] = set()

  class Replace(ast.NodeTransformer):
    def __init__(self, statement: int):
      self.statement = statement

    def generic_visit(self, node):
      if isinstance(node, ast.expr) and not isinstance(node, ast.Starred):
        root = _root(node)
        if (isinstance(root, ast.Name) and isinstance(getattr(node, "ctx", ast.Load()), ast.Load)
            and is_program(root.id)):
          for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
            if name in inside and not is_program(name):
              raise UnsupportedTest(f"the program's value {ast.unparse(node)!r} depends on "
                                    f"{name!r}, which the test binds in a loop, comprehension "
                                    "or function: write the test as one assert per input")
            needed.update(i for i in top.get(name, ()) if i < self.statement)
          probes.append(ast.unparse(node))
          return ast.copy_location(ast.Name(f"{_PROBE}{len(probes) - 1}", ast.Load()), node)
      return super().generic_visit(node)

  # the probes' own prelude statements may need earlier ones: walk back to front
  body = [Replace(index).visit(statement) for index, statement in enumerate(module.body)]
  for index in sorted(needed, reverse=True):
    for name in {n.id for n in ast.walk(module.body[index]) if isinstance(n, ast.Name)}:
      needed.update(i for i in top.get(name, ()) if i < index)
  prelude = "\n".join(ast.unparse(ast.parse(test).body[i]) for i in sorted(needed))
  return AssertPlan(ast.Module(body=body, type_ignores=[]), probes, prelude)


# --- plain data from the sandbox ----------------------------------------------------------------

_INT = re.compile(r"-?\d{1,4000}")
_FLOAT = re.compile(r"-?(inf|nan|\d+(\.\d*)?(e[-+]?\d+)?|\.\d+(e[-+]?\d+)?)", re.IGNORECASE)


def decode(data, depth: int = 0):
  """A value from the sandbox's encoding (``{"int": "12"}``, ``{"list": [...]}``...): built-in
  types only, rebuilt here; ValueError for anything else."""
  if depth > _MAX_DEPTH:
    raise ValueError("nested too deeply")
  if data is None:
    return None
  if not isinstance(data, dict) or len(data) != 1:
    raise ValueError(f"not an encoded value: {str(data)[:60]}")
  (kind, value), = data.items()
  if kind == "bool" and value in (True, False) and type(value) is bool:
    return value
  if kind == "int" and isinstance(value, str) and _INT.fullmatch(value):
    return int(value)
  if kind == "float" and isinstance(value, str) and _FLOAT.fullmatch(value):
    return float(value)
  if kind == "str" and isinstance(value, str):
    return value
  if kind == "bytes" and isinstance(value, str):
    return bytes.fromhex(value)
  if kind in ("list", "tuple", "set", "frozenset") and isinstance(value, list):
    items = [decode(item, depth + 1) for item in value]
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
  if kind == "dict" and isinstance(value, list):
    pairs = []
    for pair in value:
      if not (isinstance(pair, list) and len(pair) == 2):
        raise ValueError("a dict item is not a pair")
      pairs.append((decode(pair[0], depth + 1), decode(pair[1], depth + 1)))
    return dict(pairs)
  raise ValueError(f"not an encoded value: {str(data)[:60]}")


def literal(value) -> str:
  """Python source that evaluates to ``value`` (built-in data only)."""
  kind = type(value)
  if value is None or kind in (bool, int, str, bytes):
    return repr(value)
  if kind is float:
    return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
  if kind is list:
    return "[" + ", ".join(map(literal, value)) + "]"
  if kind is tuple:
    return "(" + "".join(literal(v) + ", " for v in value) + ")"
  if kind is set:
    return "{" + ", ".join(map(literal, value)) + "}" if value else "set()"
  if kind is frozenset:
    return f"frozenset({literal(set(value))})"
  if kind is dict:
    return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
  raise TypeError(f"not plain data: {kind.__name__}")


def render(plan: AssertPlan, values: list) -> str:
  """The test with each probe written in as its value's literal: code that holds nothing of
  the program (for the second sandbox)."""

  class Fill(ast.NodeTransformer):
    def visit_Name(self, node):
      if node.id.startswith(_PROBE):
        return ast.parse(literal(values[int(node.id[len(_PROBE):])]), mode="eval").body
      return node

  return ast.unparse(Fill().visit(ast.parse(ast.unparse(plan.module))))


def records(results: bytes) -> dict[tuple[str, int | None], dict]:
  """The sandbox's report lines by (kind, test index); the first line for each wins, and a
  line that is not a well-formed record is ignored."""
  records = {}
  for line in results.decode(errors="replace").splitlines():
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if not isinstance(record, dict):
      continue
    for kind in ("io", "test", "ran"):
      if kind in record:
        index = record[kind] if kind != "ran" else None
        if kind == "ran" or (type(index) is int):
          records.setdefault((kind, index), record)
        break
  return records


def probe_values(record: dict | None, count: int) -> list | None:
  """The probes' values from a test's record (``checker.Raised`` for a probe that raised or
  returned something that is not plain data); None for a missing or malformed record."""
  if not record or not isinstance(record.get("values"), list) or len(record["values"]) != count:
    return None
  values = []
  for item in record["values"]:
    if isinstance(item, dict) and "value" in item:
      try:
        values.append(decode(item["value"]))
      except (ValueError, TypeError, RecursionError):
        values.append(Raised("a value that is not plain data"))
    else:
      error = item.get("error") if isinstance(item, dict) else None
      values.append(Raised(error if isinstance(error, str) else "unknown"))
  return values


# --- the trusted evaluator ----------------------------------------------------------------------

def _bounded_range(*args):
  r = range(*args)
  if len(r) > _MAX_SIZE:
    raise _NeedsSandbox("a long range")
  return r


_CALLABLES = {name: getattr(builtins, name) for name in (
    "abs", "all", "any", "bool", "bytes", "chr", "dict", "divmod", "enumerate", "float",
    "frozenset", "int", "isinstance", "len", "list", "max", "min", "ord", "repr", "reversed",
    "round", "set", "sorted", "str", "sum", "tuple", "type", "zip")}
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


class _Evaluator:
  def __init__(self, values: list):
    self.names = {f"{_PROBE}{k}": v for k, v in enumerate(values)}

  def run(self, module: ast.Module) -> bool:
    for statement in module.body:
      if isinstance(statement, ast.Assert):
        if not self.expr(statement.test):
          return False
      elif isinstance(statement, ast.Assign) and all(
          isinstance(t, ast.Name) for t in statement.targets):
        value = self.expr(statement.value)
        for target in statement.targets:
          self.names[target.id] = value
      elif isinstance(statement, ast.Expr):
        self.expr(statement.value)
      elif isinstance(statement, ast.Import) and all(
          a.name in TRUSTED_MODULES and a.asname is None for a in statement.names):
        continue  # the trusted modules are known by name
      elif not isinstance(statement, ast.Pass):
        raise _NeedsSandbox(type(statement).__name__)
    return True

  def expr(self, node: ast.AST):
    if isinstance(node, ast.Constant):
      return node.value
    if isinstance(node, ast.Name):
      if node.id in self.names:
        value = self.names[node.id]
        if isinstance(value, Raised):
          raise ValueError(f"the program raised {value.error}")
        return value
      if node.id in _VALUES:
        return _VALUES[node.id]
      if node.id in _CALLABLES:
        return _CALLABLES[node.id]
      raise _NeedsSandbox(node.id)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
      if any(isinstance(e, ast.Starred) for e in node.elts):
        raise _NeedsSandbox("starred")
      items = [self.expr(e) for e in node.elts]
      return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
      if any(k is None for k in node.keys):
        raise _NeedsSandbox("dict unpacking")
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
        raise _NeedsSandbox("a large power")
      counts = [abs(x) for x in (left, right) if type(x) is int]
      if isinstance(node.op, ast.Mult) and counts and (
          max(_size(left), _size(right)) * counts[0] > _MAX_SIZE):
        raise _NeedsSandbox("a large repetition")
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
      raise _NeedsSandbox(f"attribute {node.attr}")
    if isinstance(node, ast.Call):
      function = self.expr(node.func)
      if any(isinstance(a, ast.Starred) for a in node.args) or any(
          k.arg is None for k in node.keywords):
        raise _NeedsSandbox("unpacked arguments")
      args = [self.expr(a) for a in node.args]
      kwargs = {k.arg: self.expr(k.value) for k in node.keywords}
      return function(*args, **kwargs)
    raise _NeedsSandbox(type(node).__name__)


def evaluate(plan: AssertPlan, values: list) -> bool | None:
  """Whether the test holds with the probes' ``values``: True or False from the trusted
  evaluator, or None when the test needs the second sandbox. A probe that raised, or an
  expression that raises, fails the test."""
  try:
    return bool(_Evaluator(values).run(plan.module))
  except _NeedsSandbox:
    return None
  except Exception:  # noqa: BLE001 - an assert whose expression raises fails, as in Python
    return False
