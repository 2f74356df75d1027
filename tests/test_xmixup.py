"""X-Mixup: lambda = 0 is the plain encoder, Eq. 3-5 by hand, the scheduled sampling of Eq. 6,
inference, and the method end to end on the demo data."""
import argparse
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import layers
import xlt
from conftest import padded_batch, quick_pretrained
from test_train import eval_cli, run


def model(task='xnli', layer=2, n_layer=3, **flags):
    """A small X-Mixup with random LayerNorm weights (so that where a LayerNorm is applied shows)."""
    torch.manual_seed(0)
    enc = layers.Encoder(layers.Config(vocab_size=60, n_layer=n_layer, n_head=2, dim=16, ffn_dim=32))
    with torch.no_grad():
        for ln in (mod for mod in enc.modules() if isinstance(mod, torch.nn.LayerNorm)):
            ln.weight.copy_(1 + 0.5 * torch.randn_like(ln.weight))
            ln.bias.copy_(0.3 * torch.randn_like(ln.bias))
    return xlt.XMixup(enc, task, argparse.Namespace(mixup_layer=layer, **flags)).eval()


def pair():
    src, tgt = padded_batch(60, [9, 5], seed=1), padded_batch(60, [4, 7], seed=2)
    return data.Pair(data.Batch(src, src.ne(1)), data.Batch(tgt, tgt.ne(1)))


def test_lambda_zero_normalises_the_target_twice():
    """Eq. 4 as the released code: lambda = 0 gives LN(h_T) with h_T already normalised, then the FFN."""
    m, p = model(), pair()
    enc, t = m.encoder, p.tgt
    m.lambda_0 = 0.0
    with torch.no_grad():
        _, h_t, lam = m.encode(p.src, t)
        assert lam.abs().max() == 0
        block = enc.blocks[1]
        x = enc.blocks[0](enc.embed(t.ids), t.mask)
        twice = block.ln1(block.ln1(x + block.attn(x, t.mask)))
        expected = enc.blocks[2](block.ln2(twice + block.ffn(twice)), t.mask)
        assert (h_t - expected).abs().max() <= 1e-5
        assert (h_t - enc(t.ids, t.mask)).abs().max() > 1e-2  # not the plain layer


def layer_norm(x, ln):
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def attention_by_hand(attn, q_in, kv_in, key_mask, heads=2):
    """softmax(Q K^T / sqrt(d)) V per head, then the output projection (Eq. 3), with explicit
    matmuls -> (output, probabilities, the raw scores)."""
    D = q_in.size(-1)
    w, b = attn.qkv.weight, attn.qkv.bias
    q, k, v = q_in @ w[:D].T + b[:D], kv_in @ w[D:2 * D].T + b[D:2 * D], kv_in @ w[2 * D:].T + b[2 * D:]
    split = lambda t: t.view(t.size(0), t.size(1), heads, D // heads).transpose(1, 2)
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(D // heads)
    probs = scores.masked_fill(~key_mask[:, None, None, :], float('-inf')).softmax(-1)
    out = (probs @ split(v)).transpose(1, 2).reshape(q_in.size(0), -1, D)
    return out @ attn.out.weight.T + attn.out.bias, probs, scores


def test_mixed_state_and_entropy_by_hand():
    m, p = model(layer=1, n_layer=1), pair()
    block, enc = m.encoder.blocks[0], m.encoder
    with torch.no_grad():
        m.w.fill_(0.7), m.b.fill_(-0.3)
        x_s, x_t = enc.embed(p.src.ids), enc.embed(p.tgt.ids)
        a_s = x_s + attention_by_hand(block.attn, x_s, x_s, p.src.mask)[0]
        a_t = x_t + attention_by_hand(block.attn, x_t, x_t, p.tgt.mask)[0]
        h_s, h_t = layer_norm(a_s, block.ln1), layer_norm(a_t, block.ln1)
        h_ts, probs_ts, scores = attention_by_hand(block.attn, h_t, h_s, p.src.mask)  # Eq. 3
        # A^T: the same scores, each source token normalised over the real target tokens
        probs_st = scores.transpose(-1, -2).masked_fill(~p.tgt.mask[:, None, None, :], float('-inf')).softmax(-1)
        # Eq. 5 by loops: over real query tokens only, over heads, padded keys have probability 0
        def entropy(probs, query_mask):
            out = []
            for b in range(probs.size(0)):
                rows = [-(probs[b, h, i] * probs[b, h, i].clamp_min(1e-30).log()).sum()
                        for h in range(probs.size(1)) for i in range(probs.size(2)) if query_mask[b, i]]
                out.append(sum(rows) / len(rows))
            return torch.stack(out)
        H = entropy(probs_ts, p.tgt.mask) + entropy(probs_st, p.src.mask)
        assert torch.allclose(xlt.attention_entropy(scores, p.tgt.mask, p.src.mask), entropy(probs_ts, p.tgt.mask), atol=1e-6)
        lam = 0.5 * torch.sigmoid(H * 0.7 - 0.3)  # Eq. 5 with W = 0.7, b = -0.3
        mixed = layer_norm(lam.view(-1, 1, 1) * h_ts + (1 - lam.view(-1, 1, 1)) * h_t, block.ln1)  # Eq. 4, released
        expected_t = layer_norm(mixed + block.ffn(mixed), block.ln2)
        expected_s = layer_norm(h_s + block.ffn(h_s), block.ln2)
        out_s, out_t, got_lam = m.mix(block, x_s, p.src.mask, x_t, p.tgt.mask)
    assert torch.allclose(got_lam.view(-1), lam.view(-1), atol=1e-6)
    assert (out_t - expected_t).abs().max() <= 1e-5 and (out_s - expected_s).abs().max() <= 1e-5


@pytest.mark.parametrize('step', [0, 500, 1000, 3000, 6908, 10000])
def test_p_star_follows_the_inverse_sigmoid(step):
    m = model()
    m.p_k, m.step = 1000, step
    assert m.p_star() == pytest.approx(1000 / (1000 + math.exp(step / 1000)))
    if step == 6908:  # k ln k: the halfway point
        assert m.p_star() == pytest.approx(0.5, abs=1e-3)


def test_source_switches_between_real_and_round_trip_at_the_rate_p_star():
    m = model()
    n = 4000
    real, trip = torch.full((n, 3), 11), torch.full((n, 5), 22)
    p = data.Pair(data.Batch(real, real.ne(1), torch.zeros(n, dtype=torch.long)), data.Batch(real, real.ne(1)),
                  data.Batch(trip, trip.ne(1), torch.ones(n, dtype=torch.long)))
    m.p_k = 100
    for step in (0, 300, 460, 900):
        m.step = step
        torch.manual_seed(step)
        src, real = m.scheduled_source(p)
        share = real.float().mean().item()
        is_real = src.ids[:, 0] == 11
        assert torch.equal(real, is_real)
        assert share == pytest.approx(m.p_star(), abs=4 * math.sqrt(0.25 / n))  # four standard deviations
        assert (src.labels == 0).tolist() == is_real.tolist()  # labels follow their text
        assert (src.ids[is_real, 3:] == 1).all() and (src.mask[is_real].sum(1) == 3).all()  # padded to 5
    p.alt = None
    assert m.scheduled_source(p)[0] is p.src  # no round-trip data: always the real text


def test_inference_variants():
    m, p = model(), pair()
    with torch.no_grad():
        h_s, h_t, _ = m.encode(p.src, p.tgt)
        mean = (m.head(h_t, p.tgt.mask) + m.head(h_s, p.src.mask)) / 2
        assert torch.allclose(m.predict(p), mean, atol=1e-6)  # classification: both sides' logits, averaged
        m.mixup_inference = False
        assert torch.allclose(m.predict(p), m.head(m.encoder(p.tgt.ids, p.tgt.mask), p.tgt.mask), atol=1e-6)
    q = model(task='xquad')
    with torch.no_grad():
        h_t = q.encode(p.src, p.tgt)[1]
        expected = q.head.out(h_t).masked_fill(~p.tgt.mask[..., None], float('-inf'))  # padding out of the softmax
        assert torch.equal(q.predict(p), expected)


@pytest.mark.slow
def test_xmixup_end_to_end(tmp_path, capsys):
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=150, n_eval=30)
    os.remove(os.path.join(demo, 'xnli', 'round-trip', 'train-en-zh-en.tsv'))
    init = quick_pretrained(demo, tmp_path / 'pretrained')
    results = run(tmp_path / 'run', demo, '--method', 'xmixup', '--task', 'xnli', '--epochs', '4', '--p_k', '10', '--init', init)
    assert capsys.readouterr().out.count('warning: no round-trip data for xnli in zh') == 1
    logged = [json.loads(line) for line in open(tmp_path / 'run' / 'log.jsonl') if '"loss"' in line]
    assert all(0 < r['lambda'] < 0.5 for r in logged)
    assert logged[0]['p_star'] > 0.8 > 0.2 > logged[-1]['p_star']
    scores = eval_cli(tmp_path / 'run', demo)['xnli']
    assert {k: v for k, v in results['test'].items() if k != 'gap'} == pytest.approx(
        {**scores['accuracy'], 'avg': scores['avg_accuracy']}, abs=1e-9)
    # tagging needs a source-language model's labels for T
    with pytest.raises(SystemExit, match='pass --teacher RUN'):
        run(tmp_path / 'tag', demo, '--method', 'xmixup', '--task', 'panx', '--epochs', '1', '--init', init)


def labelled_side(family, lengths, seed, n_labels):
    """A batch of random ids with random labels of the family (tagging: about 70% of the real
    tokens labelled, never <s>)."""
    g = torch.Generator().manual_seed(seed)
    ids = padded_batch(60, lengths, seed=seed)
    mask = ids.ne(1)
    if family == 'classification':
        labels = torch.randint(0, n_labels, (len(lengths),), generator=g)
        ids[:, 0] = torch.randint(4, 60, (len(lengths),), generator=g)  # a first token that differs: unequal <s> states
    elif family == 'tagging':
        chosen = mask & (torch.rand(ids.shape, generator=g) < 0.7)
        chosen[:, 0] = False
        labels = torch.where(chosen, torch.randint(0, n_labels, ids.shape, generator=g), data.IGNORE)
    else:
        labels = torch.stack([torch.randint(1, n - 1, (2,), generator=g).sort().values for n in lengths])
    return data.Batch(ids, mask, labels, list(range(len(lengths))), labels.ne(data.IGNORE) if family == 'tagging' else None)


def ce(logits, label):
    return -logits.log_softmax(-1)[label]


def kl(p, q):  # sum p log(p / q) over the last dimension
    return (p * (p.log() - q.log())).sum(-1)


@pytest.mark.parametrize('task, ablation', [('xnli', {}), ('panx', {}), ('mlqa', {}), ('xnli', {'no_mse': True}),
                                            ('xnli', {'no_kl': True}), ('mlqa', {'mixup_alpha': 0.7}),
                                            ('panx', {'no_mse': True, 'mixup_alpha': 0.3})])
def test_xmixup_loss_is_eq_7_and_8_by_hand(task, ablation):
    """The whole training loss from the heads' outputs, example by example: Eq. 8's alpha mix for a
    real source; for QA and tagging, the target's loss alone (weight 1) for a round-trip source;
    Eq. 7's MSE on <s> (classification) or the mean of the tokens between <s> and </s>, and KL(p_S || p_T);
    the ablations of Tables 5 and 9 without the MSE (--no_mse) or the KL (--no_kl), and another alpha."""
    family, n_labels = data.TASKS[task].family, max(2, len(data.TASKS[task].labels))
    m = model(task, **ablation)
    with torch.no_grad():
        for linear in (m.head.dense, m.head.out):  # distributions far from uniform: KL(p_S || p_T) is not KL(p_T || p_S)
            linear is None or linear.weight.mul_(20)
    src, tgt, alt = (labelled_side(family, lengths, seed, n_labels)
                     for lengths, seed in (([9, 5, 7, 6], 1), ([4, 7, 8, 5], 2), ([8, 6, 5, 7], 3)))
    if family == 'tagging':  # T learns from a teacher's stored word distributions
        tgt.labels = None
        m.p_teacher = [torch.rand(n, n_labels, generator=torch.Generator().manual_seed(n)).softmax(-1) for n in (4, 7, 8, 5)]
    m.p_k, m.step = 10, 23  # p* = 0.50
    torch.manual_seed(5)
    real = (torch.rand(4) < m.p_star()).tolist()
    assert 0 < sum(real) < 4  # both kinds of source in the batch
    def one(b, i):  # example i alone, without padding
        n = int(b.mask[i].sum())
        cut = lambda t: None if t is None else t[i:i + 1, :n] if t.dim() == 2 and family != 'qa' else t[i:i + 1]
        return data.Batch(b.ids[i:i + 1, :n], b.mask[i:i + 1, :n], cut(b.labels), [i], cut(b.first))
    parts = []
    with torch.no_grad():
        for i in range(4):
            s, t = one(src if real[i] else alt, i), one(tgt, i)
            h_s, h_t, _ = m.encode(s, t)
            z_s, z_t = m.head(h_s, s.mask)[0], m.head(h_t, t.mask)[0]
            if family == 'classification':
                r_s, r_t = h_s[0, 0], h_t[0, 0]
                task_s, task_t = ce(z_s, s.labels[0]), ce(z_t, t.labels[0])
                extra = kl(z_s.softmax(-1), z_t.softmax(-1))
            elif family == 'qa':
                r_s, r_t = h_s[0, 1:-1].mean(0), h_t[0, 1:-1].mean(0)
                span = lambda z, y: (ce(z[:, 0], y[0]) + ce(z[:, 1], y[1])) / 2
                task_s, task_t, extra = span(z_s, s.labels[0]), span(z_t, t.labels[0]), 0.0
            else:
                r_s, r_t = h_s[0, 1:-1].mean(0), h_t[0, 1:-1].mean(0)
                labelled = s.labels[0].ne(data.IGNORE)
                task_s = sum(ce(z_s[j], s.labels[0, j]) for j in range(len(labelled)) if labelled[j])
                task_t = sum(kl(m.p_teacher[i][j], z_t[j].softmax(-1)) for j in range(len(t.ids[0])) if t.first[0, j])
                extra = 0.0
            parts.append((task_s, task_t, ((r_s - r_t) ** 2).mean(), extra, int(s.labels.ne(data.IGNORE).sum()),
                          int(t.first.sum()) if family == 'tagging' else 1))
        if family == 'classification':
            assert sum(p[3] for p in parts) > 0.1  # a KL that matters in the total
        a = ablation.get('mixup_alpha', {'classification': 0.4, 'tagging': 0.8, 'qa': 0.2}[family])
        parts = [(p[0], p[1], 0.0 if ablation.get('no_mse') else p[2], 0.0 if ablation.get('no_kl') else p[3], *p[4:])
                 for p in parts]
        if family == 'tagging':  # token means over the batch, each token weighted by its example's weight
            n_s, n_t = sum(p[4] for p in parts), sum(p[5] for p in parts)
            expected = (sum(a * p[0] for p, r in zip(parts, real) if r) / n_s
                        + sum((1 - a if r else 1.0) * p[1] for p, r in zip(parts, real)) / n_t
                        + sum(p[2] for p in parts) / 4)
        else:
            expected = sum((a * p[0] + (1 - a) * p[1] if r or family == 'classification' else p[1]) + p[2] + p[3]
                           for p, r in zip(parts, real)) / 4
        torch.manual_seed(5)
        loss, logs = m.loss(data.Pair(src, tgt, alt))
    assert logs['real_source'] == sum(real) / 4
    assert loss.item() == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize('n_layer,expected', [(24, (1, 4, 16)), (12, (1, 4, 8)), (6, (1, 4, 4))])
def test_only_qa_mixup_layer_depends_on_depth(n_layer, expected):
    """Section 4.1 and the released scripts: layer 1 (classification) and 4 (tagging) at any depth;
    QA at 16 of 24, 8 of 12."""
    enc = layers.Encoder(layers.Config(vocab_size=60, n_layer=n_layer, n_head=2, dim=8, ffn_dim=8))
    got = tuple(xlt.XMixup(enc, task, argparse.Namespace()).layer for task in ('xnli', 'panx', 'mlqa'))
    assert got == expected


def test_the_ablations_without_mixup_and_without_scheduled_sampling():
    """--no_mixup: each side through the plain encoder, no lambda to learn, the target alone predicts; without
    scheduled sampling the real English is the source whatever p*."""
    m, p = model('xnli', no_mixup=True), pair()
    with torch.no_grad():
        h_s, h_t, lam = m.encode(p.src, p.tgt)
        assert torch.equal(h_s, m.encoder(p.src.ids, p.src.mask)) and torch.equal(h_t, m.encoder(p.tgt.ids, p.tgt.mask))
        assert not hasattr(m, 'w') and lam.abs().sum() == 0
        assert torch.equal(m.predict(p), m.head(m.encoder(p.tgt.ids, p.tgt.mask), p.tgt.mask))
    m = model('xnli', no_scheduled_sampling=True)
    m.p_k, m.step = 10, 100  # p* near 0: every source would be the round trip
    alt = data.Batch(p.tgt.ids, p.tgt.mask)
    source, real = m.scheduled_source(data.Pair(p.src, p.tgt, alt))
    assert source is p.src and real.all()
    m = model('xnli')
    m.p_k, m.step = 10, 100
    assert not m.scheduled_source(data.Pair(p.src, p.tgt, alt))[1].any()  # with it: the round trips


def test_xmixup_tagging_learns_the_target_from_its_releases_distributions(tmp_path):
    """X-Mixup's released tagging data (translate-train-logits: each translated word with the English model's
    distribution), converted (python data.py download --translations xmixup) and trained on without a teacher: the
    run's stored p_teacher holds each translated word's released distribution on its first piece, in the task's tag
    order, and English paired with itself its own tags."""
    from test_download import released_tagging, TAGS
    import train
    demo = data.make_demo(str(tmp_path / 'data'), n_train=40, n_eval=8)
    pairs = data.read_translations(demo, 'udpos', 'train', 'de')
    sentences = [(t or e)['words'] for e, t in pairs]
    vocab = sorted({w for words in sentences for w in words})  # a word's distribution depends on the word alone, as
    dist = torch.rand(len(vocab), len(TAGS), generator=torch.Generator().manual_seed(0)).softmax(-1)  # a model's on
    soft = [[dist[vocab.index(w)].tolist() for w in words] for words in sentences]  # the same text would
    folder = tmp_path / 'X-Mixup-data'
    released_tagging(folder, 'de', sentences, soft)
    for split in ('dev', 'test'):  # its dev and test sets translated into English, of the demo's sentence counts
        n = len(data.read_split(demo, 'udpos', split, 'de'))
        open(folder / 'udpos' / f'translate-{split}-token' / 'de.txt', 'w').write('Go\t_\n\n' * n)
    open(folder / 'udpos' / 'translate-train-en-token' / 'de.txt', 'w').write(''.join(
        ''.join(f'{w}\t_\n' for w in e['words']) + '\n' for e, _ in pairs))
    data.main(['download', '--task', 'udpos', '--translations', 'xmixup', '--from', str(folder), '--out', demo])
    out = tmp_path / 'run'
    train.main(['--method', 'xmixup', '--task', 'udpos', '--data_dir', demo, '--model', 'tiny', '--from_scratch',
                '--epochs', '1', '--batch_size', '16', '--langs', 'de', '--max_len', '8', '--out', str(out)])
    stored = torch.load(out / 'p_teacher.pt', weights_only=True)  # a data.Ragged
    values, ends = stored.values, stored.ends
    tok = data.Tokenizer(os.path.join(demo, 'sentencepiece.bpe.model'))
    items = data.training_set(data.Tokenization(tok, os.path.join(demo, 'xmixup'), 'udpos', 8), ['de'], 'every_lang',
                              paired=True, round_trip=True)
    first, seen = {}, {}  # where each target window's words start in its sentence (8 tokens: long ones are cut)
    for number in sorted(set(items.index[:, 1].tolist())):  # a sentence's windows are numbered in order
        window = items.feature(number)
        if window.label is None:  # a translation's (English's own, paired with itself, are labelled)
            n = window.example - len(pairs)  # examples are numbered over the set's sources, English's first
            first[number], seen[n] = seen.get(n, 0), seen.get(n, 0) + len(window.words)
    for i in range(len(items)):
        target, p = items[i][1], values[ends[i]:ends[i + 1]]
        if target.label is None:  # a translated sentence: the released distributions, reordered to TASKS' tags
            a, n = first[int(items.index[i, 1])], target.example - len(pairs)
            released = torch.tensor(soft[n][a:a + len(target.words)])[
                :, [TAGS.index(t) for t in data.TASKS['udpos'].labels]]
            assert torch.allclose(p[target.words], released, atol=1e-5) and p.sum() == pytest.approx(len(released))
        else:  # English with itself: its gold tags
            tagged = [n for n, t in enumerate(target.label) if t != data.IGNORE]
            assert p[tagged].argmax(-1).tolist() == [target.label[n] for n in tagged] and p.sum() == len(tagged)
    assert seen == {n: len(words) for n, words in enumerate(sentences)} and max(
        len(data.tagging_features(tok, 'udpos', [{'words': w, 'tags': None}], 8)) for w in sentences) > 1  # windows
