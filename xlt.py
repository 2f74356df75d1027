"""Task heads, losses and one small module per cross-lingual transfer method.

Every method has the same shape: `loss(batch) -> (loss, logs)` on a training batch, where the
loss is the mean over the batch's examples, and `predict(batch) -> outputs` (class logits
(B, C), tag logits (B, T, C), or span logits (B, T, 2)). `forward` is `loss`, so that DDP
wraps a method as it is. The training loop knows nothing else; a new method is a new class.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from data import IGNORE, TASKS


class Head(nn.Module):
    """classification: <s> -> dense -> tanh -> classes (RoBERTa's head); tagging: a class per
    token; QA: a start and an end score per token."""

    def __init__(self, family, dim, n_labels, dropout=0.1):
        super().__init__()
        self.family = family
        self.drop = nn.Dropout(dropout)
        self.dense = nn.Linear(dim, dim) if family == 'classification' else None
        self.out = nn.Linear(dim, 2 if family == 'qa' else n_labels)
        for linear in (self.dense, self.out):
            if linear is not None:
                nn.init.normal_(linear.weight, std=0.02)
                nn.init.zeros_(linear.bias)

    def forward(self, h):
        if self.dense is not None:
            h = torch.tanh(self.dense(self.drop(h[:, 0])))
        return self.out(self.drop(h))


def per_example_loss(family, logits, labels):
    """Cross-entropy per example (B,): a sentence's tagging loss is the mean over its labelled
    words, a QA loss the mean of the start and end losses."""
    if family == 'classification':
        return F.cross_entropy(logits.float(), labels, reduction='none')
    if family == 'tagging':
        tokens = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE, reduction='none')
        return tokens.sum(1) / labels.ne(IGNORE).sum(1).clamp(min=1)
    start, end = logits.float().unbind(-1)
    return (F.cross_entropy(start, labels[:, 0], reduction='none') + F.cross_entropy(end, labels[:, 1], reduction='none')) / 2


class Baseline(nn.Module):
    """Fine-tuning the encoder and a task head on labelled examples: English alone (zero-shot
    transfer), or English translated into the target languages (translate-train)."""
    paired = False

    def __init__(self, encoder, task, args=None):
        super().__init__()
        self.encoder, self.family = encoder, TASKS[task].family
        self.head = Head(self.family, encoder.cfg.dim, len(TASKS[task].labels), encoder.cfg.dropout)

    def predict(self, batch):
        return self.head(self.encoder(batch.ids, batch.mask))

    def loss(self, batch):
        loss = per_example_loss(self.family, self.predict(batch), batch.labels).mean()
        return loss, {'loss': loss.item()}

    def forward(self, batch):
        return self.loss(batch)


# --method name -> (module, what it trains on: 'en' English, 'translations' English plus the
# translations into the target languages, 'translation' those into one --train_lang)
METHODS = {
    'zeroshot': (Baseline, 'en'),
    'translate-train': (Baseline, 'translation'),
    'translate-train-all': (Baseline, 'translations'),
}
