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


# the flags that decide which kernels run and how fast: the ISA variants, native 16-bit products, AMX
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_name():
    """The CPU's model name, with its family and model numbers and the ISA_FLAGS it has: a virtual
    machine often names only the vendor ("AMD EPYC"), and one name covers CPUs of several ISAs."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key:
                    break  # the first processor's block is enough
                fields.setdefault(key, value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        flags = set(fields.get("flags", "").split())
        have = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS)
        name += f" (family {fields['cpu family']} model {fields['model']}; {have})"
    return name


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
        if not busy(peak, self.cpus):
            return None
        return (f"warning: the machine was busy while the rows were timed (1-minute load average up to {peak:.1f} on "
                f"{self.cpus} CPUs; this run alone accounts for about {self.cpus}): other work shared the cores, so "
                "step times and their ratios are unreliable; rerun on an idle machine")


def busy(peak, cpus=None):
    """Whether a peak 1-minute load average (None or "": not sampled) shows other work on the CPUs."""
    if peak in (None, ""):
        return False
    return float(peak) > (cpus or os.cpu_count() or 1) + 0.5


def busy_note(peak, cpus=None):
    """The plots' mark of a busy run (LoadWatch.warning's, short), or None when the machine was not busy."""
    if not busy(peak, cpus):
        return None
    return (f"UNRELIABLE TIMES: the machine was busy (load average up to {float(peak):.1f} on {cpus or os.cpu_count()} "
            "CPUs); rerun on an idle machine")
