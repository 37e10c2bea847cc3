"""A reward function of your own: rlx calls ``score(response, row)`` for every sampled
response, in its reward worker processes (a call that raises, hangs or crashes scores 0 and
is counted; the run goes on).

``row`` is the whole data row: here ``prompt``, ``answer`` and the file's extra ``kind``
column. The returned dict's ``reward`` is what RL maximises, ``correct`` is what held-out
accuracy counts, and every other entry is logged as ``reward/<name>``.
"""

from rlx.rewards import final_answer


def score(response: str, row: dict) -> dict:
  answer = final_answer(response)
  correct = answer is not None and answer.strip() == row["answer"]
  formatted = response.rstrip().endswith("</answer>")
  return {"reward": float(correct) + 0.1 * float(formatted), "correct": correct,
          "format": float(formatted), f"correct_{row['kind']}": float(correct)}
