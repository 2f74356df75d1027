"""VECO for generation: the encoder-decoder assembled from the pre-trained blocks, label-smoothed
cross-entropy written out by hand, beam search against greedy decoding, the cache against the
whole prefix, fairseq's length penalty on a hand-computed case, and translation runs that
resume, split over processes and average their checkpoints exactly."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import eval as ev
import layers
import train
import xlt
from conftest import demo_run, one_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pretrained(seed=0, vocab=50, n_layer=3):
    torch.manual_seed(seed)
    return layers.Encoder(layers.Config(vocab_size=vocab, n_layer=n_layer, n_head=2, dim=32, ffn_dim=64), cross=True)


def translator(seed=0, n=2, init='last', lively=False):
    """A random VECO translator over 50 pieces + 2 language tokens (ids 50, 51). A random
    decoder repeats its input token (the residual path and the tied output layer); lively
    strengthens the positions, the cross-attention and </s>, so that what it says varies with
    the step and the source and its hypotheses end at different lengths."""
    enc, dec = xlt.assemble(pretrained(seed), n, init, new_tokens=2)
    m = xlt.VecoTranslate(enc, dec, bos=51, eps=0.2).eval()
    if lively:
        with torch.no_grad():
            dec.pos.weight.mul_(20)
            enc.tok.weight[2] *= 3
            for block in dec.blocks:
                block.cross.out.weight.mul_(10)
                block.cross.qkv.weight.mul_(3)
    return m


def sources(lengths=(7, 3, 11, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), 1)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(4, 50, (n,), generator=g)
        ids[row, n - 2:n] = torch.tensor([2, 50])  # x </s> [src]
    return data.Batch(ids, ids.ne(1))


def test_decoder_layer_i_is_pretrained_layer_L_minus_n_plus_i():
    pre = pretrained()
    L = pre.cfg.n_layer
    for init, first in (('last', L - 2), ('first', 0)):
        enc, dec = xlt.assemble(pre, 2, init, new_tokens=2)
        for i in range(2):
            mine, theirs = dec.blocks[i].state_dict(), pre.blocks[first + i].state_dict()
            assert any('cross' in k for k in mine) and set(mine) == set(theirs)
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert not enc.has_cross and len(enc.blocks) == L
        assert all(torch.equal(v, pre.state_dict()[k]) for k, v in enc.state_dict().items() if k != 'tok.weight')
        # one embedding for both sides and the output, grown by the two language tokens
        assert dec.tok.weight is enc.tok.weight and enc.tok.weight.shape[0] == 52
        assert torch.equal(enc.tok.weight[:50], pre.tok.weight) and enc.cfg.embed_scale == dec.cfg.embed_scale == 1.0
    enc, dec = xlt.assemble(pre, 2, 'random', new_tokens=2)
    assert not torch.equal(dec.blocks[1].cross.qkv.weight, pre.blocks[2].cross.qkv.weight)
    with pytest.raises(ValueError, match='--dec_layers 4'):
        xlt.assemble(pre, 4)


@pytest.mark.slow
def test_embeddings_keep_the_scale_the_model_was_trained_with(tmp_path, demo_data, capsys):
    """assemble scales token embeddings as the pre-trained model was trained (recorded in its config),
    by hand: LayerNorm(s * E[ids] + P[positions]); a run records the scale in results.json and best.pt."""
    pre = pretrained()
    pre.cfg = layers.Config(**{**pre.cfg.__dict__, 'embed_scale': 3.0})
    ids = torch.tensor([[0, 7, 9, 2]])
    for scale, expected in ((None, 3.0), (0.5, 0.5)):
        enc, dec = xlt.assemble(pre, 2, new_tokens=2, embed_scale=scale)
        for m in (enc.eval(), dec.eval()):
            by_hand = F.layer_norm(expected * m.tok.weight[ids] + m.pos.weight[torch.tensor([[2, 3, 4, 5]])], (32,),
                                   m.ln.weight, m.ln.bias, 1e-5)
            assert torch.allclose(m.embed(ids), by_hand, atol=1e-6)
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    trained = layers.Encoder(layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': tok.vocab_size, 'embed_scale': 2.0}), cross=True)
    layers.save_checkpoint(str(tmp_path / 'pre.pt'), {'method': 'veco', 'task': 'pretrain', 'model': 'tiny'}, **layers.encoder_parts(trained))
    alone = layers.Encoder(layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': tok.vocab_size}))
    layers.save_checkpoint(str(tmp_path / 'veco-nlu.pt'), {}, **layers.encoder_parts(alone))
    for name, more, scale in (('init', ['--init', str(tmp_path / 'pre.pt')], 2.0), ('new', ['--from_scratch'], 8.0),
                              ('alone', ['--init', str(tmp_path / 'veco-nlu.pt')], 1.0)):
        demo_run(tmp_path / name, demo_data, ['--method', 'veco', '--task', 'translate', '--steps', '2', '--eval_every', '2',
                                              '--batch_size', '8', '--average_last', '0', '--beam', '1', *more])
        assert json.load(open(tmp_path / name / 'results.json'))['embed_scale'] == scale  # a new model: sqrt(64)
        assert layers.load_checkpoint(str(tmp_path / name / 'best.pt'))['config']['embed_scale'] == scale
        said = capsys.readouterr().out
        assert ('is an encoder alone, without cross-attention or decoder' in said) == (name == 'alone'), said


def test_label_smoothed_loss_is_fairseqs_formula_by_hand():
    torch.manual_seed(0)
    logits, eps = torch.randn(2, 3, 5), 0.2
    targets = torch.tensor([[1, 4, 0], [3, -100, -100]])
    loss, nll = xlt.label_smoothed_loss(logits, targets, eps)
    for b in range(2):
        for t in range(3):
            if targets[b, t] < 0:
                assert loss[b, t] == 0 and nll[b, t] == 0
                continue
            logp = [math.log(math.exp(z) / sum(math.exp(w) for w in logits[b, t].tolist())) for z in logits[b, t].tolist()]
            by_hand = (1 - eps) * -logp[targets[b, t]] + eps / 5 * sum(-lp for lp in logp)
            assert abs(loss[b, t].item() - by_hand) < 1e-5 and abs(nll[b, t].item() + logp[targets[b, t]]) < 1e-5


def test_the_training_loss_is_the_mean_over_target_tokens_and_sees_no_future_target():
    m = translator()
    src = sources((6, 4))
    tgt = data.collate([data.Feature([51, 7, 8, 9], [7, 8, 9, 2]), data.Feature([51, 12], [12, 2])])
    pair = data.Pair(src, tgt)
    loss, nll = m.token_losses(pair)
    assert abs(m.loss(pair)[0].item() - loss.sum().item() / 6) < 1e-6  # 4 + 2 target tokens
    # position t's prediction does not change when a later target token does
    changed = data.Pair(src, data.collate([data.Feature([51, 7, 30, 31], [7, 30, 31, 2]), data.Feature([51, 12], [12, 2])]))
    memory = m.encoder(src.ids, src.mask)
    a, b = m.decode(pair.tgt.ids, memory, src.mask), m.decode(changed.tgt.ids, memory, src.mask)
    assert torch.allclose(a[0, :2], b[0, :2], atol=1e-6) and not torch.allclose(a[0, 2], b[0, 2])


def test_the_valid_loss_makes_the_logits_a_slice_of_the_batch_at_a_time(monkeypatch):
    """valid_losses makes the vocabulary's logits for at most VALID_LOGITS of them at a time: the same losses."""
    m = translator()
    items = [(data.Feature([5 + i, 6, 2, 50]), data.Feature([51, 7 + i, 8], [7 + i, 8, 2])) for i in range(5)]
    whole, rows, logits = m.valid_losses(items, 64, torch.device('cpu'), 'fp32'), [], m.logits
    monkeypatch.setattr(m, 'logits', lambda h: (rows.append(len(h)), logits(h))[1])
    monkeypatch.setattr(xlt, 'VALID_LOGITS', 2 * 3 * m.encoder.tok.weight.size(0))  # two rows of 3 target tokens
    assert m.valid_losses(items, 64, torch.device('cpu'), 'fp32') == pytest.approx(whole, rel=1e-6)
    assert rows == [2, 2, 1]


def test_batches_in_tokens_are_cut_as_fairseqs_max_tokens():
    """Sorted by length (2..9 tokens, a pair by its longer side), cut greedily into 2 micro-batches of at most 12
    tokens each, padding included: {2, 3 | 4, 5}, {6 | 7}, {8 | 9}, shuffled by the seed."""
    lengths = np.array([[5, 1], [3, 3], [1, 9], [2, 2], [7, 7], [4, 1], [8, 2], [1, 6]])
    batches = data.token_batches(lengths, 12, 2, seed=0)
    assert sorted(sorted(lengths[b].max(1).tolist()) for b in batches) == [[2, 3, 4, 5], [6, 7], [8, 9]]
    for batch in batches:
        for micro in np.array_split(np.array(batch), 2):
            assert len(micro) * lengths[micro].max() <= 12
    assert data.token_batches(lengths, 12, 2, seed=0) == batches
    assert {tuple(map(tuple, (data.token_batches(lengths, 12, 2, seed=s)))) for s in range(6)} != {tuple(map(tuple, batches))}
    args = train.parse_args(['--method', 'veco', '--task', 'translate', '--demo', '--max_tokens', '12'])
    items = [(data.Feature([4] * s), data.Feature([4] * t)) for s, t in lengths]
    first_pass = data.token_batches(lengths, 12, 1, seed=1000)  # --seed 1's, on one process
    assert train.Run(args, 0, 1, torch.device('cpu'), None, sets={}).shuffled(items)(0)[:len(first_pass)] == first_pass


def greedy(m, src, max_new):
    """Greedy decoding written plainly: the whole prefix through the decoder at every step."""
    out = []
    for row in range(src.ids.size(0)):
        ids, mask = src.ids[row:row + 1], src.mask[row:row + 1]
        memory, prefix = m.encoder(ids, mask), [51]
        for step in range(max_new + 1):
            logp = m.logits(m.decode(torch.tensor([prefix]), memory, mask))[0, -1].float().log_softmax(-1)
            logp[1] = -math.inf
            if step == 0:
                logp[2] = -math.inf
            if step == max_new:
                break
            token = logp.argmax().item()
            if token == 2:
                break
            prefix.append(token)
        out.append(prefix[1:])
    return out


def test_beam_one_is_greedy_and_the_cache_changes_nothing():
    m, src = translator(seed=2, lively=True), sources()
    want = greedy(m, src, 25)
    assert len({len(w) for w in want}) > 1 and len({tuple(w) for w in want}) == 4  # they differ and end early
    assert m.generate(src, beam=1, max_new=25) == want
    assert m.generate(src, beam=1, max_new=25, cache=False) == want
    assert m.generate(src, beam=4, max_new=25) == m.generate(src, beam=4, max_new=25, cache=False)
    # step by step, the cached next-token distribution equals the one from the whole prefix
    memory, prefix, state = m.encoder(src.ids, src.mask), torch.full((4, 1), 51), {}
    for token in (9, 17, 23, 5):
        cached = layers.next_log_probs(m.decoder, prefix, memory, src.mask, state)
        assert torch.allclose(cached, layers.next_log_probs(m.decoder, prefix, memory, src.mask), atol=1e-5)
        prefix = torch.cat([prefix, torch.full((4, 1), token)], 1)


def test_length_penalty_ranks_finished_hypotheses_as_fairseq(monkeypatch):
    """Beam 2 on a model whose next-token probabilities are set by hand (ids: 2 </s>, 3-5 words,
    0 the start). Step 0: 3 (0.6) and 4 (0.4) go on. Step 1: 3 </s> (0.6 x 0.7 = 0.42) is first
    and finishes; 4 5 (0.36) and 3 5 (0.18) go on. Step 2: 4 5 </s> (0.36 x 0.95 = 0.342) finishes
    the sentence's second hypothesis. Scores log p / length ** lenpen, </s> counted:
    lenpen 1: 3 -> ln 0.42 / 2 = -0.434, 4 5 -> ln 0.342 / 3 = -0.358: 4 5 wins;
    lenpen 0: -0.868 against -1.073: 3 wins; lenpen 0.4: -0.868 / 2^0.4 = -0.658 against
    -1.073 / 3^0.4 = -0.692: 3 wins (a length without </s> would make it -0.868 against -0.813)."""
    table = {(): {3: 0.6, 4: 0.4}, (3,): {2: 0.7, 5: 0.3}, (4,): {5: 0.9, 2: 0.05, 3: 0.05},
             (3, 5): {2: 0.5, 4: 0.4, 3: 0.1}, (4, 5): {2: 0.95, 3: 0.05}}

    def next_log_probs(decoder, tokens, memory, memory_mask, cache=None):
        logp = torch.full((tokens.size(0), 8), -30.0)
        for row, prefix in enumerate(tokens[:, 1:].tolist()):
            for word, p in table.get(tuple(prefix), {2: 1.0}).items():
                logp[row, word] = math.log(p)
        return logp
    torch.manual_seed(0)
    enc, dec = xlt.assemble(layers.Encoder(layers.Config(vocab_size=8, n_layer=1, n_head=1, dim=8, ffn_dim=8), cross=True), 1)
    m = xlt.VecoTranslate(enc, dec, bos=0).eval()
    monkeypatch.setattr(layers, 'next_log_probs', next_log_probs)
    src = data.Batch(torch.tensor([[5, 2, 6]]), torch.ones(1, 3, dtype=torch.bool))
    assert m.generate(src, beam=2, lenpen=1.0) == [[4, 5]]
    assert m.generate(src, beam=2, lenpen=0.0) == [[3]]
    assert m.generate(src, beam=2, lenpen=0.4) == [[3]]
    assert m.generate(src, beam=1) == [[3]]  # greedy: 3, then </s> at 0.7


@pytest.fixture(scope='module')
def demo_data(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo') / 'demo-data'), n_train=40, n_eval=12)


def translate(out, demo_data, *args, runner=None):
    return demo_run(out, demo_data, ['--method', 'veco', '--task', 'translate', '--from_scratch', '--steps', '12',
                                     '--eval_every', '4', '--batch_size', '8', '--average_last', '2', '--beam', '2', *args],
                    runner)


@pytest.mark.slow
def test_translation_runs_resume_split_over_processes_and_average(tmp_path, demo_data):
    one = translate(tmp_path / 'one', demo_data, '--grad_accum', '2')
    results = json.load(open(tmp_path / 'one' / 'results.json'))
    hyps = open(tmp_path / 'one' / 'predictions' / 'test.en-de.de').read().split('\n')[:-1]
    refs = open(os.path.join(demo_data, 'translation', 'en-de', 'test.de')).read().split('\n')[:-1]
    assert len(hyps) == len(refs) == 12 and results['decoded_with'].startswith('the mean of the last 2 checkpoints (8 to 12')
    assert sorted(os.listdir(tmp_path / 'one' / 'checkpoints')) == ['step0000008.pt', 'step0000012.pt']
    assert results['test']['bleu']['bleu'] == ev.bleu(hyps, refs)['bleu']
    # the decoded weights are the mean of the two kept checkpoints
    kept = [torch.load(tmp_path / 'one' / 'checkpoints' / f, weights_only=True)['method'] for f in ('step0000008.pt', 'step0000012.pt')]
    args = train.parse_args(['--method', 'veco', '--task', 'translate', '--demo', '--out', str(tmp_path / 'one'),
                             '--average_last', '2'])
    cfg = layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': one['encoder.tok.weight'].size(0) - 2})
    m = xlt.VecoTranslate(*xlt.assemble(layers.Encoder(cfg, cross=True), 2, new_tokens=2), bos=0)
    xlt.average_last(train.Run(args, 0, 1, torch.device('cpu'), None), xlt.VecoTranslate, m, 2)
    assert not torch.equal(kept[0]['decoder.blocks.0.cross.qkv.weight'], kept[1]['decoder.blocks.0.cross.qkv.weight'])
    assert all(torch.allclose(v, (kept[0][k] + kept[1][k]) / 2) for k, v in m.state_dict().items())
    two = translate(tmp_path / 'two', demo_data,
                    runner=[sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2'])
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5
    assert open(tmp_path / 'two' / 'predictions' / 'test.en-de.de').read().split('\n')[:-1] == hyps
    killed = subprocess.run([sys.executable, 'train.py', '--method', 'veco', '--task', 'translate', '--demo', '--from_scratch',
                             '--out', str(tmp_path / 'one'), '--steps', '12', '--eval_every', '4', '--batch_size', '8',
                             '--average_last', '2', '--beam', '2', '--grad_accum', '2', '--save_minutes', '0', '--log_every', '3', '--halt_after', '10'],
                            cwd=ROOT, capture_output=True)
    assert killed.returncode == 3
    resumed = translate(tmp_path / 'one', demo_data, '--grad_accum', '2', '--resume')
    assert max((one[k] - resumed[k]).abs().max().item() for k in one) <= 1e-6
    assert open(tmp_path / 'one' / 'predictions' / 'test.en-de.de').read().split('\n')[:-1] == hyps
    os.remove(tmp_path / 'one' / 'predictions' / 'test.en-de.de')
    translate(tmp_path / 'one', demo_data, '--eval_only')  # decodes the kept checkpoints again
    assert open(tmp_path / 'one' / 'predictions' / 'test.en-de.de').read().split('\n')[:-1] == hyps


def test_decoding_without_a_kept_model_stops_in_one_line(tmp_path):
    """--eval_only on a folder without best.pt (--init given, so the run's checks let it through): one
    line, not the untrained model decoded."""
    args = train.parse_args(['--method', 'veco', '--task', 'translate', '--demo', '--out', str(tmp_path), '--average_last', '0'])
    m = xlt.VecoTranslate(*xlt.assemble(layers.Encoder(layers.CONFIGS['tiny'], cross=True), 2, new_tokens=2), bos=0)
    with pytest.raises(SystemExit, match=f'error: {tmp_path / "best.pt"} not found: --eval_only decodes a finished run in --out'):
        xlt.average_last(train.Run(args, 0, 1, torch.device('cpu'), None, sets={}), xlt.VecoTranslate, m, 0)


def test_translation_pairs_and_what_is_skipped(tmp_path, demo_data):
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    folder = tmp_path / 'translation' / 'de-en'  # the other direction's folder serves en -> de too
    os.makedirs(folder)
    lines = {'en': ['Anna reads the book .', '', 'Ben sees the red ball in Paris .'],
             'de': ['Anna der Buch liest .', 'Ben', 'Ben in Paris der Ball rot sieht .']}
    for split in ('train', 'test'):
        for lang in ('en', 'de'):
            (folder / f'{split}.{lang}').write_text(''.join(line + '\n' for line in lines[lang]))
    longest = len(tok.encode(lines['en'][0]))
    train_items = data.translation_items(tok, str(tmp_path), 'en', 'de', 'train', (600, 601), max_len=longest)
    (x, y), = train_items  # the empty side and the longer pair are skipped
    assert x.ids == tok.encode(lines['en'][0]) + [2, 600]
    assert y.ids == [601] + tok.encode(lines['de'][0]) and y.label == tok.encode(lines['de'][0]) + [2]
    test_items = data.translation_items(tok, str(tmp_path), 'en', 'de', 'test', (600, 601), max_len=longest)
    assert len(test_items) == 3 and test_items[1][0].ids == [2, 600]  # every test line gets a translation


def test_translation_set_up_errors_are_one_line(tmp_path, demo_data):
    one_line(['--method', 'filter', '--task', 'translate', '--demo'], 'pass --method veco')
    one_line(['--method', 'veco', '--task', 'translate', '--src', 'de', '--tgt', 'de', '--demo'], 'two languages')
    one_line(['--method', 'veco', '--task', 'xnli', '--beam', '4', '--demo'], '--beam belongs to --method veco --task translate, not to veco on xnli')
    corpus = tmp_path / 'corpus'
    os.makedirs(corpus / 'translation' / 'en-fr')
    os.symlink(os.path.join(demo_data, 'sentencepiece.bpe.model'), corpus / 'sentencepiece.bpe.model')
    common = ['--method', 'veco', '--task', 'translate', '--tgt', 'fr', '--data_dir', str(corpus), '--from_scratch',
              '--model', 'tiny', '--out', str(tmp_path / 'run')]
    for split in ('train', 'valid', 'test'):
        (corpus / 'translation' / 'en-fr' / f'{split}.en').write_text('one\ntwo\n')
        (corpus / 'translation' / 'en-fr' / f'{split}.fr').write_text('un\ndeux\n')
    one_line(common + ['--dec_layers', '3'], '--dec_layers 3 is not a layer count of the 2-layer model')
    (corpus / 'translation' / 'en-fr' / 'valid.fr').write_text('un\n')
    one_line(common, 'parallel files align line by line')
    os.remove(corpus / 'translation' / 'en-fr' / 'valid.fr')
    one_line(common, 'valid.fr')
    assert not os.path.exists(tmp_path / 'run' / 'config.json')


def test_decoding_is_fp32_unless_asked(tmp_path, demo_data, monkeypatch):
    """The run's bf16 autocast (--precision bf16, as on a GPU) is off while decoding, as in the
    released inference script; --decode_bf16 decodes in bf16."""
    seen = []  # while decoding: is autocast on? (then empty hypotheses: the bf16 beam search is slow on a CPU)
    monkeypatch.setattr(xlt.VecoTranslate, 'generate', lambda self, src, *a: seen.append(torch.is_autocast_enabled('cpu'))
                        or [[]] * src.ids.size(0))
    for name, flag in (('fp32', []), ('bf16', ['--decode_bf16'])):
        translate(tmp_path / name, demo_data, '--steps', '2', '--eval_every', '2', '--average_last', '0',
                  '--precision', 'bf16', *flag)
        assert seen and set(seen) == {bool(flag)}
        seen.clear()
    assert json.load(open(tmp_path / 'fp32' / 'results.json'))['decoded_in'] == 'fp32'


def test_translation_defaults_are_the_released_scripts():
    """finetune-wmt14en2de.sh and en2fr.sh, inference-wmt14en2de.sh (AliceMind's VECO/NLG), written out here."""
    de, fr = (train.parse_args(['--method', 'veco', '--task', 'translate', '--model', 'large', '--tgt', t]) for t in ('de', 'fr'))
    released = {'lr': 1e-4, 'steps': 100000, 'warmup': 16000 / 100000, 'eval_every': 5000, 'average_last': 10,
                'clip': 0.1, 'weight_decay': 0.01, 'label_smoothing': 0.2, 'beam': 5, 'lenpen': 1.0, 'dec_layers': 6,
                'dec_init': 'last', 'decode_bf16': False}  # --keep-decoder-layers 18,...,23: the last 6 of 24
    assert {k: getattr(de, k) for k in released} == released == {k: getattr(fr, k) for k in released}
    assert (de.dropout, de.attn_dropout, fr.dropout, fr.attn_dropout) == (0.3, 0.1, 0.1, 0.0)
    assert fr.batch_size == 4 * de.batch_size  # 256k tokens a step against 64k (--update-freq 8 against 2)
    assert (de.adam_beta2, de.adam_eps, de.seed, xlt.VecoTranslate.DECAY_ALL) == (0.999, 1e-8, 222, True)  # fairseq's Adam


def test_en_fr_reads_the_released_preparation_and_skips_pairs_of_unlike_lengths(tmp_path, demo_data):
    """AliceMind's prepare-wmt14en2fr.sh writes raw/{train,valid,test}.{en,fr}, a sentence a line (valid newstest2012
    and 2013, test newstest2014), then keeps the training and valid pairs of 1 to 250 pieces whose sides differ at most
    1.5 times (clean-corpus-n.perl -ratio 1.5): those files, as translation/en-fr, read with --tgt fr's settings."""
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    folder = tmp_path / 'translation' / 'en-fr'
    os.makedirs(folder)
    lines = {'en': ['Anna reads the book .', 'Ben', 'Ben sees the ball .'],  # the toy sides alike but the second
             'fr': ['Anna reads the book .', 'Ben sees the red ball in the park of Paris .', 'Ben sees the ball .']}
    for split in ('train', 'valid', 'test'):
        for lang in ('en', 'fr'):
            (folder / f'{split}.{lang}').write_text(''.join(line + '\n' for line in lines[lang]))
    fr = train.parse_args(['--method', 'veco', '--task', 'translate', '--tgt', 'fr', '--model', 'large'])
    assert (fr.length_ratio, fr.max_len, fr.dropout, fr.attn_dropout) == (1.5, 250, 0.1, 0.0)
    assert train.parse_args(['--method', 'veco', '--task', 'translate', '--model', 'large']).length_ratio is None
    lengths = [(len(tok.encode(x)), len(tok.encode(y))) for x, y in zip(lines['en'], lines['fr'])]
    kept = [n for n, (a, b) in enumerate(lengths) if max(a, b) <= 1.5 * min(a, b)]
    assert kept == [0, 2]  # Ben against his long French sentence: unlike lengths
    for split in ('train', 'valid'):
        items = data.translation_items(tok, str(tmp_path), 'en', 'fr', split, (600, 601), 250, fr.length_ratio)
        assert [x.ids[:-2] for x, _ in items] == [tok.encode(lines['en'][n]) for n in kept]
    assert len(data.translation_items(tok, str(tmp_path), 'en', 'fr', 'test', (600, 601), 250, 1.5)) == 3


@pytest.mark.slow
def test_curve_decodes_the_test_set_with_each_checkpoint(tmp_path, demo_data):
    """--curve keeps every checkpoint (steps 4, 8 and 12) and gives each one's BLEU. With --average_last 1 the final
    translation is the last checkpoint's alone, so its BLEU is the curve's last point."""
    translate(tmp_path / 'run', demo_data, '--curve', '--average_last', '1')
    results = json.load(open(tmp_path / 'run' / 'results.json'))
    assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == [f'step{s:07d}.pt' for s in (4, 8, 12)]
    assert list(results['curve']) == ['4', '8', '12'] and results['curve']['12'] == results['test']['bleu']['bleu']
    ev.analyse('bleu-curve', [str(tmp_path / 'run')], str(tmp_path / 'out'))
    assert json.load(open(tmp_path / 'out' / 'bleu-curve.json'))['runs'][str(tmp_path / 'run')]['table'] == {
        'BLEU': results['curve']}
