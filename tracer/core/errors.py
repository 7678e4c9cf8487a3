"""The one exception type for mistakes a user can make.

The CLI prints its message as one line on stderr and exits with code 2; the API raises it with
the same message. Anything else escaping is a bug in tracer.
"""

import difflib


class TracerError(Exception):
    """A user-caused error: bad variant, missing file or tensor, shape mismatch, bad prompt."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """Another library's exception message as one line, short enough for a one-line CLI error."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unknown_name(what: str, name: str, names, listed_by: str) -> str:
    """"unknown engine 'llamacp'; did you mean llamacpp?" for a typo, else where the names are listed:
    a list of them all would run the one line past a terminal's width."""
    close = did_you_mean(name, names)
    return f"unknown {what} {name!r}" + (close or f" ({listed_by} lists them)")


def ids_text(ids) -> str:
    """Token ids in an error line: the first few and how many ("7 ids 1,17,5,42,8,..."), never a long list."""
    ids = list(ids)
    shown = ",".join(map(str, ids[:5])) + (",..." if len(ids) > 5 else "")
    return f"{len(ids)} id{'' if len(ids) == 1 else 's'} {shown}"


def printable(text: str) -> str:
    """`text` with every character a terminal would not print as itself escaped (a path holding a record
    separator or a newline stays on one line, as a one-line error must)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def did_you_mean(name: str, choices) -> str:
    """"; did you mean theta?" when one of `choices` is close to `name` (a typo), else "".

    difflib's ratio at its usual cutoff: one letter dropped, doubled or swapped in a short name
    passes ("thetaa" -> "theta", "--variantt" -> "--variant"), an unrelated word does not.
    """
    close = difflib.get_close_matches(str(name), [str(choice) for choice in choices], n=1)
    return f"; did you mean {close[0]}?" if close else ""
