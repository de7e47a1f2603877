"""Files in folders that a job's user can write, as the node agent touches them.

Under `--run-as` the agent is root and the job's user owns folders the agent works in: its
snapshot folder (hand-overs, snapshot files), torchrun's log folder (each worker's output),
its memory tier. Whatever path the agent opens there, the job's user may have replaced a
moment before: a symbolic link to a root-only file (root would read it and ship its lines as
the job's output), a link at a temporary file's name (root would overwrite its target), a
FIFO (root's open would block), a folder swapped for a link to another folder.

So every such path is walked one component at a time from `/` (or from a folder already
open), each folder opened with O_NOFOLLOW | O_DIRECTORY relative to the one above it, and
the last component with O_NOFOLLOW | O_NONBLOCK, then checked with `fstat` to be a regular
file owned by the folder's owner (a hard link to someone else's file has that someone's
uid). A link anywhere on the way is ELOOP, a file of another kind or owner EINVAL or EPERM:
an OSError, which every caller already handles as "not there". Files the agent writes there
are made with O_CREAT | O_EXCL | O_NOFOLLOW under a name nobody could guess, then renamed
over the target (a rename replaces a link, never its target), and given to the folder's
owner, whose they are.

The paths handed in must be free of links themselves (the agent resolves its data directory
and each job folder once, when it makes them: `real_path`).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # (a FIFO would block an open)
# `owner=FOLDER_OWNER`: the file must belong to whoever owns the folder it is in.
FOLDER_OWNER = -1


def real_path(path: str | Path) -> Path:
    """`path` absolute, with the links of the part that exists resolved (an operator's
    configured paths may go through links; what the agent makes below them may not)."""
    return Path(os.path.realpath(path))


def _parts(path: str | Path) -> tuple[str, list[str]]:
    """Where a walk of `path` starts ("/" or "."), and its components."""
    p = os.fspath(path)
    names = [n for n in p.split("/") if n not in ("", ".")]
    if ".." in names:
        raise OSError(errno.EINVAL, "a path with '..' is not walked", p)
    return ("/" if p.startswith("/") else "."), names


def open_dir(path: str | Path, *, dir_fd: int | None = None, make_mode: int | None = None) -> int:
    """An fd of the folder `path` (relative to `dir_fd` if given), no component a link;
    with `make_mode`, the missing components are made with that mode (umask or not).

    Raises:
        OSError: a component is missing, a link (ELOOP) or not a folder (ENOTDIR).
    """
    start, names = _parts(path)
    fd = os.open(start, _DIR_FLAGS, dir_fd=dir_fd) if dir_fd is None or start == "/" else os.dup(dir_fd)
    try:
        for name in names:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if make_mode is None:
                    raise
                try:
                    os.mkdir(name, make_mode, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: opened below like any other (a link there fails)
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.fchmod(nfd, make_mode)  # mkdir's mode passed through the umask
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def folder(path: str | Path, *, dir_fd: int | None = None) -> Iterator[int]:
    """`open_dir(path)`, closed at the end of the block."""
    fd = open_dir(path, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _split(path: str | Path) -> tuple[str, str]:
    p = os.fspath(path)
    parent, name = os.path.split(p)
    if not name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not a file's path", p)
    return (parent or "."), name


def open_file(path: str | Path, flags: int = os.O_RDONLY, *, dir_fd: int | None = None,
              owner: int | None = FOLDER_OWNER) -> int:
    """An fd of the regular file `path` (relative to `dir_fd` if given), reached through no
    link, and owned by `owner` (FOLDER_OWNER: its folder's owner; None: anyone).

    Raises:
        OSError: missing, a link on the way (ELOOP), not a regular file (EINVAL), another
        owner's (EPERM).
    """
    parent, name = _split(path)
    with folder(parent, dir_fd=dir_fd) as pfd:
        fd = os.open(name, flags | _FILE_FLAGS, dir_fd=pfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
            want = os.fstat(pfd).st_uid if owner == FOLDER_OWNER else owner
            if want is not None and st.st_uid != want:
                raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not by uid {want}", os.fspath(path))
        except BaseException:
            os.close(fd)
            raise
    return fd


def open_reader(path: str | Path, *, dir_fd: int | None = None, owner: int | None = FOLDER_OWNER) -> BinaryIO:
    """`open_file(path)` as a binary file object for reading."""
    return os.fdopen(open_file(path, dir_fd=dir_fd, owner=owner), "rb")


def read_bytes(path: str | Path, max_bytes: int, *, dir_fd: int | None = None,
               owner: int | None = FOLDER_OWNER) -> bytes:
    """At most `max_bytes` of the regular file `path` (as `open_file` opens it)."""
    with open_reader(path, dir_fd=dir_fd, owner=owner) as f:
        return f.read(max_bytes)


def replace_file(path: str | Path, data: bytes, mode: int = 0o600) -> None:
    """`path` replaced whole by `data` (a new file beside it, fsync, rename), the new file
    given to the folder's owner; a link at `path` is replaced, never followed."""
    parent, name = _split(path)
    with folder(parent) as pfd:
        tmp = f"{name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=pfd)
        try:
            with os.fdopen(fd, "wb") as f:
                _give_to_folder_owner(f.fileno(), pfd)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except BaseException:
            _unlink_quietly(tmp, pfd)
            raise


def _give_to_folder_owner(fd: int, pfd: int) -> None:
    folder_st, st = os.fstat(pfd), os.fstat(fd)
    if (st.st_uid, st.st_gid) != (folder_st.st_uid, folder_st.st_gid) and os.geteuid() == 0:
        try:
            os.fchown(fd, folder_st.st_uid, folder_st.st_gid)
        except OSError:
            pass  # root without the right here (NFS's root_squash): the file stays the server's choice


def _unlink_quietly(name: str, pfd: int) -> None:
    try:
        os.unlink(name, dir_fd=pfd)
    except OSError:
        pass


def rename(path: str | Path, new_name: str) -> None:
    """Rename `path` to `new_name` in the same folder (a link is renamed, not followed)."""
    parent, name = _split(path)
    with folder(parent) as pfd:
        os.replace(name, new_name, src_dir_fd=pfd, dst_dir_fd=pfd)


def unlink(path: str | Path, missing_ok: bool = True) -> None:
    """Remove the name `path` (a link itself, never its target)."""
    parent, name = _split(path)
    try:
        with folder(parent) as pfd:
            os.unlink(name, dir_fd=pfd)
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_flat_folder(path: str | Path) -> None:
    """Remove the folder `path` and the names directly in it (a sharded snapshot holds no
    folders); a link anywhere is removed as a name, never followed. Gone already: fine."""
    parent, name = _split(path)
    try:
        with folder(parent) as pfd:
            with folder(name, dir_fd=pfd) as fd:
                for entry in os.listdir(fd):
                    os.unlink(entry, dir_fd=fd)
            os.rmdir(name, dir_fd=pfd)
    except FileNotFoundError:
        pass


def listdir(path: str | Path, *, dir_fd: int | None = None) -> list[str]:
    """The names in folder `path`, reached through no link."""
    with folder(path, dir_fd=dir_fd) as fd:
        return os.listdir(fd)


def lexists(path: str | Path) -> bool:
    """Whether a name `path` is there (a link counts, and is not followed)."""
    parent, name = _split(path)
    try:
        with folder(parent) as pfd:
            os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except OSError:
        return False
    return True


def is_dir(path: str | Path) -> bool:
    """Whether `path` is a folder reached through no link."""
    try:
        with folder(path):
            return True
    except OSError:
        return False


def lstat(path: str | Path) -> os.stat_result:
    """`path`'s own status (a link's, not its target's), reached through no link."""
    parent, name = _split(path)
    with folder(parent) as pfd:
        return os.stat(name, dir_fd=pfd, follow_symlinks=False)


def give_dir(path: str | Path, uid: int | None, gid: int | None, mode: int, *,
             dir_fd: int | None = None) -> None:
    """Make folder `path` (reached through no link) `uid`'s (None: left as it is), `mode`."""
    with folder(path, dir_fd=dir_fd) as fd:
        if uid is not None:
            os.fchown(fd, uid, -1 if gid is None else gid)
        os.fchmod(fd, mode)


# A tree deeper than this is not the agent's to remove (each level holds an fd while it goes).
MAX_REMOVE_DEPTH = 128


def remove_tree(path: str | Path) -> None:
    """Remove folder `path` and everything in it: nothing below is followed (a link is
    removed, not its target) nor opened but folders (a FIFO would block an open).

    Raises:
        OSError: `path` is not a folder reached through no link, or something in it could
        not be removed (what could is gone).
    """
    parent, name = _split(path)
    with folder(parent) as pfd:
        _remove_in(pfd, name, MAX_REMOVE_DEPTH, top=True)


def _remove_in(pfd: int, name: str, depth: int, top: bool = False) -> None:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if top or exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        os.unlink(name, dir_fd=pfd)  # a file, a link, a FIFO: the name goes
        return
    try:
        if depth <= 0:
            raise OSError(errno.ELOOP, "a tree too deep to remove", name)
        for entry in os.listdir(fd):
            _remove_in(fd, entry, depth - 1)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=pfd)
