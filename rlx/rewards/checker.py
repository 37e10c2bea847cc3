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

Before that, HumanEval's ``def check(candidate)`` called with the entry point is inlined
(``_inline_checks``); an object the program makes and the test keeps (``c = Counter()``,
then ``c.inc()``) stays in the sandbox, every use of it a probe there in order (``_held``);
a call made for its effect alone has no value to judge; and a test that captures printed
output is refused (input/output pairs judge that).

A program can therefore pass a test only by producing the right values: reaching the
harness, patching builtins or the assert machinery, objects with a custom ``__eq__``, or
printing what a passing run would print all leave the verdict where it was.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import dataclasses
import json
import sys

from rlx.rewards.evaluator import PROBE, TRUSTED_MODULES, Evaluator, NeedsSandbox, Raised
from rlx.rewards.evaluator import evaluate as evaluate_module
from rlx.rewards.evaluator import into as evaluator_into
from rlx.rewards.plain import (_ALIAS_IMPORTS, LITERAL_MODULES, Iterated, decode,  # noqa: F401
                               exception_class, literal)

_BUILTINS = frozenset(dir(builtins))


class UnsupportedTest(ValueError):
  """A test whose probes cannot be evaluated apart from it (e.g. ``f(x)`` inside a loop over
  ``x``): it cannot be checked without running the program's judge inside the program."""


@dataclasses.dataclass
class AssertPlan:
  """One assert test, split into what the sandbox computes and what the trusted side checks."""

  module: ast.Module
  """The test, each probe replaced by the name ``_rlx_probe_<k>``."""
  probes: list[str]
  """The probes' source, evaluated in the program's namespace. Every part of a probe that does
  not need the program is either a constant, a name the test bound (``named``), or
  ``_rlx_arg_<m>``, a value the trusted side computes (``anonymous``)."""
  named: list[list[str]]
  """For each probe, the test's names it takes whole as arguments (``f(a)``): their values are
  sent, and their values after the call come back (a program that sorts ``a`` in place)."""
  anonymous: list[str]
  """The source of each ``_rlx_arg_<m>``: what the test computes for a probe (``cases[0]``,
  ``make_input()``), evaluated on the trusted side only."""
  aliases: dict[str, int]
  """Names bound to a probe's value alone (``r = f(3)``) that later probes take: the sandbox
  binds them to its own value."""
  setup: str
  """The test's statements that the named and anonymous arguments need (trusted side only)."""
  imports: list[str]
  """Standard-library modules the test uses (``datetime.date(...)``) without importing them."""


_STDLIB = frozenset(sys.stdlib_module_names) - {"__future__", "this", "antigravity"}


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
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names = [node.name]  # a helper the test defines is the test's, never the program's
    for name in names:
      bound.setdefault(name, []).append(index)
  return bound


def _bound_inside(module: ast.Module) -> set[str]:
  """Names bound by loops, comprehensions, functions, handlers and ``with`` anywhere."""
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
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
      names.update(n.id for n in ast.walk(node.optional_vars) if isinstance(n, ast.Name))
  return names


def _root(node: ast.AST) -> ast.AST:
  while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
    node = node.func if isinstance(node, ast.Call) else node.value
  return node


def _names(node: ast.AST) -> set[str]:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _is_constant(node: ast.AST) -> bool:
  """A literal written in the test (``3``, ``"ab"``, ``-1.5``, ``[1, (2, 3)]``): it carries
  nothing the test computed, so it stays in the probe's source."""
  if isinstance(node, ast.Constant):
    return True
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    return _is_constant(node.operand)
  if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
    return all(_is_constant(e) for e in node.elts)
  if isinstance(node, ast.Dict):
    return all(k is not None and _is_constant(k) and _is_constant(v)
               for k, v in zip(node.keys, node.values))
  return False


def _inline_checks(module: ast.Module) -> ast.Module:
  """HumanEval's form, ``def check(candidate): assert candidate(...) == ...`` then
  ``check(entry_point)``: each such function called once, alone, with a name, is replaced by
  its body at the call, ``candidate`` named by that name, so that its asserts are judged as
  if written there. A function that returns, yields, rebinds its parameter or is used
  otherwise stays as it is."""
  defs = {n.name: n for n in module.body
          if isinstance(n, ast.FunctionDef) and not n.decorator_list and len(n.args.args) == 1
          and not (n.args.posonlyargs or n.args.kwonlyargs or n.args.vararg or n.args.kwarg
                   or n.args.defaults)}
  calls: dict[str, list[int]] = {}
  for index, node in enumerate(module.body):
    if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name) and node.value.func.id in defs
        and len(node.value.args) == 1 and isinstance(node.value.args[0], ast.Name)
        and not node.value.keywords):
      calls.setdefault(node.value.func.id, []).append(index)
  uses = [n.id for n in ast.walk(module) if isinstance(n, ast.Name)]
  inlined = {}
  for name, where in calls.items():
    function, parameter = defs[name], defs[name].args.args[0].arg
    inner = list(ast.walk(ast.Module(body=function.body, type_ignores=[])))
    if (len(where) == 1 and uses.count(name) == 1
        and not any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Global,
                                   ast.Nonlocal, ast.FunctionDef, ast.Lambda, ast.ClassDef))
                    for n in inner)
        and not any(isinstance(n, ast.Name) and n.id == parameter
                    and not isinstance(n.ctx, ast.Load) for n in inner)):
      inlined[where[0]] = (function, parameter, module.body[where[0]].value.args[0].id)

  class Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
      self.old, self.new = old, new

    def visit_Name(self, node):
      return ast.copy_location(ast.Name(self.new, node.ctx), node) if node.id == self.old \
          else node

  gone = {id(function) for function, _, _ in inlined.values()}
  body = []
  for index, node in enumerate(module.body):
    if id(node) in gone:
      continue
    if index in inlined:
      function, parameter, target = inlined[index]
      body += [Rename(parameter, target).visit(copy.deepcopy(statement))
               for statement in function.body]
    else:
      body.append(node)
  return ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))


def _refuse_captured_output(module: ast.Module) -> None:
  """A test that captures what the program prints (``contextlib.redirect_stdout``) is
  refused: printed text is judged by input/output tests, never inside an assert's process."""
  for node in ast.walk(module):
    if isinstance(node, ast.Name) and node.id in ("redirect_stdout", "redirect_stderr") or (
        isinstance(node, ast.Attribute) and node.attr in ("redirect_stdout", "redirect_stderr",
                                                          "stdout", "stderr")):
      raise UnsupportedTest(
          "the test captures what the program prints (redirect_stdout, sys.stdout): write "
          "it as an input/output pair ({\"input\": ..., \"output\": ...}), which runs the "
          "program and compares its output, or assert on a value it returns")


def _held(module: ast.Module, top: dict[str, list[int]], is_program) -> dict[str, int]:
  """Names the test binds once, at the top, to the program's value and then uses through
  their attributes or methods (``c = Counter()`` then ``c.inc()``, ``c.n``): the object
  stays in the program's process, every use of it is a probe there, in the test's order, and
  only plain values come back. -> the statement that binds each."""
  held = {}
  for name, where in top.items():
    node = module.body[where[0]]
    if (len(where) == 1 and isinstance(node, ast.Assign) and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name) and isinstance(_root(node.value), ast.Name)
        and _root(node.value) is not node.value and is_program(_root(node.value).id)):
      used = any(isinstance(n, (ast.Attribute, ast.Call)) and _root(n) is not n
                 and isinstance(_root(n), ast.Name) and _root(n).id == name
                 for n in ast.walk(module))
      if used:
        held[name] = where[0]
  return held


def plan_asserts(test: str) -> AssertPlan:
  """Splits an assert test into probes and the trusted check; raises ``UnsupportedTest``
  when a probe needs something that cannot be sent to the program as plain data (a name the
  test binds inside a loop or function, a helper function passed to the program, printed
  output captured), and ``SyntaxError`` for a test that does not parse."""
  module = _inline_checks(ast.parse(test))
  _refuse_captured_output(module)
  test = ast.unparse(module)
  module = ast.parse(test)
  top = _bound_at_top(module)
  inside = _bound_inside(module)
  defined = {name for name, where in top.items()
             if any(isinstance(module.body[i], (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.ClassDef, ast.Import, ast.ImportFrom))
                    for i in where)}
  # a standard-library module used as one (``datetime.date``) is Python's, even where the
  # program defines that name too; a name only called (``copy(x)``) may be the program's
  modules = {n.value.id for n in ast.walk(module) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id in _STDLIB} - set(top) - inside

  def not_program(name: str) -> bool:  # builtins, modules and the test's own names
    return (name in top or name in inside or name in _BUILTINS or name in TRUSTED_MODULES
            or name in modules)

  held = _held(module, top, lambda name: not not_program(name))

  def is_program(name: str) -> bool:  # and an object the program made that the test keeps
    return name in held or not not_program(name)

  def needs_program(node: ast.AST) -> bool:
    return any(is_program(name) for name in _names(node))

  probes: list[str] = []
  named: list[list[str]] = []
  anonymous: list[str] = []
  needed: set[int] = set()
  uses: list[tuple[int, int, set[str]]] = []  # (probe, statement, the test's names it takes)

  def argument(node: ast.expr, taken: set[str]) -> ast.expr:
    """A part of a probe that does not need the program, as the probe will read it."""
    if _is_constant(node):
      return node
    if isinstance(node, ast.Name) and node.id in top and node.id not in defined:
      taken.add(node.id)
      return node
    if isinstance(node, ast.Name) and node.id in _BUILTINS and node.id not in top:
      return node  # the builtin itself (``key=abs``), the same in both processes
    if isinstance(node, ast.Lambda):
      free = _names(node.body) - {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
      if free & set(top):
        raise UnsupportedTest(f"the test passes the program a function, {ast.unparse(node)!r}, "
                              "that reads the test's own names: write their values into it")
      return node  # its code is the argument: it carries nothing the test computed
    if isinstance(node, ast.Name) and node.id in defined:
      raise UnsupportedTest(f"the test passes the program its own function or class "
                            f"{ast.unparse(node)!r}: it would run in the program's process")
    anonymous.append(ast.unparse(node))
    return ast.copy_location(ast.Name(f"_rlx_arg_{len(anonymous) - 1}", ast.Load()), node)

  def probe_of(node: ast.expr, taken: set[str]) -> ast.expr:
    """The probe ``node`` with each part that does not need the program made an argument."""

    class Arguments(ast.NodeTransformer):
      def generic_visit(self, child):
        if (isinstance(child, ast.expr) and child is not node and not needs_program(child)
            and not isinstance(child, (ast.Slice, ast.Starred))):  # their parts, not themselves
          return argument(child, taken)
        return super().generic_visit(child)

    return Arguments().visit(node)

  class Replace(ast.NodeTransformer):
    def __init__(self, statement: int):
      self.statement = statement

    def generic_visit(self, node):
      if isinstance(node, ast.expr) and not isinstance(node, ast.Starred):
        root = _root(node)
        if (isinstance(root, ast.Name) and isinstance(getattr(node, "ctx", ast.Load()), ast.Load)
            and is_program(root.id)):
          whole = ast.unparse(node)
          taken: set[str] = set()
          first = len(anonymous)
          probe = probe_of(node, taken)
          free = [_names(probe)] + [
              _names(parsed) - _bound_inside(ast.Module(body=[ast.Expr(parsed)], type_ignores=[]))
              for parsed in (ast.parse(source, mode="eval").body for source in anonymous[first:])]
          for name in set().union(*free):
            if name in inside and not is_program(name):
              raise UnsupportedTest(f"the program's value {whole!r} depends on {name!r}, which "
                                    "the test binds in a loop, comprehension or function: "
                                    "write the test as one assert per input")
          for source in anonymous[first:]:
            for name in _names(ast.parse(source, mode="eval")):
              needed.update(i for i in top.get(name, ()) if i < self.statement)
          uses.append((len(probes), self.statement, taken))
          probes.append(ast.unparse(probe))
          named.append(sorted(taken))
          return ast.copy_location(ast.Name(f"{PROBE}{len(probes) - 1}", ast.Load()), node)
      return super().generic_visit(node)

  body = [Replace(index).visit(statement) for index, statement in enumerate(module.body)]
  for name, index in held.items():  # bound where the program runs: a statement of its own
    k = int(body[index].value.id[len(PROBE):])
    probes[k] = f"({name} := {probes[k]})"
    body[index] = ast.Expr(ast.Name(f"{PROBE}{k}", ast.Load()))
  for statement in body:  # a call for its effect: its value is not the test's business
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Name) and (
        statement.value.id.startswith(PROBE)):
      k = int(statement.value.id[len(PROBE):])
      probes[k] = f"({probes[k]}, None)[1]"
  # a name a probe takes is bound by the test's data (setup), or by one probe's value alone
  aliases: dict[str, int] = {}
  for _, statement, taken in uses:
    for name in taken:
      binders = [i for i in top.get(name, ()) if i < statement]
      if not binders:
        continue  # bound only later: the probe raises NameError, as in Python
      last = body[binders[-1]]
      if (isinstance(last, ast.Assign) and len(last.targets) == 1
          and isinstance(last.targets[0], ast.Name) and isinstance(last.value, ast.Name)
          and last.value.id.startswith(PROBE)):
        aliases[name] = int(last.value.id[len(PROBE):])
      else:
        needed.update(binders)
  for index in sorted(needed, reverse=True):  # the setup's own statements may need earlier ones
    for name in _names(module.body[index]):
      needed.update(i for i in top.get(name, ()) if i < index)
  for index in needed:
    if any(isinstance(n, ast.Name) and n.id.startswith(PROBE) for n in ast.walk(body[index])):
      raise UnsupportedTest(f"the test computes the program's input from the program's own "
                            f"values ({ast.unparse(module.body[index])!r}): bind each of them "
                            "to one call alone (r = f(3)) or write the input out")
  original = ast.parse(test).body
  setup = "\n".join(ast.unparse(original[i]) for i in sorted(needed))
  return AssertPlan(ast.Module(body=body, type_ignores=[]), probes, named, anonymous, aliases,
                    setup, sorted(modules))


def _raising(value: Raised) -> str:
  return f"_rlx_raise({list(value.bases or (value.error,))!r})"


# the second sandbox's stand-ins for the program's exceptions (as ``exception_class``)
_RAISE = '''
_rlx_classes = {}
def _rlx_exception(names):
    import builtins
    names = tuple(names)
    if names not in _rlx_classes:
        made = None
        for name in names:
            base = getattr(builtins, name, None)
            if isinstance(base, type) and issubclass(base, BaseException):
                made = base if name == names[0] else type(names[0], (base,), {})
                break
        _rlx_classes[names] = made or type(names[0], (Exception,), {})
    return _rlx_classes[names]
def _rlx_raise(names):
    raise _rlx_exception(names)()
'''


_INTO = inspect.getsource(evaluator_into).replace("def into(", "def _rlx_into(")


def render(plan: AssertPlan, values: list, afters: list[dict] | None = None) -> str:
  """The test with each probe written in as its value's literal (a probe that raised as the
  same raise), and each name a probe took set to its value after the call: code that holds
  nothing of the program (for the second sandbox)."""
  afters = afters or [{} for _ in values]

  class Fill(ast.NodeTransformer):
    def visit_Name(self, node):
      if node.id.startswith(PROBE):
        value = values[int(node.id[len(PROBE):])]
        if isinstance(value, Raised):
          return ast.parse(_raising(value), mode="eval").body
        return ast.Name(node.id, ast.Load())  # bound first, as a literal
      return node

  # values are written as source, never through ast (an int past 4,300 digits has no repr)
  head = [_ALIAS_IMPORTS + _RAISE + _INTO] + [f"import {name}" for name in plan.imports]
  head += [f"{PROBE}{k} = {literal(value)}" for k, value in enumerate(values)
           if not isinstance(value, Raised)]
  body = []
  for statement in ast.parse(ast.unparse(plan.module)).body:
    probed = sorted(int(n.id[len(PROBE):]) for n in ast.walk(statement)
                    if isinstance(n, ast.Name) and n.id.startswith(PROBE))
    body.append(ast.unparse(Fill().visit(statement)))
    for k in probed:
      body.extend(f"{name} = _rlx_into(globals().get({name!r}), {literal(after)})"
                  for name, after in afters[k].items())
  return "\n".join(head + body)


def records(results: bytes) -> dict[tuple[str, int | None], dict]:
  """The sandbox's report lines by (kind, test index); the first line for each wins, and a
  line that is not a well-formed record is ignored."""
  records = {}
  for line in results.decode(errors="replace").splitlines():
    try:
      record = json.loads(line)
    except (ValueError, RecursionError):  # a forged, deeply nested line: no record
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


def probe_values(record: dict | None, count: int) -> tuple[list, list[dict]] | None:
  """The probes' values from a test's record (``checker.Raised`` for a probe that raised or
  returned something that is not plain data), and for each probe the values after it of the
  test's names it took; None for a missing or malformed record."""
  if not record or not isinstance(record.get("values"), list) or len(record["values"]) != count:
    return None
  values, afters = [], []
  for item in record["values"]:
    after = {}
    if isinstance(item, dict) and isinstance(item.get("after"), dict):
      try:
        after = {name: decode(value) for name, value in item["after"].items()
                 if isinstance(name, str) and name.isidentifier()}
      except (ValueError, TypeError, RecursionError):
        after = {}
    afters.append(after)
    if isinstance(item, dict) and "value" in item:
      try:
        values.append(decode(item["value"]))
      except (ValueError, TypeError, RecursionError):
        values.append(Raised("a value that is not plain data"))
    else:
      error = item.get("error") if isinstance(item, dict) else None
      bases = item.get("bases") if isinstance(item, dict) else None
      bases = tuple(b for b in bases[:32] if isinstance(b, str) and b.isidentifier()) if (
          isinstance(bases, list)) else ()
      values.append(Raised(error if isinstance(error, str) else "unknown", bases))
  return values, afters


def arguments(plan: AssertPlan) -> dict[str, object] | None:
  """The values of what the probes take from the test, computed here by the trusted
  evaluator from the test's setup statements: ``{name: value}`` for the named arguments and
  ``{"_rlx_arg_<m>": value}`` for the anonymous ones; None when the setup needs more than the
  evaluator covers (a helper function, a comprehension: the sandbox without the program
  computes them, ``sandbox.test_arguments``)."""
  evaluator = Evaluator([], [])
  try:
    evaluator.run(ast.parse(plan.setup))
    found = {name: evaluator.names[name] for probe in plan.named for name in probe
             if name not in plan.aliases and name in evaluator.names}
    for m, source in enumerate(plan.anonymous):
      found[f"_rlx_arg_{m}"] = evaluator.expr(ast.parse(source, mode="eval").body)
  except NeedsSandbox:
    return None
  except Exception:  # noqa: BLE001 - the test's own input raises: it cannot be checked
    return None
  return found


def evaluate(plan: AssertPlan, values: list, afters: list[dict] | None = None) -> bool | None:
  """Whether the test holds with the probes' ``values``: True or False from the trusted
  evaluator (``rlx.rewards.evaluator``), or None when the test needs the second sandbox. A
  probe that raised, or an expression that raises, fails the test."""
  return evaluate_module(plan.module, values, afters)
