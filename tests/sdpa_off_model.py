"""A model module that turns the fused attention kernels off when it is imported, as
training code does to dodge a kernel bug (the switches are process-wide): the backend
report must show that attention runs the math kernel. Its own module, so that no other
test's workers import it."""
import torch
import torch.nn.functional as F
from torch import nn

torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)
torch.backends.cuda.enable_cudnn_sdp(False)


class FeatureAttention(nn.Module):
    """Each feature a token: one self-attention over the features, then a linear head."""

    def __init__(self, n_features: int, n_outputs: int, width: int = 8):
        super().__init__()
        self.embed = nn.Linear(1, width)
        self.head = nn.Linear(width, n_outputs)

    def forward(self, x):
        h = self.embed(x.unsqueeze(-1))
        return self.head(F.scaled_dot_product_attention(h, h, h).mean(dim=1))


def attention(n_features: int, n_outputs: int) -> FeatureAttention:
    return FeatureAttention(n_features, n_outputs)
