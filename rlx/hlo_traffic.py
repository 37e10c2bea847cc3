"""Memory traffic of a compiled XLA program, op by op, read from its optimized HLO text.

XLA's own cost analysis gives one total per program, and none at all for a GPU program
compiled without the GPU (``compiled.cost_analysis()`` is None there). This reads the
optimized module instead (``compiled.as_text()``): each top-level op of the entry computation
is one kernel, which reads its operands and writes its results in device memory, so

- a fusion reads what its fused computation reads of each operand: all of it, or only the
  part that a slice, dynamic-slice or gather inside takes (through bitcasts, reshapes and
  nested fusions); it writes its results, except a dynamic-update-slice or scatter root, which
  updates its buffer in place and writes only the update;
- slices and gathers read and write what they take; an in-place update reads and writes the
  update; async copies and slices count at their start;
- a while loop's body counts once (as XLA's cost analysis does) and a conditional counts its
  costliest branch (or, asked, its cheapest: the decode step's sampler sorts the vocabulary
  only in the branch that top-p takes).

On the CPU this equals XLA's cost analysis to within tens of bytes per program (16 on the
tests' conditional, 57 on their loop): XLA also counts the tuples a while loop or a
conditional passes around (8 bytes, a pointer, per element, read and written) and its loop
condition's scalar compare, which are control flow, not a kernel's traffic, and are left out
here; the tests allow 64 bytes for it.

Sizes are of the shapes as laid out, tiles padded (``T(8,128)``: the two minor dimensions
rounded up to 8 and 128). The result estimates the traffic of a program that keeps nothing
in caches between kernels; what XLA's TPU analysis reports for the same module is within
tens of percent of it (it also counts on-chip VMEM accesses).
"""

from __future__ import annotations

import collections
import dataclasses
import re

BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
         "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_NAME = re.compile(r"%([\w.\-]+)")
_META = re.compile(r'op_name="([^"]*)"')

FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "after-all", "partition-id", "replica-id", "copy-done", "slice-done",
                  "opt-barrier", "iota", "add-dependency"})
"""Ops that move no data of their own."""
SLICING = frozenset({"slice", "dynamic-slice", "gather"})
IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
_VIEWS = frozenset({"bitcast", "reshape", "get-tuple-element"})


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (an array or a tuple of them), with TPU tiles padded."""
  total = 0
  for dtype, dims_text, layout in _ARRAY.findall(shape):
    if dtype not in BYTES:
      continue
    dims = [int(d) for d in dims_text.split(",") if d]
    tile = re.search(r":T\(([0-9,]+)\)", layout or "")
    if tile and dims:
      minor_to_major = [int(x) for x in layout[1:].split(":")[0].split(",") if x]
      sizes = [int(x) for x in tile.group(1).split(",")]
      for axis, size in zip(minor_to_major, reversed(sizes)):
        dims[axis] = -(-dims[axis] // size) * size
    count = 1
    for d in dims:
      count *= d
    total += count * BYTES[dtype]
  return total


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str
  opcode: str
  operands: list
  attributes: str
  users: list = dataclasses.field(default_factory=list)

  @property
  def bytes(self) -> int:
    return shape_bytes(self.shape)

  def called(self, key: str = "calls") -> str | None:
    found = re.search(key + r"=%?([\w.\-]+)", self.attributes)
    return found.group(1) if found else None

  @property
  def source(self) -> str:
    """The JAX operation it came from (the metadata's op_name), or its own name."""
    found = _META.search(self.attributes)
    return found.group(1) if found else self.name


@dataclasses.dataclass
class Computation:
  instructions: dict = dataclasses.field(default_factory=dict)  # name -> Instruction, in order
  parameters: dict = dataclasses.field(default_factory=dict)  # index -> name
  root: str | None = None


def _closing(text: str, start: int) -> int:
  """Index just past the bracket that closes the one at ``start``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 80]}")


def _top_level_parts(text: str) -> list[str]:
  parts, depth, current = [], 0, []
  for ch in text:
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append("".join(current))
      current = []
    else:
      current.append(ch)
  if "".join(current).strip():
    parts.append("".join(current))
  return parts


def parse(text: str) -> tuple[dict[str, Computation], str]:
  """The computations of an HLO module's text, and the name of its entry."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None:
      header = _HEADER.match(line)
      if header and not line.startswith(("HloModule", " ")):
        current = computations.setdefault(header.group(2), Computation())
        entry = header.group(2) if header.group(1) else entry
      continue
    if line.startswith("}"):
      current = None
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    rest = line[match.end():]
    end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode = _OPCODE.match(rest)
    if not opcode:
      continue
    close = _closing(rest, opcode.end() - 1)
    inside = rest[opcode.end():close - 1]
    operands = [(_NAME.findall(part) or [None])[-1] for part in _top_level_parts(inside)]
    instruction = Instruction(match.group(2), shape, opcode.group(1), operands, rest[close:])
    if instruction.opcode == "parameter":
      current.parameters[int(inside)] = instruction.name
    current.instructions[instruction.name] = instruction
    if match.group(1):
      current.root = instruction.name
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  for computation in computations.values():
    for instruction in computation.instructions.values():
      for operand in instruction.operands:
        if operand in computation.instructions:
          computation.instructions[operand].users.append(instruction.name)
  return computations, entry


@dataclasses.dataclass(frozen=True)
class Op:
  """One kernel's traffic: bytes read and written in device memory."""
  name: str
  opcode: str
  shape: str
  source: str
  read: int
  written: int
  in_loop: bool = False  # inside a while loop's body (counted once, as one iteration)

  @property
  def bytes(self) -> int:
    return self.read + self.written


class Module:
  """An optimized HLO module, parsed once; ``traffic(branch)`` reads its kernels."""

  def __init__(self, text: str):
    self.computations, self.entry = parse(text)
    self.pick = max

  def traffic(self, branch: str = "costliest") -> list["Op"]:
    """Every kernel, in order, with the ``costliest`` or the ``cheapest`` branch of each
    conditional."""
    if branch not in ("costliest", "cheapest"):
      raise ValueError(f"branch={branch!r}: 'costliest' or 'cheapest'")
    self.pick = max if branch == "costliest" else min
    return self.ops(self.entry)

  def parameter_read(self, computation: str, index: int, full: int) -> int:
    """Bytes a fused computation reads of its parameter ``index`` (``full``: all of it)."""
    comp = self.computations.get(computation)
    name = comp.parameters.get(index) if comp else None
    return full if name is None else min(full, self._read_through(comp, name, full))

  def _read_through(self, comp: Computation, name: str, full: int) -> int:
    total = 0
    for user_name in comp.instructions[name].users:
      user = comp.instructions[user_name]
      position = user.operands.index(name)
      if user.opcode in SLICING and position == 0:
        total += user.bytes
      elif user.opcode in IN_PLACE and position == 0:
        continue  # the buffer updated in place: only the update moves
      elif user.opcode in _VIEWS:
        total += self._read_through(comp, user_name, full)
      elif user.opcode == "fusion":
        total += self.parameter_read(user.called(), position, full)
      else:
        return full
    return total

  def root_written(self, computation: str) -> int:
    comp = self.computations[computation]
    root = comp.instructions[comp.root]
    roots = ([comp.instructions[o] for o in root.operands] if root.opcode == "tuple"
             else [root])
    total = 0
    for out in roots:
      if out.opcode in IN_PLACE:
        update = out.operands[2 if out.opcode == "scatter" else 1]
        total += comp.instructions[update].bytes
      elif out.opcode == "fusion":
        total += self.root_written(out.called())
      else:
        total += out.bytes
    return total

  def ops(self, computation: str, in_loop: bool = False) -> list[Op]:
    comp, out = self.computations[computation], []
    for instruction in comp.instructions.values():
      opcode = instruction.opcode
      if opcode in FREE:
        continue
      if opcode == "while":
        out += self.ops(instruction.called("body"), in_loop=True)
        continue
      if opcode == "call":
        out += self.ops(instruction.called("to_apply"), in_loop)
        continue
      if opcode == "conditional":
        listed = re.search(r"branch_computations=\{([^}]*)\}", instruction.attributes)
        names = (_NAME.findall(listed.group(1)) if listed else
                 re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", instruction.attributes))
        out += self.pick((self.ops(n, in_loop) for n in names),
                         key=lambda ops: sum(o.bytes for o in ops))
        continue
      sizes = [comp.instructions[o].bytes if o in comp.instructions else 0
               for o in instruction.operands]
      if opcode == "fusion":
        called = instruction.called()
        read = sum(self.parameter_read(called, i, size) for i, size in enumerate(sizes))
        written = self.root_written(called)
      elif opcode in SLICING:
        read = written = instruction.bytes
      elif opcode == "slice-start":  # ((operand), slice, context)
        inner = _top_level_parts(instruction.shape[1:-1])
        read = written = shape_bytes(inner[1]) if len(inner) > 1 else 0
      elif opcode == "copy-start":
        read = written = sizes[0] if sizes else 0
      elif opcode in IN_PLACE:
        update = sizes[2 if opcode == "scatter" else 1]
        read = written = update
      else:
        read, written = sum(sizes), instruction.bytes
      out.append(Op(instruction.name, opcode, instruction.shape, instruction.source, read,
                    written, in_loop))
    return out


def traffic(text: str, branch: str = "costliest") -> list[Op]:
  """Every kernel of the optimized HLO module ``text`` (``compiled.as_text()``), in order,
  with the ``costliest`` or the ``cheapest`` branch of each conditional."""
  return Module(text).traffic(branch)


def largest(ops: list[Op], count: int = 5) -> list[dict]:
  """The ``count`` JAX operations that move the most, with their share of the total: ops
  grouped by source operation (the last two parts of the op_name) and opcode."""
  total = max(sum(op.bytes for op in ops), 1)
  groups = collections.defaultdict(lambda: [0, 0, None])
  for op in ops:
    source = "/".join(op.source.split("/")[-2:])
    group = groups[(source, op.opcode)]
    group[0] += op.bytes
    group[1] += 1
    group[2] = group[2] or op.shape.split("{")[0][:60]
  ranked = sorted(groups.items(), key=lambda item: -item[1][0])[:count]
  return [{"op": source, "kind": opcode, "count": n, "shape": shape,
           "gb": round(size / 1e9, 3), "share": round(size / total, 3)}
          for (source, opcode), (size, n, shape) in ranked]


def flops(text: str) -> float | None:
  """Flops of the HLO module ``text`` by XLA's generic cost analysis (run by the CPU client:
  the count of a dot or convolution does not depend on the target), for targets whose own
  analysis is not available without the device; None where this jaxlib cannot do it."""
  try:
    import jax
    from jax._src.lib import _jax
    from jaxlib import _hlo
    module = _hlo.hlo_module_from_text(text)
    analysis = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  except Exception:  # noqa: BLE001 - private API: absent or changed in another jaxlib
    return None
  return float(analysis.get("flops", 0.0))
