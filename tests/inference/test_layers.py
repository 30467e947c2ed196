import torch
import torch.nn.functional as F

from inference.models.layers import linear


def test_single_row_bf16_linear_matches_gemm():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g).bfloat16()
    b = torch.randn(300, generator=g).bfloat16()
    x = torch.randn(1, 64, generator=g).bfloat16()
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=0.05, rtol=0.02)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=0.05, rtol=0.02)
    assert linear(x, w).shape == (1, 300)
    x3 = torch.randn(3, 64, generator=g).bfloat16()  # several rows: plain GEMM
    assert torch.equal(linear(x3, w, b), F.linear(x3, w, b))
