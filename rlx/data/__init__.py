"""Prompt sources (JSONL, Parquet, built-in synthetic tasks) and the grain prompt pipeline."""

from rlx.data.pipeline import PromptStream, prompts_drawn
from rlx.data.sources import (DataError, JsonlSource, ParquetSource, Subset, TaskSource, hold_out,
                              open_source)
from rlx.data.tasks import TASKS, task_row, task_rows

__all__ = ["DataError", "JsonlSource", "ParquetSource", "PromptStream", "Subset", "TASKS",
           "TaskSource", "hold_out", "open_source", "prompts_drawn", "task_row", "task_rows"]
