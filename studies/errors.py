"""User-facing errors of the task registry."""


class TaskError(ValueError):
    """A task or its data is wrong or missing.

    The message is one line saying what was wrong and what to do about it, e.g.
    ``unknown task 'gsm9k'; known tasks: gsm8k, humaneval, mt-bench, prompts``.
    """
