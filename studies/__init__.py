"""Tasks for tuning and benchmarking: prompt formats, data loaders and few-shot builders.

``load_prompts("gsm8k", limit=8)`` gives :class:`Prompt` values; :func:`render_prompt` turns one into
model input text with the tokenizer's chat template when it has one. Tasks are registered by exact
name in :data:`TASKS`.
"""
from studies.custom import JsonlPromptsTask
from studies.encode import encode_prompt
from studies.errors import TaskError
from studies.fewshot import question_answer_shots
from studies.gsm8k import DATA_DIR_ENV, Gsm8kTask
from studies.humaneval import HumanEvalTask
from studies.mt_bench import MtBenchTask
from studies.prompt import ChatTokenizer, Message, Prompt, render_prompt, routing_text
from studies.tasks import TASKS, Task, get_task, load_prompts

__all__ = [
    "DATA_DIR_ENV",
    "TASKS",
    "ChatTokenizer",
    "Gsm8kTask",
    "HumanEvalTask",
    "JsonlPromptsTask",
    "Message",
    "MtBenchTask",
    "Prompt",
    "Task",
    "TaskError",
    "encode_prompt",
    "get_task",
    "load_prompts",
    "question_answer_shots",
    "render_prompt",
    "routing_text",
]
