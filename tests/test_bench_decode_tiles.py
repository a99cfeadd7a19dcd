"""The decode tile sweep's layer of experts and plans, on the CPU through the Triton interpreter."""
from tests.triton_mode import interpreted, run_interpreter_cases  # noqa: F401 (before triton)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from benchmarks import bench_decode_tiles  # noqa: E402
from specter.kernels.residual_decode import DecodeLauncher, DecodePlan, expert_operands  # noqa: E402
from specter.quant.residual import bits_of  # noqa: E402


def test_interpreter_cases_in_subprocess(request):
    run_interpreter_cases(__file__, request)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_plan_of_the_sweep_rebuilds_the_layers_experts_in_one_grouped_launch(dtype):
    layout, staging, items, stacked, weights = bench_decode_tiles.layer_of(256, 128, dtype, 3, device="cpu")
    operands = expert_operands(stacked, dtype)
    assert items[:, 2].tolist() == [0, 1, 2] and not torch.equal(weights[0], weights[1])  # distinct experts
    for knobs in bench_decode_tiles.SWEEP:
        pool = torch.zeros_like(weights)
        DecodeLauncher(DecodePlan.of(layout, dtype, **knobs)).group(operands, staging, pool.view(-1), items)
        assert torch.equal(bits_of(pool), bits_of(weights)), knobs


def test_the_sweep_holds_the_default_plan():
    assert {"block_rows": 16, "num_warps": 4} in bench_decode_tiles.SWEEP
