"""Where a benchmark run writes, and what it says about the machine it timed on.

Every run gets a folder of its own (never another run's), the CPU and the ISA the C++ kernels run
are printed with the figures, and a load-average watch warns when other work shared the CPUs while
the rows were timed.
"""

import datetime
import os
import platform
from pathlib import Path

RUNS_DIR = "bench-runs"


def run_dir(out, name):
    """`out` when given, else ./bench-runs/<UTC time>-<name> (with -2, -3 ... if taken); created."""
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path.cwd() / RUNS_DIR / f"{stamp}-{name}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            found = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        found = ""
    return found or platform.processor() or platform.machine() or "unknown CPU"


def kernel_isa():
    """The instruction set the C++ attention kernels picked on this CPU (avx512bf16, avx512, avx2 or generic)."""
    from ..backend import _C

    return _C.attention_isa()


class LoadWatch:
    """Samples the 1-minute load average while rows are timed. Load above the CPU count means runnable
    threads queued for a core: with this run's own threads counted, anything beyond means other work
    took CPU time from the timed steps."""

    def __init__(self):
        self.samples = []
        self.cpus = os.cpu_count() or 1

    def sample(self):
        try:
            self.samples.append(os.getloadavg()[0])
        except (AttributeError, OSError):  # no load average on this platform
            pass

    @property
    def peak(self):
        return max(self.samples) if self.samples else None

    def warning(self):
        """A warning line when the machine was busier than this run alone makes it, else None."""
        peak = self.peak
        if peak is None or peak <= self.cpus + 0.5:
            return None
        return (f"warning: the machine was busy while the rows were timed (1-minute load average up to {peak:.1f} on "
                f"{self.cpus} CPUs; this run alone accounts for about {self.cpus}): other work shared the cores, so "
                "step times and their ratios are unreliable; rerun on an idle machine")
