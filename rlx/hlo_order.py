"""Collectives a compiled program may meet in different orders on different devices.

XLA:CPU runs a program's instructions as soon as their inputs are ready, one executor per
device. A collective blocks its thread until every device reaches the same one. When a
``while`` loop whose body holds collectives and another collective (or another such loop) do
not depend on each other, nothing makes the devices take them in the same order: one device's
thread can wait in the loop's all-reduce while the other's waits in the independent one, and
the program never finishes (the collective timeout ends the process minutes later). rlx hit
exactly this in a colocated run's warm-up step: the fused log-prob loop's all-reduce of
logits against the backward pass's all-reduce of recomputed logits.

``hazards(hlo_text)`` finds such pairs in a program's optimised HLO
(``jitted.lower(...).compile().as_text()``): in each computation, a loop that holds a
collective and another collective-holding instruction, neither reachable from the other
through operands or control edges. rlx's programs are written to have none on a mesh of
several devices; the tests check its update steps with it.
"""

from __future__ import annotations

import dataclasses
import re

COLLECTIVES = frozenset({
    "all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter",
    "all-to-all", "ragged-all-to-all", "collective-permute", "collective-permute-start",
    "collective-broadcast"})

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$")
_CALLED = re.compile(r"\b(?:condition|body|calls|to_apply|branch_computations|true_computation|"
                     r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NAME = re.compile(r"%?([\w.\-]+)")


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  inputs: list[str]  # operands and control predecessors
  calls: list[str]  # computations it runs
  op_name: str  # the JAX operation it came from, when the metadata says


def _skip_shape(rest: str) -> str:
  """``rest`` after the instruction's shape (a tuple's nested parentheses included)."""
  if not rest.startswith("("):
    return rest.split(" ", 1)[1] if " " in rest else ""
  depth = 0
  for i, char in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return rest[i + 1:].lstrip()
  return ""


def _operand_text(rest: str) -> tuple[str, str]:
  """The text inside the opcode's parentheses, and what follows them."""
  start = rest.index("(")
  depth = 0
  for i in range(start, len(rest)):
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    if depth == 0:
      return rest[start + 1:i], rest[i + 1:]
  return rest[start + 1:], ""


def _parse_instruction(name: str, text: str) -> Instruction:
  rest = _skip_shape(text)
  opcode = rest.split("(", 1)[0].strip()
  operands, attributes = _operand_text(rest) if "(" in rest else ("", "")
  inputs = [m.group(1) for m in re.finditer(r"%([\w.\-]+)", operands)]
  for control in _CONTROL.finditer(attributes):
    inputs += [m.group(1) for m in _NAME.finditer(control.group(1))]
  calls = []
  for called in _CALLED.finditer(attributes):
    calls += [m.group(1) for m in _NAME.finditer(called.group(1))]
  op_name = _OP_NAME.search(attributes)
  return Instruction(name, opcode, inputs, calls, op_name.group(1) if op_name else "")


def parse(hlo_text: str) -> dict[str, dict[str, Instruction]]:
  """Computation name -> its instructions by name, in program text order."""
  computations: dict[str, dict[str, Instruction]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = computations.setdefault(header.group(1), {})
      continue
    instruction = _INSTRUCTION.match(line)
    if instruction and current is not None:
      name = instruction.group(1)
      current[name] = _parse_instruction(name, instruction.group(2))
  return computations


def hazards(hlo_text: str) -> list[str]:
  """One line per pair of collective-holding instructions of one computation that the
  devices may run in either order, where one of them is a loop (empty: none)."""
  computations = parse(hlo_text)
  holds: dict[str, bool] = {}

  def has_collective(computation: str) -> bool:
    if computation not in holds:
      holds[computation] = False  # a cycle cannot occur in HLO; this guards the recursion
      holds[computation] = any(_holds(i) for i in computations.get(computation, {}).values())
    return holds[computation]

  def _holds(instruction: Instruction) -> bool:
    return instruction.opcode in COLLECTIVES or any(map(has_collective, instruction.calls))

  def describe(instruction: Instruction) -> str:
    """The instruction, and for a loop or call the collectives it holds, by their JAX ops."""
    if instruction.opcode in COLLECTIVES:
      return f"{instruction.opcode} {instruction.name} ({instruction.op_name or 'no op name'})"
    inside = sorted({f"{i.opcode} of {i.op_name or 'no op name'}"
                     for i in _collectives_under(computations, instruction.calls)})
    return f"{instruction.opcode} {instruction.name} holding [{'; '.join(inside)}]"

  found = []
  for computation, instructions in computations.items():
    holding = {name for name, i in instructions.items() if _holds(i)}
    if not any(instructions[name].opcode == "while" for name in holding):
      continue
    above = _holding_ancestors(instructions, holding)
    ordered = [name for name in instructions if name in holding]
    for a, first in enumerate(ordered):
      for second in ordered[a + 1:]:
        loops = [instructions[n] for n in (first, second) if instructions[n].opcode == "while"]
        if not loops or first in above[second] or second in above[first]:
          continue
        one, two = (describe(instructions[n]) for n in (first, second))
        found.append(f"in {computation}: {one} and {two} do not depend on each other")
  return found


def _collectives_under(computations: dict[str, dict[str, Instruction]],
                       called: list[str]) -> list[Instruction]:
  """The collectives in the computations ``called`` and in those they call."""
  seen, stack, found = set(), list(called), []
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    for instruction in computations.get(name, {}).values():
      if instruction.opcode in COLLECTIVES:
        found.append(instruction)
      stack.extend(instruction.calls)
  return found


def _holding_ancestors(instructions: dict[str, Instruction],
                       holding: set[str]) -> dict[str, set[str]]:
  """For every instruction, the collective-holding ones it depends on (iteratively: a
  program's chains run thousands of instructions deep)."""
  above: dict[str, set[str]] = {}
  for root in instructions:
    stack = [root]
    while stack:
      name = stack[-1]
      if name in above:
        stack.pop()
        continue
      parents = [p for p in instructions[name].inputs if p in instructions]
      waiting = [p for p in parents if p not in above]
      if waiting:
        stack.extend(waiting)
        continue
      stack.pop()
      result: set[str] = set()
      for parent in parents:
        result |= above[parent]
        if parent in holding:
          result.add(parent)
      above[name] = result
  return above
