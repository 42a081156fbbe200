"""Stand-ins for an accelerator on a machine without one: the two rules CUDA enforces that CPU does not.

- `SameDeviceMode`: run code on ``meta`` tensors (the stand-in device) and fail as CUDA would where an op
  mixes devices. CPU accepts nothing else, so CPU-only runs never see such a bug; ``meta`` silently
  accepts ``cpu_scalar += meta_tensor``, which CUDA refuses.
- `OnDevice`: a CPU tensor standing for one in device memory. Every read of its value on the host
  (``.item()``, ``.tolist()``, ``float()``, ``.cpu()``, ``.to("cpu")``...) is counted: each would be a
  host-device synchronization on CUDA. ``.cpu()`` returns an ordinary tensor (a host copy), so code that
  copies to the host once and reads the copy afterwards is counted once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Copies move data between devices on purpose; every other op must find its operands on one device.
_COPIES = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "to"}


class SameDeviceMode(TorchDispatchMode):
    """Refuse what CUDA refuses: an op whose tensors are on more than one device.

    One exception, as in CUDA's elementwise kernels: a CPU scalar (0-dim) tensor may be *read* by a
    kernel on another device, passed as a tensor argument of its own. It may not be written (``cpu +=
    device`` fails on CUDA) nor be part of a tensor list (``torch.stack``/``cat`` fail on CUDA too).
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ not in _COPIES:
            devices = {t.device for t in _operands(func, args, kwargs)}
            if len(devices) > 1:
                raise RuntimeError(
                    f"{func}: expected all tensors to be on the same device, found {sorted(map(str, devices))} "
                    "(CUDA refuses this; CPU-only runs never see it)"
                )
        return func(*args, **kwargs)


def _operands(func: Any, args: tuple, kwargs: dict) -> Iterator[Tensor]:
    schema = func._schema.arguments
    for i, value in enumerate(args):
        argument = schema[i] if i < len(schema) else None
        yield from _checked(value, argument)
    by_name = {a.name: a for a in schema}
    for name, value in kwargs.items():
        yield from _checked(value, by_name.get(name))


def _checked(value: Any, argument: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        written = argument is not None and argument.alias_info is not None and argument.alias_info.is_write
        if value.device.type == "cpu" and value.dim() == 0 and not written:
            return  # a host scalar read by a device kernel: allowed
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (t for t in tree_flatten(value)[0] if isinstance(t, Tensor))


class OnDevice(Tensor):
    """A CPU tensor that stands for one in accelerator memory; counts the host reads of its values.

    Make one with ``OnDevice.of(tensor)``; results of ops on it stay `OnDevice` (they would be on the
    device too). Read the count with `OnDevice.reads` inside `OnDevice.counting()`.
    """

    reads = 0

    @staticmethod
    def of(tensor: Tensor) -> OnDevice:
        """``tensor`` as an `OnDevice` (sharing its data)."""
        return tensor.as_subclass(OnDevice)  # type: ignore[return-value]

    @classmethod
    @contextmanager
    def counting(cls) -> Iterator[type[OnDevice]]:
        """Count host reads from zero within the block."""
        cls.reads = 0
        yield cls

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _READS:
            cls.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is Tensor.cpu or (func is Tensor.to and _to_host(args[1:], kwargs)):
            cls.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            # A copy, as a device-to-host transfer makes one: an ordinary tensor from here on.
            return out.as_subclass(Tensor).clone()
        return super().__torch_function__(func, types, args, kwargs)


_READS = {
    Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.__float__, Tensor.__int__, Tensor.__bool__, Tensor.__index__,
}  # fmt: skip


def _to_host(args: tuple, kwargs: dict) -> bool:
    for value in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return True
        if isinstance(value, Tensor) and not isinstance(value, OnDevice) and value.device.type == "cpu":
            return True
    return False
