"""Plain data across the code sandbox's wall: ``decode`` rebuilds, on the trusted side, the
values a jail reports (numbers, text, containers, ``Counter``, namedtuples, ``Fraction``,
``Decimal``, dates, exception classes, a generator's items) and nothing else; ``literal`` writes
a value as Python source for the next jail. Neither ever runs the program's code."""

from __future__ import annotations

import builtins
import collections
import dataclasses
import datetime
import decimal
import fractions
import functools
import keyword
import math
import re

_MAX_DEPTH = 64

_INT = re.compile(r"-?\d{1,4000}")
_HEX = re.compile(r"-?0x[0-9a-f]{1,262144}")  # ints of any size up to ~315,000 digits
_FLOAT = re.compile(r"-?(inf|nan|\d+(\.\d*)?(e[-+]?\d+)?|\.\d+(e[-+]?\d+)?)", re.IGNORECASE)
_DECIMAL = re.compile(r"-?(\d{1,4000}(\.\d{0,4000})?(E[-+]?\d{1,6})?|s?NaN|Infinity)")
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
@dataclasses.dataclass(frozen=True)
class Iterated:
  """What a generator or iterator the program returned gave (its first items, as the sandbox
  read them): each evaluation of the test reads it through a fresh iterator."""

  items: tuple


_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset,
              "deque": collections.deque, "iterator": lambda items: Iterated(tuple(items))}
_MAPPINGS = {"dict": dict, "Counter": lambda pairs: collections.Counter(dict(pairs)),
             "OrderedDict": collections.OrderedDict}
_TIMES = {"date": datetime.date, "datetime": datetime.datetime, "time": datetime.time}


@functools.lru_cache(maxsize=256)
def _namedtuple(typename: str, fields: tuple[str, ...]):
  return collections.namedtuple(typename, fields)


_EXCEPTIONS: dict[type, tuple[str, ...]] = {}


@functools.lru_cache(maxsize=256)
def exception_class(names: tuple[str, ...]) -> type:
  """The trusted side's stand-in for an exception class the program defined: named as it is,
  derived from its nearest built-in base (``names``: its classes' names, its own first). The
  same names give the same class, so the stand-in a probe raised is caught by the stand-in a
  test's ``except`` names."""
  for name in names:
    base = getattr(builtins, name, None)
    if isinstance(base, type) and issubclass(base, BaseException):
      made = base if name == names[0] else type(names[0], (base,), {})
      _EXCEPTIONS[made] = names
      return made
  made = type(names[0], (Exception,), {})
  _EXCEPTIONS[made] = names
  return made


def _integer(value) -> int:
  if isinstance(value, str) and _INT.fullmatch(value):
    return int(value)
  if isinstance(value, str) and _HEX.fullmatch(value):
    return int(value, 16)
  raise ValueError(f"not an encoded int: {str(value)[:60]}")


def decode(data, depth: int = 0):
  """A value from the sandbox's encoding (``{"int": "12"}``, ``{"list": [...]}``...): plain
  data of built-in and standard-library types only (numbers, text, containers, ``Counter``,
  ``namedtuple``, ``Fraction``, ``Decimal``, dates; a generator as an iterator over the items
  it gave), rebuilt here; ValueError for anything else."""
  if depth > _MAX_DEPTH:
    raise ValueError("nested too deeply")
  if data is None:
    return None
  if not isinstance(data, dict) or len(data) != 1:
    raise ValueError(f"not an encoded value: {str(data)[:60]}")
  (kind, value), = data.items()
  if kind == "bool" and value in (True, False) and type(value) is bool:
    return value
  if kind == "int":
    return _integer(value)
  if kind == "float" and isinstance(value, str) and _FLOAT.fullmatch(value):
    return float(value)
  if kind == "complex" and isinstance(value, list) and len(value) == 2 and all(
      isinstance(part, str) and _FLOAT.fullmatch(part) for part in value):
    return complex(float(value[0]), float(value[1]))
  if kind == "Fraction" and isinstance(value, list) and len(value) == 2:
    return fractions.Fraction(_integer(value[0]), _integer(value[1]))
  if kind == "Decimal" and isinstance(value, str) and _DECIMAL.fullmatch(value):
    return decimal.Decimal(value)
  if kind == "str" and isinstance(value, str):
    return value
  if kind == "bytes" and isinstance(value, str):
    return bytes.fromhex(value)
  if kind in _SEQUENCES and isinstance(value, list):
    return _SEQUENCES[kind](decode(item, depth + 1) for item in value)
  if kind in _MAPPINGS and isinstance(value, list):
    pairs = []
    for pair in value:
      if not (isinstance(pair, list) and len(pair) == 2):
        raise ValueError("a dict item is not a pair")
      pairs.append((decode(pair[0], depth + 1), decode(pair[1], depth + 1)))
    return _MAPPINGS[kind](pairs)
  if kind == "namedtuple" and isinstance(value, list) and len(value) == 3:
    typename, fields, items = value
    if not (isinstance(typename, str) and isinstance(fields, list) and isinstance(items, list)
            and len(fields) == len(items) <= 256 and all(
                isinstance(name, str) and _IDENTIFIER.fullmatch(name)
                and not keyword.iskeyword(name) for name in [typename, *fields])
            and len(set(fields)) == len(fields)):
      raise ValueError("a malformed namedtuple")
    return _namedtuple(typename, tuple(fields))(*(decode(item, depth + 1) for item in items))
  if kind in _TIMES and isinstance(value, str) and len(value) <= 64:
    return _TIMES[kind].fromisoformat(value)
  if kind == "exception" and isinstance(value, list) and 0 < len(value) <= 32 and all(
      isinstance(name, str) and _IDENTIFIER.fullmatch(name) for name in value):
    return exception_class(tuple(value))
  if kind == "timedelta" and isinstance(value, list) and len(value) == 3:
    return datetime.timedelta(*map(_integer, value))
  raise ValueError(f"not an encoded value: {str(data)[:60]}")


_ALIASES = {"collections": collections, "fractions": fractions, "decimal": decimal,
            "datetime": datetime}
LITERAL_MODULES = {f"_rlx_{name}": module for name, module in _ALIASES.items()}
"""The modules ``literal``'s source names, under names no test or program binds."""
_ALIAS_IMPORTS = "".join(f"import {name} as _rlx_{name}\n" for name in _ALIASES)


def literal(value) -> str:
  """Python source that evaluates to ``value`` (the types ``decode`` rebuilds; the modules it
  names are ``LITERAL_MODULES``)."""
  kind = type(value)
  if kind is int and value.bit_length() > 13_000:  # past Python's 4,300 decimal digits
    return hex(value)
  if value is None or kind in (bool, int, str, bytes):
    return repr(value)
  if kind is float:
    return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
  if kind is complex:
    return f"complex({literal(value.real)}, {literal(value.imag)})"
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
  if kind is collections.Counter:
    return f"_rlx_collections.Counter({literal(dict(value))})"
  if kind is collections.OrderedDict:
    return f"_rlx_collections.OrderedDict({literal(list(value.items()))})"
  if kind is collections.deque:
    return f"_rlx_collections.deque({literal(list(value))})"
  if kind is fractions.Fraction:
    return f"_rlx_fractions.Fraction({value.numerator}, {value.denominator})"
  if kind is decimal.Decimal:
    return f"_rlx_decimal.Decimal({str(value)!r})"
  if kind in (datetime.date, datetime.datetime, datetime.time, datetime.timedelta):
    return "_rlx_" + repr(value)
  if isinstance(value, tuple) and hasattr(kind, "_fields"):
    return (f"_rlx_collections.namedtuple({kind.__name__!r}, {list(kind._fields)!r})"
            f"({', '.join(map(literal, value))})")
  if isinstance(value, type) and value in _EXCEPTIONS:
    return f"_rlx_exception({list(_EXCEPTIONS[value])!r})"
  if kind is Iterated:
    return f"iter({literal(list(value.items))})"
  raise TypeError(f"not plain data: {kind.__name__}")
