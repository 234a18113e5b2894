"""A few training steps under torch.profiler, written as a plain-text table: where a step's time goes (operators
and kernels by self time on the device, and on the host), for a loop that has no benchmark of its own."""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfile:
    """`start()` before the first profiled step, `stop(path)` after the last: writes `path`."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile  # deferred: only a profiled run pays the import

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.device, self.profiler = device, profile(activities=activities)

    def start(self) -> None:
        self.profiler.__enter__()

    def stop(self, path: Path, steps: int, rows: int = 40) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profiler.__exit__(None, None, None)
        table = self.profiler.key_averages()
        by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        text = f"{steps} optimizer steps, sorted by {by}\n\n" + table.table(sort_by=by, row_limit=rows)
        if by != "self_cpu_time_total":  # on the CPU the first table is already by host time
            text += "\n\nby host time\n\n" + table.table(sort_by="self_cpu_time_total", row_limit=rows)
        path.write_text(text + "\n")
