"""A throwaway single-node Slurm cluster for tests: munged, slurmctld and slurmd on this machine.

Everything of the cluster lives under one directory (``slurm.conf``, state, spool, pid and log
files); the Slurm commands find it through ``SLURM_CONF`` (see :attr:`SlurmCluster.env`). The
daemons run in the foreground as children of this process and are stopped by their PIDs.

    cluster = SlurmCluster(tmp_dir)
    cluster.start()                       # waits until the node is idle
    job = cluster.sbatch(["--ntasks=2", "script.sbatch", "arg"], env=...)
    cluster.wait(job, {"COMPLETED"})
    cluster.stop()

Needs root (slurmd runs jobs as their users) and the Debian packages ``slurmctld slurmd
slurm-client munge`` (what ``.ci/run`` installs); no systemd is needed. :func:`unavailable` says
why a cluster cannot run here. ``python tests/slurm_cluster.py DIR`` starts a cluster to play
with (then ``export SLURM_CONF=DIR/slurm.conf``); Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel", "srun", "munged")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MUNGE_KEY = Path("/etc/munge/munge.key")

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}
"""Job states after which a job does not run again (unless requeued)."""


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin", "/usr/bin") if (p := Path(d) / name).is_file()), None)


def unavailable() -> str | None:
    """Why a throwaway cluster cannot run on this machine, or None when it can."""
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return (f"Slurm is not installed (missing {', '.join(missing)}); .ci/run installs it with "
                f"apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "a throwaway Slurm cluster needs root (slurmd runs jobs as their users)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge package's user 'munge' does not exist"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 4096


def parse_fields(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output (``Key=Value`` pairs on one line) as a dict."""
    fields = {}
    for m in re.finditer(r"(\w[\w/:]*)=(\S*)", text):
        fields.setdefault(m.group(1), m.group(2))
    return fields


class SlurmCluster:
    """One controller and one node named after this host, address 127.0.0.1, all its CPUs (at
    least 2)."""

    def __init__(self, root: str | os.PathLike, cpus: int | None = None, partition: str = "debug") -> None:
        self.root = Path(root).resolve()
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or max(2, os.cpu_count() or 1)
        self.partition = partition
        self.conf = self.root / "slurm.conf"
        self.munge_socket = MUNGE_SOCKET.parent / f"throwaway-{os.getpid()}-{id(self):x}.socket"
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    @property
    def env(self) -> dict[str, str]:
        """This process's environment plus ``SLURM_CONF``: what Slurm commands (and jobs) need."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ------------------------------------------------------------------ set-up

    def write_conf(self) -> Path:
        for sub in ("state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        # RealMemory: half of this machine, so that slurmd never finds less than configured. On a
        # one-CPU machine the node claims 2 CPUs anyway (config_overrides) so 2-rank jobs can run.
        overrides = "SlurmdParameters=config_overrides" if (os.cpu_count() or 1) < self.cpus else ""
        lines = f"""
            # A throwaway cluster of tests/slurm_cluster.py: one controller, one node, this host.
            # Private ports and munge socket, and a random first job id (the sbatch templates derive
            # rendezvous ports from it), so that two such clusters on one host stay apart.
            ClusterName=throwaway
            SlurmctldHost={self.node}(127.0.0.1)
            SlurmctldPort={free_port()}
            SlurmdPort={free_port()}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={self.munge_socket}
            FirstJobId={random.randint(1000, 15000)}
            StateSaveLocation={r}/state
            SlurmdSpoolDir={r}/spool
            SlurmctldPidFile={r}/run/slurmctld.pid
            SlurmdPidFile={r}/run/slurmd.pid
            SlurmctldLogFile={r}/log/slurmctld.log
            SlurmdLogFile={r}/log/slurmd.log
            SlurmctldDebug=info
            SlurmdDebug=info
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SwitchType=switch/none
            MpiDefault=none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_CPU
            SchedulerType=sched/backfill
            AccountingStorageType=accounting_storage/none
            JobAcctGatherType=jobacct_gather/none
            JobCompType=jobcomp/none
            MailProg=/bin/true
            ReturnToService=2
            {overrides}
            SlurmctldTimeout=30
            SlurmdTimeout=30
            MessageTimeout=20
            InactiveLimit=0
            KillWait=10
            Waittime=0
            MinJobAge=3600
            NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_mem_mb() // 2} State=UNKNOWN
            PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
        """
        self.conf.write_text("\n".join(line.strip() for line in lines.strip().splitlines()) + "\n")
        return self.conf

    def _munge_works(self) -> bool:
        try:
            cred = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True, timeout=10)
            if cred.returncode:
                return False
            return subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=cred.stdout,
                                  capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _start_munge(self) -> None:
        """A munged of this cluster, as user munge, on a socket of its own in /run/munge.

        A private socket (slurm.conf's AuthInfo) leaves any system munged alone, and two clusters
        (e.g. two test sessions) cannot stop each other's. The key is the system's
        /etc/munge/munge.key, created if missing.
        """
        munge = pwd.getpwnam("munge")
        for folder, mode in ((MUNGE_SOCKET.parent, 0o755), (Path("/var/lib/munge"), 0o700),
                             (Path("/var/log/munge"), 0o700)):  # socket; seed; log
            if not folder.is_dir():
                folder.mkdir(parents=True)
                os.chmod(folder, mode)
            os.chown(folder, munge.pw_uid, munge.pw_gid)
        if not MUNGE_KEY.is_file():
            MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
            MUNGE_KEY.write_bytes(os.urandom(128))
        os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)
        os.chmod(MUNGE_KEY, 0o400)
        self.munge_socket.unlink(missing_ok=True)  # a stale socket of a dead munged
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--pid-file={self.munge_socket.with_suffix('.pid')}",
                               f"--log-file=/var/log/munge/{self.munge_socket.stem}.log"],
                    user=munge.pw_uid, group=munge.pw_gid)
        self._until(self._munge_works, 20, "munged to answer")

    def _spawn(self, name: str, cmd: list[str], **kwargs) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self._logs.append(log)
        kwargs.setdefault("extra_groups", [])
        if "user" not in kwargs:
            kwargs.pop("extra_groups")
        self._procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)

    def _until(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}; "
                                       f"see {self.root / 'log'}\n{self.logs()}")
            if ok():
                return
            time.sleep(0.25)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Write the configuration, start the daemons and wait until the node is idle."""
        self.write_conf()
        try:
            self._start_munge()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])

            def idle() -> bool:
                out = self.cmd("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False)
                return out.strip().rstrip("*") == "idle"

            self._until(idle, timeout, f"node {self.node} to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons this object started, by PID (slurmd first)."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            try:
                self.cmd("scancel", "--full", "--signal=KILL", "-u", "root", check=False)
                self.cmd("scancel", "-u", "root", check=False)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and self.cmd("squeue", "-h", "-o", "%i", check=False).strip():
                    time.sleep(0.5)
            except (OSError, subprocess.TimeoutExpired):
                pass  # stop the daemons regardless
        for name in ("slurmd", "slurmctld", "munged"):  # by PID: the Popen objects of start()
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for path in (self.munge_socket, self.munge_socket.with_suffix(".pid"),
                     self.munge_socket.with_suffix(".socket.lock")):
            path.unlink(missing_ok=True)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ use

    def cmd(self, *args: str, check: bool = True, timeout: float = 60, **kwargs) -> str:
        """Run a Slurm command against this cluster; its stdout."""
        proc = subprocess.run(list(args), env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout, **kwargs)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None) -> str:
        """Submit ``sbatch --parsable ARGS``; the job id."""
        out = self.cmd("sbatch", "--parsable", *args, env={**self.env, **(env or {})}, cwd=cwd)
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, BeginTime, Reason, ...); {} if unknown."""
        out = self.cmd("scontrol", "-o", "show", "job", job_id, check=False)
        return parse_fields(out) if out.strip() else {}

    def wait(self, job_id: str, states: set[str] | None = None, timeout: float = 300, poll: float = 0.5,
             on_poll=None) -> dict[str, str]:
        """Poll until the job is in one of ``states`` (default: any finished state); its fields.

        ``on_poll(fields)`` runs at every poll (e.g. to release a requeued job held by BeginTime).
        """
        states = states or FINISHED
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if on_poll is not None:
                on_poll(fields)
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {fields}\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        """The tails of the daemons' logs (for error messages)."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(parts)


if __name__ == "__main__":
    reason = unavailable()
    if reason:
        sys.exit(reason)
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurm-cluster")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with SlurmCluster(root) as c:
        print(f"cluster up: export SLURM_CONF={c.conf}   (Ctrl-C or kill {os.getpid()} stops it)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
