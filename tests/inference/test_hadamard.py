"""hadamard.py: the block rotation both 8-bit formats store their values in (the C kernels'
copy is held to it byte for byte by the 8-bit KV-cache and int8 tests)."""

from __future__ import annotations

import pytest
import torch

from inference.quantization import hadamard


def sylvester(n: int) -> torch.Tensor:
    """The normalized Hadamard matrix of a power of two n (Sylvester's construction)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n**0.5


@pytest.mark.parametrize(
    "n,blocks", [(64, [64]), (576, [512, 64]), (96, [64, 32]), (1536, [1024, 512]), (1, [1])]
)
def test_the_rotation_is_hadamard_per_power_of_two_block_and_its_own_inverse(n, blocks):
    assert hadamard.rotation_blocks(n) == blocks
    x = torch.randn(5, 3, n, generator=torch.Generator().manual_seed(n))
    dense = torch.block_diag(*[sylvester(b) for b in blocks])
    rotated = hadamard.rotate(x)
    torch.testing.assert_close(rotated.double(), x.double() @ dense.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hadamard.rotate(rotated), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    matrix = hadamard.rotation_matrix(n, torch.device("cpu"))
    torch.testing.assert_close(x @ matrix, rotated, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [64, 576, 1536, 96, 1])
def test_the_rotation_by_products_is_the_rotation(n):
    x = torch.randn(2, 7, n, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(hadamard.rotate_by_products(x), hadamard.rotate(x))
