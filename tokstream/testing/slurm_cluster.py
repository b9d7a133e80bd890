"""A real Slurm on loopback for the tests: Debian's slurm-wlm (munged, slurmctld, slurmd), one node.

Everything it starts lives in one private folder: the munge key and socket, slurm.conf, the state and
spool directories, the logs and PID files, on ports of this test process's own (free_port). Clients
(sbatch, squeue, scontrol, scancel) reach it through SLURM_CONF in `env`; the munge socket is named in
AuthInfo, so no system-wide daemon or /etc file is used or touched. `stop()` ends only the daemons it
started (by the PIDs it holds) and the jobs they ran.

The node claims `cpus` CPUs whatever the machine has (SlurmdParameters=config_overrides), so that a
4-task array and a 2-rank job fit on a 2-core machine. Slurm runs jobs as root here (SlurmUser=root):
the daemons need root to switch users, and the tests run as root.
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tokstream.testing.loopback_s3 import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_reason() -> str | None:
    """Why a cluster cannot start here, in one line; None when it can."""
    absent = [name for name in (*DAEMONS, "sbatch", "scontrol") if shutil.which(name) is None]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} not found): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root (slurmd switches to the job's user)"
    return None


class SlurmCluster:
    """munged + slurmctld + slurmd on 127.0.0.1 under `root`; `env` is what clients need."""

    def __init__(self, root: Path, cpus: int = 64, kill_wait_s: int = 30, first_job_id: int = 1):
        self.root = Path(root)
        self.cpus = cpus
        self.processes: dict[str, subprocess.Popen] = {}
        self.node = socket.gethostname()
        for name in ("etc", "state", "spool", "log", "munge"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)  # munged refuses a socket folder others can write
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.conf = self.root / "etc" / "slurm.conf"
        self.kill_wait_s, self.first_job_id = kill_wait_s, first_job_id
        self.conf.write_text(self._config(kill_wait_s, first_job_id))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in [name for name in self.env if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if name != "SLURM_CONF":  # a test run inside a Slurm job must not hand its own job's settings on
                del self.env[name]

    def _config(self, kill_wait_s: int, first_job_id: int) -> str:
        root = self.root
        return "\n".join([
            "ClusterName=tokstream-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={root / 'log' / 'jobcomp.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",  # a test waits seconds, not a minute
            "ReturnToService=2",
            "JobRequeue=0",  # a job is requeued only if it asks (--requeue), as the recipes do
            f"KillWait={kill_wait_s}",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol for the test's checks
            f"FirstJobId={first_job_id}",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def start(self, timeout: float = 60, attempts: int = 3) -> "SlurmCluster":
        """Start the daemons; a port another process took between free_port() and slurmctld's bind is drawn
        again (a new config), up to `attempts` times."""
        for attempt in range(attempts):
            try:
                return self._start(timeout)
            except RuntimeError as err:
                self.stop()
                if "Address already in use" not in str(err) or attempt == attempts - 1:
                    raise
                self.conf.write_text(self._config(self.kill_wait_s, self.first_job_id))
                self.processes.clear()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> "SlurmCluster":
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        log = self.root / "log"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                               f"--log-file={log / 'munged.log'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(self._node_idle, timeout, "the node to be idle")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")
        self.processes[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                                start_new_session=True)
        out.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode}) while waiting for {what}:\n"
                                       + self.logs())
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n" + self.logs())
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        result = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def logs(self, tail: int = 30) -> str:
        parts = []
        for path in sorted((self.root / "log").iterdir()):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def run(self, *argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        result = subprocess.run(argv, env=kwargs.pop("env", self.env), capture_output=True, text=True,
                                timeout=60, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def sbatch(self, *argv: str, cwd: Path | None = None, env: dict | None = None) -> str:
        """Submit; returns the job id."""
        result = self.run("sbatch", "--parsable", *argv, cwd=cwd, env={**self.env, **(env or {})})
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of one job (the first record: an array's first element if given the array)."""
        return self.jobs(job_id)[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """scontrol's fields of a job or of each element of an array."""
        records = []
        for line in self.run("scontrol", "-o", "show", "job", job_id).stdout.splitlines():
            records.append(dict(item.partition("=")[::2] for item in line.split()))
        return records

    def wait_for(self, job_id: str, states: set[str], timeout: float = 300) -> dict[str, str]:
        """Until every record of `job_id` is in one of `states`; returns the first record."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.jobs(job_id)
            if all(record["JobState"] in states for record in records):
                return records[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: {[r['JobState'] for r in records]} after {timeout} s, "
                                   f"waiting for {sorted(states)}\n" + self.logs())
            time.sleep(0.5)

    def eligible_now(self, job_id: str, restarts: int, timeout: float = 180) -> None:
        """Until Slurm has requeued `job_id` for the `restarts`-th time and started it again, moving its begin
        time to two seconds from now: Slurm holds a requeued job about two minutes. Not to now: a job started
        in the second its previous launch's credential was revoked is killed ("Job credential revoked")."""
        deadline = time.monotonic() + timeout
        moved = -float("inf")
        while True:
            record = self.job(job_id)
            if int(record.get("Restarts", 0)) >= restarts:
                if record["JobState"] in ("RUNNING", "COMPLETED"):
                    return
                held = record["JobState"] == "PENDING" and record.get("Reason") == "BeginTime"
                if held and time.monotonic() - moved > 10:  # once, and again if the requeue set it later
                    self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+2", check=False)
                    moved = time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not started again after {restarts} requeues: {record}\n"
                                   + self.logs())
            time.sleep(0.5)

    def kill_hard(self, job_id: str) -> None:
        """SIGKILL to every process of the job at once, as a lost node or the OOM killer ends it: nothing it runs
        gets a word in. (`scancel --signal=KILL` is not that: Slurm cancels the job, SIGTERM first.)"""
        while True:
            listed = self.run("scontrol", "listpids", job_id, check=False).stdout.splitlines()[1:]
            pids = [int(line.split()[0]) for line in listed if line.split() and line.split()[0].isdigit()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def stop(self) -> None:
        """End the jobs and the daemons this cluster started; remove nothing but its own folder's contents."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", "root", check=False)
        for name in reversed(DAEMONS):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
