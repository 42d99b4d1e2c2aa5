"""Compile a small C file once per machine and load it with ``ctypes``: no torch headers, no ninja.

Used where a few lines of C do what Python cannot do cheaply (the generator skip,
``tensor/csrc``; the agreement's shared-memory exchange, ``runtime/csrc``). The file is built
with the system C compiler (``$CC``, ``cc`` or ``gcc``; ~0.2 s) into the build cache
(``env.build_root()``), one file per source, compiler and machine, written atomically so that
ranks that start together never load half a file. Every caller has a pure-Python or torch
fallback for a machine without a compiler: what it builds is never required.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess

from spmdgt._core import env as _env

__all__ = ["load"]


def load(src: str) -> ctypes.CDLL:
    """The library built from the C file ``src``, built now unless this source, compiler and
    machine built it before. Raises (``RuntimeError``, ``OSError``,
    ``subprocess.CalledProcessError``) where it cannot be built or loaded."""
    with open(src, "rb") as f:
        source = f.read()
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]
    if cc[0] is None:
        raise RuntimeError("no C compiler ($CC, cc or gcc)")
    key = hashlib.sha256(b"\0".join([source, " ".join(cc).encode(), platform.machine().encode()]))
    stem = os.path.splitext(os.path.basename(src))[0]
    so = os.path.join(_env.build_root(), f"spmdgt_{stem}_{key.hexdigest()[:16]}.so")
    if not os.path.exists(so):
        os.makedirs(os.path.dirname(so), exist_ok=True)
        tmp = f"{so}.{os.getpid()}.tmp"
        cmd = [*cc, "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", tmp]
        try:
            subprocess.run(cmd, input=source, check=True, capture_output=True, timeout=120)
            os.replace(tmp, so)  # atomic: a rank never loads another's half-written file
        finally:  # a failed or timed-out build leaves no partial file in the cache
            if os.path.exists(tmp):
                os.remove(tmp)
    return ctypes.CDLL(so)
