"""Command-line tools over the interceptor's output: ``top``, ``trace``, ``visualize``.

    python -m spmdgt.scripts.top --run-dir runs/job       # live view of a running job
    python -m spmdgt.scripts.trace -s 10 --dir traces/    # capture 10 s of every rank
    python -m spmdgt.scripts.visualize traces/trace_*.log --output timeline.png

The job publishes when started with ``GT_RUN_DIR=runs/job`` (see ``docs/observability.md``).
"""

__all__: list[str] = []
