"""XLA (xla.txt): the confidence penalty of the warm-up (Eq. 1), L = CE - H(p), written out by hand."""
import math

import pytest
import torch

import data
import layers
import train
import xlt
from conftest import one_line


def by_hand_entropy(row):
    z = [math.exp(v) for v in row]
    p = [v / sum(z) for v in z]
    return -sum(q * math.log(q) for q in p), [math.log(q) for q in p]


def test_uniform_predictions_have_entropy_log_c():
    for family, logits, labels in (('classification', torch.zeros(2, 3), torch.tensor([0, 2])),
                                   ('tagging', torch.zeros(2, 4, 7), torch.tensor([[1, -100, 3, 0], [2, 2, -100, -100]]))):
        h = xlt.entropy_per_example(family, logits, labels)
        assert torch.allclose(h.mean(), torch.tensor(math.log(logits.size(-1))))
    # QA: uniform over the real positions of each row, padding (-inf) excluded
    logits = torch.zeros(2, 5, 2)
    logits[1, 3:] = float('-inf')
    h = xlt.entropy_per_example('qa', logits, torch.zeros(2, 2, dtype=torch.long))
    assert torch.allclose(h, torch.tensor([math.log(5), math.log(3)]))


def test_penalised_loss_is_cross_entropy_minus_entropy_by_hand():
    torch.manual_seed(0)
    cfg = layers.Config(vocab_size=40, n_layer=1, n_head=2, dim=16, ffn_dim=32, dropout=0.0, attn_dropout=0.0)
    ids = torch.randint(4, 40, (3, 6))
    tags = torch.tensor([[0, 1, -100, 3, 0, -100], [2, -100, -100, 1, 1, -100], [5, 6, 0, 0, 1, -100]])  # 4, 3, 5 tokens
    for task, labels in (('xnli', torch.tensor([0, 2, 1])), ('panx', tags)):
        m = xlt.Baseline(layers.Encoder(cfg), task, train.argparse.Namespace(conf_penalty=1.0)).eval()
        batch = data.Batch(ids, ids.ne(1), labels)
        logits = m.predict(batch)
        terms = []  # (CE - H) of each labelled example or token
        if task == 'xnli':
            for b in range(3):
                h, logp = by_hand_entropy(logits[b].tolist())
                terms.append(-logp[labels[b]] - h)
        else:
            for b in range(3):
                for t in range(6):
                    if labels[b, t] >= 0:
                        h, logp = by_hand_entropy(logits[b, t].tolist())
                        terms.append(-logp[labels[b, t]] - h)
        loss, logs = m.loss(batch)
        assert abs(loss.item() - sum(terms) / len(terms)) < 1e-5  # tagging: the mean over the batch's labelled tokens
        assert 'entropy' in logs
        plain = xlt.Baseline(m.encoder, task).eval()
        plain.head = m.head
        assert plain.loss(batch)[0].item() > loss.item()  # the penalty lowers a loss whose predictions are uncertain


def test_conf_penalty_belongs_to_single_text_fine_tuning():
    one_line(['--method', 'filter', '--task', 'xnli', '--conf_penalty', '1', '--demo'], '--conf_penalty belongs to')
    one_line(['--method', 'zeroshot', '--task', 'xnli', '--conf_penalty', '-1', '--demo'], '--conf_penalty -1.0 is out of range')
    args = train.parse_args(['--method', 'zeroshot', '--task', 'xnli', '--conf_penalty', '1', '--demo'])
    assert args.conf_penalty == 1.0
    with pytest.raises(SystemExit):
        train.parse_args(['--method', 'veco', '--task', 'translate', '--conf_penalty', '1', '--demo'])
