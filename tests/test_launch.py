"""CompiledLaunch: which calls go through the JIT and what the compiled kernel's launcher receives."""
from types import SimpleNamespace

import pytest
import torch

from specter.kernels.launch import CompiledLaunch


class FakeKernel:
    """A JIT function's attributes (arg_names, params) and the records of its calls."""

    def __init__(self, interpreted: bool = False) -> None:
        self.arg_names = ["x_ptr", "n", "length", "BLOCK", "FLAG"]  # `length` is declared do_not_specialize
        self.params = [SimpleNamespace(name=name, default=default, do_not_specialize=name == "length")
                       for name, default in [("x_ptr", None), ("n", None), ("length", None), ("BLOCK", None),
                                             ("FLAG", 7)]]
        self.interpreted = interpreted
        self.jit_calls, self.bound_grids, self.launches = [], [], []

    def launcher(self, grid3):
        self.bound_grids.append(grid3)
        return lambda *args: self.launches.append(args[1:])


class Compiled:
    def __init__(self, kernel: FakeKernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid3):
        return self.kernel.launcher(grid3)


class Jit(FakeKernel):
    """kernel[grid](...) -> a compiled kernel (None when interpreted), whose compiled[grid3] is its launcher."""

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.jit_calls.append(args[1:])
            return None if self.interpreted else Compiled(self)

        return jit


def test_first_call_of_a_signature_goes_through_the_jit_later_ones_to_thelauncher():
    kernel = Jit()
    launch = CompiledLaunch(kernel)
    x = torch.zeros(8)
    launch((4,), x, 3, 100, BLOCK=16, num_warps=4)
    launch((4,), x, 3, 200, BLOCK=16, num_warps=4)  # another length: not part of the signature
    launch((2, 5), x, 3, 300, BLOCK=16, num_warps=4)  # another grid: the same compiled kernel
    launch((4,), x, 4, 100, BLOCK=16, num_warps=4)  # another value: the JIT again
    launch((4,), x[1:], 3, 100, BLOCK=16, num_warps=4)  # a misaligned pointer: the JIT again
    launch((4,), x, 3, 100, BLOCK=32, num_warps=4)  # another constexpr: the JIT again
    assert kernel.jit_calls == [(3, 100), (4, 100), (3, 100), (3, 100)]
    assert kernel.launches == [(3, 200, 16, 7), (3, 300, 16, 7)]  # trailing constexprs, FLAG by its default
    assert (4, 1, 1) in kernel.bound_grids and (2, 5, 1) in kernel.bound_grids


def test_interpreted_kernels_always_go_through_the_jit():
    kernel = Jit(interpreted=True)
    launch = CompiledLaunch(kernel)
    for _ in range(3):
        launch((1,), torch.zeros(4), 1, 2, BLOCK=8)
    assert len(kernel.jit_calls) == 3 and not kernel.launches


def test_a_launcher_that_refuses_its_arguments_leaves_the_jit_with_a_warning():
    kernel = Jit()
    kernel.launcher = lambda grid3: (lambda *args: (_ for _ in ()).throw(TypeError("expected 3 arguments")))
    launch = CompiledLaunch(kernel)
    x = torch.zeros(4)
    launch((1,), x, 1, 2, BLOCK=8)
    with pytest.warns(RuntimeWarning, match="refused its arguments"):
        launch((1,), x, 1, 2, BLOCK=8)
    launch((1,), x, 1, 2, BLOCK=8)
    assert len(kernel.jit_calls) == 3 and launch.jit_only


def test_a_bound_launch_varies_one_argument_and_goes_to_the_launcher_while_its_signature_holds():
    kernel, pointers = Jit(), []
    kernel.launcher = lambda grid3: (lambda *args: pointers.append((args[0].data_ptr(), *args[1:])))
    launch = CompiledLaunch(kernel)
    x, y = torch.zeros(8), torch.ones(8)
    launch.bound((4,), (x, 3, 100), {"BLOCK": 16}, varying=0)(x)  # not launched before: through __call__
    run = launch.bound((4,), (x, 3, 100), {"BLOCK": 16}, varying=0)
    run(y)  # the same signature: the launcher, with y in x's place
    run(y.half())  # another dtype: the JIT again
    assert kernel.jit_calls == [(3, 100), (3, 100)]
    assert pointers == [(y.data_ptr(), 3, 100, 16, 7)]


def test_a_bound_launch_of_an_interpreted_kernel_goes_through_the_jit():
    kernel = Jit(interpreted=True)
    launch = CompiledLaunch(kernel)
    x = torch.zeros(4)
    launch((1,), x, 1, 2, BLOCK=8)
    launch.bound((1,), (x, 1, 2), {"BLOCK": 8}, varying=0)(x)
    assert len(kernel.jit_calls) == 2 and not kernel.launches
