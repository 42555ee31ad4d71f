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


# errno values that mean "the disk (or quota) is full" or "this file system is read-only": a resource the user can
# free or fix, not a bug of the program.
NO_SPACE_ERRNOS = frozenset({28, 122})  # ENOSPC, EDQUOT (Linux)
READ_ONLY_ERRNOS = frozenset({30})  # EROFS


class ResourceError(UserError):
    """The machine lacks what the run needs (disk space, shared memory, a writable directory): one line, exit 2."""


def resource_error(exc: BaseException, what: str, path: "object") -> "ResourceError | None":
    """The :class:`ResourceError` for an ``OSError`` that means a full disk, a full quota or a read-only file system
    while writing ``what`` to ``path`` (None for any other error, which stays a bug with its traceback)."""
    import errno as _errno
    import os as _os

    code = getattr(exc, "errno", None)
    if not isinstance(exc, OSError) or code not in NO_SPACE_ERRNOS | READ_ONLY_ERRNOS:
        return None
    reason = _os.strerror(code)
    if code in NO_SPACE_ERRNOS:
        fix = "free space on that file system, or point cluster.fileroot at one with room"
    else:
        fix = "point cluster.fileroot at a writable directory"
    err = ResourceError(f"could not write {what} to {path}: {reason} ({_errno.errorcode.get(code, code)}); "
                        f"everything written before is intact; {fix}")
    err.errno = code  # type: ignore[attr-defined]
    return err
