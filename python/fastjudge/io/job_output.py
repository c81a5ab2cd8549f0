"""Where a file job's rows go (:class:`JobOutput`: the resumable writer, the progress bar, the
summary), and the job's exit statuses (docs/jobs.md)."""

from __future__ import annotations

import sys
import time
from collections import Counter

from .jsonl import ResumableWriter

PROGRESS_EVERY = 256  # rows per progress-bar update: cheap even at 100k+ rows/s
SHOWN_ERRORS = 3  # item errors quoted when --max-errors stops a job

# exit statuses of a job (docs/jobs.md); 2 is the command line's for a bad argument or path
EXIT_OK = 0  # every item scored
EXIT_ITEM_ERRORS = 3  # finished; some rows are item errors
EXIT_TOO_MANY_ERRORS = 4  # stopped: the item errors passed --max-errors
EXIT_SYSTEM_FAILURE = 75  # stopped by a system failure; rerunning resumes (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C; rerunning resumes


class TooManyErrors(Exception):
    """The item errors passed the job's ``max_errors``."""


class JobOutput:
    """Where a job's rows go: the resumable writer, the progress bar and the summary.
    ``means`` maps numeric result fields to the label of their mean in the summary."""

    def __init__(self, name: str, output: str, means: dict[str, str], progress: bool = True,
                 writer=None, max_errors: int | None = None):
        """``writer``: where rows go (``done``: rows per id already there, ``notes``: repairs
        made to the output, ``write``, ``close``); default a :class:`ResumableWriter` on
        ``output``. ``max_errors``: the most item errors the job takes (``emit`` raises
        :class:`TooManyErrors` past it)."""
        from tqdm import tqdm

        self.name = name
        self.output = output
        self.means = means
        self.writer = writer if writer is not None else ResumableWriter(output)
        for note in self.writer.notes:
            print(f"fastjudge: {note}", file=sys.stderr)
        self.already_done = sum(self.writer.done.values())
        self.progress = tqdm(unit="item", disable=not progress, file=sys.stderr, desc=name,
                             mininterval=0.5)
        self.items = self.errors = self._pending = 0
        self.max_errors = max_errors
        self.first_errors: list[str] = []
        self.sums = dict.fromkeys(means, 0.0)
        self.start = time.perf_counter()

    @property
    def done(self) -> Counter:
        return self.writer.done

    def set_total(self, total: int) -> None:
        self.progress.total = total
        self.progress.refresh()

    def emit(self, row: dict) -> None:
        self.writer.write(row)
        self.items += 1
        if row.get("error"):
            self.errors += 1
            if len(self.first_errors) < SHOWN_ERRORS:
                self.first_errors.append(f"{row.get('id')}: {row['error']}")
        else:
            for field in self.sums:
                self.sums[field] += row[field]
        self._pending += 1
        if self._pending >= PROGRESS_EVERY:
            self._flush_progress()
        if self.max_errors is not None and self.errors > self.max_errors:
            raise TooManyErrors()

    def _flush_progress(self) -> None:
        self.progress.update(self._pending)
        self._pending = 0

    def _close(self) -> None:
        self._flush_progress()
        self.progress.close()
        self.writer.close()

    @property
    def _resume(self) -> str:
        return "" if getattr(self.writer, "stream", False) else "; rerun the same command to resume"

    def interrupted(self) -> int:
        self._close()
        print(f"\nfastjudge: interrupted after {self.items} items{self._resume}.", file=sys.stderr)
        return EXIT_INTERRUPTED

    def stopped(self, failure: BaseException) -> int:
        """A system failure the retries did not cure: the rows so far are kept, the rest is
        left to a rerun."""
        self.summary()
        print(f"fastjudge {self.name}: error: stopped by a system failure ({failure}); no "
              f"row was written for the unfinished items{self._resume} (exit "
              f"{EXIT_SYSTEM_FAILURE})", file=sys.stderr)
        return EXIT_SYSTEM_FAILURE

    def too_many_errors(self) -> int:
        self.summary()
        reasons = "".join(f"\n  {e}" for e in self.first_errors)
        print(f"fastjudge {self.name}: error: stopped after {self.errors} item errors, more than "
              f"--max-errors allows ({self.max_errors}); the first:{reasons}", file=sys.stderr)
        return EXIT_TOO_MANY_ERRORS

    def finish(self) -> int:
        """The summary; :data:`EXIT_OK`, or :data:`EXIT_ITEM_ERRORS` when a row is an item
        error."""
        self.summary()
        return EXIT_ITEM_ERRORS if self.errors else EXIT_OK

    def summary(self) -> None:
        self._close()
        elapsed = time.perf_counter() - self.start
        scored = self.items - self.errors
        means = ", ".join(f"{label} {self.sums[f] / scored:.4f}" if scored else f"{label} n/a"
                          for f, label in self.means.items())
        print(f"fastjudge {self.name}: {self.items} items ({self.already_done} already done), "
              f"{self.errors} errors, {means}, {self.items / max(elapsed, 1e-9):.1f} items/s "
              f"-> {self.output}", file=sys.stderr)
