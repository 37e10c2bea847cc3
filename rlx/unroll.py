"""Loops traced unrolled, for counting: XLA's cost analysis counts a loop's body once, whatever
its trip count, so ``benchmarks/aot_compile.py --cost`` traces rlx's programs inside
``unrolled()``. The arithmetic is the same; only its layout in the program changes. Never used
for running (an unrolled program takes longer to compile).

    jax.lax.scan(body, carry, xs, unroll=unroll.factor())

jit's trace cache does not know of ``unrolled()``: a jitted function traced before at the same
shapes keeps its loops. Trace programs for counting inside it from the start.
"""

from __future__ import annotations

import contextlib
import contextvars

_UNROLL: contextvars.ContextVar[int | bool] = contextvars.ContextVar("rlx_unroll", default=1)


@contextlib.contextmanager
def unrolled():
  """Within it, the scans that call ``factor()`` are traced fully unrolled."""
  token = _UNROLL.set(True)
  try:
    yield
  finally:
    _UNROLL.reset(token)


def factor() -> int | bool:
  """``lax.scan``'s ``unroll``: 1 (a loop), or True inside ``unrolled()``."""
  return _UNROLL.get()
