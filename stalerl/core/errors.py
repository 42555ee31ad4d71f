"""The one exception type for mistakes in what the user asked for (torch-free, imported by the CLI first).

A :class:`UserError` (and a :class:`stalerl.config.ConfigError`) is printed by the command line as one line,
``stalerl: error: <message>``, with exit code :data:`EXIT_USER_ERROR`; a traceback appears only with ``--debug``.
Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2  # the exit code of argparse and most Unix tools for a usage error


class UserError(Exception):
    """A config, data, model, resource or trial-directory problem the user can fix; the message says how."""


class NotAvailableError(UserError, NotImplementedError):
    """A configured feature this version does not have (e.g. an engine): a user error that is also a
    NotImplementedError for callers that catch that."""


def refuse_unknown_keys(where: str, given: "object", allowed: "set[str] | frozenset[str]",
                        error: type = ValueError) -> None:
    """Raise ``error`` naming the keys of mapping ``given`` that are not in ``allowed`` (and listing the allowed)."""
    unknown = set(given) - set(allowed)  # type: ignore[call-overload]
    if unknown:
        raise error(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected some of "
                    f"{', '.join(sorted(allowed))}")
