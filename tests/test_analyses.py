"""eval.py --analyse: the papers' analyses of a run's predictions, each checked against counts written out by hand on
files made here in the real layout, and its PNG written and opened."""
import json
import os
import re

import pytest

import eval as ev

NOUN, VERB, DET, ADJ = 'NOUN', 'VERB', 'DET', 'ADJ'


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text)


def tagged(sentences):
    """A tagging file of the layout XTREME ships: a word and its tag a line, a blank line after each sentence."""
    return ''.join(''.join(f'w{i}\t{tag}\n' for i, tag in enumerate(tags)) + '\n' for tags in sentences)


def tag_lines(sentences):
    """A tagging predictions file of the leaderboard's layout: a tag a line, a blank line after each sentence."""
    return ''.join(''.join(f'{tag}\n' for tag in tags) + '\n' for tags in sentences)


def finished_run(folder, task, data_dir, predictions):
    """A finished run's folder as train.py leaves it: results.json, config.json, dev predictions {lang: text}."""
    write(os.path.join(folder, 'results.json'), json.dumps({'task': task}))
    write(os.path.join(folder, 'config.json'), json.dumps({'task': task, 'data_dir': data_dir, 'langs': ['de']}))
    for lang, text in predictions.items():
        write(os.path.join(folder, 'predictions', task, f'dev-{lang}.{ev.suffix(task)}'), text)
    return folder


def test_tag_ngram_accuracy_counts_the_windows_seen_in_english_by_hand():
    """English's tags N V D N give the trigrams (N V D), (V D N) and the bigrams (N V), (V D), (D N). The dev
    sentence N V D A, predicted N V D N, has the trigram windows (N V D), seen and right, and (V D A), unseen and
    wrong; its bigram windows (N V) and (V D) are seen and right, (D A) unseen and wrong. D N, predicted as it is,
    has no trigram window and one bigram window, seen and right."""
    english = [[NOUN, VERB, DET, NOUN]]
    gold, predicted = [[NOUN, VERB, DET, ADJ], [DET, NOUN]], [[NOUN, VERB, DET, NOUN], [DET, NOUN]]
    assert ev.tag_ngram_accuracy(english, gold, predicted, 3) == {'seen': (1, 1), 'unseen': (0, 1)}
    assert ev.tag_ngram_accuracy(english, gold, predicted, 2) == {'seen': (3, 3), 'unseen': (0, 1)}
    assert ev.tag_ngram_accuracy(english, gold, gold, 3) == {'seen': (1, 1), 'unseen': (1, 1)}


def test_pos_ngrams_writes_xtreme_s_table_4_and_its_figure(tmp_path):
    """Table 4's rows from a run's dev predictions: each language's accuracy on the trigram and 4-gram windows seen
    and unseen in English's training data, the other languages' mean (avg) and English's score less it (gap)."""
    data_dir = str(tmp_path / 'data')
    write(os.path.join(data_dir, 'udpos', 'train-en.tsv'), tagged([[NOUN, VERB, DET, NOUN, VERB]]))
    write(os.path.join(data_dir, 'udpos', 'dev-en.tsv'), tagged([[NOUN, VERB, DET, NOUN]]))
    write(os.path.join(data_dir, 'udpos', 'dev-de.tsv'), tagged([[DET, NOUN, VERB, ADJ]]))
    run = finished_run(str(tmp_path / 'run'), 'udpos', data_dir, {
        'en': tag_lines([[NOUN, VERB, DET, VERB]]),  # trigrams: (N V D) right, (V D N) wrong; the 4-gram wrong
        'de': tag_lines([[DET, NOUN, VERB, ADJ]])})  # (D N V) seen, (N V A) unseen, the 4-gram (D N V A) unseen: right
    written = ev.analyse('pos-ngrams', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'pos-ngrams.json'))['runs'][run]
    table = result['table']
    assert result['counts'] == {'3-gram, seen': {'en': 2, 'de': 1}, '3-gram, unseen': {'en': 0, 'de': 1},
                                '4-gram, seen': {'en': 1, 'de': 0}, '4-gram, unseen': {'en': 0, 'de': 1}}
    assert table == {'3-gram, seen': {'en': 50.0, 'de': 100.0, 'avg': 100.0, 'gap': -50.0},
                     '3-gram, unseen': {'de': 100.0, 'avg': 100.0},
                     '4-gram, seen': {'en': 0.0},
                     '4-gram, unseen': {'de': 100.0, 'avg': 100.0}}
    assert '3-gram, unseen' in open(tmp_path / 'out' / 'pos-ngrams.txt').read()
    figure = tmp_path / 'out' / 'pos-ngrams.png'
    assert str(figure) in written and figure.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and figure.stat().st_size > 5000


def test_shared_errors_compares_each_language_with_english_on_the_same_examples(tmp_path):
    """XTREME's Section 5 on four parallel XNLI dev examples. English is right on 1, 2 and 3 and wrong on 4; German
    is right on 1 and 4 and wrong on 2 and 3, so it is right on 1 of English's 3 rights (33.3%) and on English's one
    wrong (100%), and it predicts what English predicts on example 1 alone (25%)."""
    data_dir = str(tmp_path / 'data')
    rows = [('a1', 'b1', 'entailment'), ('a2', 'b2', 'neutral'), ('a3', 'b3', 'contradiction'), ('a4', 'b4', 'neutral')]
    for lang in ('en', 'de'):
        write(os.path.join(data_dir, 'xnli', f'dev-{lang}.tsv'), ''.join('\t'.join(row) + '\n' for row in rows))
    run = finished_run(str(tmp_path / 'run'), 'xnli', data_dir, {
        'en': 'entailment\nneutral\ncontradiction\nentailment\n',
        'de': 'entailment\ncontradiction\nneutral\nneutral\n'})
    ev.analyse('shared-errors', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'shared-errors.json'))['runs'][run]
    table = result['table']
    assert result['counts'] == {'en': 4, 'de': 4}
    assert table['right where English is right']['de'] == pytest.approx(100 / 3)
    assert table['right where English is wrong']['de'] == 100.0
    assert table['consistent with English']['de'] == 25.0
    with pytest.raises(ev.EvalError, match='reads runs of xnli or pawsx or xquad'):
        ev.analyse('shared-errors', [finished_run(str(tmp_path / 'pos'), 'udpos', data_dir, {})], str(tmp_path))


def test_shared_errors_on_xquad_counts_exact_matches_of_the_test_answers(tmp_path):
    """XQuAD's half of Section 5: the test answers, right on an exact match after SQuAD's normalisation (articles and
    case dropped). English gets q1 right ('the Rhine' for 'Rhine') and q2 wrong; German gets both right: 100% of
    English's rights and 100% of its wrongs. A QA answer is in its own language, so no consistency row."""
    data_dir = str(tmp_path / 'data')
    for lang, first, second in (('en', 'Rhine', 'Paris'), ('de', 'Rhein', 'Paris')):
        qas = [{'id': 'q1', 'question': '?', 'answers': [{'text': first, 'answer_start': 0}]},
               {'id': 'q2', 'question': '?', 'answers': [{'text': second, 'answer_start': 0}]}]
        labels = {'data': [{'title': 't', 'paragraphs': [{'context': f'{first} {second}', 'qas': qas}]}]}
        write(os.path.join(data_dir, 'labels', 'xquad', f'test-{lang}.json'), json.dumps(labels))
    run = finished_run(str(tmp_path / 'run'), 'xquad', data_dir, {})
    write(os.path.join(run, 'predictions', 'xquad', 'test-en.json'), json.dumps({'q1': 'the Rhine', 'q2': 'Lyon'}))
    write(os.path.join(run, 'predictions', 'xquad', 'test-de.json'), json.dumps({'q1': 'Rhein', 'q2': 'paris'}))
    ev.analyse('shared-errors', [run], str(tmp_path / 'out'))
    table = json.load(open(tmp_path / 'out' / 'shared-errors.json'))['runs'][run]['table']
    assert table == {'right where English is right': {'de': 100.0, 'avg': 100.0},
                     'right where English is wrong': {'de': 100.0, 'avg': 100.0}}


def test_an_analysis_names_what_it_lacks_in_one_line(tmp_path):
    with pytest.raises(ev.EvalError, match="unknown analysis 'pos'"):
        ev.analyse('pos', [str(tmp_path)])
    with pytest.raises(ev.EvalError, match='is not a finished run'):
        ev.analyse('pos-ngrams', [str(tmp_path)])
    run = finished_run(str(tmp_path / 'run'), 'udpos', str(tmp_path / 'data'), {})
    write(os.path.join(tmp_path, 'data', 'udpos', 'train-en.tsv'), tagged([[NOUN]]))
    write(os.path.join(tmp_path, 'data', 'udpos', 'dev-en.tsv'), tagged([[NOUN]]))
    with pytest.raises(ev.EvalError, match='dev-en.tsv is not there: the analysis reads the dev predictions'):
        ev.analyse('pos-ngrams', [run], str(tmp_path / 'out'))


def test_every_analysis_the_reproduction_page_runs_exists():
    """The ledger's analysis rows cite `eval.py --analyse NAME` commands: each NAME is one of eval.ANALYSES, and the
    tasks of the runs they name are the analysis's."""
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs', 'reproducing.md'),
                encoding='utf-8').read()
    commands = re.findall(r'^python eval\.py --analyse (\S+) (.+)$', page, flags=re.M)
    assert len(commands) >= 2
    for name, runs in commands:
        assert name in ev.ANALYSES, name
        assert all(run.split('/')[1].split('-')[0] in ev.ANALYSES[name][0] for run in runs.split()), runs  # runs/<task>-


def test_ner_entities_writes_xtreme_s_table_11_by_hand(tmp_path):
    """Table 11 on German dev entities against English's training entities New York City, Paris and Anna Müller.
    Neu York City (two words of New York City: seen, long, Latin) is predicted right; Paris, twice, once wrong (seen,
    short, frequent); Берлин (unseen, short, not Latin) right; Anna Schmidt (one word of Anna Müller: unseen) right.
    (a) 2 of 3, (b) 2 of 2, (c) 3 of 4, (d) 3 of 4, (e) 1 of 2; (a) - (b) = -33.3, the least of (a) - (c-e) -8.3."""
    data_dir = str(tmp_path / 'data')
    sentence = lambda *pairs: ''.join(f'{w}\t{t}\n' for w, t in pairs) + '\n'
    write(os.path.join(data_dir, 'panx', 'train-en.tsv'), sentence(('New', 'B-LOC'), ('York', 'I-LOC'), (
        'City', 'I-LOC'), ('and', 'O'), ('Paris', 'B-LOC')) + sentence(('Anna', 'B-PER'), ('Müller', 'I-PER')))
    write(os.path.join(data_dir, 'panx', 'dev-en.tsv'), sentence(('Paris', 'B-LOC'), ('is', 'O')))
    write(os.path.join(data_dir, 'panx', 'dev-de.tsv'), sentence(
        ('Neu', 'B-LOC'), ('York', 'I-LOC'), ('City', 'I-LOC'), ('liegt', 'O')) + sentence(
        ('Paris', 'B-LOC'), ('ist', 'O')) + sentence(('Берлин', 'B-LOC')) + sentence(
        ('Anna', 'B-PER'), ('Schmidt', 'I-PER'), ('und', 'O'), ('Paris', 'B-LOC')))
    run = finished_run(str(tmp_path / 'run'), 'panx', data_dir, {
        'en': tag_lines([['B-LOC', 'O']]),
        'de': tag_lines([['B-LOC', 'I-LOC', 'I-LOC', 'O'], ['B-ORG', 'O'], ['B-LOC'], ['B-PER', 'I-PER', 'O', 'B-LOC']])})
    ev.analyse('ner-entities', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'ner-entities.json'))['runs'][run]
    table, counts = result['table'], result['counts']
    assert {row: table[row]['de'] for row in table if 'de' in table[row]} == pytest.approx({
        '(a) seen': 200 / 3, '(b) not seen': 100.0, '(c) short': 75.0, '(d) Latin': 75.0, '(e) frequent': 50.0,
        '(a) - (b)': 200 / 3 - 100, 'min((a) - (c-e))': 200 / 3 - 75})
    assert {row: counts[row]['de'] for row in counts} == {'(a) seen': 3, '(b) not seen': 2, '(c) short': 4,
                                                          '(d) Latin': 4, '(e) frequent': 2}
    assert table['(a) seen']['en'] == 100.0 and 'en' not in table['(b) not seen']  # English's Paris: seen, right


def test_xla_epochs_draws_xla_s_figure_2_from_each_training_s_results(tmp_path):
    """Figure 2 from an XLA run's trainings, in the order an epoch trains them: the pairs (1, 2), (1, 3), (2, 1),
    (2, 3), (3, 1), (3, 2) teach models 3, 2, 3, 1, 2, 1. Model 1 starts at 60 (its first training's score before)
    and is 70 after epoch 1 (its last training there, better). In epoch 2 it reaches 72, and its last training (72 to
    71) is not better, so 72 stays. Model 2's 45 to 44 in epoch 1 leaves 45. A missing training (model 3's in epoch 2)
    leaves no score for that epoch."""
    run = finished_run(str(tmp_path / 'run'), 'panx', str(tmp_path), {})
    write(os.path.join(run, 'config.json'), json.dumps({'task': 'panx', 'method': 'xla', 'data_dir': str(tmp_path)}))
    trainings = {(1, 'model3-by12'): (50, 55, True), (1, 'model2-by13'): (40, 45, True),
                 (1, 'model3-by21'): (55, 58, True), (1, 'model1-by23'): (60, 65, True),
                 (1, 'model2-by31'): (45, 44, False), (1, 'model1-by32'): (65, 70, True),
                 (2, 'model2-by13'): (45, 50, True), (2, 'model1-by23'): (70, 72, True),
                 (2, 'model2-by31'): (50, 52, True), (2, 'model1-by32'): (72, 71, False)}
    for (epoch, name), (before, after, better) in trainings.items():
        write(os.path.join(run, f'epoch{epoch}', name, 'results.json'),
              json.dumps({'dev_before': before, 'dev_after': after, 'better': better}))
    ev.analyse('xla-epochs', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'xla-epochs.json'))['runs'][run]
    assert result['table'] == {'model 1': {'warm-up': 60, 'epoch 1': 70, 'epoch 2': 72},
                               'model 2': {'warm-up': 40, 'epoch 1': 45, 'epoch 2': 52},
                               'model 3': {'warm-up': 50, 'epoch 1': 58}}
    assert result['counts'] == {'model 1': 4, 'model 2': 4, 'model 3': 2}
    with pytest.raises(ev.EvalError, match='reads XLA runs'):
        ev.analyse('xla-epochs', [finished_run(str(tmp_path / 'other'), 'panx', str(tmp_path), {})], str(tmp_path))


def test_wikipedia_and_families_draw_xtreme_s_figures_2_3_and_6_by_hand(tmp_path):
    """A run's test scores en 90, de 80, zh 60, sw 50 beside Table 5's articles (millions) 5.98, 2.37, 1.09 and 0.05:
    Pearson's rho written out. Families in the order of their languages' mean articles: Niger-Congo (sw, 0.05),
    Sino-Tibetan (zh, 1.09), IE: Germanic (en and de, 4.175); scripts: Chinese ideograms (zh, 1.09), Latin (en, de
    and sw, 2.8). A language Table 5 lacks (xx) is left out."""
    run = finished_run(str(tmp_path / 'run'), 'xnli', str(tmp_path), {})
    scores = {'en': 90.0, 'de': 80.0, 'zh': 60.0, 'sw': 50.0}
    write(os.path.join(run, 'results.json'), json.dumps({'task': 'xnli', 'test': {**scores, 'xx': 10.0, 'avg': 1}}))
    write(os.path.join(run, 'config.json'), json.dumps({'task': 'xnli', 'data_dir': str(tmp_path),
                                                        'langs': ['de', 'zh', 'sw', 'xx']}))
    ev.analyse('wikipedia', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'wikipedia.json'))['runs'][run]
    x, y = [5.98, 2.37, 1.09, 0.05], [90.0, 80.0, 60.0, 50.0]
    mx, my = sum(x) / 4, sum(y) / 4
    rho = sum((a - mx) * (b - my) for a, b in zip(x, y)) / (
        sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y)) ** 0.5
    assert result['table'] == {'xnli': scores} and result['counts']['rho'] == pytest.approx(rho)
    assert result['counts']['articles'] == dict(zip(scores, x))
    written = ev.analyse('families', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'families.json'))['runs'][run]
    assert list(result['table']['family'].items()) == [('Niger-Congo (1)', 50.0), ('Sino-Tibetan (1)', 60.0),
                                                       ('IE: Germanic (2)', 85.0)]
    assert list(result['table']['script'].items()) == [('Chinese ideograms (1)', 60.0), ('Latin (3)', 220 / 3)]
    assert result['counts']['script'] == {'Chinese ideograms': ['zh'], 'Latin': ['en', 'de', 'sw']}
    figure = tmp_path / 'out' / 'families.png'
    assert str(figure) in written and figure.read_bytes()[:4] == b'\x89PNG' and figure.stat().st_size > 5000


def test_pca_finds_the_directions_of_largest_variance_by_hand():
    """Points at x = +-2 and y = +-1: the mean is 0, the first axis is x (variance 8/3), the second y (2/3), each
    signed so that its largest entry is positive."""
    import numpy as np
    points = np.array([[2.0, 0, 0], [-2, 0, 0], [0, 1, 0], [0, -1, 0]])
    mean, axes = ev.pca(points + 5)
    assert mean == pytest.approx([5, 5, 5])
    assert np.abs(axes - [[1, 0], [0, 1], [0, 0]]).max() < 1e-9
    assert ((points @ axes) == [[2, 0], [-2, 0], [0, 1], [0, -1]]).all()
    _, flipped = ev.pca(-points + 5)  # the same axes, not their negatives
    assert np.abs(flipped - axes).max() < 1e-9
    diagonal = np.array([[2.0, 2, 0], [-2, -2, 0], [1, -1, 0], [-1, 1, 0]])  # the axes (1, 1, 0) and (1, -1, 0)
    _, axes = ev.pca(diagonal)
    assert np.abs(diagonal @ axes - [[8 ** 0.5, 0], [-8 ** 0.5, 0], [0, 2 ** 0.5], [0, -2 ** 0.5]]).max() < 1e-9


def test_bleu_curve_reads_a_translation_run_s_curve(tmp_path):
    run = str(tmp_path / 'run')
    write(os.path.join(run, 'results.json'), json.dumps({'task': 'translate', 'curve': {'4': 10.5, '8': 12.0}}))
    write(os.path.join(run, 'config.json'), json.dumps({'task': 'translate', 'data_dir': str(tmp_path)}))
    written = ev.analyse('bleu-curve', [run], str(tmp_path / 'out'))
    assert json.load(open(tmp_path / 'out' / 'bleu-curve.json'))['runs'][run]['table'] == {'BLEU': {'4': 10.5,
                                                                                                   '8': 12.0}}
    assert open(written[2], 'rb').read(4) == b'\x89PNG'
    write(os.path.join(run, 'results.json'), json.dumps({'task': 'translate'}))
    with pytest.raises(ev.EvalError, match='has no BLEU curve: give a VECO translation run made with --curve'):
        ev.analyse('bleu-curve', [run], str(tmp_path / 'out'))


def predicted_run(tmp_path, split, sentences):
    """A PAN-X run that has predicted German's split (train.py --predict): sentences [(gold, predicted, probability,
    distribution)], the gold tags in the data folder."""
    data_dir = str(tmp_path / 'data')
    write(os.path.join(data_dir, 'panx', f'{split}-de.tsv'), tagged([gold for gold, *_ in sentences]))
    run = finished_run(str(tmp_path / 'run'), 'panx', data_dir, {})
    each = [{'tags': tags, 'probability': p, 'distribution': d} for _, tags, p, d in sentences]
    write(os.path.join(run, 'predicted', f'{split}-de.scores.json'), json.dumps({'predictions': each}))
    return run


def test_xla_losses_computes_figures_4_to_6_by_hand(tmp_path):
    """Three German sentences. s1: 3 words, none wrong, probabilities .5 .8 1 (loss (ln 2 + ln 1.25) / 3,
    confidence .767); s2: 4 words, 3 wrong, all .9 (loss ln(1/.9), confidence .9); s3: 3 words, 2 wrong, all .6
    (loss ln(1/.6), confidence .6). s1 and s3 are accurate-2 (at most two wrong); 80% of 3 is 2 kept, the most
    confident: s2 and s1."""
    import math
    O, P = 'O', 'B-PER'
    run = predicted_run(tmp_path, 'train', [([P, O, O], [P, O, O], [0.5, 0.8, 1.0], None),
                                           ([O, O, O, O], [O, P, P, P], [0.9] * 4, None),
                                           ([O, O, O], [P, P, O], [0.6] * 3, None)])
    written = ev.analyse('xla-losses', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'xla-losses.json'))['runs'][run]
    loss = [(math.log(2) + math.log(1.25)) / 3, math.log(1 / 0.9), math.log(1 / 0.6)]
    each = result['points']['de']
    assert each['loss'] == pytest.approx(loss) and each['length'] == [3, 4, 3] and each['wrong'] == [0, 3, 2]
    assert each['kept'] == [True, True, False] and each['accurate-2'] == [True, False, True]
    assert {row: values['de'] for row, values in result['table'].items()} == pytest.approx({
        'accurate-2, % of sentences': 200 / 3, 'loss, accurate-2': (loss[0] + loss[2]) / 2, 'loss, noisy': loss[1],
        'length, all': 10 / 3, 'length, kept': 3.5})
    assert result['counts'] == {'de': 3} and open(written[2], 'rb').read(4) == b'\x89PNG'


def test_xla_logits_reduces_each_word_s_log_probabilities_by_hand(tmp_path):
    """Figure 3: four words' tag distributions, their logarithms projected on the first two principal axes (an SVD
    here), grouped by gold tag; the accuracy of each gold tag (O: 1 of 2 right, B-PER 2 of 2)."""
    import numpy as np
    O, P = 'O', 'B-PER'
    dists = [[[0.7, 0.2, 0.1], [0.2, 0.7, 0.1]], [[0.1, 0.1, 0.8], [0.6, 0.3, 0.1]]]
    run = predicted_run(tmp_path, 'dev', [([P, O], [P, P], None, dists[0]), ([O, P], [O, P], None, dists[1])])
    ev.analyse('xla-logits', [run], str(tmp_path / 'out'))
    result = json.load(open(tmp_path / 'out' / 'xla-logits.json'))['runs'][run]
    assert result['table'] == {'accuracy by gold tag, de': {P: 100.0, O: 50.0}} and result['counts'] == {'de': 4}
    logp = np.log(np.array(dists).reshape(4, 3))
    centred = logp - logp.mean(0)
    axes = np.linalg.svd(centred)[2][:2].T
    axes *= np.sign(axes[np.abs(axes).argmax(0), [0, 1]])
    flat = centred @ axes
    assert np.abs(np.array(result['points']['points'][P]) - flat[[0, 3]]).max() < 2e-3  # rounded to 3 decimals
    assert np.abs(np.array(result['points']['points'][O]) - flat[[1, 2]]).max() < 2e-3
