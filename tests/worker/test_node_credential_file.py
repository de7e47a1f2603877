"""The node credential an agent keeps in its data directory, and the name's lock there."""

from __future__ import annotations

import os
import stat

import pytest

from worker.node_link import NameInUse, NodeLink, lock_name


def test_the_credential_file_is_the_agents_alone_and_is_read_back(tmp_path):
    path = tmp_path / "node-credential.n0"
    link = NodeLink("http://127.0.0.1:9", "bootstrap", "n0", credential_file=path)
    try:
        assert link._read_credential() is None  # a new agent presents none
        link._write_credential("ftrain-node.n0.first")
        link._write_credential("ftrain-node.n0.second")  # replaced whole
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert link._read_credential() == "ftrain-node.n0.second"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["node-credential.n0"]  # no temp left
        path.write_text("x" * 1000)  # not a credential: registering goes on without it
        assert link._read_credential() is None
    finally:
        link.close()


def test_a_second_agent_of_one_name_on_one_data_dir_is_refused(tmp_path):
    fd = lock_name(tmp_path, "n0")
    try:
        with pytest.raises(NameInUse, match="another agent named 'n0'"):
            lock_name(tmp_path, "n0")
        os.close(lock_name(tmp_path, "n1"))  # another name is free
    finally:
        os.close(fd)
    os.close(lock_name(tmp_path, "n0"))  # free again once its holder is gone
