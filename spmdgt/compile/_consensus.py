"""Agreeing on a fallback: if any rank's compile failed, every rank falls back.

Inductor may order a graph's collectives differently from eager, so a rank running a function
compiled while another runs it eagerly can pair the wrong collectives. Every rank compiles a hot
function at the same call (it turned hot at the same op everywhere), so each frame compile is
an agreement point on the gloo side group of ``spmdgt.runtime._agree``: first the usual
fingerprint exchange (the same compile on every rank, else ``RankDivergenceError``), then one
int64 MAX all-reduce of "my compile failed". Decided from exchanged data only.
"""

from __future__ import annotations

import sys

__all__ = ["any_rank"]


def any_rank(failed: bool, what: str, site: str) -> bool:
    """Whether ``failed`` holds on any rank (this rank's value in a world of one or before
    ``gt.init()``). A collective on the side group: every rank calls it at the same compile."""
    agree = sys.modules.get("spmdgt.runtime._agree")
    group = getattr(agree, "_group", None) if agree is not None else None
    if group is None or getattr(agree, "_broken", False):
        return failed
    import torch
    import torch.distributed as dist

    agree.agree(what, site=site)
    with torch._C.DisableTorchFunction():  # the agreement's own ops: no hook runs a region here
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
