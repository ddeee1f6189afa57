"""User-facing runtime errors: one line saying what is wrong and what to do."""


class RuntimeUserError(ValueError):
    """Bad input to the runtime (unknown model, incompatible draft, prompt too long, ...)."""
