"""Prompt sources: built-in synthetic tasks (the grain pipeline over files lands with the trainer)."""

from rlx.data.tasks import TASKS, task_rows

__all__ = ["TASKS", "task_rows"]
