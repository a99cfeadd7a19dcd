"""Triton launches with little host time: a compiled kernel's own launcher, after the JIT's first launch.

Triton's JIT derives every argument's specialisation on each call, tens of microseconds of host time for
a kernel with many arguments: more than a cache load or a verify wave can spare. `CompiledLaunch` keys
each call by a signature that fixes the JIT's specialisation (each tensor's dtype, device and 16-byte
alignment, every other argument's value, the constexprs and launch options), sends the first call of a
signature through the JIT (which compiles or finds the kernel) and later calls straight to that compiled
kernel's launcher. Arguments the kernel declares `do_not_specialize` are left out of the signature.
Under the interpreter (no compiled kernel) every call goes through the JIT, and so does every call after
a launcher refused its arguments (a Triton whose launcher takes another argument list), with a warning.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def _signature(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.get_device(), value.data_ptr() % 16 == 0
    return value


class CompiledLaunch:
    """`launch(grid, *args, **constexprs)` is `kernel[grid](*args, **constexprs)`, through the compiled
    kernel's launcher once the JIT has launched that signature. `constexprs` holds the kernel's trailing
    parameters by name (those not given fall back to their defaults) and launch options (num_warps, ...)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.names = list(kernel.arg_names)
        self.skip = {i for i, param in enumerate(getattr(kernel, "params", ()))  # none interpreted
                     if getattr(param, "do_not_specialize", False)}
        self.compiled = {}  # signature -> compiled kernel (None: the interpreter)
        self.runners = {}  # (signature, grid) -> (launcher, trailing parameter values)
        self.jit_only = False  # set when a compiled kernel's launcher refused its arguments

    def __call__(self, grid: tuple, *args, **constexprs) -> None:
        if self.jit_only:
            self.kernel[grid](*args, **constexprs)
            return
        key = self._key(args, constexprs)
        runner = self.runners.get((key, grid))
        if runner is None:
            if key not in self.compiled:  # the JIT compiles (or finds) and launches
                self.compiled[key] = self.kernel[grid](*args, **constexprs)
                self._bind(key, grid, len(args), constexprs)
                return
            runner = self._bind(key, grid, len(args), constexprs)  # a known kernel at another grid
        self._launch_compiled(runner, grid, args, constexprs)

    def _key(self, args: tuple, constexprs: dict) -> tuple:
        return (tuple(None if i in self.skip else _signature(a) for i, a in enumerate(args)),
                tuple(constexprs.items()))

    def bound(self, grid: tuple, args: tuple, constexprs: dict, varying: int) -> Callable:
        """`run(value)` is `self(grid, *args, **constexprs)` with `args[varying]` = value, straight to the compiled
        kernel's launcher (no signature derived but `value`'s) while `value` has `args[varying]`'s signature and
        `args` has been launched before; through `__call__` otherwise. The other arguments are fixed."""
        runner = self.runners.get((self._key(args, constexprs), grid))
        head, tail, expected = args[:varying], args[varying + 1:], _signature(args[varying])

        def run(value) -> None:
            full = (*head, value, *tail)
            if runner is None or self.jit_only or _signature(value) != expected:
                self(grid, *full, **constexprs)
            else:
                self._launch_compiled(runner, grid, full, constexprs)
        return run

    def _launch_compiled(self, runner: tuple, grid: tuple, args: tuple, constexprs: dict) -> None:
        launcher, trailing = runner
        try:
            launcher(*args, *trailing)
        except TypeError as exc:  # raised before launching: the argument list did not parse
            warnings.warn(f"{getattr(self.kernel, '__name__', 'a Triton kernel')}: the compiled kernel's launcher "
                          f"refused its arguments ({exc}); launching through the JIT", RuntimeWarning)
            self.jit_only = True
            self.kernel[grid](*args, **constexprs)

    def _bind(self, key, grid: tuple, given: int, constexprs: dict) -> tuple | None:
        """The launcher of `key`'s compiled kernel at `grid` with its trailing parameters, kept (None when
        interpreted: nothing to bind, every call goes through the JIT)."""
        compiled = self.compiled[key]
        if compiled is None:
            self.compiled.pop(key)
            return None
        defaults = {param.name: param.default for param in self.kernel.params}
        trailing = tuple(constexprs[name] if name in constexprs else defaults[name] for name in self.names[given:])
        runner = self.runners[(key, grid)] = (compiled[(*grid, 1, 1)[:3]], trailing)  # the launcher reads 3 sizes
        return runner
