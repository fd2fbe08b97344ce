"""Process measurements shared by the benchmark scripts, from /proc and getrusage.

Torch-free on purpose: the drivers import it without importing torch, so they put no
floor under their workers' figures. (`longstraw.measure` has the RSS helpers the demo uses,
but importing `longstraw` imports torch.)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A size field of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile) in bytes; -1 if
    the process or the field is not there."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def peak_rss() -> int:
    """This process's peak RSS (ru_maxrss, KiB on Linux), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def own_cpu_s() -> float:
    """CPU-seconds (user + system) this process has used."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.processor() or "")
    except OSError:
        return platform.processor() or ""


def mem_total() -> int | None:
    """Physical memory in bytes (/proc/meminfo), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            return int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def code_info(repo: str, *, short: bool = False) -> dict:
    """Which longstraw was measured: the git revision of `repo` (None outside git), and
    whether its longstraw/ had uncommitted changes (the numbers then belong to the
    working tree, not the commit)."""
    def git(*a):
        try:
            return subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True, timeout=30,
                                  check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    rev = git("rev-parse", *(["--short"] if short else []), "HEAD") or None
    return {"git_rev": rev, "longstraw_dirty": bool(git("status", "--porcelain", "--", "longstraw"))}


def worker_row(cmd: list[str], **kwargs) -> dict:
    """Run one benchmark worker (`cmd`, a fresh process) and return the JSON object it
    printed as its last stdout line; a worker that fails raises with its stderr's tail.
    `kwargs` go to subprocess.run (cwd, env)."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-20:])} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine_row(repo: str) -> dict:
    """What every benchmark row records about where and when it ran: the load average,
    CPU model, memory, time and the measured code's revision (`code_info`)."""
    return dict(load_avg_1m=os.getloadavg()[0], cpu=cpu_model(), mem_total=mem_total(),
                when=time.strftime("%Y-%m-%dT%H:%M:%S"), **code_info(repo, short=True))
