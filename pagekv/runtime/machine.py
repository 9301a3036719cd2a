"""The machine a timing ran on, to write beside it: its CPU, the flags that decide which
dtypes run fast there, its cores and its load (other work on the cores slows every
figure). Read by the benchmarks and by the experiments that time a run."""

from __future__ import annotations

import os

#: The CPU flags that decide which dtypes run fast (named beside every CPU timing).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_facts() -> dict:
    """The CPU the timings ran on: its model name, the `CPU_FLAGS` it has, its cores and
    the load average when written."""
    name, flags = "unknown", set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {
        "model": name,
        "flags": [f for f in CPU_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }
