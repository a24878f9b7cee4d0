"""A small causal language model on synthetic tokens: the transformer scenario of ``time_to_accuracy.py``.

In the manner of Lightning's demo Transformer (``lightning.pytorch.demos``), but decoder-only and causal, so that
next-token accuracy on held-out text measures learning (the demo's encoder-decoder sees its own target). The text
is a seeded second-order chain over ``VOCAB`` tokens: the next token is a fixed function of the two before it, except
that one token in five (``NOISE``) is drawn at random, so accuracy rises over some 20,000 blocks towards about 0.8 as
the model learns the 1,024 contexts (a first-order chain is learnt within a few hundred steps). Each step is mostly
per-sample work (an embedding, two encoder layers and a head over 32 positions): a larger total pays little.

Pure torch and Lightning; no download.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, BLOCK = 32, 32  # tokens, and positions a sample
NOISE = 0.2  # the share of tokens drawn at random: the accuracy a perfect model reaches is about 1 - NOISE
RULE_SEED = 1234  # the chain's rule: the same for the training and the test text


def second_order_text(num_blocks: int, seed: int) -> TensorDataset:
    """``num_blocks`` samples ``(tokens, next tokens)`` of ``BLOCK`` positions from one stream of the chain."""
    rule = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=torch.Generator().manual_seed(RULE_SEED))
    gen = torch.Generator().manual_seed(seed)
    length = num_blocks * BLOCK + 1
    random = torch.rand(length, generator=gen) < NOISE
    draws = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
    stream = [0, 1]
    for i in range(2, length):  # a few hundred thousand tokens: a Python loop takes about a second
        stream.append(draws[i] if random[i] else int(rule[stream[-2], stream[-1]]))
    tokens = torch.tensor(stream)
    return TensorDataset(tokens[:-1].view(num_blocks, BLOCK), tokens[1:].view(num_blocks, BLOCK))


class CausalLM(pl.LightningModule):
    """Token and position embeddings, two causal encoder layers (width 64, 2 heads), a linear head; Adam.

    ``forward`` returns logits as ``(batch, VOCAB, BLOCK)``, the class dimension second, as cross entropy and
    torchmetrics' multiclass accuracy take them.

    Args:
        lr: Adam's learning rate, tuned for the base batch.
        width: the model's width.

    """

    def __init__(self, lr: float = 0.003, width: int = 64) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(BLOCK, width))
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(BLOCK), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(tokens) + self.position, mask=self.causal, is_causal=True)
        return self.head(hidden).transpose(1, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, following = batch
        return nn.functional.cross_entropy(self(tokens), following)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)
