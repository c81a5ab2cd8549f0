"""``fastjudge bench``: a judge's speed on this machine, measured on fastjudge alone.

``items`` makes the items (the bundled sample cycled, or synthetic ones from a seed; pictures
drawn with Pillow), ``meter`` times and counts the batches a backend runs and reads peak memory
and the device's name, ``command`` is the subcommand: its options, the runs, the table and the
JSON. The side-by-side comparisons with other implementations are the scripts in benchmarks/.
"""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    from .command import add_bench_parser as add

    add(sub)


def run_bench(args) -> int:
    from .command import run_bench as run

    return run(args)
