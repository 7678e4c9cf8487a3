"""The one exception type for mistakes a user can make.

The CLI prints its message as one line on stderr and exits with code 2; the API raises it with
the same message. Anything else escaping is a bug in tracer.
"""


class TracerError(Exception):
    """A user-caused error: bad variant, missing file or tensor, shape mismatch, bad prompt."""
