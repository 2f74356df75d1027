"""VECO: the variable blocks' two streams (Eq. 4-7), Eq. 8 against its terms computed by hand,
BERT masking, the NLU assembly, XLM-R weights in the VECO model, pre-training runs that resume
and split over processes exactly."""
import argparse
import collections
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F

import data
import layers
import train
import xlt
from conftest import demo_run, hf_config, naive_xlmr, one_line, padded_batch, random_hf_weights, write_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 60  # vocabulary of the random batches: ids 4..58 are pieces, 59 is <mask>


def model(seed=0, cross_only_steps=0):
    torch.manual_seed(seed)
    cfg = layers.Config(vocab_size=V, n_layer=2, n_head=2, dim=32, ffn_dim=64)
    return xlt.VecoPretrain(layers.Encoder(cfg, cross=True), mask_id=V - 1, cross_only_steps=cross_only_steps).eval()


def masked_pair(seed=0, parallel=(False, True, True)):
    """x^, y^ with about a third of the pieces masked, their targets, and the row kinds."""
    x, y = padded_batch(V - 1, [9, 6, 11], seed=seed), padded_batch(V - 1, [7, 10, 5], seed=seed + 1)
    torch.manual_seed(seed)
    (x_hat, x_bar), (y_hat, y_bar) = xlt.bert_mask(x, 0.35, V - 1), xlt.bert_mask(y, 0.35, V - 1)
    return x_hat, x.ne(1), x_bar, y_hat, y.ne(1), y_bar, torch.tensor(parallel)


def test_cs_stream_sees_only_the_past_and_is_stream_everything():
    m = model()
    x, xm, _, y, ym, _, _ = masked_pair()
    X = m.inner(x, xm)
    t = 3
    changed = y.clone()
    changed[:, t + 1:] = torch.where(ym[:, t + 1:], (changed[:, t + 1:] + 7) % (V - 5) + 4, changed[:, t + 1:])
    with torch.no_grad():
        cs, cs_changed = m.crossed(y, ym, X, xm), m.crossed(changed, ym, X, xm)
        is_, is_changed = m.inner(y, ym), m.inner(changed, ym)
    assert torch.allclose(cs[:, :t + 1], cs_changed[:, :t + 1], atol=1e-6)  # positions <= t: unchanged
    assert not torch.allclose(cs[:, t + 1:], cs_changed[:, t + 1:], atol=1e-3)
    assert not torch.allclose(is_[:, :t + 1], is_changed[:, :t + 1], atol=1e-3)  # IS-MLM is bidirectional
    # and the CS stream reads the memory: another X^N changes every position
    assert not torch.allclose(cs, m.crossed(y, ym, X.roll(1, 0), xm.roll(1, 0)), atol=1e-3)


def embeddings_of(m):
    """Record the embedding output of each call (inner(x), inner(y), crossed(y), crossed(x), tlm),
    made leaves that require a gradient, so that a gradient can be asked of each stream alone."""
    seen, embed = [], m.encoder.embed

    def recording(ids):
        e = embed(ids).detach().requires_grad_()
        seen.append(e)
        return e
    m.encoder.embed = recording
    return seen


def test_cs_mlm_leaves_x_alone_and_is_mlm_leaves_the_cross_attention_alone():
    m = model()
    seen = embeddings_of(m)
    terms = m.terms(xlt.Masked.of(*masked_pair()))
    e_x, e_y, e_y_cs = seen[0], seen[1], seen[2]
    cross = [p for n, p in m.named_parameters() if '.cross.' in n or '.ln_cross.' in n]
    grads = torch.autograd.grad(terms['cs_xy'], [e_x, e_y, e_y_cs] + cross, allow_unused=True, retain_graph=True)
    assert grads[0] is None and grads[1] is None  # X^N detached: nothing flows into x^'s stream
    assert grads[2].abs().sum() > 0 and all(g is not None and g.abs().sum() > 0 for g in grads[3:])
    grads = torch.autograd.grad(terms['is_x'] + terms['is_y'] + terms['tlm'], cross, allow_unused=True)
    assert all(g is None for g in grads)  # IS-MLM and TLM never pass through a cross-attention


def mlm_ce(m, h, targets):
    """Eq. 5 / 7 by hand: -log P of each chosen token under the MLM head, averaged over them."""
    logits = m.mlm(h)
    chosen = targets.ne(data.IGNORE)
    return -logits.log_softmax(-1)[chosen].gather(1, targets[chosen][:, None]).mean()


def by_hand(m, x, xm, x_bar, y, ym, y_bar, parallel):
    """Eq. 8's four terms and TLM from the blocks called one by one, no VecoPretrain code."""
    enc = m.encoder

    def stream(ids, mask, memory=None, memory_mask=None):
        h = enc.embed(ids)
        for block in enc.blocks:
            h = block(h, mask, memory, memory_mask, causal=memory is not None)
        return h
    X, Y = stream(x, xm), stream(y, ym)
    terms = {'is_x': mlm_ce(m, X, x_bar), 'is_y': mlm_ce(m, Y, y_bar),
             'cs_xy': mlm_ce(m, stream(y, ym, X, xm), y_bar), 'cs_yx': mlm_ce(m, stream(x, xm, Y, ym), x_bar)}
    rows, ids, targets = parallel.nonzero().squeeze(1).tolist(), [], []
    for r in rows:  # <s> x </s></s> y </s>: y's <s> becomes </s>
        xr, yr = x[r][xm[r]].tolist(), y[r][ym[r]].tolist()
        ids.append(xr + [2] + yr[1:])
        targets.append(x_bar[r][xm[r]].tolist() + y_bar[r][ym[r]].tolist())
    longest = max(map(len, ids))
    ids_t = torch.tensor([i + [1] * (longest - len(i)) for i in ids])
    targets_t = torch.tensor([t + [data.IGNORE] * (longest - len(t)) for t in targets])
    terms['tlm'] = mlm_ce(m, stream(ids_t, ids_t.ne(1)), targets_t)
    return terms


def test_eq8_is_the_sum_of_its_terms_by_hand_and_symmetric():
    m = model()
    batch = masked_pair()
    with torch.no_grad():
        terms, hand = m.terms(xlt.Masked.of(*batch)), by_hand(m, *batch)
        assert terms.keys() == hand.keys()
        for name in hand:
            assert torch.allclose(terms[name], hand[name], atol=1e-5), name
        x, xm, x_bar, y, ym, y_bar, parallel = batch
        swapped = m.terms(xlt.Masked.of(y, ym, y_bar, x, xm, x_bar, parallel))
        eq8 = lambda t: t['is_x'] + t['is_y'] + t['cs_xy'] + t['cs_yx']
        assert torch.allclose(eq8(swapped), eq8(terms), atol=1e-6)  # Eq. 8 (TLM's order of x and y is not)
        assert torch.allclose(swapped['cs_xy'], terms['cs_yx'], atol=1e-6)
        # loss(): the same masks drawn again from the same seed give the sum of the terms
        pair = data.Pair(data.Batch(batch[0], xm, parallel.long()), data.Batch(batch[3], ym, parallel.long()))
        torch.manual_seed(5)
        loss, logs = m.loss(m.host(pair))
        torch.manual_seed(5)
        (x2, xb2), (y2, yb2) = m.masked(pair.src, parallel), m.masked(pair.tgt, parallel)
        expected = by_hand(m, x2, xm, xb2, y2, ym, yb2, parallel)
        assert torch.allclose(loss, sum(expected.values()), atol=1e-5)
        assert logs['tlm'].item() == pytest.approx(expected['tlm'].item(), abs=1e-5)


def test_without_cs_mlm_it_is_xlm_mlm_and_tlm():
    """Table 2's XLM: an encoder without cross-attention, the loss MLM (the IS terms) + TLM, by hand."""
    m = model()
    cfg = m.encoder.cfg
    xlm = xlt.VecoPretrain(layers.Encoder(cfg), mask_id=V - 1, cs_mlm=False).eval()
    assert not any('cross' in k for k in xlm.state_dict())
    xlm.load_state_dict({k: v for k, v in m.state_dict().items() if 'cross' not in k})
    batch = masked_pair()
    with torch.no_grad():
        terms, hand = xlm.terms(xlt.Masked.of(*batch)), by_hand(m, *batch)
    assert terms.keys() == {'is_x', 'is_y', 'tlm'} and all(torch.allclose(t, hand[k], atol=1e-5) for k, t in terms.items())
    pre = lambda *more: train.parse_args(['--method', 'veco', '--task', 'pretrain', '--model', 'veco_small', *more])
    small = pre('--init', 'x.pt', '--no_cs_mlm')
    assert (small.lr, small.adam_beta2, small.adam_eps, small.cross_only_steps) == (3e-4, 0.999, 1e-6, 0)
    assert layers.CONFIGS['veco_small'] == layers.Config(n_layer=6, n_head=12, dim=768, ffn_dim=3072)  # Table 5's small
    one_line(['--method', 'veco', '--task', 'pretrain', '--demo', '--no_cs_mlm', '--cross_only_steps', '5'], 'drop one')


def test_cross_only_phase_trains_the_cross_attention_alone():
    m = model(cross_only_steps=10).train()
    pair = data.Pair(data.Batch(*masked_pair()[0:2], torch.tensor([0, 1, 1])), data.Batch(*masked_pair()[3:5], torch.tensor([0, 1, 1])))
    loss, logs = m.loss(m.host(pair))
    assert 'tlm' not in logs and loss.item() == pytest.approx((logs['cs_xy'] + logs['cs_yx']).item(), rel=1e-6)
    loss.backward()
    m.before_update()  # the first phase: every gradient but the cross-attention's dropped
    names = [n for n, p in m.named_parameters() if p.grad is not None]
    assert names and all('.cross.' in n or '.ln_cross.' in n for n in names)
    assert m.stepped(9) is None and m.stepped(10) == 'every parameter trains from here on' and m.step == 10
    loss, logs = m.loss(m.host(pair))
    loss.backward()
    m.before_update()  # the second phase: every parameter trains
    assert 'tlm' in logs and all(p.grad is not None for p in m.parameters())


def test_evaluation_builds_no_graph_in_either_phase():
    """Under the caller's no_grad (held_out_losses) nothing is saved for a backward pass; in training it is."""
    def saved_for_backward(m, grad):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), torch.set_grad_enabled(grad):
            m.terms(xlt.Masked.of(*masked_pair()))
        return len(saved)
    for cross_only_steps in (0, 10):  # phase 2, then phase 1
        m = model(cross_only_steps=cross_only_steps)
        assert saved_for_backward(m, False) == 0 and saved_for_backward(m, True) > 0


def test_bert_masking_shares_and_targets():
    torch.manual_seed(0)
    ids = torch.randint(4, 1000, (400, 128))
    ids[:, 0], ids[:, -1], ids[:5, 60:] = 0, 2, 1  # <s>, </s>, padding: never chosen
    pieces = ids.ge(4)
    for share in (0.15, 0.25):
        masked, targets = xlt.bert_mask(ids, share, 1000)
        chosen = targets.ne(data.IGNORE)
        assert not chosen[~pieces].any() and torch.equal(targets[chosen], ids[chosen])
        assert abs(chosen.sum() / pieces.sum() - share) < 0.005
        assert torch.equal(masked[~chosen], ids[~chosen])  # unchosen tokens stay, their targets are ignored
        as_mask = masked[chosen].eq(1000).float().mean()
        kept = masked[chosen].eq(ids[chosen]).float().mean()
        others = masked[chosen][masked[chosen].ne(1000)]
        assert abs(as_mask - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and others.ge(4).all()  # random: pieces
    m = model()
    rows = torch.randint(4, V - 1, (2000, 40))
    kind = torch.arange(2000) % 2 == 1  # odd rows parallel: 25%, even rows monolingual: 15%
    _, targets = m.masked(data.Batch(rows, rows.ne(1)), kind)
    share = targets.ne(data.IGNORE).float().mean(1)
    assert abs(share[~kind].mean() - 0.15) < 0.005 and abs(share[kind].mean() - 0.25) < 0.005


def test_steps_alternate_monolingual_and_bilingual_batches_of_their_own_sizes():
    groups = {'mono:en': list(range(50)), 'mono:de': list(range(50, 60)), 'para:de-en': list(range(60, 100))}
    of = lambda i: next(g for g, positions in groups.items() if i in positions)
    sizes = {'mono:en': 3, 'mono:de': 3, 'para:de-en': 12}
    batches = data.pretrain_batches(groups, sizes, 10, seed=0)
    assert [(len({of(i) for i in b}), of(b[0])[:4], len(b)) for b in batches] == [(1, 'mono', 3), (1, 'para', 12)] * 5
    assert {of(b[0]) for b in batches[::2]} == {'mono:en', 'mono:de'}  # both languages drawn
    assert [len(b) for b in data.pretrain_batches({'para:de-en': groups['para:de-en']}, sizes, 3, seed=0)] == [12] * 3
    pre = train.parse_args(['--method', 'veco', '--task', 'pretrain', '--from_scratch'])
    demo = train.parse_args(['--method', 'veco', '--task', 'pretrain', '--demo', '--batch_size', '16'])
    assert (pre.batch_size, pre.para_batch_size, demo.para_batch_size) == (1024, 4096, 16)  # Table 5; the demo 1:1


def test_pretraining_batches_in_tokens_fill_each_micro_batch_from_the_groups_longest_pair():
    """--max_tokens 200 over 2 micro-batches: each group's steps hold 2 x (200 // its longest pair's tokens, both sides)
    pairs."""
    items = [(data.Feature([4] * a), data.Feature([4] * b)) for a, b in ((30, 20), (10, 10), (60, 61), (7, 8), (9, 1))]
    groups = {'mono:en': [0, 1], 'para:de-en': [2, 3], 'mono:de': [4]}
    sizes = data.token_sizes(lambda index: data.item_lengths(items, index), groups, 200, 2)
    assert sizes == {'mono:en': 2 * (200 // 50), 'para:de-en': 2 * (200 // 121), 'mono:de': 2 * (200 // 10)}
    assert [len(b) for b in data.pretrain_batches(groups, sizes, 2, seed=0)] in ([8, 2], [40, 2])


def test_languages_are_drawn_with_the_smoothing_exponent():
    """p_i = q_i^alpha / sum_j q_j^alpha, q_i a language's share of the pairs: Swahili's 10% is
    drawn 34% of the time at XLM-R's 0.3, 25% at VECO's (and XLM's) 0.5, 10% at 1."""
    groups = {'mono:en': range(0, 900), 'mono:sw': range(900, 1000)}
    for alpha, expected in ((0.3, 0.1 ** 0.3 / (0.1 ** 0.3 + 0.9 ** 0.3)), (0.5, 0.1 ** 0.5 / (0.1 ** 0.5 + 0.9 ** 0.5)),
                            (1.0, 0.1)):
        batches = data.pretrain_batches(groups, {'mono:en': 1, 'mono:sw': 1}, 4000, seed=0, alpha=alpha)
        assert abs(sum(b[0] >= 900 for b in batches) / 4000 - expected) < 0.03  # 4 standard deviations
    assert train.parse_args(['--method', 'veco', '--task', 'pretrain', '--from_scratch']).lang_alpha == 0.5


def test_tlm_pairs_are_xlmr_pairs():
    a, b = torch.tensor([[0, 5, 6, 2], [0, 7, 2, 1]]), torch.tensor([[0, 8, 2, 1, 1], [0, 9, 10, 11, 2]])
    ids, mask, order = xlt.concat_pairs(a, a.ne(1), b, b.ne(1))
    assert ids.tolist() == [[0, 5, 6, 2, 2, 8, 2, 1], [0, 7, 2, 2, 9, 10, 11, 2]]
    assert mask.sum(1).tolist() == [7, 8]


def test_nlu_encoder_drops_the_cross_attention_and_equals_the_is_stream(tmp_path):
    m = model(seed=3)
    for p in m.encoder.parameters():  # LayerNorms and biases not at their initial values
        p.data += 0.05 * torch.randn_like(p)
    layers.save_checkpoint(tmp_path / 'veco.pt', {}, **layers.encoder_parts(m.encoder, m.mlm))
    enc, mlm = layers.load_pretrained(str(tmp_path / 'veco.pt'))[:2]
    assert not enc.has_cross and not any('cross' in n for n, _ in enc.named_parameters()) and mlm is not None
    again, _ = layers.load_pretrained(str(tmp_path / 'veco.pt'), cross=True)[:2]
    assert torch.equal(again.blocks[1].cross.qkv.weight, m.encoder.blocks[1].cross.qkv.weight)
    x, xm = masked_pair()[:2]
    with torch.no_grad():
        assert torch.allclose(enc.eval()(x, xm), m.inner(x, xm), atol=1e-6)


def test_xlmr_weights_in_the_veco_model(tmp_path):
    cfg = hf_config(layers=2, dim=32, heads=4, ffn=64, vocab=V)
    sd = random_hf_weights(cfg)
    enc, mlm = layers.load_pretrained(write_hf_dir(sd, cfg, tmp_path / 'hf'), cross=True)[:2]
    assert enc.has_cross and mlm is not None
    for i, block in enumerate(enc.blocks):  # every XLM-R tensor used: here the first layer's query and FFN
        p = f'roberta.encoder.layer.{i}.'
        assert torch.equal(block.attn.qkv.weight[:32], sd[p + 'attention.self.query.weight'])
        assert torch.equal(block.ffn.fc2.bias, sd[p + 'output.dense.bias'])
        assert abs(block.cross.qkv.weight.std().item() - 0.02) < 0.005 and torch.equal(block.ln_cross.weight, torch.ones(32))
    m = xlt.VecoPretrain(enc, V - 1, mlm).eval()
    ids = padded_batch(V, [7, 12, 4])
    hidden, logits = naive_xlmr(sd, 4, ids)
    with torch.no_grad():
        h = m.inner(ids, ids.ne(1))
        real = ids.ne(1)
        assert (h[real].double() - hidden[real]).abs().max() <= 1e-5
        assert (m.mlm(h)[real].double() - logits[real]).abs().max() <= 1e-4
        plain = layers.load_pretrained(os.path.join(tmp_path, 'hf'))[0].eval()  # plain XLM-R, the same weights
        assert (plain(ids)[real] - h[real]).abs().max() <= 1e-6


def pretrain(out, demo_data, *args, runner=None):
    return demo_run(out, demo_data, ['--method', 'veco', '--task', 'pretrain', '--steps', '24', '--eval_every', '12', *args],
                    runner)


@pytest.fixture(scope='module')
def demo_data(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo') / 'demo-data'), n_train=50, n_eval=20)


@pytest.mark.slow
def test_pretraining_ddp_equals_one_process_and_resumes_exactly(tmp_path, demo_data):
    one = pretrain(tmp_path / 'one', demo_data, '--batch_size', '8', '--grad_accum', '2')
    two = pretrain(tmp_path / 'two', demo_data, '--batch_size', '8',
                   runner=[sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2'])
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5
    killed = subprocess.run([sys.executable, 'train.py', '--method', 'veco', '--task', 'pretrain', '--demo', '--out',
                             str(tmp_path / 'one'), '--steps', '24', '--eval_every', '12', '--batch_size', '8',
                             '--grad_accum', '2', '--save_minutes', '0', '--log_every', '5', '--halt_after', '17'], cwd=ROOT, capture_output=True)
    assert killed.returncode == 3
    resumed = pretrain(tmp_path / 'one', demo_data, '--batch_size', '8', '--grad_accum', '2', '--resume')
    assert max((one[k] - resumed[k]).abs().max().item() for k in one) <= 1e-6
    logged = [json.loads(line) for line in open(tmp_path / 'one' / 'log.jsonl')]
    assert {'is_x', 'is_y', 'cs_xy', 'cs_yx', 'tlm'} <= {k for r in logged for k in r}
    results = json.load(open(tmp_path / 'one' / 'results.json'))
    assert {'mono', 'para'} == set(results['held_out']) and 'cs_shuffled' in results['held_out']['para']
    # the checkpoint starts a fine-tuning run: the cross-attention left out
    enc, mlm = layers.load_pretrained(str(tmp_path / 'one' / 'best.pt'))[:2]
    assert not enc.has_cross and mlm is not None


@pytest.mark.slow
def test_each_phase_warms_up_and_phase_2_trains_everything(tmp_path, demo_data):
    """Phase 1 (--cross_only_steps 6) changes the cross-attention alone; phase 2 changes every weight,
    XLM-R's with fresh Adam moments, the cross-attention's with those of phase 1. Each phase warms up
    over --warmup of its own steps, then decays linearly (written out below); the log marks step 6."""
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    cfg = dataclasses.replace(layers.CONFIGS['tiny'], vocab_size=tok.vocab_size)
    torch.manual_seed(3)
    enc = layers.Encoder(cfg)
    mlm = layers.MLMHead(cfg, enc.tok.weight)
    layers.save_checkpoint(str(tmp_path / 'xlmr.pt'), {'method': None, 'task': None, 'model': None}, **layers.encoder_parts(enc, mlm))
    start = {**{f'encoder.{k}': v for k, v in enc.state_dict().items()}, **{f'mlm.{k}': v for k, v in mlm.state_dict().items()}}
    argv = ['--init', str(tmp_path / 'xlmr.pt'), '--steps', '8', '--eval_every', '8', '--cross_only_steps', '6',
            '--warmup', '0.5', '--log_every', '1', '--save_minutes', '0', '--lr', '1e-2']
    os.makedirs(tmp_path / 'one')
    os.symlink(demo_data, tmp_path / 'one' / 'demo-data')
    killed = subprocess.run([sys.executable, 'train.py', '--method', 'veco', '--task', 'pretrain', '--demo', '--out',
                             str(tmp_path / 'one'), *argv, '--halt_after', '6'], cwd=ROOT, capture_output=True)
    assert killed.returncode == 3
    cross = lambda name: layers.is_cross('enc.' + name.removeprefix('encoder.'))
    params = list(xlt.VecoPretrain(layers.Encoder(cfg, cross=True), tok.mask).named_parameters())
    names = [n for n, p in params if p.dim() >= 2] + [n for n, p in params if p.dim() < 2]  # the optimiser's two groups
    adam_steps = lambda run: [int(state['step']) if state else 0 for state in (
        torch.load(tmp_path / run / 'last.pt', weights_only=True)['optimizer']['state'].get(i) for i in range(len(names)))]
    phase_1 = torch.load(tmp_path / 'one' / 'last.pt', weights_only=True)['method']
    assert all(torch.equal(phase_1[k], v) for k, v in start.items())  # XLM-R frozen: unchanged, no Adam state
    assert adam_steps('one') == [6 if cross(n) else 0 for n in names]
    os.makedirs(tmp_path / 'two')
    os.symlink(demo_data, tmp_path / 'two' / 'demo-data')
    killed = subprocess.run([sys.executable, 'train.py', '--method', 'veco', '--task', 'pretrain', '--demo', '--out',
                             str(tmp_path / 'two'), *argv, '--halt_after', '7'], cwd=ROOT, capture_output=True)
    assert adam_steps('two') == [7 if cross(n) else 1 for n in names]  # the cross-attention's moments carried over
    final = demo_run(tmp_path / 'two', demo_data, ['--method', 'veco', '--task', 'pretrain', *argv, '--resume'])
    assert not any(torch.equal(final[k], v) for k, v in phase_1.items())  # phase 2 changes everything
    # the learning rate after each step: phase 1 warms up over 3 of its 6 steps, phase 2 over 1 of its 2
    factor = lambda s: min((s + 1) / 3, (6 - s) / 3) if s < 6 else min(s - 6 + 1, 8 - s)
    log = [json.loads(line) for line in open(tmp_path / 'two' / 'log.jsonl')]
    assert [r['lr'] for r in log if 'lr' in r] == pytest.approx([1e-2 * factor(s) for s in range(1, 9)])
    assert [r['step'] for r in log if 'event' in r] == [6]


def test_pretraining_set_up_errors_are_one_line(tmp_path, demo_data):
    one_line(['--method', 'filter', '--task', 'pretrain', '--demo'], 'pass --method veco')
    one_line(['--method', 'veco', '--task', 'pretrain', '--epochs', '2', '--demo'], 'pre-training is counted in --steps')
    one_line(['--method', 'veco', '--task', 'translate', '--epochs', '2', '--demo'], 'translation is counted in --steps')
    one_line(['--method', 'zeroshot', '--task', 'xnli', '--translate_train_all', '--demo'], '--translate_train_all belongs to --method veco, not to zeroshot')
    one_line(['--method', 'veco', '--task', 'pretrain', '--demo', '--cross_only_steps', '2000'], 'leaves no step of phase 2')
    one_line(['--method', 'veco', '--task', 'pretrain', '--data_dir', str(tmp_path / 'none'), '--from_scratch',
              '--model', 'tiny', '--out', str(tmp_path / 'nothing')], 'mono/<lang>.txt')
    corpus = tmp_path / 'corpus'
    os.makedirs(corpus / 'pretrain' / 'parallel')
    os.symlink(os.path.join(demo_data, 'sentencepiece.bpe.model'), corpus / 'sentencepiece.bpe.model')
    (corpus / 'pretrain' / 'parallel' / 'de-en.de').write_text('eins\nzwei\n')
    (corpus / 'pretrain' / 'parallel' / 'de-en.en').write_text('one\n')
    common = ['--method', 'veco', '--task', 'pretrain', '--data_dir', str(corpus), '--from_scratch', '--model', 'tiny',
              '--out', str(tmp_path / 'run')]
    one_line(common, 'parallel files align line by line')
    os.remove(corpus / 'pretrain' / 'parallel' / 'de-en.en')
    one_line(common, 'has no other side')
    assert not os.path.exists(tmp_path / 'run' / 'config.json')


def test_every_monolingual_document_makes_pairs(tmp_path, demo_data):
    """Adjacent segments pair in order, an odd last one with the one before it; a one-segment
    document is cut at a line boundary, a one-line one at the word start nearest its middle, a
    line without spaces at the piece nearest its middle; a single piece is left out. Each
    document is counted once."""
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    line, chinese, piece = 'Anna reads the book .', data.demo_say('fact', data.demo_fact(__import__('random').Random(0)), 'zh')[0], '.'
    ids, zh = tok.encode(line), tok.encode(chinese)
    n, m = len(ids), len(zh)
    assert len(tok.encode(piece)) == 1 and 3 < m < 3 * n and ' ' not in chinese  # segments of two lines, the zh one
    os.makedirs(tmp_path / 'pretrain' / 'mono')
    # five lines, two a segment: segments (1 2) (3 4) (5); two lines: one segment; one line; Chinese; one piece
    docs = ['\n'.join([line] * 5), '\n'.join([line] * 2), line, chinese, piece]
    (tmp_path / 'pretrain' / 'mono' / 'en.txt').write_text('\n\n'.join(docs) + '\n')
    items, groups, counts = data.pretraining_set(tok, str(tmp_path), max_len=max(2 * n, m) + 2)
    starts = [i for i in range(1, n) if tok.sp.id_to_piece(ids[i] - 1).startswith('\u2581')]
    cut = min(starts, key=lambda i: abs(i - n / 2))  # the word start nearest the middle
    middle = min(range(1, m), key=lambda i: abs(i - m / 2))  # the piece boundary nearest it
    two = [0] + ids * 2 + [2]
    expected = [(two, two), (two, [0] + ids + [2]),  # (1 2)-(3 4), then the odd (5) with (3 4)
                (two[:n + 1] + [2], [0] + ids + [2]),  # two lines: one segment, cut between them
                ([0] + ids[:cut] + [2], [0] + ids[cut:] + [2]),  # one line, cut at a word
                ([0] + zh[:middle] + [2], [0] + zh[middle:] + [2])]  # no spaces: cut at a piece
    assert [(x.ids, y.ids) for x, y in items] == expected and all(x.label == 0 for x, _ in items)
    assert counts == {'adjacent segments': [1, 2, 4 * n], 'odd last segment, with the one before': [0, 1, n],
                      'one segment, cut at a line': [1, 1, 2 * n], 'one line, cut at a word': [1, 1, n],
                      'one line of one word (no spaces), cut at a piece': [1, 1, m], 'left out: a single piece': [1, 1, 1]}
    assert sum(documents for documents, _, _ in counts.values()) == len(docs)


def test_pretraining_text_is_read_a_chunk_at_a_time_and_as_a_whole_file(tmp_path, demo_data, monkeypatch):
    """Documents and parallel lines read a chunk at a time (here one each) from files with a BOM,
    CRLF line ends, a line of spaces and extra blank lines give the pairs, groups and counts of
    the same text read in one chunk from plain files."""
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    line, word = 'Anna reads the book .', 'Anna'
    docs = ['\n'.join([line] * 5), '\n'.join([line] * 2), line, word]
    para = [('Anna reads .', 'Anna liest .'), ('the book', ''), ('a', 'ein'), ('Anna', 'Anna'), ('book .', 'Buch .')]

    def write(folder, mono, parallel, end='\n'):
        os.makedirs(folder / 'pretrain' / 'mono')
        os.makedirs(folder / 'pretrain' / 'parallel')
        (folder / 'pretrain' / 'mono' / 'en.txt').write_bytes(mono.replace('\n', end).encode('utf-8-sig' if end != '\n' else 'utf-8'))
        for side, lang in enumerate(('en', 'de')):
            (folder / 'pretrain' / 'parallel' / f'en-de.{lang}').write_bytes(''.join(p[side] + end for p in parallel).encode())
        return str(folder)
    plain = write(tmp_path / 'plain', '\n\n'.join(docs) + '\n', para)
    messy = write(tmp_path / 'messy', '\n\n\n'.join(docs[:2]).replace(line, line + '\n   ', 1) + '\n\n' + '\n\n'.join(docs[2:]),
                  para, end='\r\n')
    expected = data.pretraining_set(tok, plain, 64)
    monkeypatch.setattr(data, 'TEXT_SLICE', 1)
    items, groups, counts = data.pretraining_set(tok, messy, 64)
    assert [(x.ids, y.ids, x.label) for x, y in items] == [(x.ids, y.ids, x.label) for x, y in expected[0]]
    assert groups == expected[1] == {'mono:en': range(0, 3), 'para:en-de': range(3, 7)}  # 3 documents of pairs; a line has an empty side
    assert counts == expected[2] and counts['left out: parallel lines with an empty side'] == [1, 0, 0]
    assert counts['parallel lines, a pair each'][:2] == [4, 8]


def test_fine_tuning_defaults_are_vecos():
    zero = train.parse_args(['--method', 'veco', '--task', 'xnli'])
    assert (zero.lr, zero.epochs, zero.weight_decay, zero.warmup, zero.batch_size, zero.eval_steps) == (2e-5, 2, 0.0, 0.0, 64, 500)
    assert train.parse_args(['--method', 'veco', '--task', 'xnli', '--translate_train_all']).lr == 5e-6
    qa = train.parse_args(['--method', 'veco', '--task', 'xquad'])
    assert (qa.lr, qa.epochs, qa.batch_size, qa.weight_decay, qa.warmup_steps, qa.doc_stride, qa.eval_steps) == \
        (2e-5, 2, 16, 1e-4, 500, 64, 200)
    base = train.parse_args(['--method', 'zeroshot', '--task', 'xquad'])
    assert (base.warmup_steps, base.weight_decay, base.doc_stride) == (500, 1e-4, 128)  # XTREME's train_qa.sh
    factor = xlt.Baseline(layers.Encoder(layers.CONFIGS['tiny']), 'xquad').schedule(qa, 2000)  # 500 steps up, then down to 0 at 2000
    assert [factor(s) for s in (0, 249, 499, 500, 1250, 1999)] == pytest.approx([1 / 500, 0.5, 1, 1, 0.5, 1 / 1500])
    assert train.parse_args(['--method', 'zeroshot', '--task', 'xnli']).weight_decay == 0.0  # XTREME's scripts, none
    pre = train.parse_args(['--method', 'veco', '--task', 'pretrain', '--init', 'x.pt', '--model', 'large'])
    assert (pre.lr, pre.steps, pre.cross_only_steps, pre.max_len, pre.epochs, pre.adam_beta2) == (
        2e-4, 240000, 12000, 512, None, 0.98)  # train counts 120 of 2000 steps


def test_translate_train_all_trains_on_every_translation(demo_data):
    args = train.parse_args(['--method', 'veco', '--task', 'pawsx', '--demo', '--translate_train_all'])
    args.data_dir = demo_data
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    items = train.Run(args, 0, 1, torch.device('cpu'), tok).items(xlt.method_class(args)(layers.Encoder(layers.CONFIGS['tiny']), 'pawsx'))
    translated = [t for lang in ('de', 'zh') for _, t in data.read_translations(demo_data, 'pawsx', 'train', lang) if t]
    assert len(items) == len(data.read_split(demo_data, 'pawsx', 'train')) + len(translated)  # English, de and zh


def released_nlg_state(seed=0, V=50, D=32, H=2, Fd=64, L=3, P=34):
    """Random weights in the key layout of fairseq's translation models (VECO's released NLG model:
    share_all_embeddings, layernorm_embedding, learned positions), and their args."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2
    emb, sd = r(V, D), {'encoder.version': torch.tensor([3.0]), 'decoder.version': torch.tensor([3.0])}
    for side in ('encoder', 'decoder'):
        sd.update({f'{side}.embed_tokens.weight': emb, f'{side}.embed_positions.weight': r(P, D),
                   f'{side}.layernorm_embedding.weight': 1 + r(D), f'{side}.layernorm_embedding.bias': r(D)})
        for i in range(L):
            p = f'{side}.layers.{i}.'
            for attn in ('self_attn', 'encoder_attn') if side == 'decoder' else ('self_attn',):
                for proj in ('q_proj', 'k_proj', 'v_proj', 'out_proj'):
                    sd[f'{p}{attn}.{proj}.weight'], sd[f'{p}{attn}.{proj}.bias'] = r(D, D), r(D)
                sd[f'{p}{attn}_layer_norm.weight'], sd[f'{p}{attn}_layer_norm.bias'] = 1 + r(D), r(D)
            sd.update({p + 'fc1.weight': r(Fd, D), p + 'fc1.bias': r(Fd), p + 'fc2.weight': r(D, Fd), p + 'fc2.bias': r(D),
                       p + 'final_layer_norm.weight': 1 + r(D), p + 'final_layer_norm.bias': r(D)})
    sd['decoder.output_projection.weight'] = emb
    args = argparse.Namespace(arch='veco_large', encoder_attention_heads=H, activation_fn='gelu', no_scale_embedding=False)
    return {'args': args, 'model': sd}


def fairseq_translation_logits(sd, src, tgt, keep, heads, scale):
    """fairseq's post-LN TransformerEncoder and TransformerDecoder (kept layers `keep`) for one
    source and target prefix, written out in float64 from the raw tensors -> logits (T, V)."""
    w = {k: v.double() for k, v in sd.items()}
    D = w['encoder.embed_tokens.weight'].size(1)
    ln = lambda x, p: F.layer_norm(x, (D,), w[p + '.weight'], w[p + '.bias'], 1e-5)
    lin = lambda x, p: x @ w[p + '.weight'].T + w[p + '.bias']

    def attention(x, memory, p, causal):  # fairseq's MultiheadAttention: q times head_dim ** -0.5
        q, k, v = lin(x, p + '.q_proj') * (D // heads) ** -0.5, lin(memory, p + '.k_proj'), lin(memory, p + '.v_proj')
        q, k, v = (t.view(-1, heads, D // heads).transpose(0, 1) for t in (q, k, v))
        scores = q @ k.transpose(1, 2)
        if causal:
            scores = scores.masked_fill(torch.ones(len(x), len(memory)).triu(1).bool(), float('-inf'))
        return lin((scores.softmax(-1) @ v).transpose(0, 1).reshape(len(x), D), p + '.out_proj')

    def layer(x, p, memory=None):
        x = ln(x + attention(x, x, p + 'self_attn', memory is not None), p + 'self_attn_layer_norm')
        if memory is not None:
            x = ln(x + attention(x, memory, p + 'encoder_attn', False), p + 'encoder_attn_layer_norm')
        return ln(x + lin(F.gelu(lin(x, p + 'fc1')), p + 'fc2'), p + 'final_layer_norm')
    embed = lambda ids, side: ln(scale * w[f'{side}.embed_tokens.weight'][ids] + w[f'{side}.embed_positions.weight'][
        torch.arange(len(ids)) + 2], f'{side}.layernorm_embedding')  # positions from padding_idx + 1
    x = embed(src, 'encoder')
    for i in range(sum(k.endswith('fc1.weight') and k.startswith('encoder.') for k in sd)):
        x = layer(x, f'encoder.layers.{i}.')
    y = embed(tgt, 'decoder')
    for i in keep:
        y = layer(y, f'decoder.layers.{i}.', x)
    return y @ w['decoder.output_projection.weight'].T


def test_released_nlg_checkpoint_is_the_translation_model(tmp_path):
    """VECO's NLG checkpoint (fairseq's layout) loads into the translation model: its encoder, its
    decoder's last two layers (--keep-decoder-layers), embeddings times sqrt(dim); the logits equal
    fairseq's computation written out by hand in float64."""
    ckpt = released_nlg_state()
    torch.save(ckpt, tmp_path / 'model.pt')
    pre, mlm, released, new_cross = layers.load_pretrained(str(tmp_path / 'model.pt'), cross=True, decoder=True)
    assert mlm is None and len(released.blocks) == 3 and pre.cfg.embed_scale == math.sqrt(32)
    assert released.tok.weight is not pre.tok.weight and torch.equal(released.tok.weight, pre.tok.weight)
    encoder, decoder = xlt.assemble(pre, 2, dropout=0.0, released=released)
    m = xlt.VecoTranslate(encoder, decoder, bos=0).eval()
    src, tgt = torch.tensor([0, 11, 23, 7, 2]), torch.tensor([0, 5, 19, 33])
    with torch.no_grad():
        ours = m.logits(m.decode(tgt[None], encoder(src[None]), src[None].ne(1)))[0]
    expected = fairseq_translation_logits(ckpt['model'], src, tgt, [1, 2], heads=2, scale=math.sqrt(32))
    assert torch.allclose(ours.double(), expected, atol=1e-4)
    # an encoder alone (XLM-R, the released NLU model) has no decoder to give
    enc = layers.Encoder(layers.Config(vocab_size=50, n_layer=2, n_head=2, dim=32, ffn_dim=64))
    layers.save_checkpoint(str(tmp_path / 'veco-nlu.pt'), {}, **layers.encoder_parts(enc))
    pre, _, released, new_cross = layers.load_pretrained(str(tmp_path / 'veco-nlu.pt'), cross=True, decoder=True)
    assert released is None and new_cross


def test_translation_files_this_model_cannot_read_are_refused_naming_why(tmp_path):
    """A decoder with other heads than the encoder (read with the encoder's, its log-probabilities
    would be off), and embeddings not shared between encoder and decoder: one line each, naming it."""
    ckpt = released_nlg_state()
    ckpt['args'].decoder_attention_heads = 4
    torch.save(ckpt, tmp_path / 'heads.pt')
    with pytest.raises(layers.CheckpointError, match='^the checkpoint\'s decoder has 4 attention heads and its encoder 2'):
        layers.load_pretrained(str(tmp_path / 'heads.pt'), cross=True, decoder=True)
    for key, what in (('decoder.embed_tokens.weight', 'token embeddings'), ('decoder.output_projection.weight', 'output projection')):
        ckpt = released_nlg_state()
        ckpt['model'][key] = ckpt['model'][key] + 1  # its own tensor, as fairseq saves it without share_all_embeddings
        torch.save(ckpt, tmp_path / 'apart.pt')
        with pytest.raises(layers.CheckpointError, match=f'^the decoder\'s {what} differs from enc.tok.weight; this model '
                           'ties them \\(the file was trained without share_all_embeddings\\)$'):
            layers.load_pretrained(str(tmp_path / 'apart.pt'), cross=True, decoder=True)


def fork_dictionary(sp, corpus, langs):
    """dict.txt as VECO's fork makes one (prepare-wmt14en2de.sh): fairseq-preprocess counts the pieces
    of spm_encode --output_format=piece, most frequent first; the language tokens [xx] are lines of
    it; the dictionary, its 4 special symbols counted, is padded to a multiple of 8 with madeupwordNNNN.
    -> (its lines' symbols, its text)."""
    counts = collections.Counter(p for line in corpus for p in sp.encode(line, out_type=str))
    lines = [p for p, _ in counts.most_common()] + [f'[{lang}]' for lang in langs]
    lines += [f'madeupword{i:04d}' for i in range(-(4 + len(lines)) % 8)]
    return lines, ''.join(f'{w} {counts.get(w, 1)}\n' for w in lines)


def test_released_nlg_model_is_read_through_its_dict_txt(tmp_path, demo_data):
    """VECO's NLG model as released: embedding rows in the order of the fairseq dict.txt beside it (4
    special symbols, its lines, <mask>). Ids are the dictionary's (a piece by its line, a piece it
    lacks as <unk>: by hand), [en] and [de] its lines; the translation model's logits on a test pair
    equal fairseq's by hand; a run finds the dict.txt beside --init, and without it says so."""
    sp = spm.SentencePieceProcessor(model_file=os.path.join(demo_data, 'sentencepiece.bpe.model'))
    en, de = (list(data.read_lines(f'{demo_data}/translation/en-de/test.{lang}')) for lang in ('en', 'de'))
    lines, text = fork_dictionary(sp, en[1:] + de, ('en', 'de'))  # en[0]'s rarer pieces are left out
    folder = tmp_path / 'veco-nlg'
    os.makedirs(folder)
    (folder / 'dict.txt').write_text(text)
    tok = data.Tokenizer(sp_path := os.path.join(demo_data, 'sentencepiece.bpe.model'), dictionary=str(folder / 'dict.txt'))
    by_hand = lambda line: [4 + lines.index(p) if p in lines else 3 for p in sp.encode(line, out_type=str)]
    assert all(tok.encode(line) == by_hand(line) for line in en + de) and 3 in by_hand(en[0])
    assert tok.decode(tok.encode(de[0])) == de[0] and tok.vocab_size == 4 + len(lines) + 1 == tok.mask + 1
    assert tok.language_ids('en', 'de') == (4 + lines.index('[en]'), 4 + lines.index('[de]'))
    with pytest.raises(data.DataError, match=r'dict.txt has no line \[fr\]: give the dict.txt'):
        tok.language_ids('en', 'fr')
    (tmp_path / 'other.txt').write_text('a 1\na 2 #fairseq:overwrite\n▁b\n')
    with pytest.raises(data.DataError, match='other.txt line 3 is not "<symbol> <count>": give the dict.txt'):
        data.read_dictionary(str(tmp_path / 'other.txt'))
    assert data.read_dictionary(str(tmp_path / 'other.txt').replace('other', 'veco-nlg/dict')) == lines
    ckpt = released_nlg_state(V=tok.vocab_size, D=64, H=2, Fd=128, L=2, P=130)
    torch.save(ckpt, folder / 'model.pt')
    pre, _, released, _ = layers.load_pretrained(str(folder / 'model.pt'), cross=True, decoder=True)
    m = xlt.VecoTranslate(*xlt.assemble(pre, 2, dropout=0.0, released=released), bos=tok.language_ids('de')[0]).eval()
    src, tgt = data.translation_items(tok, demo_data, 'en', 'de', 'test', tok.language_ids('en', 'de'), 250)[0]
    assert src.ids == by_hand(en[0]) + [2, 4 + lines.index('[en]')] and tgt.ids == [4 + lines.index('[de]')] + by_hand(de[0])
    with torch.no_grad():
        x, y = torch.tensor([src.ids]), torch.tensor([tgt.ids])
        ours = m.logits(m.decode(y, m.encoder(x), x.ne(1)))[0]
    assert torch.allclose(ours.double(), fairseq_translation_logits(ckpt['model'], x[0], y[0], [0, 1], 2, 8.0), atol=1e-4)
    argv = ['--method', 'veco', '--task', 'translate', '--steps', '2', '--eval_every', '2', '--batch_size', '8',
            '--average_last', '0', '--beam', '1']
    demo_run(tmp_path / 'run', demo_data, argv + ['--init', str(folder / 'model.pt')])
    assert json.load(open(tmp_path / 'run' / 'config.json'))['dict'] == str(folder / 'dict.txt')
    assert layers.load_checkpoint(str(tmp_path / 'run' / 'best.pt'))['config']['vocab_size'] == tok.vocab_size  # no new rows
    os.remove(folder / 'dict.txt')
    one_line(['--demo', '--out', str(tmp_path / 'run'), *argv, '--init', str(folder / 'model.pt'), '--overwrite'],
             f'the tokenizer has {data.Tokenizer(sp_path).vocab_size} ids (padding 1, separator 2), the model '
             f'{tok.vocab_size} (1, 2): pass its own (--spm, --dict; --vocab)')


def test_released_nlu_checkpoint_is_the_encoder(tmp_path):
    """VECO's NLU checkpoint is Hugging Face's XLM-R layout (roberta.*; its config a model_type of
    its own): the encoder equals XLM-R's computation written out in float64."""
    cfg = {**hf_config(2, 32, 2, 64, 60), 'model_type': 'veco', 'architectures': ['VecoForMaskedLM']}
    sd = random_hf_weights(cfg)
    enc, mlm = layers.load_pretrained(write_hf_dir(sd, cfg, tmp_path / 'veco-nlu', fmt='bin'))[:2]
    ids = torch.tensor([[0, 9, 33, 41, 2, 1], [0, 12, 2, 1, 1, 1]])
    with torch.no_grad():
        h = enc.eval()(ids)
    expected, _ = naive_xlmr(sd, 2, ids)
    real = ids.ne(1)
    assert torch.allclose(h[real].double(), expected[real], atol=1e-5) and not enc.has_cross


@pytest.mark.slow
def test_search_runs_the_grid_and_keeps_the_best_average_dev_score(tmp_path, demo_data):
    """Under two processes: each reads a grid point's results once process 0 has written them."""
    argv = ['--method', 'veco', '--task', 'pawsx', '--from_scratch', '--search', 'lr=1e-3,1e-5', 'epochs=2', 'batch_size=32']
    demo_run(tmp_path / 'grid', demo_data, argv,
             runner=[sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2'])
    points = {name: json.load(open(tmp_path / 'grid' / name / 'results.json'))
              for name in ('lr0.001-epochs2-batch_size32', 'lr1e-05-epochs2-batch_size32')}
    assert [json.load(open(tmp_path / 'grid' / n / 'config.json'))['lr'] for n in points] == [1e-3, 1e-5]
    results = json.load(open(tmp_path / 'grid' / 'results.json'))
    best = max(points.values(), key=lambda r: r['dev']['avg'])
    assert results['dev'] == pytest.approx(best['dev']) and results['test'] == pytest.approx(best['test'])
    assert points['lr0.001-epochs2-batch_size32']['dev']['avg'] != points['lr1e-05-epochs2-batch_size32']['dev']['avg']
    assert os.path.isfile(tmp_path / 'grid' / 'predictions' / 'pawsx' / 'test-de.tsv')  # the run's own, for --collect
    tta = train.parse_args(['--method', 'veco', '--task', 'xnli', '--translate_train_all', '--search'])
    assert [s['lr'] for s in xlt.method_class(tta).stages(tta).values()] == [3e-6, 5e-6, 1e-5]  # Table 6
    full = train.parse_args(['--method', 'veco', '--task', 'xnli', '--search'])
    assert len(xlt.method_class(full).stages(full)) == 27
    one_line(['--method', 'veco', '--task', 'xnli', '--demo', '--search', 'dropout=0.1'], 'NAME one of lr, epochs')


@pytest.mark.slow
def test_search_fans_out_over_processes_and_makes_the_table_of_its_points_one_after_another(tmp_path, demo_data,
                                                                                            capsys):
    """--search of 3 points with --gpus 2 on a CPU: three train.py processes (--only_stage), two at a time, one thread
    each; the run's table, its results and each point's equal the grid run one after another in this process (one
    thread too). --commands prints each point's command line and runs none."""
    argv = ['--method', 'veco', '--task', 'pawsx', '--from_scratch', '--search', 'lr=1e-3,3e-4,1e-4', 'epochs=2',
            'batch_size=32']
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        demo_run(tmp_path / 'together', demo_data, argv)
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    demo_run(tmp_path / 'apart', demo_data, [*argv, '--gpus', '2'])
    said = capsys.readouterr().out
    names = ['lr0.001-epochs2-batch_size32', 'lr0.0003-epochs2-batch_size32', 'lr0.0001-epochs2-batch_size32']
    assert [line.split(':')[0] for line in said.splitlines() if ': running in' in line] == names
    assert said.count(': finished in') == 3 and all(f'{name}: reused' in said for name in names)
    results = lambda run: json.load(open(tmp_path / run / 'results.json'))
    together, apart = results('together'), results('apart')
    flat = lambda scores: {(point, split, lang): v for point, r in scores.items() for split in ('dev', 'test')
                           for lang, v in r[split].items()}
    assert set(apart['runs']) == set(names) and flat({'run': apart, **apart['runs']}) == pytest.approx(
        flat({'run': together, **together['runs']}), abs=1e-6)
    for name in names:  # each point's kept model, the same weights
        a, b = (torch.load(tmp_path / run / name / 'best.pt', weights_only=True)['method'] for run in ('apart', 'together'))
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert (tmp_path / 'apart' / 'results.txt').read_text() == (tmp_path / 'together' / 'results.txt').read_text()
    demo_run(tmp_path / 'listed', demo_data, [*argv, '--commands'])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-2:] for line in lines] == [['--only_stage', name] for name in names]
    assert '--commands' not in lines[0] and os.listdir(tmp_path / 'listed') == ['demo-data']
