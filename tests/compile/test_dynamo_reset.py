"""``torch._dynamo.reset()`` clears every compile callback, spmdgt's included.

While torch traces, ``gt.Tensor`` must behave as the DTensor it is (``tensor/_dynamo.py``):
its hook disabled, DTensor's implicit replication on. Those switches hang on dynamo's
compile-start/end callbacks, which a reset (a notebook's, a test fixture's) clears. Without
them dynamo traced spmdgt's own hook, and a 2-D hot function's every compiled loss came out
doubled (``test_hot_functions_mesh2d_dist`` resets too).
"""

from __future__ import annotations

import torch


def test_gt_tensor_is_dtensor_while_torch_traces_after_every_reset():
    from spmdgt.tensor._tensor import Tensor

    ours = Tensor.__dict__["__torch_function__"]
    seen = []

    def backend(gm, example_inputs):  # runs between the callbacks: what a trace sees
        hook = Tensor.__dict__["__torch_function__"]
        seen.append((hook is torch._C._disabled_torch_function_impl, hook is ours))
        seen.append(torch._C._get_dtensor_allow_implicit_replication())
        return gm.forward

    try:
        for scale in (2.0, 3.0):
            torch._dynamo.reset()
            out = torch.compile(lambda a, s=scale: a * s + 1, backend=backend)(torch.ones(3))
            assert out.tolist() == [scale + 1] * 3
    finally:
        torch._dynamo.reset()
    assert seen == [(True, False), True] * 2, seen
    assert Tensor.__dict__["__torch_function__"] is ours  # restored when the compile ended
    assert not torch._C._get_dtensor_allow_implicit_replication()
