"""Importing a third-party package without the optional parts of it that polyrl never uses.

Several packages import an optional dependency inside `try`/`except ImportError` and carry on
without it. A `None` entry in `sys.modules` makes an import of that name raise ImportError (without
importing its parent package), so the package takes its own path for something that is not
installed. `skipped_imports` sets those entries only while the package imports: the rest of the
process imports the same names as usual, and a module already imported is left as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def skipped_imports(names: tuple[str, ...]) -> Iterator[None]:
    """While inside, importing any of `names` that is not imported yet raises ImportError."""
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = None  # type: ignore[assignment]  # the import system's "not importable" mark
    try:
        yield
    finally:
        for n in added:
            if n in sys.modules and sys.modules[n] is None:
                del sys.modules[n]
