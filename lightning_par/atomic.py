"""Atomic writes: a file or a directory appears under its final name complete, or not at all.

[Note: atomic checkpoints] A process killed in the middle of a save (a SIGKILL, a node lost, a job
preempted) must not leave a torn checkpoint under the name a restart resumes from. So every checkpoint is
written under a hidden temporary name in the same folder (``.<name>.tmp`` for a file, ``.<name>.partial``
for a directory: same file system, so the rename is atomic, and no checkpoint pattern such as
``last*.ckpt`` matches it), flushed to disk (``fsync`` of every file and of the folders) and only then
renamed to its final name. ``os.replace`` swaps a file in one step. A directory cannot be renamed onto a
non-empty one, so an existing directory of that name is first moved aside (``.<name>.old``), the new one
renamed in, and the old one removed: a kill between these renames leaves no directory under the final
name (the old one is still complete under ``.<name>.old``), never a half-written one. A leftover temporary
of an earlier killed save is replaced by the next save of the same name.

Example::

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> write_file(os.path.join(folder, "a.txt"), lambda tmp: open(tmp, "w").write("whole"))
    >>> def write_two(tmp):
    ...     for name in ("x", "y"):
    ...         open(os.path.join(tmp, name), "w").write(name)
    >>> write_directory(os.path.join(folder, "ckpt"), write_two)
    >>> write_directory(os.path.join(folder, "ckpt"), write_two)  # replaces the existing directory
    >>> sorted(os.listdir(folder)), sorted(os.listdir(os.path.join(folder, "ckpt")))
    (['a.txt', 'ckpt'], ['x', 'y'])
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Optional


def hidden_name(path: str, suffix: str) -> str:
    """``<folder>/.<name>.<suffix>``: the temporary of ``path`` in its own folder.

    Example::

        >>> hidden_name("runs/checkpoints/last.ckpt", "tmp")
        'runs/checkpoints/.last.ckpt.tmp'
    """
    folder, name = os.path.split(os.path.normpath(path))
    return os.path.join(folder, f".{name}.{suffix}")


def fsync_path(path: str) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def write_file(path: str, write: Callable[[str], None]) -> None:
    """Write a file atomically: ``write(tmp)`` writes the hidden temporary, which is flushed and renamed to
    ``path`` ([Note: atomic checkpoints]). On an error the temporary is removed and the error raised."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = hidden_name(path, "tmp")
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(folder)


def clear_temporary(path: str) -> str:
    """The hidden temporary directory of ``path`` (``.<name>.partial``), with what a killed save left there and
    under ``.<name>.old`` removed; the caller (one process) then writes into it."""
    path = os.path.normpath(os.fspath(path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp, old = hidden_name(path, "partial"), hidden_name(path, "old")
    for stale in (tmp, old):  # left by a save that was killed: a file or a directory
        try:
            os.remove(stale)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(stale)
    return tmp


def publish_directory(tmp: str, path: str) -> None:
    """Give the complete directory ``tmp`` its final name ``path`` ([Note: atomic checkpoints]): flushed, an
    existing ``path`` moved aside to ``.<name>.old`` first (a rename onto a non-empty directory fails), then
    renamed, the old one removed."""
    path = os.path.normpath(os.fspath(path))
    folder, old = os.path.dirname(os.path.abspath(path)), hidden_name(path, "old")
    _fsync_tree(tmp)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_path(folder)
    if os.path.isdir(old):
        shutil.rmtree(old)
    elif os.path.exists(old):  # a file of that name before
        os.remove(old)


def write_directory(path: str, write: Callable[[str], None], *, publisher: bool = True,
                    barrier: Optional[Callable[[], None]] = None) -> None:
    """Write a directory atomically ([Note: atomic checkpoints]): ``write(tmp)`` fills the hidden temporary
    directory (it exists, empty, when ``write`` is called), which is flushed and renamed to ``path``.

    Several processes may write one directory together (``torch.distributed.checkpoint``): each calls this
    with the same ``path``; ``publisher`` (one of them, e.g. rank 0) prepares the temporary and, once its own
    ``write`` has returned, renames it; ``barrier`` (a collective, called twice) keeps the others from writing
    before the temporary exists and from going on before it is renamed. The publisher's ``write`` must return
    only once every process's part is written (``dcp.save`` writes its ``.metadata`` last, after all).
    """
    tmp = hidden_name(os.path.normpath(os.fspath(path)), "partial")
    if publisher:
        os.makedirs(clear_temporary(path))
    if barrier is not None:
        barrier()
    write(tmp)
    if publisher:
        publish_directory(tmp, path)
    if barrier is not None:
        barrier()
