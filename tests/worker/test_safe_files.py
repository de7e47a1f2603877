"""worker/safe_files.py: what the agent reads, writes and removes in a folder a job's user can
write is reached through no link, is a regular file of the folder's owner, and is never a
FIFO that would block it; tried on the real filesystem."""

from __future__ import annotations

import errno
import os
import pwd
import stat

import pytest

from tests.helpers.other_user import needs_root
from worker import safe_files


@pytest.fixture
def folder(tmp_path):
    """The job's folder, with a root-only file beside it that the job's user would like read."""
    (tmp_path / "job").mkdir()
    (tmp_path / "secret").write_bytes(b"root's secret\n")
    (tmp_path / "secret-dir").mkdir()
    (tmp_path / "secret-dir" / "stdout.log").write_bytes(b"root's secret\n")
    return tmp_path / "job"


def test_a_regular_file_is_read_and_a_link_on_the_way_or_at_the_end_is_refused(folder):
    (folder / "stdout.log").write_bytes(b"the job's line\n")
    (folder / "link.log").symlink_to(folder.parent / "secret")
    (folder / "linked-dir").symlink_to(folder.parent / "secret-dir")
    assert safe_files.read_bytes(folder / "stdout.log", 100) == b"the job's line\n"
    for path in (folder / "link.log", folder / "linked-dir" / "stdout.log"):
        with pytest.raises(OSError) as got:
            safe_files.read_bytes(path, 100)
        assert got.value.errno in (errno.ELOOP, errno.ENOTDIR), path
    with safe_files.folder(folder) as fd:  # relative to a folder held open, too
        assert safe_files.read_bytes("stdout.log", 100, dir_fd=fd) == b"the job's line\n"
        with pytest.raises(OSError):
            safe_files.open_reader("link.log", dir_fd=fd)
        with pytest.raises(OSError):
            safe_files.listdir("linked-dir", dir_fd=fd)


def test_a_fifo_is_refused_at_once_and_never_blocks(folder):
    os.mkfifo(folder / "stdout.log")  # nobody writes it: a plain open would wait for ever
    with pytest.raises(OSError) as got:
        safe_files.open_file(folder / "stdout.log")
    assert got.value.errno == errno.EINVAL


@needs_root()
def test_a_file_not_owned_by_the_folders_owner_is_refused(folder):
    """A hard link to another user's file keeps that user's uid: only the folder's owner's own
    files are the job's."""
    nobody = pwd.getpwnam("nobody")
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    (folder / "root.log").write_bytes(b"root's\n")
    (folder / "mine.log").write_bytes(b"nobody's\n")
    os.chown(folder / "mine.log", nobody.pw_uid, nobody.pw_gid)
    assert safe_files.read_bytes(folder / "mine.log", 100) == b"nobody's\n"
    with pytest.raises(OSError) as got:
        safe_files.read_bytes(folder / "root.log", 100)
    assert got.value.errno == errno.EPERM
    assert safe_files.read_bytes(folder / "root.log", 100, owner=None) == b"root's\n"


def test_a_file_replaced_whole_replaces_a_link_at_its_name_never_its_target(folder):
    (folder / "hand-over.json").symlink_to(folder.parent / "secret")
    safe_files.replace_file(folder / "hand-over.json", b"{}")
    assert (folder.parent / "secret").read_bytes() == b"root's secret\n"
    assert not (folder / "hand-over.json").is_symlink()
    assert (folder / "hand-over.json").read_bytes() == b"{}"
    assert sorted(os.listdir(folder)) == ["hand-over.json"]  # no temporary file left


@needs_root()
def test_a_file_the_agent_writes_in_the_jobs_folder_is_the_folders_owners(folder):
    nobody = pwd.getpwnam("nobody")
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    safe_files.replace_file(folder / "hand-over.json", b"{}")
    st = (folder / "hand-over.json").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, nobody.pw_gid, 0o600)


def test_a_tree_is_removed_without_following_its_links_or_opening_its_fifos(folder):
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "file").write_bytes(b"x")
    (folder / "a" / "to-secret").symlink_to(folder.parent / "secret")
    (folder / "a" / "to-secret-dir").symlink_to(folder.parent / "secret-dir")
    os.mkfifo(folder / "a" / "b" / "fifo")
    safe_files.remove_tree(folder / "a")
    assert not (folder / "a").exists()
    assert (folder.parent / "secret").read_bytes() == b"root's secret\n"
    assert (folder.parent / "secret-dir" / "stdout.log").exists()
    (folder / "top").symlink_to(folder.parent / "secret-dir")
    with pytest.raises(OSError):
        safe_files.remove_tree(folder / "top")  # a link where a folder was: not followed
    assert (folder.parent / "secret-dir" / "stdout.log").exists()


def test_folders_made_on_the_way_get_the_mode_asked_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        fd = safe_files.open_dir(tmp_path / "a" / "b", make_mode=0o711)
    finally:
        os.umask(old)
    os.close(fd)
    assert [stat.S_IMODE((tmp_path / p).stat().st_mode) for p in ("a", "a/b")] == [0o711, 0o711]
    (tmp_path / "c").symlink_to(tmp_path / "a")
    with pytest.raises(OSError):
        safe_files.open_dir(tmp_path / "c" / "d", make_mode=0o700)  # a link on the way: made nowhere
    assert not (tmp_path / "a" / "d").exists()
