"""mergefs's benchmarks: one tool, ``python -m bench SECTION [options]`` from the repository
root (``python -m bench --help`` lists the sections; ``bench/sections/<section>.py``).

Timing lives here, never in the test suite (``tests/test_bench_smoke.py`` only checks that
the tool runs). The installed package ``mergefs`` never imports this one.
"""
