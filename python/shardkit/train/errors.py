"""The one exception class of ``python -m shardkit.train`` for a user's mistake.

``cli.main`` turns a :class:`UsageError` into one line on stderr and exit status 2; any
other exception is ours (a bug) and keeps its traceback (exit status 1).
"""


class UsageError(Exception):
    """A user error: the message says what is wrong and what to do."""
