"""XLA (Bari et al.), each piece against a computation by hand: the warm-up's confidence penalty
(Eq. 1), distillation by confidence and by a GMM (Appendix B), agreement, Eq. 2, successive max
and cross; then the whole run, its resume, and two processes against one."""
import argparse
import itertools
import json
import math
import statistics
import sys

import pytest
import torch
from dataclasses import replace

import data
from data import IGNORE
import layers
import train
import xlt
from conftest import demo_run, one_line, quick_pretrained


def by_hand_entropy(row):
    z = [math.exp(v) for v in row]
    p = [v / sum(z) for v in z]
    return -sum(q * math.log(q) for q in p), [math.log(q) for q in p]


def test_uniform_predictions_have_entropy_log_c():
    for family, logits, labels in (('classification', torch.zeros(2, 3), torch.tensor([0, 2])),
                                   ('tagging', torch.zeros(2, 4, 7), torch.tensor([[1, -100, 3, 0], [2, 2, -100, -100]]))):
        h = xlt.entropy_per_example(family, logits, labels.ne(-100))
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
        ce, entropy = [], []  # of each example; tagging: CE of each labelled token, H of every real token
        if task == 'xnli':
            for b in range(3):
                h, logp = by_hand_entropy(logits[b].tolist())
                ce.append(-logp[labels[b]])
                entropy.append(h)
        else:
            for b in range(3):
                for t in range(6):
                    h, logp = by_hand_entropy(logits[b, t].tolist())
                    entropy.append(h)  # every token of the attention mask (all 18 here), as the released code
                    if labels[b, t] >= 0:
                        ce.append(-logp[labels[b, t]])
        loss, logs = m.loss(batch)
        assert abs(loss.item() - (sum(ce) / len(ce) - sum(entropy) / len(entropy))) < 1e-5
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


# ----------------------------------------------------------------------------------------
# Distillation (Section 3.3, Appendix B), agreement and Eq. 2, each against a hand computation.

def test_confidence_keeps_exactly_the_floor_of_eta_n_most_confident():
    """The released unsup_utils.py keeps len * top_k // 100 samples."""
    conf = torch.tensor([0.9, 0.2, 0.6, 0.95, 0.4, 0.7, 0.1])
    for eta, want in ((0.5, {3, 0, 5}), (0.8, {3, 0, 5, 2, 4}), (1.0, set(range(7))), (0.01, set())):
        keep = xlt.top_confident(conf, eta)
        assert keep.sum().item() == 7 * round(100 * eta) // 100 and set(keep.nonzero().squeeze(1).tolist()) == want
    assert xlt.top_confident(torch.rand(100), 29 / 100).sum() == 29  # 0.29 x 100 is 28.999999999999996, not 28


def test_pseudo_labels_and_confidence_by_hand():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])  # a batch of two samples
    p = lambda row, c: math.exp(logits[row, c]) / sum(math.exp(u) for u in logits[row].tolist())
    label, count, conf, loss = xlt.pseudo_labels('classification', logits)
    assert label.tolist() == [1, 0] and count.tolist() == [1, 1]
    assert torch.allclose(conf, torch.tensor([p(0, 1), p(1, 0)])) and torch.allclose(loss, -conf.log())
    # tagging: the argmax tag of each word's first piece, the words one after another; confidence the mean over the words
    logits = torch.tensor([[[9.0, 0.0], [0.0, 1.0], [5.0, 0.0], [3.0, 0.0], [0.0, 0.0]],
                           [[0.0, 9.0], [0.0, 2.0], [7.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    first = torch.tensor([[0, 1, 0, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.bool)  # words at 1 and 3; at 1
    label, count, conf, loss = xlt.pseudo_labels('tagging', logits, first)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))
    top = [[sigmoid(1), sigmoid(3)], [sigmoid(2)]]
    assert label.tolist() == [1, 0, 1] and count.tolist() == [2, 1]
    assert torch.allclose(conf, torch.tensor([sum(t) / len(t) for t in top]))
    assert torch.allclose(loss, torch.tensor([-sum(map(math.log, t)) / len(t) for t in top]))


def by_hand_em_step(x, mu, var, pi):
    normal = lambda v, m, s2: math.exp(-(v - m) ** 2 / (2 * s2)) / math.sqrt(2 * math.pi * s2)
    r = []
    for v in x:
        w = [pi[k] * normal(v, mu[k], var[k]) for k in range(2)]
        r.append([w[k] / sum(w) for k in range(2)])
    n = [sum(row[k] for row in r) for k in range(2)]
    mu2 = [sum(row[k] * v for row, v in zip(r, x)) / n[k] for k in range(2)]
    var2 = [sum(row[k] * (v - mu2[k]) ** 2 for row, v in zip(r, x)) / n[k] for k in range(2)]
    return mu2, var2, [n[k] / len(x) for k in range(2)]


def test_em_step_matches_appendix_b_by_hand():
    x = [0.1, 0.3, 0.2, 1.5, 1.9, 0.7]
    mu, var, pi = [0.2, 1.0], [0.5, 0.3], [0.6, 0.4]
    got = xlt.em_step(torch.tensor(x, dtype=torch.float64), torch.tensor(mu, dtype=torch.float64),
                      torch.tensor(var, dtype=torch.float64), torch.tensor(pi, dtype=torch.float64))
    for ours, hand in zip(got[:3], by_hand_em_step(x, mu, var, pi)):
        assert torch.allclose(ours, torch.tensor(hand, dtype=torch.float64), atol=2e-5)  # var: + reg_covar 1e-5


def test_gmm_splits_two_clusters_whatever_the_starting_order():
    g = torch.Generator().manual_seed(0)
    clean, noisy = 0.1 + 0.05 * torch.rand(40, generator=g), 2.0 + 0.3 * torch.rand(25, generator=g)
    losses = torch.cat([clean, noisy])[torch.randperm(65, generator=g)]
    truth = losses < 1.0
    for init in (None, [2.0, 0.1], [0.1, 2.0], [losses.max().item(), losses.min().item()]):
        good = xlt.gmm_good(losses, init=init)
        assert torch.equal(good >= 0.5, truth)  # the low-loss component is found, not component 0
        assert good[truth].min() > 0.99 and good[~truth].max() < 0.01


def labelled(labels, keep):
    """distil's output of a set: each sample's labels (a list each) one after another, with their ends."""
    return {'label': torch.tensor([x for sample in labels for x in sample]), 'keep': torch.tensor(keep, dtype=torch.bool),
            'ends': torch.tensor([0] + list(itertools.accumulate(map(len, labels))))}


def test_agreement_keeps_only_samples_both_keep_with_equal_labels():
    j = labelled([[0], [1, 2], [2], [1], [3, 4], [5, 6, 7]], [1, 1, 1, 0, 1, 1])  # tagging: every tag must agree
    k = labelled([[0], [1, 0], [2], [1], [3, 4], [5, 6, 8]], [1, 1, 0, 1, 1, 1])
    assert xlt.agreement(j, k).tolist() == [True, False, False, False, True, False]


def test_each_model_learns_from_its_two_peers_never_from_itself():
    feats = [data.Feature([0, 10 + i, 2]) for i in range(9)]
    # model m labels sample i with 1, except the samples i % 3 == m, which it labels 0: two peers agree
    # only on the samples of the third model, and both label those 1 where that model says 0
    labels = [{'target': labelled([[0 if i % 3 == m else 1] for i in range(9)], [1] * 9)} for m in range(3)]
    english = [data.Feature([0, 5, 2], 1)]
    for k, j, l in ((0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)):
        parts = xlt.taught_by_peers(labels[k], labels[j], {'target': feats}, english)
        items = xlt.Chosen(parts.values())  # what model l trains on: English, then the target samples
        assert items[0] is english[0] and parts['source'][0] is english
        assert [items[n].ids[1] - 10 for n in range(1, len(items))] == [i for i in range(9) if i % 3 == l]
        assert all(items[n].label == 1 for n in range(1, len(items)))  # the peers' label; its own would be 0
    assert 'source' not in xlt.taught_by_peers(labels[1], labels[2], {'target': feats})
    assert xlt.XLA.SETS == {1: ('source', 'target'), 2: ('target vicinal',),
                              3: ('source', 'target', 'source vicinal', 'target vicinal')}  # Algorithm 1, line 22


def test_union_adds_what_one_peer_alone_keeps_with_its_label():
    """The ablation (the released --agreement_param 2): both keep and agree, or one peer alone keeps."""
    feats = [data.Feature([0, 10 + i, 2]) for i in range(4)]
    # for model 0, peers 1 and 2: sample 0 both keep with label 1; 1 both keep, labels differ; 2 only peer 1 keeps
    # (label 2); 3 only peer 2 keeps (label 0)
    peer_1 = {'target': labelled([[1], [1], [2], [1]], [True, True, True, False])}
    peer_2 = {'target': labelled([[1], [0], [1], [0]], [True, True, False, True])}
    chosen = lambda union: xlt.Chosen(xlt.taught_by_peers(peer_1, peer_2, {'target': feats}, None, union).values())
    taught = lambda union: [(f.ids[1] - 10, f.label) for f in map(chosen(union).__getitem__, range(len(chosen(union))))]
    assert taught(False) == [(0, 1)] and taught(True) == [(0, 1), (2, 2), (3, 0)]
    # tagging, the same choices: a tag per word, set on the word's first piece (words at 1 and 3, or at 2)
    feats = [data.Feature([0, 10 + i, 7, 8, 2], [IGNORE] * 5, i, [1, 3] if i % 2 else [2]) for i in range(4)]
    peer_1 = {'target': labelled([[1], [4, 5], [2], [1, 1]], [True, True, True, False])}
    peer_2 = {'target': labelled([[1], [4, 6], [1], [0, 3]], [True, True, False, True])}
    assert taught(False) == [(0, [IGNORE, IGNORE, 1, IGNORE, IGNORE])]
    assert taught(True)[1:] == [(2, [IGNORE, IGNORE, 2, IGNORE, IGNORE]), (3, [IGNORE, 0, IGNORE, 3, IGNORE])]


def test_each_pair_of_peers_trains_the_third_model_on_labels_of_their_newest_checkpoints(monkeypatch):
    """Algorithm 1, lines 3-22: for k, then j != k, the model l that is neither trains on what k and j
    keep, so each model trains twice an epoch, and every pair labels with its newest checkpoints
    (trained earlier in the epoch); a checkpoint labels once."""
    labelled, trained = [], []
    labels = lambda path: {'target': {'keep': torch.ones(1, dtype=torch.bool), 'labels': [0], 'by': path}}
    monkeypatch.setattr(xlt, 'distil', lambda run, path, sets, eta: labelled.append(path) or labels(path))
    monkeypatch.setattr(xlt, 'taught_by_peers', lambda by_k, by_j, *rest: (by_k['target']['by'], by_j['target']['by']))

    def co_train(run, epoch, l, pair, labellers, start):  # the model trained, by whose labels, from where
        trained.append((l + 1, labellers, start))
        return f'T{len(trained)}'
    monkeypatch.setattr(xlt, 'co_train', co_train)
    run = argparse.Namespace(args=argparse.Namespace(eta=[80], union=False, single=False), say=print,
                             folder=argparse.Namespace(cached=lambda name, compute: compute()))
    last = xlt.XLA.co_teaching(run, 1, ['w1', 'w2', 'w3'], {'target': []}, None)
    # worked out by hand from Algorithm 1's loops: (k, j) = (1, 2), (1, 3), (2, 1), (2, 3), (3, 1), (3, 2)
    assert trained == [(3, ('w1', 'w2'), 'w3'), (2, ('w1', 'T1'), 'w2'), (3, ('T2', 'w1'), 'T1'),
                       (1, ('T2', 'T3'), 'w1'), (2, ('T3', 'T4'), 'T2'), (1, ('T3', 'T5'), 'T4')]
    assert last == ['T6', 'T5', 'T3'] and labelled == ['w1', 'w2', 'T1', 'T2', 'T3', 'T4', 'T5']
    trained.clear()  # --single: each of the three models learns what it keeps itself (Table 5's φ, a mean of three)
    run.args.single = True
    assert xlt.XLA.co_teaching(run, 1, ['w1', 'w2', 'w3'], {'target': []}, None) == ['T1', 'T2', 'T3']
    assert trained == [(1, ('w1', 'w1'), 'w1'), (2, ('w2', 'w2'), 'w2'), (3, ('w3', 'w3'), 'w3')]


def test_eq2_sampling_probabilities():
    sizes = [1000, 100, 10, 0]
    for alpha in (0.0, 0.3, 0.7, 1.0):
        q = data.sampling_weights(sizes, alpha)
        f = [n / sum(sizes) for n in sizes[:3]]
        hand = [v ** alpha / sum(u ** alpha for u in f) for v in f] + [0.0]  # an empty set is never drawn
        assert abs(sum(q) - 1) < 1e-12 and all(abs(a - b) < 1e-12 for a, b in zip(q, hand))
    assert data.sampling_weights(sizes, 1.0)[:3] == pytest.approx([n / 1110 for n in sizes[:3]])  # proportional
    assert data.sampling_weights(sizes, 0.0)[:3] == pytest.approx([1 / 3] * 3)  # uniform
    # an epoch draws sum(n) samples, round(q_i sum(n)) from set i, in batches
    batches = xlt.mixture_batches([30, 10], 0.0, 8, seed=1, chunks=1)
    drawn = [i for b in batches for i in b]
    assert len(drawn) == 40 and sum(i < 30 for i in drawn) == 20 and len(set(i for i in drawn if i >= 30)) == 10


class FixedLogits(torch.nn.Module):
    family = 'classification'

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def predict(self, batch):
        return self.logits


def test_the_ensemble_averages_the_models_probabilities():
    logits = [torch.tensor([[3.2, 0.0, 0.0], [0.0, 1.0, 0.5]]), torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 0.0]]),
              torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, 0.1]])]
    got = xlt.Ensemble([FixedLogits(t) for t in logits]).predict(None).exp()
    hand = [[sum(math.exp(t[r][c]) / sum(math.exp(v) for v in t[r]) for t in map(torch.Tensor.tolist, logits)) / 3
             for c in range(3)] for r in range(2)]
    assert torch.allclose(got, torch.tensor(hand), atol=1e-6)
    assert got[0].argmax() == 1 and sum(logits)[0].argmax() == 0  # the logits' mean would pick class 0 (3.2 against 3.0)


def test_warm_ups_differ_in_seed_and_penalise_confidence_the_xla_epochs_do_not():
    args = train.parse_args(['--method', 'xla', '--task', 'panx', '--train_lang', 'de', '--demo', '--seed', '5'])
    stages = xlt.XLA.stages(args)
    assert [s['seed'] for s in stages.values()] == [5, 2005, 3005] and all(s['method'] == 'zeroshot' for s in stages.values())
    assert [s['seed'] for s in xlt.XLA.stages(train.parse_args(['--method', 'xla', '--task', 'conll', '--train_lang', 'de'])
                                           ).values()] == [1000, 3000, 4000]  # UXLA's base-multilingual_xlmr.sh
    seeds = lambda s: {v['seed'] for v in xlt.XLA.stages(argparse.Namespace(**{**vars(args), 'seed': s})).values()}
    assert not seeds(1) & seeds(2)  # runs of neighbouring --seed share no model
    assert all(s['conf_penalty'] == 1.0 for s in stages.values())  # Eq. 1 in the warm-up, weight 1
    encoder = layers.Encoder(layers.CONFIGS['tiny'])
    penalised = argparse.Namespace(conf_penalty=2.0)
    assert xlt.Baseline(encoder, 'panx', penalised).conf_penalty == 2.0 and xlt.XLA(encoder, 'panx', penalised).conf_penalty == 0


def test_an_xla_epoch_trains_with_table_8s_optimiser_settings():
    """co_train's training run: one pass, --xla_lr, --xla_batch_size, 10% warm-up, the run's --seed (UXLA's
    multi-mix scripts: 1000 for every model)."""
    class Recording:  # a Run that records the training's settings and finds the training already done
        args = train.parse_args(['--method', 'xla', '--task', 'panx', '--train_lang', 'de', '--seed', '3'])

        def sub(self, folder, **changes):
            self.made = folder, changes
            return self

        @property
        def folder(self):  # the run folder's contract: cached and drop below
            return self

        def cached(self, name, compute):
            return {'better': False}

        def drop(self, name):
            self.dropped = name
    run = Recording()
    assert xlt.co_train(run, 2, 1, (0, 2), {}, 'warmup-2/best.pt') == 'warmup-2/best.pt'  # not better: the model as it was
    assert run.dropped == 'best.pt'  # and the training's own is not kept
    assert run.made == ('epoch2/model2-by13', {'epochs': 1, 'steps': None, 'eval_every': None, 'lr': 5e-6, 'batch_size': 16, 'warmup': 0.1, 'warmup_steps': None, 'seed': 3,
                                               'eval_steps': 50, 'weight_decay': 0.01})


def test_an_xla_training_is_kept_only_when_its_best_target_dev_score_beats_the_start():
    """co_train: selection on the --train_lang dev score (every --eval_steps), the best weights kept
    only when strictly better than the starting model's, as the released code; else the start."""
    class Scripted:  # a Run whose dev scores are given: the start's, then the best checkpoint's
        args = train.parse_args(['--method', 'xla', '--task', 'panx', '--train_lang', 'de', '--demo'])
        chunks = 1

        def __init__(self, scores):
            self.scores, self.validated, self.dropped = list(scores), [], []

        def sub(self, folder, **changes):
            self.args = argparse.Namespace(**{**vars(Scripted.args), **changes})
            return self

        @property
        def folder(self):  # the run folder's contract: cached and drop below
            return self

        def cached(self, name, compute):
            return compute()

        def restore(self, path, cls):
            return None

        def path(self, name):
            return name

        def say(self, message):
            pass

        def evaluate(self, method, split, langs=None):
            scores = {'de': {'score': self.scores.pop(0)}, 'en': {'score': 99.0}}
            return {lang: s for lang, s in scores.items() if langs is None or lang in langs}, {}

        def fit(self, method, items, validate, batches_of):
            self.validated.append(validate())  # what selects within the training: German alone

        def load_best(self, method):
            pass

        def drop(self, name):
            self.dropped.append(name)
    parts = {'target': ([data.Feature([0, 5, 2], 1)] * 4, None, None, None)}  # Chosen's part: all four
    for before, best, kept in ((70.0, 70.0, 'warmup-1/best.pt'), (70.0, 70.5, 'epoch1/model1-by23/best.pt')):
        run = Scripted([before, 0.0, best])  # the start, the one validation inside fit, the best checkpoint
        assert xlt.co_train(run, 1, 0, (1, 2), parts, 'warmup-1/best.pt') == kept
        assert run.validated == [{'de': {'score': 0.0}}]
        assert run.dropped == (['best.pt'] if kept.startswith('warmup') else [])  # a training not kept keeps no best.pt
    assert xlt.XLA.RUN['panx']['eval_steps'] == xlt.XLA.RUN['xnli']['eval_steps'] == 50  # Table 8's logging step


# ----------------------------------------------------------------------------------------
# GEN-LM (Section 3.2): successive max and successive cross.

class RecordingMLM(torch.nn.Module):
    """An 'encoder' that records its inputs and an MLM head that prefers the highest id."""

    def __init__(self, vocab):
        super().__init__()
        self.inputs, self.vocab = [], vocab

    def forward(self, ids, mask):
        self.inputs.append(ids.clone())
        assert torch.equal(mask, ids.ne(1))  # what is <pad> is masked out, a removed piece too
        return torch.zeros(*ids.shape, 1)

    def head(self, h):
        return torch.arange(self.vocab, dtype=torch.float).expand(len(h), -1)


def test_successive_max_fills_one_word_at_a_time_with_the_best_allowed_piece():
    vocab, mask_id = 20, 19
    fillable = (torch.arange(vocab) >= 4) & (torch.arange(vocab) < mask_id)
    ids = torch.tensor([[0, 4, 5, 6, 7, 8, 2], [0, 9, 10, 11, 2, 1, 1]])
    words = torch.tensor([[[3, 5], [1, 3]], [[2, 4], [-1, -1]]])  # (first, end) of each masked word, in order
    fake = RecordingMLM(vocab)
    out = xlt.fill_successively(fake, fake.head, ids, ids.ne(1), words, fillable, mask_id, 1)
    assert [seen.tolist() for seen in fake.inputs] == [  # one <mask> for the whole word, its other pieces <pad>
        [[0, 4, 5, 19, 1, 8, 2], [0, 9, 19, 1, 2, 1, 1]],
        [[0, 19, 1, 18, 1, 8, 2]]]  # step 2 reads step 1's fill; the row without a step 2 is not run
    assert out.tolist() == [[0, 18, 1, 18, 1, 8, 2], [0, 9, 18, 1, 2, 1, 1]]  # the best piece that is no special token


def test_a_word_s_other_pieces_as_padding_read_as_if_removed():
    """The MLM's output for a row whose removed pieces are <pad> inside it equals its output for the
    shorter row: the attention mask and the position numbers skip them."""
    torch.manual_seed(0)
    cfg = layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': 40})
    encoder = layers.Encoder(cfg).eval()
    mlm = layers.MLMHead(cfg, encoder.tok.weight).eval()
    short = torch.tensor([[0, 7, 39, 12, 13, 2]])  # 39: the <mask> of a word whose pieces were 8, 9, 10
    padded = torch.tensor([[0, 7, 39, 1, 1, 12, 13, 2]])
    with torch.no_grad():
        a, b = (mlm(encoder(x, x.ne(1))) for x in (short, padded))
    assert torch.allclose(a, b[:, [0, 1, 2, 5, 6, 7]], atol=1e-5)
    assert not torch.allclose(a, mlm(encoder(padded, torch.ones_like(padded, dtype=torch.bool)))[:, [0, 1, 2, 5, 6, 7]], atol=1e-3)


def test_masked_words_as_the_released_code_chooses_them():
    """Words: a word-start piece begins one; words of 3+ characters only; k = max(int(P n), 1) a
    sample, successive windows of one random order; repeated sets dropped; 5-150 words."""
    word_start = (torch.arange(30) >= 4) & (torch.arange(30) < 20)  # 4-19 begin words, 20-29 continue them
    chars = torch.tensor([0] * 4 + [2] * 6 + [3] * 10 + [1] * 10)  # 4-9: two characters, 10-19: three
    g = lambda: torch.Generator().manual_seed(0)
    sentence = lambda *words: [0] + [i for w in words for i in w] + [2]
    masked = lambda ids, *rest, words=None: xlt.masked_words(data.Feature(ids, words=words), *rest)
    for n in (4, 151):
        assert masked(sentence(*[[12]] * n), 'tagging', [3], 0.3, word_start, chars, g()) == \
            ([], {'sentences under 5 or over 150 words': 1})
    assert masked(sentence(*[[5]] * 6), 'tagging', [3], 0.3, word_start, chars, g()) == \
        ([], {'sentences without a word of 3 or more characters': 1})
    # ten words: 0 and 2 too short (5 + 20 is 'xx' + 'x': three characters, eligible), 4 is three pieces
    words = [[5], [12], [6], [13], [14, 21, 22], [15], [16], [5, 20], [17], [18]]
    parts, removed = masked(sentence(*words), 'tagging', [3], 0.3, word_start, chars, g())
    first = [1 + sum(len(w) for w in words[:i]) for i in range(10)]  # each word's position in the row
    span = {first[i]: first[i] + len(words[i]) for i in range(10)}
    (sets,), chosen = parts, [w for s in parts[0] for w in s]
    assert removed == {'repeated sets of masked words': 0} and [len(s) for s in sets] == [3, 3, 3]  # int(0.3 x 10)
    assert all(end == span[start] for start, end in chosen) and {first[0], first[2]}.isdisjoint(s for s, _ in chosen)
    assert len({s for s, _ in chosen[:8]}) == 8 and chosen[8] == chosen[0]  # one order of the 8 eligible, cycled
    # five words, one eligible: every sample would mask the same word, so one is left of three
    parts, removed = masked(sentence([5], [5], [12], [5], [5]), 'tagging', [3], 0.3, word_start, chars, g())
    assert parts == [[[[3, 4]]]] and removed == {'repeated sets of masked words': 2}
    # tagging takes the data's words: a word of no piece is an <unk> (3), which starts no word but is one
    parts, _ = masked(sentence([12], [3], [13], [14], [15]), 'tagging', [4], 0.3, word_start, chars, g(), words=[1, 2, 3, 4, 5])
    assert sorted(w for s in parts[0] for w, _ in s) == [1, 3, 4, 5] and [1, 2] in [w for s in parts[0] for w in s]
    pair = [0, 12, 13, 14, 15, 16, 2, 2, 12, 13, 14, 15, 16, 17, 2]  # a pair: each part its own words and sets
    parts, removed = masked(pair, 'classification', [2, 2], 0.3, word_start, chars, g())
    assert [len(p) for p in parts] == [2, 2] and all(1 <= s <= 6 for p in parts[0] for w in p for s in w)
    assert all(8 <= s <= 14 for p in parts[1] for w in p for s in w) and [len(p[0]) for p in parts] == [1, 1]


@pytest.fixture(scope='module')
def demo_data(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo') / 'demo-data'), n_train=40, n_eval=12)


def test_generation_keeps_the_word_count_masks_at_most_k_words_and_crosses_d1_d2(demo_data, tmp_path):
    tok = data.Tokenizer(f'{demo_data}/sentencepiece.bpe.model')
    torch.manual_seed(0)
    cfg = layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': tok.vocab_size})
    encoder = layers.Encoder(cfg).eval()
    vicinity = encoder, layers.MLMHead(cfg, encoder.tok.weight).eval()
    for task, delta, share in (('xnli', [2, 3], 0.3), ('panx', [3], 0.4)):
        feats = data.make_features(tok, task, data.read_split(demo_data, task, 'dev', 'de')[:8], 128)
        feats[0] = data.Feature(feats[0].ids[:4] + [2], None, 0, [1, 2, 3]) if task == 'panx' else data.Feature([0, 9, 2, 2, 9, 2])
        if task == 'panx':  # words of several pieces, and one of none (an <unk>)
            long = data.make_features(tok, task, [{'words': ['Donaudampfschifffahrtsgesellschaft', 'Haus', '\u200b', 'Kapitanssohn',
                                                           'Berlin', 'Oberbürgermeisterin', 'Tokio'], 'tags': None}], 128)
            feats[-1] = replace(long[0], example=feats[-1].example)
            assert tok.unk in feats[-1].ids and len(feats[-1].ids) > 12
        args = train.parse_args(['--method', 'xla', '--task', task, '--demo', '--delta', *map(str, delta),
                                 '--aug_share', str(share), '--out', str(tmp_path), '--seed', '1'])  # its draws
        args.data_dir = demo_data
        run = lambda **changes: train.Run(argparse.Namespace(**{**vars(args), **changes}), 0, 1, torch.device('cpu'), tok)
        samples = xlt.vicinal_samples(run(), feats, vicinity, 1, task)
        again = xlt.vicinal_samples(run(resume=True), feats, None, 1, task)  # read back as written
        assert [(s.ids, s.example, s.words) for s in again] == [(s.ids, s.example, s.words) for s in samples]
        samples = [samples[n] for n in range(len(samples))]
        removed = json.loads((tmp_path / task / 'meta.json').read_text())['removed']
        assert removed['sentences under 5 or over 150 words'] == 1  # feats[0], and no sample of it
        texts = lambda f: [tok.decode(f.ids[a:b]).split() for a, b in xlt.parts_of(f.ids, data.TASKS[task].family)]
        for f in feats[1:]:
            made = [s for s in samples if s.example == f.example]
            assert len({tuple(s.ids) for s in made}) == len(made)  # no sample twice
            for s in made:  # the same words but at most k of 3+ characters, each now one piece
                assert s.label is None and [len(p) for p in texts(s)] == [len(p) for p in texts(f)]
                for old, new in zip(texts(f), texts(s)):
                    changed = [w for w, v in zip(old, new) if w != v]
                    assert len(changed) <= max(int(share * len(old)), 1) and all(len(w) >= 3 for w in changed)
                if task == 'panx':  # the tags' first pieces follow their words: each word as it was, or one piece
                    spans = lambda x: [x.ids[a:b] for a, b in zip(x.words, x.words[1:] + [len(x.ids) - 1])]
                    assert len(s.words) == len(f.words) and all(new == old or len(new) == 1 for old, new in zip(spans(f), spans(s)))
            if task == 'xnli':  # successive cross: every kept a-sample with every kept b-sample
                pairs = [tuple(map(tuple, texts(s))) for s in made]
                assert len(pairs) <= 6 and set(pairs) == set(itertools.product({a for a, _ in pairs}, {b for _, b in pairs}))
        if task == 'panx':  # a kept sample of the long words' sentence lost pieces (the words' other pieces)
            assert any(len(s.ids) < len(feats[-1].ids) for s in samples if s.example == feats[-1].example)
        # every other sentence gets its delta1 x delta2 samples but those removed (no set repeats here)
        assert removed['repeated sets of masked words'] == 0 and 0 < len(samples) < math.prod(delta) * (len(feats) - 1)
        assert len(samples) + removed['samples whose word count changed'] == math.prod(delta) * (len(feats) - 1)


def test_successive_cross_pairs_every_a_sample_with_every_b_sample():
    a = torch.tensor([[0, 10, 11, 2, 2, 5, 2], [0, 12, 13, 2, 2, 5, 2]])  # part a (1, 3) differs
    b = torch.tensor([[0, 9, 9, 2, 2, 20, 2], [0, 9, 9, 2, 2, 21, 2]])  # part b (5, 6) differs
    rows = xlt.successive_cross(a, b, (1, 3)).tolist()
    assert sorted((r[1], r[5]) for r in rows) == [(10, 20), (10, 21), (12, 20), (12, 21)]
    assert all(r[:1] + r[3:5] + r[6:] == [0, 2, 2, 2] and r[2] == r[1] + 1 for r in rows)


# ----------------------------------------------------------------------------------------
# The whole run: warm-ups, three XLA epochs, the report; a resumed run goes on where it stopped.

@pytest.mark.slow
def test_xla_run_reports_every_model_and_resumes_without_redoing_finished_stages(demo_data, tmp_path, capsys, monkeypatch):
    init = quick_pretrained(demo_data, tmp_path / 'pre', steps=30)  # its MLM head makes the vicinal samples
    out = tmp_path / 'xla'
    argv = ['--method', 'xla', '--task', 'panx', '--init', init, '--epochs', '2', '--xla_lr', '1e-4']
    etas, alphas, distil, mixture = [], [], xlt.distil, xlt.mixture_batches
    monkeypatch.setattr(xlt, 'distil', lambda run, model, sets, eta: etas.append(eta) or distil(run, model, sets, eta))
    monkeypatch.setattr(xlt, 'mixture_batches', lambda sizes, alpha, *a, **k: alphas.append(alpha) or mixture(sizes, alpha, *a, **k))
    demo_run(out, demo_data, argv)
    labellings = [len(list(out.glob(f'epoch{e}/labels-*.pt'))) for e in (1, 2, 3)]  # a checkpoint labels once an epoch
    assert etas == [0.8] * labellings[0] + [1.0] * sum(labellings[1:])  # Table 8's eta per epoch (80, 100, 100)
    assert alphas == [0.7] * 18  # Eq. 2's alpha in each model's two trainings an epoch
    first = json.loads((out / 'results.json').read_text())
    assert set(first['runs']) == {'warm-up (zero-shot + penalty), mean', 'XLA model 1', 'XLA model 2', 'XLA model 3',
                                  'XLA mean of the models', 'XLA std of the models'}
    models = [first['runs'][f'XLA model {m}']['test'] for m in (1, 2, 3)]
    for lang in models[0]:  # the paper's report: the three models' mean and standard deviation
        assert first['runs']['XLA mean of the models']['test'][lang] == pytest.approx(statistics.mean(m[lang] for m in models))
        assert first['runs']['XLA std of the models']['test'][lang] == pytest.approx(statistics.pstdev(m[lang] for m in models))
    assert (out / 'predictions' / 'panx' / 'test-de.tsv').exists() and (out / 'model3' / 'predictions').exists()
    # on disk: no finished training keeps its resume point, nor one whose model was not kept its best.pt
    assert not list(out.rglob('last.pt')) and len(list(out.rglob('trained.json'))) >= 3 + 9
    better = {p.parent: json.loads(p.read_text())['better'] for p in out.glob('epoch*/model*/results.json')}
    assert len(better) == 18 and all((folder / 'best.pt').exists() == kept for folder, kept in better.items())
    kept = lambda e, m: set(json.loads((out / f'epoch{e}' / m / 'results.json').read_text())['kept'])
    trainings = ('model3-by12', 'model2-by13', 'model3-by21', 'model1-by23', 'model2-by31', 'model1-by32')
    assert all(kept(1, m) == {'source', 'target'} and kept(2, m) == {'target vicinal'} for m in trainings)  # line 22
    stage = json.loads((out / 'epoch3' / 'model1-by23' / 'results.json').read_text())
    assert set(stage['kept']) == {'source', 'target', 'source vicinal', 'target vicinal'}
    assert stage['kept']['source vicinal'] <= 3 * 40 and stage['kept']['source'] == 40
    # as if killed during epoch 2's second training (model 2 by 1 and 3): what it and later stages wrote is gone
    began = min(p.stat().st_mtime for p in (out / 'epoch2' / 'model2-by13').iterdir())
    for path in [p for p in out.rglob('*') if p.is_file() and p.stat().st_mtime >= began]:
        path.unlink()
    capsys.readouterr()
    demo_run(out, demo_data, argv + ['--resume'])
    said = capsys.readouterr().out
    trained = lambda e, m: f'XLA epoch {e}, model {m}: trained on' in said
    assert 'warm-up 1 of 3' not in said and not any(trained(1, m) for m in ('3 by 1 and 2', '1 by 3 and 2'))
    assert not trained(2, '3 by 1 and 2') and trained(2, '2 by 1 and 3') and trained(3, '1 by 3 and 2')
    assert json.loads((out / 'results.json').read_text())['runs'] == first['runs']  # the same run, resumed
    (out / 'results.json').unlink()
    demo_run(out, demo_data, argv + ['--eval_only'])  # the models the run ended with, evaluated again
    assert json.loads((out / 'results.json').read_text())['runs'] == first['runs']
    # --xla_epochs 0: the three warm-ups alone (reused from --warmup_dir), their mean and their ensemble
    demo_run(tmp_path / 'zero', demo_data, argv + ['--xla_epochs', '0', '--warmup_dir', str(out)])
    zero = json.loads((tmp_path / 'zero' / 'results.json').read_text())
    for m in (1, 2, 3):
        assert zero['runs'][f'warm-up model {m}']['test'] == json.loads((out / f'warmup-{m}' / 'results.json').read_text())['test']
    assert zero['runs']['warm-up mean of the models']['test'] == first['runs']['warm-up (zero-shot + penalty), mean']['test']
    assert not list((tmp_path / 'zero').glob('epoch*')) and zero['test'] != zero['runs']['warm-up model 1']['test']
    assert set(zero['runs']) == {'warm-up model 1', 'warm-up model 2', 'warm-up model 3', 'warm-up mean of the models',
                                 'warm-up std of the models'}
    # warm-ups kept for other runs are reused only with the same settings
    one_line(['--demo', '--out', str(out), *argv, '--warmup_dir', str(out), '--conf_penalty', '0.5'],
             'holds a finished warmup-1 with --conf_penalty 1.0 (this run: 0.5)')
    assert (out / 'final-models.json').exists()  # the refused run removed nothing
    capsys.readouterr()
    demo_run(out, demo_data, argv)  # a new run in a used folder starts over, but for finished warm-ups of its settings
    said = capsys.readouterr().out
    assert 'warmup-1: reused' in said and 'warm-up 1 of 3' not in said and trained(1, '3 by 1 and 2')
    assert json.loads((out / 'results.json').read_text())['runs'] == first['runs']
    # --distil gmm end to end: a model keeps the samples whose low-loss posterior is at least --posterior
    posteriors, gmm_good = [], xlt.gmm_good
    monkeypatch.setattr(xlt, 'gmm_good', lambda loss: posteriors.append(gmm_good(loss)) or posteriors[-1])
    demo_run(tmp_path / 'gmm', demo_data, argv + ['--distil', 'gmm', '--xla_epochs', '1', '--warmup_dir', str(out)])
    keep = [torch.load(tmp_path / 'gmm' / 'epoch1' / f'labels-xla-warmup-{m}.pt', weights_only=True)['target']['keep']
            for m in (1, 2)]  # the warm-ups in --warmup_dir xla
    assert all(torch.equal(k, p >= 0.5) for k, p in zip(keep, posteriors[:2]))  # the first two labellers
    assert any(0 < k.sum() < len(k) for k in keep)  # not a confidence share: what the posterior says
    # the ablations run: without vicinal samples epoch 2 trains on the target set, no sample is made
    demo_run(tmp_path / 'ablations', demo_data, argv + ['--no_vicinal', '--union', '--xla_epochs', '2', '--warmup_dir', str(out)])
    assert set(json.loads((tmp_path / 'ablations' / 'epoch2' / 'model1-by23' / 'results.json').read_text())['kept']) == {'target'}
    assert not list((tmp_path / 'ablations').glob('epoch*/*vicinal*'))
    # each model instead of co-teaching (Table 5's φ, a mean of three): each warm-up trained on what it keeps itself
    demo_run(tmp_path / 'single', demo_data, argv + ['--single', '--xla_epochs', '1', '--warmup_dir', str(out)])
    for m in (1, 2, 3):
        kept = torch.load(tmp_path / 'single' / 'epoch1' / f'labels-xla-warmup-{m}.pt', weights_only=True)['target']['keep']
        trained = json.loads((tmp_path / 'single' / 'epoch1' / f'model{m}-by{m}{m}' / 'results.json').read_text())['kept']
        assert trained == {'source': 40, 'target': int(kept.sum())}
    assert len(list((tmp_path / 'single').glob('epoch1/model*'))) == 3
    assert {'XLA model 3', 'XLA mean of the models'} <= set(json.loads((tmp_path / 'single' / 'results.json').read_text())['runs'])


def test_share_of_draws_disjoint_parts_in_order():
    rows = list(range(100))
    a, b = data.share_of(rows, 0.05, part=0), data.share_of(rows, 0.05, part=1)
    assert len(a) == len(b) == 5 and not set(a) & set(b) and a == sorted(a) and b == sorted(b)
    assert a == data.share_of(rows, 0.05, part=0) and data.share_of(rows, 1.0, part=1) == rows
    assert len(data.share_of(rows, 0.5, part=1)) == 50 and not set(data.share_of(rows, 0.5)) & set(data.share_of(rows, 0.5, part=1))


def test_xla_refuses_what_it_cannot_do():
    one_line(['--method', 'xla', '--task', 'xquad', '--demo'], 'xla runs xnli, pawsx, panx, udpos, conll, not xquad')
    one_line(['--method', 'zeroshot', '--task', 'xnli', '--eta', '50', '--demo'], '--eta belongs to --method xla, not to zeroshot on xnli')
    one_line(['--method', 'xla', '--task', 'panx', '--demo', '--delta', '2', '2'], '--delta takes one number (samples per sentence) for panx')
    one_line(['--method', 'xla', '--task', 'xnli', '--demo', '--posterior', '0.5'], '--posterior is the threshold of --distil gmm')
    one_line(['--method', 'xla', '--task', 'xnli', '--from_scratch', '--data_dir', '/nonexistent'], 'pass --train_lang')
    args = train.parse_args(['--method', 'xla', '--task', 'xnli', '--train_lang', 'de', '--init', 'x.pt'])
    assert (args.lr, args.epochs, args.batch_size, args.xla_lr, args.eta, args.aug_share, args.delta, args.train_share) == \
        (1e-6, 6, 32, 1e-6, [50, 80, 100], 0.3, [2, 2], 0.05)  # Table 8
    args = train.parse_args(['--method', 'xla', '--task', 'panx', '--train_lang', 'de', '--distil', 'gmm'])
    assert (args.delta, args.posterior, args.alpha, args.xla_epochs, args.max_len) == ([3], 0.5, 0.7, 3, 280)
    assert (args.eval_steps, args.xla_eval_steps) == (50, 50)  # Table 8's logging step: warm-up, adaptation
    xla = lambda task, *more: train.parse_args(['--method', 'xla', '--task', task, '--train_lang', 'de', '--model', 'large', *more])
    assert [(a.eval_steps, a.xla_eval_steps, a.xla_epochs) for a in (xla('xnli'), xla('pawsx'))] == [(50, 25, 3), (50, 25, 6)]
    warm_up = lambda a: (a.lr, a.epochs, a.batch_size, a.weight_decay, a.warmup)
    for task in ('xnli', 'pawsx'):  # 100%: Table 8 gives 5% alone; the warm-up is the zero-shot baseline's
        zeroshot = train.parse_args(['--method', 'zeroshot', '--task', task, '--model', 'large'])
        full = xla(task, '--train_share', '1')
        assert warm_up(full) == warm_up(zeroshot) != warm_up(xla(task)) and full.train_share == 1
        assert (full.xla_lr, full.xla_batch_size, full.xla_eval_steps, full.eta) == (1e-6, 32, 25, xla(task).eta)
        assert full.weight_decay == 0.0 and full.xla_weight_decay == xla(task).xla_weight_decay == 0  # Table 8's XLA epochs


@pytest.mark.slow
def test_xla_under_two_processes_makes_the_samples_one_process_makes(demo_data, tmp_path):
    init = quick_pretrained(demo_data, tmp_path / 'pre', steps=30)
    out = tmp_path / 'ddp'
    argv = ['--method', 'xla', '--task', 'panx', '--init', init, '--epochs', '1', '--xla_epochs', '2', '--xla_batch_size', '8']
    demo_run(out, demo_data, argv, runner=[sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2'])
    assert 'XLA model 3' in json.loads((out / 'results.json').read_text())['runs']
    # GEN-LM sharded over two processes and gathered = GEN-LM in one (the draws follow the sentence)
    args = train.parse_args(['--demo', '--out', str(out), *argv])
    args.data_dir, args.out = demo_data, str(tmp_path)
    tok = data.Tokenizer(f'{demo_data}/sentencepiece.bpe.model')
    target = data.unlabelled_set(data.Tokenization(tok, demo_data, 'panx', args.max_len), args.train_lang, args.train_share)
    run = train.Run(args, 0, 1, torch.device('cpu'), tok)
    one = xlt.vicinal_samples(run, target, [part.eval() for part in run.pretrained(init=args.init)[:2]], 2, 'one')
    two = data.Items(str(out / 'epoch2' / 'target-vicinal'))
    fields = lambda items: [(s.ids, s.example, s.words, s.label) for s in map(items.__getitem__, range(len(items)))]
    assert len(one) > len(target) and fields(one) == fields(two)
    # DISTIL's labels and choices, each process labelling its block, = one process labelling all
    labels = xlt.distil(run, str(out / 'warmup-1' / 'best.pt'), {'target': target}, args.eta[0] / 100)['target']
    sharded = torch.load(out / 'epoch1' / 'labels-warmup-1.pt', weights_only=True)['target']
    assert [torch.equal(labels[key], sharded[key]) for key in ('label', 'ends', 'keep')] == [True] * 3
    assert torch.allclose(labels['confidence'], sharded['confidence'], atol=1e-5) and 0 < labels['keep'].sum() < len(target)


def test_each_seed_keeps_its_warm_ups_apart_in_the_shared_folder():
    import train
    out = lambda seed: [s['out'] for s in xlt.XLA.stages(train.parse_args(
        ['--method', 'xla', '--task', 'conll', '--train_lang', 'es', '--warmup_dir', 'w', '--seed', str(seed)])).values()]
    assert out(1000) == ['w/warmup-1', 'w/warmup-2', 'w/warmup-3']  # the default seed's where they always were
    assert out(1) == ['w/seed1/warmup-1', 'w/seed1/warmup-2', 'w/seed1/warmup-3']
