"""Record what a block of code asks torch to create, to check that no rank builds a whole
tensor when its part would do."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode


class CreationShapes(TorchFunctionMode):
    """The shape of every call to ``funcs`` made inside it (calls on the meta device skipped).

    ``with CreationShapes(torch.zeros) as shapes: ...`` then ``shapes == [(2, 3), ...]``.
    """

    def __init__(self, *funcs) -> None:
        super().__init__()
        self.funcs = funcs
        self.shapes: list[tuple[int, ...]] = []

    def __enter__(self) -> list[tuple[int, ...]]:
        super().__enter__()
        return self.shapes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.funcs and str(kwargs.get("device")) != "meta":
            size = args[0]
            self.shapes.append(tuple(size) if isinstance(size, (tuple, list)) else (size,))
        return func(*args, **kwargs)
