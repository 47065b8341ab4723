"""How the four console scripts report a user's mistake: one short message, exit status 2, no traceback.

[Note: user errors on the command line]
A mistake on the command line (a bad override, impossible sizes, a missing path, a bad flag) is the
user's to fix, so it prints one line that names the value and the fix, as ``argparse`` does for a bad
flag, and exits with status 2 (argparse's own status for a usage error). A traceback helps only the
developer of the failing code, so it is printed only on request: ``--debug`` on the argparse CLIs,
``HYDRA_FULL_ERROR=1`` (Hydra's own switch, honoured by every CLI here alike). Library code raises
:class:`UsageError` (or a ``ValueError`` / ``FileNotFoundError`` whose text already names the value and
the fix) and the console script's ``main`` goes through :func:`run_cli`; nothing else exits the process.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Optional, Sequence

USAGE_EXIT = 2  # argparse's status for a usage error, kept for every mistake a user can fix


class UsageError(Exception):
    """A mistake the user fixes on the command line; its text names the value and the fix."""


def debug_requested(argv: Optional[Sequence[str]] = None) -> bool:
    """Whether the user asked for tracebacks (``--debug`` in ``argv``, default ``sys.argv``, or ``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or "--debug" in (sys.argv[1:] if argv is None else argv)


def version_text(prog: str) -> str:
    """``prog lightning_par X (torch Y, lightning Z)``: what ``--version`` prints on every CLI."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    from lightning_par import __version__

    return f"{prog} {__version__} (torch {of('torch')}, lightning {of('lightning')})"


def cwd_importable() -> None:
    """Make the current directory importable, as ``python -m`` does: a console script's ``sys.path[0]`` is its
    own folder, and ``model._target_=my_pkg.MyModule`` must find the user's package where they run it."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def fail(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` on stderr and exit with :data:`USAGE_EXIT`."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_EXIT)


def run_cli(prog: str, body: Callable[[], object], argv: Optional[Sequence[str]] = None,
            user_errors: tuple[type[BaseException], ...] = (UsageError,)) -> int:
    """Run a console script's ``body``; a user error becomes one message and exit 2 (see the Note above).

    ``user_errors`` are the exception types whose text is written for the user (by default only
    :class:`UsageError`; a CLI whose library raises clear ``ValueError`` / ``FileNotFoundError`` passes
    them too). A broken pipe (``... | head``) ends quietly. With :func:`debug_requested` the exception
    propagates with its traceback. Returns 0 on success.
    """
    try:
        body()
    except BrokenPipeError:
        # the reader went away (`| head`): nothing more can be written; silence the interpreter's own flush
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaced for the interpreter's exit flush
        except OSError:
            pass
        return 0
    except user_errors as err:
        if debug_requested(argv):
            raise
        fail(prog, str(err).strip() or type(err).__name__)
    return 0


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``--version`` and ``--debug`` on every CLI of the package."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=version_text(self.prog))
        self.add_argument("--debug", action="store_true", help="print the full traceback of an error")
