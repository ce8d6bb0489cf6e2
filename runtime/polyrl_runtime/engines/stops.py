"""Stop strings of any length, checked on a bounded tail of the reply.

Checked after every token, a stop string is found at the step that produces its last character; so
each check needs only the reply's last few tokens: enough that their text covers the longest stop
string. A token decodes to at least one byte except a special token (skipped in reply text), and
a tail may start inside a multi-byte character (one replacement character, at most 3 bytes lost),
so the tail is the longest stop string's UTF-8 length plus a margin. The cost of a check does not
grow with the reply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

TAIL_MARGIN = 8


def tail_length(stops: Sequence[str]) -> int:
    """How many trailing reply tokens a check decodes."""
    return max(len(s.encode("utf-8")) for s in stops) + TAIL_MARGIN


def find_stop(decode: Callable[[Sequence[int]], str], reply: Sequence[int], stops: Sequence[str]) -> str:
    """The stop string that the reply's decoded tail contains ("" when none): the one that starts
    first, the longest of those that start together."""
    if not stops or not reply:
        return ""
    text = decode(reply[-tail_length(stops) :])
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    return min(hits)[2] if hits else ""
