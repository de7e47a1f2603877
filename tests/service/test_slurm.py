"""`ftrain slurm`'s pure parts: the batch scripts, the node token's file, the workers' SLURM names."""

from __future__ import annotations

import stat

import pytest
from click.testing import CliRunner

from service import slurm
from service.cli import default_node_name, main
from worker.launch import slurm_names


def test_nodes_script_runs_one_agent_per_node_and_names_the_token_file_only(tmp_path):
    argv = slurm.agent_argv("http://cp:8000", tmp_path / "node-token", tmp_path / "nodes", 2)
    script = slurm.nodes_script(4, argv)
    assert script.startswith("#!/bin/bash\n")
    for directive in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue"):
        assert directive in script.splitlines()
    command = script.splitlines()[-1]
    assert command.startswith("exec srun ") and "--ntasks-per-node=1" in command
    assert f"--token-file {tmp_path / 'node-token'}" in command and "--nproc-per-node 2" in command


def test_a_token_file_others_can_read_is_refused(tmp_path):
    token = tmp_path / "node-token"
    token.write_text("secret\n")
    token.chmod(0o640)
    with pytest.raises(slurm.SlurmError, match="chmod 600"):
        slurm.node_token_file(str(token), {}, tmp_path)
    token.chmod(0o600)
    assert slurm.node_token_file(str(token), {}, tmp_path) == token


def test_a_token_from_the_environment_goes_to_a_private_file(tmp_path):
    path = slurm.node_token_file(None, {"FTRAIN_NODE_TOKEN": "s3cret"}, tmp_path / "data")
    assert path.read_text().strip() == "s3cret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_sbatch_gets_no_token_variable():
    env = {"PATH": "/bin", "FTRAIN_NODE_TOKEN": "a", "FTRAIN_TOKEN": "b", "FTRAIN_USER_TOKEN": "c"}
    assert slurm.without_secrets(env) == {"PATH": "/bin"}


def test_slurm_run_asks_sbatch_for_the_range_of_nodes():
    script = slurm.run_script({"min": 2, "max": 4}, ["python", "-m", "service.cli", "slurm", "run", "--", "x y"])
    assert "#SBATCH --nodes=2-4" in script.splitlines()
    assert script.splitlines()[-1].endswith("-- 'x y'")
    assert slurm.sbatch_nodes({"min": 3, "max": 3}) == "3"


def test_print_script_shows_what_would_be_submitted(tmp_path):
    token = tmp_path / "t"
    token.write_text("x")
    token.chmod(0o600)
    result = CliRunner().invoke(main, ["slurm", "nodes", "--nodes", "2", "--server", "http://cp:8000",
                                       "--token-file", str(token), "--data-dir", str(tmp_path), "--print-script"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --nodes=2" in result.output and "x\n" not in result.output


def test_workers_in_an_allocation_get_slurm_names_of_their_rank():
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "5", "LOCAL_RANK": "1",
           "WORLD_SIZE": "8", "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    slurm_names(env)
    assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NTASKS"], env["SLURM_NODEID"],
            env["SLURM_NNODES"]) == ("5", "1", "8", "2", "4")


def test_workers_outside_slurm_get_no_slurm_names():
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    slurm_names(env)
    assert not any(k.startswith("SLURM_") for k in env)


def test_a_node_is_named_by_its_slurm_name(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu017")
    assert default_node_name() == "gpu017"
