"""The ``calc`` agent as a black-box program: it knows nothing of rlx, only an OpenAI client.

It asks the policy for the product, runs the calculator itself whenever the answer calls it,
sends the result back as a tool message, and stops at the first answer without a call. It
returns None, so the run's reward (the task's verifier) scores that final answer; a program
may also return a number, or ``{"reward": r, "correct": bool}``.

    python -m rlx.main --config configs/agent_calc_openai.py     # trains it (env.agent)
"""

import ast
import json
import operator
import warnings

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": 'integers, + - * /, e.g. "123*4567"'}},
            "required": ["expression"],
        },
    },
}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
  """+ - * / over integers, or an error message."""

  def value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
      return _OPERATORS[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
      return _OPERATORS[type(node.op)](value(node.operand))
    raise ValueError(f"cannot evaluate {expression!r}")

  try:
    with warnings.catch_warnings():  # "12abc" must not print a SyntaxWarning
      warnings.simplefilter("ignore", SyntaxWarning)
      tree = ast.parse(expression.strip(), mode="eval")
    result = value(tree.body)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as error:
    return f"error: {error}"
  return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def run(client, row, max_turns=3):
  messages = [{"role": "user", "content": row["prompt"]}]
  for _ in range(max_turns):
    reply = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[CALCULATOR])
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
      break
    for call in message.tool_calls:
      try:
        expression = json.loads(call.function.arguments).get("expression", "")
      except json.JSONDecodeError:
        expression = ""
      messages.append({"role": "tool", "tool_call_id": call.id,
                       "content": calculate(str(expression))})
  return None
