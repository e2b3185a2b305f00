"""The one exception type that reaches the user as a one-line message.

Every stage raises :class:`UserError` for problems the user can fix (bad file, unknown
model, impossible SLA, full disk). The CLI prints ``xsched: error: <message>`` and exits
with status 2, without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem with the user's input or environment; the message says what to do."""
