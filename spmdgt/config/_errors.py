"""The one error type for user configuration mistakes."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration mistake, named by file, line, signal/section, key and value.

    It is a ``ValueError`` so callers that catch bad values in general catch it too.
    ``message`` keeps the bare message, so a caller that learns the line later (the YAML
    layer, which records each key's line) can re-raise it ``located``.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        section: str | None = None,
        key: str | None = None,
        value: object = None,
        line: int | None = None,
    ) -> None:
        self.message = message
        self.file, self.section, self.key, self.value, self.line = file, section, key, value, line
        where = []
        if file:
            where.append(f"{file}:{line}" if line else file)
        elif line:
            where.append(f"line {line}")
        if section:
            where.append(f"signal {section!r}" if not section.startswith("[") else section)
        if key:
            where.append(f"key {key!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)

    def located(self, *, line: int | None = None, file: str | None = None) -> ConfigError:
        """The same error with ``line`` (and ``file``) filled in where they were unknown."""
        return ConfigError(
            self.message,
            file=self.file or file,
            section=self.section,
            key=self.key,
            value=self.value,
            line=self.line or line,
        )
