"""Evaluation tasks: needle-in-a-haystack, curated QA and code, custom; and scoring.

from pagekv.tasks import make_needle_task, score
task = make_needle_task(tokenizer, context_tokens=2000, depth=0.5, seed=0)
ids = task.build_prompt_ids(tokenizer)        # input_ids, needle_token_positions
score("PELICAN-42", task)["correct"]
"""

from pagekv.tasks.base import (
    ANSWER_INSTRUCTION,
    DEFAULT_MAX_NEW_TOKENS,
    QUESTION_POSITIONS,
    TASK_KINDS,
    Task,
    TaskError,
    check_custom_prompt,
    contains,
    default_max_new_tokens,
    exact_match,
    needle_depth,
    normalize,
    score,
)
from pagekv.tasks.curated import curated_name, get_task, load_tasks, task_names
from pagekv.tasks.haystack import load_haystack, load_haystack_file
from pagekv.tasks.needle import (
    BUILTIN_NEEDLES,
    CODEWORD_NEEDLES,
    Needle,
    make_custom_task,
    make_multi_needle_task,
    make_needle_task,
)

__all__ = [
    "check_custom_prompt",
    "default_max_new_tokens",
    "DEFAULT_MAX_NEW_TOKENS",
    "needle_depth",
    "ANSWER_INSTRUCTION",
    "BUILTIN_NEEDLES",
    "CODEWORD_NEEDLES",
    "QUESTION_POSITIONS",
    "TASK_KINDS",
    "Needle",
    "Task",
    "TaskError",
    "contains",
    "curated_name",
    "exact_match",
    "get_task",
    "load_haystack",
    "load_haystack_file",
    "load_tasks",
    "make_custom_task",
    "make_multi_needle_task",
    "make_needle_task",
    "normalize",
    "score",
    "task_names",
]
