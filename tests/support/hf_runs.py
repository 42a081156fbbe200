"""Hugging Face models as the HF tests train them."""

from __future__ import annotations

import torch

from benchmarks.hf_zoo import batches
from lit_efficient.models import HFCausalLM


class SGDLM(HFCausalLM):
    """Plain SGD with momentum: the acceptance check's optimizer (a user replaces configure_optimizers so)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


# The router's auxiliary (load-balancing) loss, trained: two Mixtral-style families at a coefficient far from its
# default, so a coefficient read from the wrong place or a term dropped on one path shows.
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.02)


def padded_batches(n: int) -> list[dict[str, torch.Tensor]]:
    """`batches` as dicts with a right-padded row: the auxiliary loss excludes padding, so the mask must reach it."""
    out = []
    for i, (ids, _) in enumerate(batches(n)):
        mask = torch.ones_like(ids)
        mask[1, ids.size(1) - 1 - i % 3 :] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out
