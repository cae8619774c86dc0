"""Every Triton kernel against its PyTorch reference on odd shapes (on the CPU under TRITON_INTERPRET=1, set in
conftest; small shapes, as the interpreter is slow). Inputs are made in bf16 and computed in fp32."""

from __future__ import annotations

import pytest
import torch

from hf_deltakv.kernels import reference

pytest.importorskip("triton", reason="needs the triton extra")


@pytest.mark.parametrize(
    ("batch", "n_out", "n_in", "block_size", "bias"),
    [(1, 7, 45, 16, True), (3, 65, 96, 32, False), (2, 130, 33, 8, True)],
)
def test_skip_matvec_matches_reference(batch, n_out, n_in, block_size, bias):
    from hf_deltakv.kernels.triton.skip_matvec import skip_matvec

    torch.manual_seed(n_in)
    x = torch.randn(batch, n_in, dtype=torch.bfloat16).float()
    weight = torch.randn(n_out, n_in, dtype=torch.bfloat16).float()
    b = torch.randn(n_out, dtype=torch.bfloat16).float() if bias else None
    blocks = -(-n_in // block_size)
    keep = torch.rand(blocks) > 0.4
    keep[-1] = True  # the padded last block
    expected = reference.skip_matvec(x, weight, b, keep, block_size)
    torch.testing.assert_close(skip_matvec(x, weight, b, keep, block_size), expected, atol=1e-4, rtol=1e-4)
    # an input-major (transposed) weight, as the CPU layout keeps it
    transposed = weight.t().contiguous().t()
    torch.testing.assert_close(skip_matvec(x, transposed, b, keep, block_size), expected, atol=1e-4, rtol=1e-4)


def test_skip_matvec_with_nothing_kept_is_the_bias():
    from hf_deltakv.kernels.triton.skip_matvec import skip_matvec

    x, weight, b = torch.randn(1, 20), torch.randn(5, 20), torch.randn(5)
    torch.testing.assert_close(skip_matvec(x, weight, b, torch.zeros(2, dtype=torch.bool), 16), b[None])


def test_non_power_of_two_blocks_are_refused_by_the_kernel():
    from hf_deltakv.kernels.triton.skip_matvec import skip_matvec

    with pytest.raises(ValueError, match="power-of-two"):
        skip_matvec(torch.randn(1, 12), torch.randn(3, 12), None, torch.ones(2, dtype=torch.bool), 6)
