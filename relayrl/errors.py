"""User-facing errors.

Anything a user can cause (a bad config, a missing file, a wrong model path) raises
:class:`RelayError` with a message that names the thing and what was expected. The CLI prints
the message alone (no traceback unless ``--debug``) and exits with a non-zero code.
"""


class RelayError(Exception):
    """An error caused by user input; its message is shown to the user as is."""

    exit_code = 2
