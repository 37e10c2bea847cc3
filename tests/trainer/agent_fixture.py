"""Agent programs for tests/trainer/test_agent_programs.py: a chatty one that talks three
turns (and rewrites its history on request), and ones that fail in every way a program can
(one blocks its event loop)."""

import asyncio
import time


async def run(client, row):
  mode = row.get("mode", "ok")
  if mode == "raise":
    raise RuntimeError("the agent broke")
  if mode == "hang":
    await asyncio.sleep(3600)
  if mode == "block":  # blocks its event loop, as a synchronous library call does
    time.sleep(7)
  if mode == "silent":
    return 1.0
  messages = [{"role": "user", "content": row["prompt"]}]
  for turn in range(3):
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "again" + "!" * (turn + 1)})
  if mode == "rewrite":  # a summary instead of the history: a new segment
    await client.chat.completions.create(model="policy", max_tokens=6, messages=[
        {"role": "user", "content": "summary: " + row["prompt"]}])
  if mode == "bad":
    return "great"
  return {"reward": float(len(messages)), "correct": True} if mode == "dict" else None
