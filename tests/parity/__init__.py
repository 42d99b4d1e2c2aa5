"""OpInfo-driven parity sweep: every op on every placement equals one process, or raises on
every rank. ``python -m tests.parity --help``; the ledger is ``tests/parity/ledger.csv``."""
