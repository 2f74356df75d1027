"""X-Mixup: lambda = 0 is the plain encoder, Eq. 3-5 by hand, the scheduled sampling of Eq. 6,
inference, and the method end to end on the demo data."""
import argparse
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import data
import layers
import xlt
from conftest import padded_batch
from test_train import eval_cli, run


def model(task='xnli', layer=2, n_layer=3, **flags):
    torch.manual_seed(0)
    enc = layers.Encoder(layers.Config(vocab_size=60, n_layer=n_layer, n_head=2, dim=16, ffn_dim=32))
    return xlt.XMixup(enc, task, argparse.Namespace(mixup_layer=layer, **flags)).eval()


def pair():
    src, tgt = padded_batch(60, [9, 5], seed=1), padded_batch(60, [4, 7], seed=2)
    return data.Pair(data.Batch(src, src.ne(1)), data.Batch(tgt, tgt.ne(1)))


def test_lambda_zero_is_the_plain_encoder_on_the_target():
    m, p = model(), pair()
    m.lambda_0 = 0.0
    with torch.no_grad():
        _, h_t, lam = m.encode(p.src, p.tgt)
        assert lam.abs().max() == 0
        assert (h_t - m.encoder(p.tgt.ids, p.tgt.mask)).abs().max() <= 1e-6
    m.lambda_0 = 0.5
    with torch.no_grad():
        assert (m.encode(p.src, p.tgt)[1] - m.encoder(p.tgt.ids, p.tgt.mask)).abs().max() > 1e-3


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
        lam = 0.5 * torch.sigmoid(H * m.w + m.b)
        mixed = layer_norm(lam.view(-1, 1, 1) * h_ts + (1 - lam.view(-1, 1, 1)) * a_t, block.ln1)  # Eq. 4
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
        src, share = m.scheduled_source(p)
        is_real = src.ids[:, 0] == 11
        assert share == pytest.approx(m.p_star(), abs=4 * math.sqrt(0.25 / n))  # four standard deviations
        assert (src.labels == 0).tolist() == is_real.tolist()  # labels follow their text
        assert (src.ids[is_real, 3:] == 1).all() and (src.mask[is_real].sum(1) == 3).all()  # padded to 5
    p.alt = None
    assert m.scheduled_source(p)[0] is p.src  # no round-trip data: always the real text


def test_inference_variants():
    m, p = model(), pair()
    with torch.no_grad():
        h_s, h_t, _ = m.encode(p.src, p.tgt)
        mean = (m.head(h_t, p.tgt.mask).softmax(-1) + m.head(h_s, p.src.mask).softmax(-1)) / 2
        assert torch.allclose(m.predict(p).softmax(-1), mean, atol=1e-6)  # classification: both sides' distributions
        m.mixup_inference = False
        assert torch.allclose(m.predict(p), m.head(m.encoder(p.tgt.ids, p.tgt.mask), p.tgt.mask), atol=1e-6)
    q = model(task='xquad')
    with torch.no_grad():
        h_t = q.encode(p.src, p.tgt)[1]
        expected = q.head.out(h_t).masked_fill(~p.tgt.mask[..., None], float('-inf'))  # padding out of the softmax
        assert torch.equal(q.predict(p), expected)


def test_xmixup_end_to_end(tmp_path, capsys):
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=150, n_eval=30)
    os.remove(os.path.join(demo, 'xnli', 'round-trip', 'train-en-zh-en.tsv'))
    results = run(tmp_path / 'run', demo, '--method', 'xmixup', '--task', 'xnli', '--epochs', '4', '--p_k', '10')
    assert capsys.readouterr().out.count('warning: no round-trip data for xnli in zh') == 1
    logged = [json.loads(line) for line in open(tmp_path / 'run' / 'log.jsonl') if '"loss"' in line]
    assert all(0 < r['lambda'] < 0.5 for r in logged)
    assert logged[0]['p_star'] > 0.8 > 0.2 > logged[-1]['p_star']
    scores = eval_cli(tmp_path / 'run', demo)['xnli']
    assert {k: v for k, v in results['test'].items() if k != 'gap'} == pytest.approx(
        {**scores['accuracy'], 'avg': scores['avg_accuracy']}, abs=1e-9)
    assert results['dev']['en'] > 40
    # tagging needs a source-language model's labels for T
    with pytest.raises(SystemExit, match='pass --teacher RUN'):
        run(tmp_path / 'tag', demo, '--method', 'xmixup', '--task', 'panx', '--epochs', '1')
