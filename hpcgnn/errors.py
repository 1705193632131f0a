"""User-facing errors.

An :class:`InputError` is bad input that the user can fix (a missing file, a
wrong field, an out-of-range value). The CLI prints its message on one line,
``hpcgnn: error: <message>``, with no traceback, and exits with
:data:`EXIT_INPUT`. Every message names the file, field or value and says what
was expected.
"""

EXIT_INPUT = 2


class InputError(Exception):
    """Bad user input; the message is the whole one-line explanation."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def require(condition: bool, message: str) -> None:
    """Raise :class:`InputError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise InputError(message)


class TrainingDiverged(InputError):
    """The loss or a gradient became nan or +-inf (raised on every rank at the same step, before
    the optimizer step, so the parameters and checkpoints stay finite); the fix is the user's:
    a lower learning rate, or finite input features."""
