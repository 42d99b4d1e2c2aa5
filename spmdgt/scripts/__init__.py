"""Command-line tools: over the interceptor's output (``top``, ``trace``, ``visualize``) and
over results files (``plot``: charts from benchmark JSON; ``compare_runs``: two training runs'
losses, step by step, non-zero exit past a tolerance; ``dryrun``: a training step for a world
that is not there).

    python -m spmdgt.scripts.top --run-dir runs/job       # live view of a running job
    python -m spmdgt.scripts.trace -s 10 --dir traces/    # capture 10 s of every rank
    python -m spmdgt.scripts.visualize traces/trace_*.log --output timeline.png

    python -m spmdgt.scripts.plot results/*.json --out docs/charts
    python -m spmdgt.scripts.compare_runs runs/ddp runs/fsdp --atol 1e-5

The job publishes when started with ``GT_RUN_DIR=runs/job`` (see ``docs/observability.md``).
"""

__all__: list[str] = []
