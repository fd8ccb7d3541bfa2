#!/usr/bin/python3
"""scripts/slurm/ under a real Slurm: munge, slurmctld and slurmd started on this host for the
test (as root; Debian's slurm-wlm and munge), one node, the real sbatch scripts submitted.
Usage: slurm_tests.py BUILD_DIR
Checks, in one cluster (its daemons are stopped at the end, whatever happened):
  1. requeue: a training job given the signal Slurm sends before a time limit (the script's
     --signal=B:USR1: SIGUSR1 to the batch shell) checkpoints, exits 75 and is requeued; it then
     resumes, runs to its end, and its metrics hold the losses of the same run straight through
     under srun, for every step;
  2. the time limit: a job with a 2-minute limit is signalled by Slurm's timer before the limit,
     checkpoints and requeues itself; then scancel while it runs again leaves a checkpoint that a
     later run resumes from;
  3. gradcheck.sbatch passes.
Exit status: 0 pass, 1 fail (what was expected and the job's output), 77 skip (not root, or no
Slurm installed).
"""
import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SKIP = 77
REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "slurm"


class Failure(Exception):
    pass


def fail(what, output=""):
    raise Failure(what + (f"\n----- output -----\n{output}----- end -----" if output else ""))


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Cluster:
    """A one-node Slurm in `root`, its own munge key and socket, on free ports."""

    def __init__(self, root):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.env = dict(os.environ, SLURM_CONF=str(self.root / "slurm.conf"))
        for var in [v for v in self.env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
            del self.env[var]  # a test run inside a Slurm job must not talk to that job
        self.env["OMP_WAIT_POLICY"] = "passive"  # as the sbatch scripts set it (train.sbatch)
        self.munge_pid = None

    def run(self, *argv, check=True, timeout=60):
        try:
            r = subprocess.run([str(a) for a in argv], env=self.env, cwd=self.root,
                               timeout=timeout, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
            fail(f"{' '.join(map(str, argv))} still ran after {timeout} s", (out or "") +
                 self.logs())
        if check and r.returncode != 0:
            fail(f"{' '.join(map(str, argv))} exited with {r.returncode}", r.stdout + self.logs())
        return r.stdout

    def start(self):
        r = self.root
        for d in ("munge", "state", "spool", "log", "work"):
            (r / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = r / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = r / "munge" / "socket"
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={sock}",
                        f"--pid-file={r / 'munge' / 'pid'}", f"--log-file={r / 'munge' / 'log'}",
                        f"--seed-file={r / 'munge' / 'seed'}"], check=True)
        self.munge_pid = int((r / "munge" / "pid").read_text())
        cpus = os.cpu_count() or 2
        (r / "slurm.conf").write_text(f"""\
ClusterName=tessera-test
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=30
MinJobAge=3600
NodeName={self.host} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        self.run("slurmctld", "-i")
        self.run("slurmd")
        deadline = time.monotonic() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%T", check=False):
            if time.monotonic() > deadline:
                fail("the test cluster's node never became idle", self.logs())
            time.sleep(0.5)

    def stop(self):
        self.run("scontrol", "shutdown", check=False)
        for pidfile in ("slurmctld.pid", "slurmd.pid"):
            self.kill_pidfile(self.root / pidfile)
        if self.munge_pid:
            self.kill_pid(self.munge_pid)

    def kill_pidfile(self, path):
        try:
            self.kill_pid(int(path.read_text()))
        except (OSError, ValueError):
            pass

    @staticmethod
    def kill_pid(pid):
        deadline = time.monotonic() + 10
        try:
            os.kill(pid, 15)
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.1)
            os.kill(pid, 9)
        except ProcessLookupError:
            pass

    def logs(self):
        out = ""
        for f in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / f
            if p.exists():
                out += f"--- {f} (last lines) ---\n" + "".join(p.read_text().splitlines(True)[-15:])
        return out

    def submit(self, *argv, env=None):
        run_env = dict(self.env, **(env or {}))
        r = subprocess.run(["sbatch", "--parsable", *map(str, argv)], env=run_env,
                           cwd=self.root / "work", stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60)
        if r.returncode != 0:
            fail("sbatch refused the job", r.stdout)
        return r.stdout.strip().split(";")[0]

    def job(self, job_id):
        text = self.run("scontrol", "show", "job", job_id, "-o", check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def output(self, name):
        p = self.root / "work" / name
        return p.read_text(errors="replace") if p.exists() else ""

    def wait(self, job_id, done, what, seconds, out_name):
        """Polls the job until done(job fields, output) holds."""
        deadline = time.monotonic() + seconds
        while True:
            fields, out = self.job(job_id), self.output(out_name)
            if done(fields, out):
                return fields, out
            if time.monotonic() > deadline:
                fail(f"job {job_id}: expected {what} within {seconds} s; it is "
                     f"{fields.get('JobState')} ({fields.get('Reason')}), "
                     f"{fields.get('Restarts')} restart(s)", out + self.logs())
            time.sleep(0.5)

    def wait_output(self, out_name, text, what, seconds):
        """Polls a job's output file alone until it holds text: slurmctld can take as long to
        answer `scontrol show job` as a short job runs (9 s seen while a job started on 2 busy
        cores), so a wait that asks it first can see a job's early lines only after its end."""
        deadline = time.monotonic() + seconds
        while text not in self.output(out_name):
            if time.monotonic() > deadline:
                fail(f"expected {what} within {seconds} s", self.output(out_name) + self.logs())
            time.sleep(0.2)

    def release(self, job_id, minutes=10):
        """A requeued job waits before it may start again (its BeginTime, two minutes or so):
        let it start now, with room to finish, once the step daemons of its last start are gone
        (srun's PMI2 otherwise meets the old step's and fails at the end of the new one), and not
        within the second of the requeue: slurmd revokes the last start's credential then and
        refuses a start of the same job whose credential is no newer ("Killing non-startable
        batch JobId=3: Job credential revoked", seen once when the start came 0.7 s after)."""
        time.sleep(1.5)
        deadline = time.monotonic() + 60
        while step_daemons_running(job_id):
            if time.monotonic() > deadline:
                fail(f"job {job_id}: the steps of its last start still run 60 s after the requeue",
                     self.logs())
            time.sleep(0.2)
        self.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}", "StartTime=now")


def find_process(pattern):
    """The PID of a process whose command line matches the regular expression, or None: pgrep -f's
    question, answered from /proc (a fresh machine may lack procps)."""
    pattern = re.compile(pattern)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if pattern.search(cmdline):
            return int(pid)
    return None


def step_daemons_running(job_id):
    """Whether a `slurmstepd: [<job>.<step>]` process runs."""
    return find_process(rf"slurmstepd: \[{job_id}\.") is not None


def batch_shell(job_id):
    """The PID of a job's batch shell, the process that runs
    `<SlurmdSpoolDir>/job<id>/slurm_script`."""
    return find_process(rf"/job0*{job_id}/slurm_script(\s|$)")


def losses(path):
    with open(path, newline="") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"}


def ended(state):
    return lambda fields, out: fields.get("JobState") == state


SMALL = ["--model", "unet-small", "--height", "32", "--width", "32", "--samples", "16",
         "--val-samples", "0", "--batch", "4", "--progress", "plain"]


def check_requeue(c, exe):
    # Long enough that the stop, handed on by train.sbatch no sooner than 2 s after the launch and
    # again every 10 s, comes well before the end: CI's job ran all of 600 steps (8 ms each)
    # before it did (2026-11-29); then a 3000-step job (4 ms a step here) ended at 13 s with its
    # first USR1 lost by srun and the repeat not yet sent (session 36). 6000 steps take 25-50 s
    # on 2 cores: the repeat at 13 s comes in time.
    steps = 6000
    args = [*SMALL, "--steps", steps, "--log-every", "1"]
    straight = c.run("srun", "-n", "2", "--mpi=pmi2", exe, "train", *args, "--metrics",
                     c.root / "work" / "straight.csv", timeout=300)
    if f"step {steps}/{steps}" not in straight:
        fail("the straight run under srun did not finish", straight)
    job = c.submit("-n", "2", "--job-name", "requeue", "-o", "requeue.out",
                   SCRIPTS / "train.sbatch", *args, "--metrics", "requeue.csv",
                   env={"TESSERA": str(exe)})
    c.wait_output("requeue.out", "step 20/", "training to begin", 120)
    # What --signal=B:USR1@T makes slurmd do at the time limit, now: SIGUSR1 to the batch shell.
    # Sent from here, not with `scancel --batch --signal=USR1`: slurmctld, slow to answer while the
    # job starts, delivered that one after the 10-second run had ended (a CI failure); the
    # time-limit check below has Slurm's own timer send it.
    shell = batch_shell(job)
    if shell is None:
        fail(f"job {job}: no batch shell runs, though its output shows training",
             c.output("requeue.out"))
    os.kill(shell, signal.SIGUSR1)
    fields, out = c.wait(job, lambda f, out: int(f.get("Restarts", 0)) >= 1 or
                         f.get("JobState") in ("COMPLETED", "FAILED"), "a requeue", 120,
                         "requeue.out")
    if int(fields.get("Restarts", 0)) < 1:
        fail(f"job {job}: expected a requeue; it ended {fields.get('JobState')} instead", out)
    c.release(job)
    fields, out = c.wait(job, ended("COMPLETED"), "the resumed job to complete", 300,
                         "requeue.out")
    m = re.search(rf"stopped by SIGUSR1 after step (\d+) of {steps}: checkpoint \S+ written", out)
    if m is None or "requeueing job" not in out:
        fail("expected the stop message and the requeue", out)
    k = int(m.group(1))
    for part in ["train.sbatch: job", "(start 2)", f"checkpoint-{k}.h5 (step {k})",
                 f"step {steps}/{steps}", "done:"]:
        if part not in out:
            fail(f"expected {part!r} in the requeued job's output", out)
    a, b = losses(c.root / "work" / "straight.csv"), losses(c.root / "work" / "requeue.csv")
    if sorted(b) != list(range(1, steps + 1)):
        fail(f"expected the requeued job's metrics to log steps 1..{steps} once each", out)
    for step in range(1, steps + 1):
        if a[step] != b[step]:
            fail(f"step {step}: loss {b[step]!r} after the requeue, {a[step]!r} straight", out)
    print(f"requeue: stopped after step {k}, requeued, resumed, {steps} losses equal")


def check_time_limit_and_scancel(c, exe):
    # Long enough never to end within the limit: Slurm's timer must stop it.
    args = [*SMALL, "--steps", 10**7, "--log-every", "10"]
    # slurmctld looks at time limits and their warning signals every 30 s; on 2 busy cores one
    # look came late enough that a 1-minute limit with USR1@50 timed out unsignalled: a 2-minute
    # limit with USR1@100 leaves 100 s for a look between the warning and the limit.
    job = c.submit("-n", "2", "--job-name", "limit", "-o", "limit.out", "--time=2",
                   "--signal=B:USR1@100", SCRIPTS / "train.sbatch", *args,
                   env={"TESSERA": str(exe), "CHECKPOINT_DIR": "limit-ckpt"})
    fields, out = c.wait(job, lambda f, out: int(f.get("Restarts", 0)) >= 1,
                         "Slurm's USR1 before the 2-minute limit and a requeue", 210, "limit.out")
    m = re.search(r"stopped by SIGUSR1 after step (\d+) of", out)
    if m is None or "USR1 received" not in out or "requeueing job" not in out:
        fail("expected the time-limit signal, a checkpoint and the requeue", out)
    first = int(m.group(1))
    c.release(job)
    def trained_on(fields, out):
        second = out.split("(start 2)", 1)
        return len(second) == 2 and any(
            int(n) >= first + 20 for n in re.findall(r"^step (\d+)/", second[1], re.M))
    c.wait(job, trained_on, "the resumed run to train on", 120, "limit.out")
    c.run("scancel", job)
    fields, out = c.wait(job, ended("CANCELLED"), "the cancelled job to end", 120, "limit.out")
    # scancel's SIGTERM reaches the ranks directly and through the batch shell (passed on as
    # SIGUSR1 to srun): whichever comes first names the stop.
    m = re.search(r"stopped by SIG(?:TERM|USR1) after step (\d+) of", out.split("(start 2)")[-1])
    if m is None:
        fail("expected scancel to stop tessera train with a checkpoint", out)
    last = int(m.group(1))
    if last <= first:
        fail(f"expected the second start to get past step {first}", out)
    later = c.run("srun", "-n", "2", "--mpi=pmi2", exe, "train", *SMALL, "--steps", last + 2,
                  "--checkpoint-dir", c.root / "work" / "limit-ckpt", "--resume", timeout=300)
    if f"checkpoint-{last}.h5 (step {last})" not in later or "done:" not in later:
        fail(f"expected the checkpoint of step {last} left by scancel to resume", later)
    print(f"time limit: signalled after step {first}; scancel after step {last}; resumed")


def check_gradcheck(c, exe):
    job = c.submit("-n", "2", "--ntasks-per-node=2", "--job-name", "gradcheck",
                   "-o", "gradcheck.out",
                   SCRIPTS / "gradcheck.sbatch", "--model", "unet-small", "--height", "32",
                   "--width", "32", env={"TESSERA": str(exe)})
    fields, out = c.wait(job, lambda f, o: f.get("JobState") in ("COMPLETED", "FAILED"),
                         "gradcheck to end", 180, "gradcheck.out")
    if fields.get("JobState") != "COMPLETED" or "PASS" not in out:
        fail("expected gradcheck.sbatch to pass", out)
    print("gradcheck.sbatch: passed")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    exe = Path(sys.argv[1]).resolve() / "tessera"
    if os.geteuid() != 0:
        print("SKIP: the test cluster's daemons run as root; this user is not")
        return SKIP
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch", "srun")
               if shutil.which(p) is None]
    if missing:
        print(f"SKIP: not installed: {', '.join(missing)} (Debian: slurm-wlm munge)")
        return SKIP
    root = tempfile.mkdtemp(prefix="tessera-slurm-")
    os.chmod(root, 0o755)
    c = Cluster(root)
    try:
        c.start()
        check_requeue(c, exe)
        check_time_limit_and_scancel(c, exe)
        check_gradcheck(c, exe)
    except Failure as e:
        print(f"FAIL: {e}")
        return 1
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
