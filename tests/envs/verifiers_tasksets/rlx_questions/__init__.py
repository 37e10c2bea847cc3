"""A small ``verifiers`` environment for tests/envs/test_verifiers.py: a taskset of arithmetic
questions and its own harness, which talks two turns in-process (through the interception
endpoint ``verifiers`` hands it, as every harness must) and fails on request.

The reward is read from the trace ``verifiers`` recorded: the number of characters of the
final assistant message, modulo 3, so a test can recompute it from the sampled tokens."""

import httpx
import verifiers.v1 as vf


class QuestionData(vf.TaskData):
  fail: bool = False


class Question(vf.Task[QuestionData]):
  @vf.reward
  async def length_mod_3(self, task, trace) -> float:
    return float(len(str(trace.last_message.content or "")) % 3)


class Questions(vf.Taskset[Question]):
  def load(self):
    for i in range(6):
      yield Question(QuestionData(prompt=f"What is {i}*7?", fail=i == 5), self.config.task)


class TwoTurnsConfig(vf.HarnessConfig):
  pass


class TwoTurns(vf.Harness[TwoTurnsConfig]):
  EXECUTES_CODE = False
  NEEDS_CONTAINER = False

  async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                   tool_interception_url=None):
    if data.fail:
      raise RuntimeError("the harness broke")
    _, prompt = self.resolve_prompt(data)
    messages = [{"role": "user", "content": prompt}]
    async with httpx.AsyncClient(timeout=120) as http:
      for turn in range(2):
        reply = await http.post(f"{endpoint.rstrip('/')}/chat/completions",
                                headers={"Authorization": f"Bearer {secret}"},
                                json={"model": ctx.model, "messages": messages, "max_tokens": 6})
        reply.raise_for_status()
        messages.append(reply.json()["choices"][0]["message"])
        messages.append({"role": "user", "content": "again" + "!" * (turn + 1)})
    return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["Questions", "TwoTurns"]
