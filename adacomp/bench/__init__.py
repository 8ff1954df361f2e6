"""The benchmarks: one module per benchmark, each with ``main(argv) -> int``, run as
``adacomp bench NAME [args]`` (or ``python -m adacomp.bench.NAME``), also under a launcher
(``adacomp run -np 2 -- adacomp bench NAME``, ``torchrun -m adacomp.bench.NAME``, ``mpirun`` /
``horovodrun ... adacomp bench NAME``). ``adacomp bench`` lists them with their launch lines.

Shared pieces: :mod:`adacomp.bench.common` (process group, self-launch, results files),
:func:`adacomp.tools.stepclock.time_steps` (the one step-timing loop) and the model zoo in
:mod:`adacomp.models`. Results files default to ``docs/results/`` under the current directory.
"""
