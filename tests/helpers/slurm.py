"""A real SLURM cluster on this host for the tests: munged, slurmctld and a few slurmd.

Everything of it lives in one directory of the test's: the munge key and socket, the
slurm.conf (its own ports, state and spool directories, logs), so it shares nothing with
another cluster on the host. Each slurmd is one node (`slurmd -N n1`), all on this host
(each its own Port, NodeHostname this host), processes tracked by their tree
(proctrack/linuxproc: no cgroups needed). The daemons are children of the test, stopped by
PID; the jobs they run are cancelled first. The client commands (sbatch, srun, scancel,
squeue) find the cluster through SLURM_CONF (`env`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from bench.harness import free_port, wait_for

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "scontrol")
# The grace SLURM gives a job's processes between SIGTERM and SIGKILL: more than an agent's
# drain (the control plane's ack timeout, 15 s, and 1 s).
KILL_WAIT_S = 30


def slurm_unavailable() -> str | None:
    """Why a real SLURM cannot run here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found): `apt-get install slurm-wlm "
                "munge` (.ci/run installs them)")
    if os.geteuid() != 0:
        return "a test SLURM cluster needs root (slurmd starts job steps as their users)"
    return None


def _conf(root: Path, nodes: list[str], ports: dict[str, int]) -> str:
    host = socket.gethostname()
    lines = [
        f"ClusterName=ft{os.getpid() % 100000}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports['ctld']}",
        f"SlurmdPort={ports[nodes[0]]}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={root / 'munge' / 'socket'}",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root}/log/slurmd.%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/linear",
        "SchedulerType=sched/builtin", "SlurmdParameters=config_overrides", "ReturnToService=2",
        f"KillWait={KILL_WAIT_S}", "MpiDefault=none", "SwitchType=switch/none",
    ]
    lines += [f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs=1" for n in nodes]
    lines.append(f"PartitionName=main Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """munged, slurmctld and `nodes` slurmd, in `root`."""

    def __init__(self, root: Path, nodes: int = 3):
        self.root = root
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ports = {"ctld": free_port(), **{n: free_port() for n in self.nodes}}
        self.conf.write_text(_conf(self.root, self.nodes, ports))
        m = self.root / "munge"
        self._spawn("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={m / 'socket'}",
                               f"--pid-file={m / 'pid'}", f"--log-file={m / 'log'}", f"--seed-file={m / 'seed'}"])
        wait_for(lambda: (m / "socket").exists(), 10, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        wait_for(self._all_idle, 60, f"SLURM nodes {self.nodes} idle")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "ab") as log:
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=self.env))

    def run(self, *argv: str, check: bool = True) -> str:
        """A SLURM client command against this cluster; its stdout."""
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def _all_idle(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}; logs in {self.root / 'log'}")
        states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).split()
        return len(states) == 2 * len(self.nodes) and all(s == "idle" for s in states[1::2])

    def jobs(self) -> list[str]:
        """The ids of the jobs SLURM still holds (any state but gone)."""
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def steps(self, job_id: str) -> dict[str, str]:
        """A running job's steps by node: {node: 'JOB.STEP'} (not its batch step)."""
        out = self.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %N", check=False)
        return {node: step for step, node in (line.split() for line in out.splitlines() if line.strip())
                if not step.endswith(".batch") and not step.endswith(".extern")}

    def stop(self) -> None:
        """Cancel every job, wait for their processes to go (up to KillWait), then stop the daemons."""
        if all(p.poll() is None for p in self.procs) and (jobs := self.jobs()):
            self.run("scancel", "--full", *jobs, check=False)
            with contextlib.suppress(AssertionError, TimeoutError):
                wait_for(lambda: not self.jobs(), KILL_WAIT_S + 15, "SLURM's jobs to end")
        for proc in reversed(self.procs):  # the slurmd, then slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
