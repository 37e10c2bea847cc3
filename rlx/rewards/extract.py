"""Finding the final answer of a response. Only an explicitly marked final answer counts:
the last ``<answer>...</answer>``, the last ``\\boxed{...}``, or a last line that starts
with ``Answer:`` / ``The answer is`` / ``####``. A number that merely appears
somewhere in the text is never taken for the answer by ``final_answer``; ``last_number`` is
the separate, explicit fallback of the rewards that accept one (``word_sums``)."""

from __future__ import annotations

import re

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANCHOR = re.compile(r"^\s*(?:answer\s*:|the (?:final )?answer is\s*:?|####)\s*(.+?)\s*\.?\s*$",
                     re.IGNORECASE)


def last_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 0, start + len("\\boxed")
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j].strip()
  return None


def final_answer(text: str) -> str | None:
  """The response's explicitly marked final answer, or None when it gives none."""
  tags = _TAG.findall(text)
  if tags:
    return tags[-1].strip()
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed
  lines = [line for line in text.strip().splitlines() if line.strip()]
  if lines:
    match = _ANCHOR.match(lines[-1])
    if match:
      return match.group(1).strip()
  return None


_NUMBER = re.compile(r"-?\d[\d,]*")


def last_number(text: str) -> str | None:
  """The last integer written in ``text`` (thousands commas kept), or None."""
  numbers = _NUMBER.findall(text)
  return numbers[-1].rstrip(",") if numbers else None
