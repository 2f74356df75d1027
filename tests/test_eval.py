"""eval.py against the leaderboard's published numbers and against hand computations."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import eval as ev
from data import Feature

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOCK = os.path.join(ROOT, 'tests', 'fixtures', 'xtreme-mock')


def published_scores():
    """The table of tests/fixtures/xtreme-mock/README.md: {task: {avg_<metric>: value}} and the group line."""
    text = open(os.path.join(MOCK, 'README.md'), encoding='utf-8').read()
    tasks = {}
    for task, cells in re.findall(r'^\| (\w+) \| ([a-z_].*?) \|$', text, re.M):
        if task != 'task':
            tasks[task] = {f'avg_{m}': float(v) for m, v in re.findall(r'(\w+) ([\d.]+)', cells)}
    groups = {k: float(v) for k, v in re.findall(r'(\w+) ([\d.]+)[,.;]', text.split('Groups:')[1])}
    return tasks, groups


def test_mock_submission_reproduces_the_published_table(tmp_path):
    tasks, groups = published_scores()
    assert len(tasks) == 9 and len(groups) == 5
    subprocess.run([sys.executable, 'eval.py', '--predictions', os.path.join(MOCK, 'predictions'),
                    '--labels', os.path.join(MOCK, 'labels'), '--out', str(tmp_path / 's.json')], cwd=ROOT, check=True,
                   capture_output=True)
    scores = json.load(open(tmp_path / 's.json'))
    for task, expected in tasks.items():
        for key, value in expected.items():
            assert abs(scores[task][key] - value) <= 1e-6, (task, key)
        if 'avg_exact_match' in expected:
            assert scores[task]['avg_metric'] == (scores[task]['avg_exact_match'] + scores[task]['avg_f1']) / 2
    for group, value in groups.items():
        assert abs(scores[group] - value) <= 1e-6, group
    assert list(scores) == ['all_task', 'classification', 'tagging', 'qa', 'retrieval', 'pawsx', 'xnli', 'panx',
                            'udpos', 'bucc2018', 'tatoeba', 'xquad', 'mlqa', 'tydiqa']


# Per-language values of the mock submission, from a run of the leaderboard's own evaluate.py
# with seqeval 1.2.2 (6 significant digits).
OFFICIAL = [('panx', 'f1', 'de', 57.1429), ('panx', 'precision', 'ja', 50.0), ('panx', 'recall', 'ka', 75.0),
            ('udpos', 'f1', 'th', 34.4086), ('udpos', 'precision', 'es', 79.6296), ('udpos', 'recall', 'he', 52.5),
            ('xquad', 'f1', 'zh', 25.0), ('xquad', 'f1', 'es', 54.5455), ('mlqa', 'f1', 'es', 26.6667),
            ('mlqa', 'f1', 'de', 85.7143), ('mlqa', 'exact_match', 'en', 0.0), ('tydiqa', 'f1', 'id', 75.0),
            ('tatoeba', 'accuracy', 'th', 0.0), ('bucc2018', 'f1', 'zh', 70.0), ('xnli', 'accuracy', 'ru', 70.0)]


@pytest.mark.parametrize('task,metric,lang,value', OFFICIAL)
def test_mock_per_language_scores(task, metric, lang, value):
    name = lambda d: os.path.join(MOCK, d, task, f'test-{lang}.{ev.suffix(task)}')
    assert abs(ev.score_file(task, name('predictions'), name('labels'), lang)[metric] - value) < 5e-5


# ----------------------------------------------------------------------------------------
# seqeval 1.2.2's default mode, by hand.

@pytest.mark.parametrize('sentences,expected', [
    ([['B-PER', 'I-PER', 'O', 'B-LOC']], {('PER', 0, 1), ('LOC', 3, 3)}),
    ([['I-ORG', 'I-ORG'], ['B-ORG']], {('ORG', 0, 1), ('ORG', 3, 3)}),  # an 'O' separates sentences
    ([['NOUN', 'NOUN', 'VERB']], {('OUN', 0, 1), ('ERB', 2, 2)}),  # POS tags: prefix N, type OUN; runs merge
    ([['SYM', 'SYM']], {('YM', 0, 0), ('YM', 1, 1)}),  # 'S' prefix: single-token chunks
    ([['NOUN'], ['X', 'NOUN']], {('OUN', 0, 0), ('_', 0, 2), ('OUN', 3, 3)}),  # X shares O's type: stale begin
    ([['NOUN', 'X']], {('OUN', 0, 0)}),  # ... and is dropped at a sentence end
    ([['O']], set()),
])
def test_chunks_follow_seqeval(sentences, expected):
    assert ev.tag_chunks(sentences) == expected


def test_chunk_f1_by_hand():
    gold = [['B-PER', 'I-PER', 'O', 'B-LOC'], ['B-ORG']]
    pred = [['B-PER', 'I-PER', 'O', 'B-ORG'], ['O']]
    p, r = 1 / 2, 1 / 3  # one of two predicted chunks is right; one of three gold chunks is found
    assert ev.chunk_f1(gold, pred) == pytest.approx({'f1': 100 * 2 * p * r / (p + r), 'precision': 100 * p,
                                                     'recall': 100 * r})
    assert ev.chunk_f1([['O']], [['O']]) == {'f1': 0.0, 'precision': 0.0, 'recall': 0.0}


# ----------------------------------------------------------------------------------------
# QA: SQuAD v1.1 and MLQA normalisation.

@pytest.mark.parametrize('text,lang,expected', [
    ('The  Cat’s hat!', None, 'cat’s hat'),  # SQuAD: ASCII punctuation only, English articles
    ('The  Cat’s hat!', 'en', 'cats hat'),  # MLQA: every Unicode punctuation mark
    ('Ein Hund, der bellt', 'de', 'hund bellt'),
    ('北京大学, Peking University!', 'zh', '北 京 大 学 peking university'),  # one token per CJK character
    ('كالكتاب الجديد', 'ar', 'ك كتاب جديد'),  # every 'ال' goes, inside words too
    ('la casa y el perro', 'es', 'casa y perro'),
])
def test_answer_normalisation(text, lang, expected):
    assert ev.normalize_answer(text, lang) == expected


def test_qa_scores_by_hand():
    data = [{'paragraphs': [{'context': '', 'qas': [
        {'id': 'a', 'answers': [{'text': 'a red car'}, {'text': 'the big red car'}]},
        {'id': 'b', 'answers': [{'text': 'Paris'}]},
        {'id': 'c', 'answers': [{'text': 'the'}]}]}]}]
    preds = {'a': 'big red car', 'c': 'a'}  # b is unanswered: it scores 0 but counts
    # a: EM 1 (the second answer), F1 1; c: both normalise to '' -> EM 1, F1 0
    assert ev.qa_scores(data, preds) == pytest.approx({'exact_match': 100 * 2 / 3, 'f1': 100 * 1 / 3})
    assert ev.qa_f1('the big red car', 'a red car') == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))


def test_bucc_counts_pairs_once():
    scores = ev.bucc_f1(['de-1\ten-1', 'de-2\ten-2'], ['de-1\ten-1', 'de-1\ten-1', 'de-3\ten-9'])
    assert scores == pytest.approx({'f1': 50.0, 'precision': 50.0, 'recall': 50.0})


def test_accuracy_and_prediction_files_round_trip(tmp_path):
    preds, gold = ['entailment', 'neutral', 'neutral'], ['entailment', 'neutral', 'contradiction']
    for folder, lines in (('p', preds), ('g', gold)):
        ev.write_predictions(tmp_path / folder, 'xnli', 'de', lines)
    name = lambda d: str(tmp_path / d / 'xnli' / 'test-de.tsv')
    assert ev.score_file('xnli', name('p'), name('g'), 'de') == pytest.approx({'accuracy': 200 / 3})
    tags = [['B-PER', 'O'], ['O', 'O', 'B-LOC']]
    ev.write_predictions(tmp_path / 'p', 'panx', 'de', tags)
    assert ev.read_tag_file(str(tmp_path / 'p' / 'panx' / 'test-de.tsv')) == tags


def test_mismatched_predictions_fail_in_one_line(tmp_path):
    ev.write_predictions(tmp_path / 'p', 'xnli', 'de', ['neutral'] * 2)
    ev.write_predictions(tmp_path / 'g', 'xnli', 'de', ['neutral'] * 3)
    with pytest.raises(ev.EvalError, match=r'test-de.tsv has 2 lines, .* has 3: write one per test example'):
        ev.score_file('xnli', str(tmp_path / 'p/xnli/test-de.tsv'), str(tmp_path / 'g/xnli/test-de.tsv'), 'de')
    ev.write_predictions(tmp_path / 'p', 'panx', 'de', [['O', 'O']])
    ev.write_predictions(tmp_path / 'g', 'panx', 'de', [['O', 'O', 'O']])
    with pytest.raises(ev.EvalError, match='sentence 1 has 2 tags for 3 words'):
        ev.score_file('panx', str(tmp_path / 'p/panx/test-de.tsv'), str(tmp_path / 'g/panx/test-de.tsv'), 'de')
    res = subprocess.run([sys.executable, 'eval.py', '--predictions', str(tmp_path / 'p'), '--labels', str(tmp_path / 'g'),
                          '--out', str(tmp_path / 's.json')], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.count('\n') == 1 and 'test-ar.tsv is not there' in res.stderr


# ----------------------------------------------------------------------------------------
# Decoding, retrieval, CKA, tables.

def window(spans, max_context):
    head = 3  # <s> q </s> before the context, </s> after; the question's window
    return Feature(ids=[0] * (head + len(spans) + 1), example=0, spans=[None] * head + spans + [None],
                   max_context=[False] * head + max_context + [False])


def test_decode_qa_picks_the_best_valid_span_across_windows():
    context = 'Anna lives in Paris now'
    spans = [(0, 4), (5, 10), (11, 13), (14, 19), (20, 23)]
    w1 = window(spans[:4], [True, True, True, False])
    w2 = window(spans[2:], [False, True, True])
    question = [{'id': 'q', 'context': context}]
    # positions: 3 Anna, 4 lives, 5 in, 6 Paris in w1; 3 in, 4 Paris, 5 now in w2; <s> and </s> are not context
    s1 = torch.tensor([9.0, 0, 0, 1, 0, 0, 7, 9])
    e1 = torch.tensor([9.0, 0, 0, 0, 3, 0, 2, 9])
    s2 = torch.tensor([0.0, 0, 0, 0, 4, 0, 0])
    e2 = torch.tensor([0.0, 0, 0, 0, 4, 0, 0])
    # 'Paris' would score 9 in w1, but w1 is not where it has its fullest context: w2's 8 wins
    assert ev.decode_qa([w1, w2], [s1, s2], [e1, e2], question) == {'q': 'Paris'}
    assert ev.decode_qa([w1], [s1], [e1], question) == {'q': 'Anna lives'}  # start 1 + end 3, the best valid span left
    # an answer longer than max_answer_len tokens is not allowed
    assert ev.decode_qa([w1], [s1], [e1], question, max_answer_len=1) != {'q': 'Anna lives'}


def test_each_prediction_has_its_probability_by_hand():
    import math
    label, three, each = ev.with_probabilities('xnli', None, [torch.tensor([0.0, math.log(3), 0.0])], [{}])
    assert label == ['entailment'] and three == pytest.approx([3 / 5]) and each == [[0.2, 0.6, 0.2]]  # e^0 / (1 + 3 + 1)
    tags = [torch.tensor([[0.0, 0, 0, 0, 0, 0, 0], [math.log(6), 0, 0, 0, 0, 0, 0], [0, 0, math.log(2), 0, 0, 0, 0]])]
    _, top, each = ev.with_probabilities('panx', [Feature(ids=[0, 5, 2], words=[1, 2])], tags, [{}])
    assert top[0] == pytest.approx([6 / 12, 2 / 8])  # the words' first pieces are positions 1 and 2
    assert each[0] == [[0.5] + [round(1 / 12, 4)] * 6, [0.125, 0.125, 0.25] + [0.125] * 4]
    spans = [(0, 4), (5, 10)]
    s, e = torch.tensor([0.0, 0, 0, math.log(2), 0, 0]), torch.tensor([0.0, 0, 0, 0, math.log(3), 0])
    answer, found, _ = ev.with_probabilities('xquad', [window(spans, [True, True])], [torch.stack([s, e], -1)],
                                          [{'id': 'q', 'context': 'Anna lives'}])
    assert answer == {'q': 'Anna lives'} and found == pytest.approx({'q': 2 / 7 * 3 / 8})  # start 2 of 7, end 3 of 8


def test_linear_cka_against_the_hsic_formula():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 8, generator=g), torch.randn(50, 5, generator=g)
    n = x.size(0)
    h = torch.eye(n, dtype=torch.float64) - 1 / n
    k, l = x.double() @ x.double().T, y.double() @ y.double().T
    hsic = lambda a, b: torch.trace(a @ h @ b @ h)
    assert ev.linear_cka(x, y) == pytest.approx(float(hsic(k, l) / (hsic(k, k) * hsic(l, l)).sqrt()), rel=1e-9)
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=g))
    assert ev.linear_cka(x, 3 * x @ q + 1) == pytest.approx(1.0)  # invariant to rotation, scale and shift


def test_nearest_and_threshold():
    keys = torch.tensor([[1.0, 0], [0, 1.0], [1.0, 1.0]])
    index, score = ev.nearest(torch.tensor([[2.0, 0.1], [0.1, 3.0], [1.0, 0.9]]), keys)
    assert index.tolist() == [0, 1, 2]  # by angle, not by distance
    assert score[0] == pytest.approx(2 / 4.01 ** 0.5)
    pairs, scores = [('a', 1), ('b', 2), ('c', 9)], [0.9, 0.8, 0.7]
    # gold {a, b}: keeping the two best pairs gives F1 1; the threshold falls between 0.8 and 0.7
    assert ev.best_threshold(scores, pairs, {('a', 1), ('b', 2)}) == pytest.approx(0.75)


def mine_by_hand(x, y, k=4):
    """XTREME's mine_bitext with its defaults, written out from its definition: cosine; the mean of
    each sentence's k best similarities on the other side; the ratio margin; each sentence's best
    margin among its k nearest, both ways; taken in falling score while neither side is taken."""
    cos = lambda a, b: float(a @ b) / float(a.norm() * b.norm())
    sim = [[cos(a, b) for b in y] for a in x]
    x_mean = [sum(sorted(row, reverse=True)[:k]) / min(k, len(y)) for row in sim]
    y_mean = [sum(sorted((row[j] for row in sim), reverse=True)[:k]) / min(k, len(x)) for j in range(len(y))]
    score = lambda i, j: sim[i][j] / ((x_mean[i] + y_mean[j]) / 2)
    candidates = []
    for i in range(len(x)):
        j = max(sorted(range(len(y)), key=lambda j: -sim[i][j])[:k], key=lambda j: score(i, j))
        candidates.append((score(i, j), i, j))
    for j in range(len(y)):
        i = max(sorted(range(len(x)), key=lambda i: -sim[i][j])[:k], key=lambda i: score(i, j))
        candidates.append((score(i, j), i, j))
    taken_x, taken_y, out = set(), set(), []
    for value, i, j in sorted(candidates, key=lambda c: -c[0]):
        if i not in taken_x and j not in taken_y:
            taken_x.add(i), taken_y.add(j)
            if value > 0:
                out.append((i, j, value))
    return out


def test_bucc_margin_mining_is_xtremes_by_hand():
    """On random embeddings (more sources than targets, so that both directions propose pairs): the
    pairs and margin scores of eval.margin_mine equal the brute force above; bucc_candidates embeds
    each distinct sentence once, and a sentence under two ids in its file names no pair."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 6, generator=g), torch.randn(7, 6, generator=g)
    mined, expected = ev.margin_mine(x, y), mine_by_hand(x, y)
    assert [(i, j) for i, j, _ in mined] == [(i, j) for i, j, _ in expected] and len(mined) >= 5
    assert all(abs(a[2] - b[2]) < 1e-5 for a, b in zip(mined, expected))
    vectors = {f's{i}': x[i] for i in range(9)} | {f'e{j}': y[j] for j in range(7)}
    src = {f'de-{n}': f's{n % 9}' for n in range(10)}  # de-0 and de-9: one sentence, two ids
    eng = {f'en-{n}': f'e{n}' for n in range(7)}
    seen = []
    embed = lambda texts: seen.append(list(texts)) or torch.stack([vectors[t] for t in texts])
    pairs, scores = ev.bucc_candidates(embed, src, eng)
    assert seen[0] == [f's{i}' for i in range(9)]  # the duplicate embedded once
    assert any(i == 0 for i, _, _ in expected)  # the duplicated sentence is mined: its pair must go
    hand = [((f'de-{i}', f'en-{j}'), value) for i, j, value in expected if i != 0]
    assert pairs == [p for p, _ in hand] and all(abs(a - b) < 1e-5 for a, (_, b) in zip(scores, hand))
    cosine, _ = ev.bucc_candidates(embed, src, eng, 'cosine')
    assert len(cosine) == 10 and cosine[0][0] == 'de-0'  # every source id its nearest, the duplicates too


def test_summary_and_table():
    out = ev.summarize({'en': 80.0, 'de': 70.0, 'zh': 60.0})
    assert out['avg'] == pytest.approx(70.0) and out['gap'] == pytest.approx(15.0)
    table = ev.format_table({'dev': out})
    assert 'gap' in table and '15.0' in table


def test_retrieval_embeds_a_layer_a_range_of_layers_side_by_side_or_the_first_token(spm_path):
    """XTREME's Table 14: the mean over a text's tokens of one layer's states, of layers a..b side by side, or the
    first token's state; each written out here block by block."""
    import data
    import layers as L
    tok = data.Tokenizer(spm_path)
    torch.manual_seed(0)
    enc = L.Encoder(L.Config(vocab_size=tok.vocab_size, n_layer=3, n_head=2, dim=16, ffn_dim=32)).eval()
    texts = ['Привет, как дела?', 'Café crème brûlée à São Paulo, naïve façade déjà vu.']
    with torch.no_grad():
        by_hand = []
        for text in texts:
            ids = torch.tensor([tok.encode_pair(text)])
            h, states = enc.embed(ids), []
            for block in enc.blocks:
                h = block(h, torch.ones_like(ids, dtype=torch.bool))
                states.append(h[0])
            by_hand.append(states)  # after blocks 1, 2, 3
        one = ev.embed_texts(enc, tok, texts, (2,), 8, 'cpu')
        assert torch.allclose(one, torch.stack([s[1].mean(0) for s in by_hand]), atol=1e-5)
        both = ev.embed_texts(enc, tok, texts, (2, 3), 8, 'cpu')
        assert torch.allclose(both, torch.stack([torch.cat([s[1].mean(0), s[2].mean(0)]) for s in by_hand]), atol=1e-5)
        first = ev.embed_texts(enc, tok, texts, (3,), 8, 'cpu', pool='cls')
        assert torch.allclose(first, torch.stack([s[2][0] for s in by_hand]), atol=1e-5)


def test_spearman_by_hand_with_a_tie():
    # ranks (0, 1.5, 1.5, 3) and (0, 2, 1, 3): covariance 4.5, variances 4.5 and 5
    assert ev.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert ev.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1)


def test_cka_of_a_run_is_eq_1_on_its_encoders_s_states_by_hand(tmp_path, capsys):
    """eval.py --cka RUN: per language, linear CKA between the mean states (last layer: X-Mixup's sentence
    representation) of English's and the language's test pairs under RUN's encoder, each computed here one example at
    a time."""
    import data
    import layers
    import train
    demo = data.make_demo(str(tmp_path / 'run' / 'demo-data'), n_train=200, n_eval=30)
    train.main(['--demo', '--task', 'xnli', '--epochs', '2', '--out', str(tmp_path / 'run')])
    results = json.load(open(tmp_path / 'run' / 'results.json'))
    results['test'].update(de=70.0, zh=30.0)  # scores that rank the languages (the demo's may tie)
    json.dump(results, open(tmp_path / 'run' / 'results.json', 'w'))
    ev.main(['--cka', str(tmp_path / 'run'), '--out', str(tmp_path / 'cka.json')])
    out = json.load(open(tmp_path / 'cka.json'))
    ckpt = layers.load_checkpoint(str(tmp_path / 'run' / 'best.pt'))
    enc = layers.Encoder(layers.stored_config(ckpt['config'])).eval()
    enc.load_state_dict(ckpt['encoder'])
    tok = data.Tokenizer(os.path.join(demo, 'sentencepiece.bpe.model'))
    with torch.no_grad():
        reps = lambda lang: torch.stack([enc(torch.tensor([tok.encode_pair(ex['a'], ex['b'])]))[0].mean(0)
                                         for ex in data.read_split(demo, 'xnli', 'test', lang)])
        english = reps('en')
        for lang in ('de', 'zh'):
            x, y = english.double() - english.double().mean(0), reps(lang).double() - reps(lang).double().mean(0)
            by_hand = float((y.T @ x).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm()))
            assert out['cka'][lang] == pytest.approx(by_hand, rel=1e-4)
    assert out['test'] == {'de': 70.0, 'zh': 30.0} and out['cka']['de'] != out['cka']['zh']
    assert out['rho'] == pytest.approx(1.0 if out['cka']['de'] > out['cka']['zh'] else -1.0)
    assert 'Spearman\'s rho of CKA and test score over 2 languages' in capsys.readouterr().out
    ev.analyse('representations', [str(tmp_path / 'run')], str(tmp_path / 'out'))  # X-Mixup's Figures 1 and 4
    found = json.load(open(tmp_path / 'out' / 'representations.json'))['runs'][str(tmp_path / 'run')]
    with torch.no_grad():
        each = {lang: reps(lang).double() for lang in ('en', 'de', 'zh')}
    for lang in ('de', 'zh'):  # the centroids' distance in the full space
        by_hand = float((each[lang].mean(0) - each['en'].mean(0)).norm())
        assert found['table']['distance to English'][lang] == pytest.approx(by_hand, rel=1e-4)
    together = torch.cat(list(each.values()))
    axes = torch.linalg.svd(together - together.mean(0), full_matrices=False)[2][:2].T  # an SVD, not eigh
    axes *= axes.gather(0, axes.abs().argmax(0, keepdim=True)).sign()
    flat = (each['de'] - together.mean(0)) @ axes
    assert torch.allclose(torch.tensor(found['points']['points']['de']).double(), flat, atol=2e-3)
    assert found['counts'] == {'en': 30, 'de': 30, 'zh': 30}
    train.main(['--out', str(tmp_path / 'run'), '--predict', 'dev-de'])  # a split of the run's data, as it reads it
    predicted = json.load(open(tmp_path / 'run' / 'predicted' / 'dev-de.scores.json'))
    assert predicted['scores']['accuracy'] == pytest.approx(results['dev']['de'])
    assert all(sum(p['distribution']) == pytest.approx(1, abs=1e-3) for p in predicted['predictions'])


def test_a_layer_the_model_lacks_is_refused_before_the_folder_changes(tmp_path):
    import data
    import train
    demo = data.make_demo(str(tmp_path / 'run' / 'demo-data'), n_train=20, n_eval=8)
    (tmp_path / 'run' / 'results.json').write_text('{}')  # an earlier run's, which must stay
    with pytest.raises(SystemExit, match='--layer 3: the model has layers 1 to 2'):
        train.main(['--demo', '--task', 'tatoeba', '--layer', '3', '--out', str(tmp_path / 'run')])
    assert (tmp_path / 'run' / 'results.json').read_text() == '{}' and demo
    for bad in ('2-1', '1-2-3'):
        with pytest.raises(SystemExit, match=f'--layer {bad}: give a layer N or a range A-B with A at most B'):
            train.parse_args(['--task', 'tatoeba', '--layer', bad])
