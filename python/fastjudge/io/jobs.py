"""The shared shell of resumable JSONL-to-JSONL jobs (``fastjudge lave``, ``fastjudge vqa-acc``):
skip ids already written, write rows as they come, show progress, and end with a summary, or,
on Ctrl-C, with a note that rerunning resumes."""

from __future__ import annotations

import sys
import time

from .jsonl import ResumableWriter

PROGRESS_EVERY = 256  # rows per progress-bar update: cheap even at 100k+ rows/s


class JsonlJob:
    """``means`` maps numeric output fields to the label of their mean in the summary."""

    def __init__(self, name: str, output: str, means: dict[str, str], progress: bool = True,
                 writer=None):
        """``writer``: where rows go (``done``, ``write``, ``close``, ``truncated_partial_line``);
        default a :class:`ResumableWriter` on ``output``."""
        from tqdm import tqdm

        self.name = name
        self.output = output
        self.means = means
        self.writer = writer if writer is not None else ResumableWriter(output)
        if self.writer.truncated_partial_line:
            print(f"fastjudge: removed a partial last line from {output} (interrupted run)",
                  file=sys.stderr)
        self.already_done = len(self.writer.done)
        self.progress = tqdm(unit="item", disable=not progress, file=sys.stderr, desc=name,
                             mininterval=0.5)
        self.items = self.errors = self._pending = 0
        self.sums = dict.fromkeys(means, 0.0)
        self.start = time.perf_counter()

    @property
    def done(self) -> set[str]:
        return self.writer.done

    def set_total(self, total: int) -> None:
        self.progress.total = total
        self.progress.refresh()

    def emit(self, row: dict) -> None:
        self.writer.write(row)
        self.items += 1
        if row.get("error"):
            self.errors += 1
        else:
            for field in self.sums:
                self.sums[field] += row[field]
        self._pending += 1
        if self._pending >= PROGRESS_EVERY:
            self._flush_progress()

    def _flush_progress(self) -> None:
        self.progress.update(self._pending)
        self._pending = 0

    def _close(self) -> None:
        self._flush_progress()
        self.progress.close()
        self.writer.close()

    def interrupted(self) -> int:
        self._close()
        print(f"\nfastjudge: interrupted after {self.items} items; rerun the same command to "
              "resume.", file=sys.stderr)
        return 130

    def finish(self) -> int:
        self._close()
        elapsed = time.perf_counter() - self.start
        scored = self.items - self.errors
        means = ", ".join(f"{label} {self.sums[f] / scored:.4f}" if scored else f"{label} n/a"
                          for f, label in self.means.items())
        print(f"fastjudge {self.name}: {self.items} items ({self.already_done} already done), "
              f"{self.errors} errors, {means}, {self.items / max(elapsed, 1e-9):.1f} items/s "
              f"-> {self.output}", file=sys.stderr)
        return 0
