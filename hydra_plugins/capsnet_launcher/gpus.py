"""`hydra/launcher=gpus`: a sweep's jobs run in parallel, one process per job, each pinned to
its own device with CUDA_VISIBLE_DEVICES.

    python train.py -m seed=0,1,2,3 hydra/launcher=gpus                          # every GPU, one job each
    python train.py -m seed=0,1,2,3 hydra/launcher=gpus hydra.launcher.devices=[0,1]

Each job is `python train.py <its overrides> <the sweep's hydra overrides> hydra.run.dir=<its
job dir>` (single-run mode) in a process of its own: TensorFlow takes the devices it sees when
it starts, and one process cannot start it again for another GPU. The job dir is the one the
sequential sweep (Hydra's basic launcher) gives the job, hydra.sweep.dir/hydra.sweep.subdir,
computed here from the same sweep config, so its config, checkpoints, metrics.json and
TensorBoard events land where they would, and the job composes the same config (its
.hydra/hydra.yaml says hydra.mode RUN and hydra.run.dir its dir). Its stdout and stderr go to <job dir>/output.log.

Why not Hydra's joblib launcher (hydra-joblib-launcher): it runs jobs in reused loky worker
processes, with no way to give each job its own CUDA_VISIBLE_DEVICES before that worker has
imported TensorFlow (a worker's second job would keep its first job's GPU), and a job's
sys.exit (train.py's one-line user errors) would take its worker down.

A failed job (non-zero exit status) is reported on stderr in one line as it ends and the
other jobs go on; once all have ended the sweep fails (exit status 2) naming the failed
ones. A job's return value is its metrics.json's test_accuracy, what train.py returns, so a
sweeper that optimises it (Optuna) works as with the basic launcher.

Without GPUs (CI) `devices` are just slots: devices=[0,1] runs two CPU jobs at once, with
CUDA_VISIBLE_DEVICES=0 and 1, which nothing reads.
"""
import copy
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from capsnet.cli import user_environ
from capsnet.errors import ConfigError, Interrupted, SweepJobsFailed

log = logging.getLogger(__name__)

# Hydra overrides that make the parent a sweep with this launcher; a job runs once, in its dir.
# (hydra.sweep.* stay: unused by a single run, they keep its .hydra/hydra.yaml the sweep's.)
_SWEEP_ONLY = ("hydra.mode", "hydra.run.dir", "hydra.job.num", "hydra.job.id", "hydra/launcher",
               "hydra.launcher.", "hydra/sweeper", "hydra.sweeper.")
# Flags of Hydra's command line naming the config, which each job needs as the sweep had them.
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
_POLL_SECONDS = 0.2
_GRACE_SECONDS = 10


def visible_gpus():
    """The devices a job can be pinned to when none are configured: CUDA_VISIBLE_DEVICES's
    entries if it is set, else one per GPU that `nvidia-smi -L` lists, else [] (no GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if listed.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(listed.stdout.splitlines()) if line.startswith("GPU ")]


def check_devices(devices, jobs):
    """(devices as CUDA_VISIBLE_DEVICES strings, jobs at once), or ConfigError in one line.
    devices None = visible_gpus(), or one unpinned slot (None) where there is no GPU."""
    if devices is None:
        devices = visible_gpus() or [None]
    else:
        if isinstance(devices, (str, int)) or not devices:
            raise ConfigError("hydra.launcher.devices must be a non-empty list of devices, e.g. [0,1], "
                              f"got {devices!r}")
        devices = [str(d).strip() for d in devices]
        if any(not d or "," in d for d in devices):
            raise ConfigError(f"hydra.launcher.devices must name one device per entry, got {devices}")
        repeated = sorted({d for d in devices if devices.count(d) > 1})
        if repeated:
            raise ConfigError(f"hydra.launcher.devices lists device {', '.join(repeated)} more than once: "
                              "hydra.launcher.jobs runs several jobs per device")
    if jobs is None:
        jobs = len(devices)
    elif isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"hydra.launcher.jobs must be a positive integer or null, got {jobs!r}")
    return devices, jobs


def config_flags(argv):
    """The config-naming flags of a Hydra command line (`-cn paper`, `--config-dir=x`), in order."""
    flags, take_next = [], False
    for arg in argv:
        if take_next:
            flags.append(arg)
            take_next = False
        elif arg in _CONFIG_FLAGS:
            flags.append(arg)
            take_next = True
        elif arg.split("=", 1)[0] in _CONFIG_FLAGS:
            flags.append(arg)
    return flags


def quoted(value):
    """`value` as a quoted Hydra override value: a job dir may hold `=`, `,` or quotes (a
    hydra.sweep.dir or hydra.sweep.subdir given on the command line, e.g. ${hydra.job.override_dirname}
    with Hydra's own separators: 0_seed=0,lr=0.1)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def last_error_line(path):
    """The line of a job's output that says why it failed: its last `error: ...` line, else its
    last line (a traceback's exception), else ''."""
    try:
        lines = [line.strip() for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or [""])[-1]


class _Job:
    """One sweep job: its index, overrides, config, dir, and once started its process and device."""

    def __init__(self, idx, overrides, config, job_dir):
        self.idx, self.overrides, self.config, self.dir = idx, list(overrides), config, job_dir
        self.process, self.device, self.output, self.started = None, None, None, None
        self.name = f"#{idx}"

    def name_by(self, shared):
        """Name the job by its index and the overrides it does not share with every job."""
        own = [o for o in filter_overrides(self.overrides) if o not in shared]
        self.name = f"#{self.idx} ({' '.join(own)})" if own else f"#{self.idx}"


class _JobReturn(JobReturn):
    """A JobReturn whose failed return value raises without Hydra's "Error executing job with
    overrides: [...]" line on stderr: this launcher has reported the job in its own line."""

    @property
    def return_value(self):
        assert self.status != JobStatus.UNKNOWN, "return_value not yet available"
        if self.status == JobStatus.COMPLETED:
            return self._return_value
        raise self._return_value

    @return_value.setter
    def return_value(self, value):
        self._return_value = value


class GpusLauncher(Launcher):
    def __init__(self, devices=None, jobs=None):
        super().__init__()
        # OmegaConf's ListConfig → a plain list; checked in setup(), where a ConfigError
        # reaches train.py as one line (Hydra would wrap one raised here in its own words).
        self.devices = OmegaConf.to_container(devices) if OmegaConf.is_config(devices) else devices
        self.jobs = jobs
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.devices, self.jobs = check_devices(self.devices, self.jobs)
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        jobs = [self._job(idx, overrides) for idx, overrides in enumerate(job_overrides, initial_job_idx)]
        shared = set.intersection(*[set(job.overrides) for job in jobs]) if len(jobs) > 1 else set()
        for job in jobs:
            job.name_by(shared)
        slots = "no GPU found" if self.devices == [None] else "devices " + ", ".join(self.devices)
        log.info(f"Launching {len(jobs)} jobs, {self.jobs} at a time, {slots}")
        pending, running = list(jobs), []
        try:
            while pending or running:
                while pending and len(running) < self.jobs:
                    running.append(self._start(pending.pop(0), running))
                time.sleep(_POLL_SECONDS)
                for job in [j for j in running if j.process.poll() is not None]:
                    running.remove(job)
                    self._ended(job)
        except KeyboardInterrupt:
            self._stop(running)
            raise Interrupted(f"sweep interrupted: job{'s' if len(running) > 1 else ''} "
                              f"{', '.join(job.name for job in running) or 'none'} stopped, {len(pending)} not "
                              f"started (job dirs in {self.config.hydra.sweep.dir})") from None
        return self._results(jobs)

    @staticmethod
    def _stop(running):
        """After Ctrl-C: the jobs, in this process group, had it from the terminal too; any still
        running after a grace period (a SIGINT sent to this process alone) get it from here.
        Not at once: a second SIGINT would interrupt a job's own handling of the first."""
        deadline = time.monotonic() + _GRACE_SECONDS
        while any(job.process.poll() is None for job in running) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        for job in running:
            if job.process.poll() is None:
                job.process.send_signal(signal.SIGINT)
        for job in running:
            job.process.wait()
            job.output.close()

    def _job(self, idx, overrides):
        """A job's config and dir, as Hydra's basic launcher makes them (its run_job)."""
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = idx
            sweep_config.hydra.job.num = idx
        HydraConfig.instance().set_config(sweep_config)  # for ${hydra:...} in the sweep dir
        job_dir = Path(str(OmegaConf.select(sweep_config, "hydra.sweep.dir"))) / str(
            OmegaConf.select(sweep_config, "hydra.sweep.subdir"))
        return _Job(idx, overrides, sweep_config, job_dir)

    def _command(self, job):
        # As written: `hydra.sweep.subdir=${hydra.job.num}` is text here, not an interpolation.
        written = OmegaConf.to_container(self.config.hydra.overrides.hydra, resolve=False)
        hydra_overrides = [o for o in written if not o.startswith(_SWEEP_ONLY)]
        return [sys.executable, os.path.abspath(sys.argv[0]), *config_flags(sys.argv[1:]), *job.overrides,
                *hydra_overrides, f"hydra.run.dir={quoted(job.dir.resolve())}", f"hydra.job.num={job.idx}",
                f"hydra.job.id={job.idx}"]

    def _start(self, job, running):
        # The least busy device: one job each while jobs <= devices.
        busy = [j.device for j in running]
        job.device = min(self.devices, key=busy.count)
        env = user_environ()
        if job.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = job.device
        if self.jobs > len(self.devices):
            # Jobs sharing a GPU: TensorFlow would otherwise take all its memory for the first.
            env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        job.dir.mkdir(parents=True, exist_ok=True)
        job.output = open(job.dir / "output.log", "w")
        env["CAPSNET_JOB_OUTPUT"] = str(job.dir / "output.log")  # ours in the job's run dir (run_lock.check_ours)
        log.info(f"\t{job.name}" + ("" if job.device is None else f" on device {job.device}"))
        job.started = time.monotonic()
        job.process = subprocess.Popen(self._command(job), env=env, stdout=job.output, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=os.getcwd())
        return job

    def _ended(self, job):
        job.output.close()
        status = job.process.returncode
        seconds = time.monotonic() - job.started
        if status == 0:
            log.info(f"\t#{job.idx} done in {seconds:.0f} s")
            return
        why = last_error_line(job.dir / "output.log")
        where = "" if job.device is None else f" on device {job.device}"
        sys.stderr.write(f"sweep job {job.name}{where} failed with exit status {status}"
                         f"{': ' + why if why else ''} (its output: {job.dir / 'output.log'})\n")
        sys.stderr.flush()

    def _results(self, jobs):
        """JobReturns as the basic launcher gives them, for the sweeper and Hydra's callbacks; a
        failed job's return value raises SweepJobsFailed naming every failed job, as the
        sweeper reads each one once all have ended."""
        failed = [job for job in jobs if job.process.returncode != 0]
        error = None
        if failed:
            error = SweepJobsFailed(f"{len(failed)} of {len(jobs)} sweep jobs failed: "
                                    + ", ".join(f"{job.name} exit status {job.process.returncode}" for job in failed)
                                    + "; each job dir's output.log says why")
        results: List[JobReturn] = []
        for job in jobs:
            task_cfg = copy.deepcopy(job.config)
            with read_write(task_cfg), open_dict(task_cfg):
                del task_cfg["hydra"]
            ret = _JobReturn(overrides=job.overrides, cfg=task_cfg,
                             hydra_cfg=OmegaConf.masked_copy(job.config, "hydra"),
                             working_dir=str(job.dir), task_name=job.config.hydra.job.name)
            if job.process.returncode == 0:
                ret.status, ret.return_value = JobStatus.COMPLETED, self._return_value(job)
            else:
                ret.status, ret._return_value = JobStatus.FAILED, error
            results.append(ret)
        return results

    @staticmethod
    def _return_value(job):
        """What train.py's main returned in the job's process: metrics.json's test_accuracy."""
        try:
            return json.loads((job.dir / "metrics.json").read_text()).get("test_accuracy")
        except (OSError, ValueError):
            return None
