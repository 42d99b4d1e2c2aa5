"""GT's environment variables: ``spmdgt._core.env`` declares each once and parses them by one
rule (flags ``1/true/on/yes`` on, ``0/false/off/no/''`` off, anything else an error naming the
variable). ``python -m spmdgt.env`` prints the table with this process's values;
``--markdown`` prints the table of ``docs/environment.md``."""

from __future__ import annotations

import sys

from spmdgt._core.env import (
    VARIABLES,
    EnvError,
    Var,
    flag,
    get,
    integer,
    is_set,
    launcher_int,
    main,
    markdown,
    number,
    raw,
    table,
    text,
)

__all__ = [
    "VARIABLES",
    "EnvError",
    "Var",
    "flag",
    "get",
    "integer",
    "is_set",
    "launcher_int",
    "main",
    "markdown",
    "number",
    "raw",
    "table",
    "text",
]

if __name__ == "__main__":
    sys.exit(main())
