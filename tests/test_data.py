"""Readers on files in the real XTREME formats, features and their round trips, batches, the demo."""
import csv
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
import torch

import data
import eval as ev
from conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOCK = os.path.join(ROOT, 'tests', 'fixtures', 'xtreme-mock')
MOCK_QA = sorted(glob.glob(os.path.join(MOCK, 'labels', '*', 'test-*.json')))


@pytest.fixture(scope='module')
def demo_dir(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo')), n_train=60, n_eval=20)


@pytest.fixture(scope='module')
def mock_tok(tmp_path_factory):
    """A sentencepiece model trained on the mock QA texts; coverage below 1 leaves rare characters <unk>."""
    texts = [t for f in MOCK_QA for ex in data.read_squad(f) for t in (ex['context'], ex['question'])]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=1500,
                                   hard_vocab_limit=False, character_coverage=0.995, minloglevel=2, num_threads=1)
    path = tmp_path_factory.mktemp('spm') / 'mock.model'
    path.write_bytes(model.getvalue())
    return data.Tokenizer(str(path))


# ----------------------------------------------------------------------------------------
# Readers, on files written the way XTREME writes them.

def write_xtreme_tsv(path, rows):
    """As utils_preprocess.py: csv.writer with a tab delimiter (CRLF, quotes around fields with a '"')."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8', newline='') as f:
        csv.writer(f, delimiter='\t').writerows(rows)


def test_classification_reader(tmp_path):
    rows = [('He said "hi" .', 'Er sagte "hallo" .', 'entailment'), ('A man sleeps .', 'Nobody sleeps .', 'contradiction')]
    write_xtreme_tsv(tmp_path / 'xnli' / 'dev-de.tsv', rows)
    assert b'"He said ""hi"" ."' in (tmp_path / 'xnli' / 'dev-de.tsv').read_bytes()  # the real files' quoting
    assert data.read_split(str(tmp_path), 'xnli', 'dev', 'de') == [{'a': a, 'b': b, 'label': l} for a, b, l in rows]
    write_xtreme_tsv(tmp_path / 'xnli' / 'test-de.tsv', [r[:2] for r in rows])
    assert [ex['label'] for ex in data.read_split(str(tmp_path), 'xnli', 'test', 'de')] == [None, None]
    write_xtreme_tsv(tmp_path / 'xnli' / 'train-en.tsv', [('A b .', 'C d .', 'contradiction')])
    tt = tmp_path / 'xnli' / 'translate-train' / 'en-de-translated.tsv'
    tt.parent.mkdir()
    tt.write_text('A b .\tC d .\tE f .\tG h .\tcontradictory\n', encoding='utf-8')  # XNLI-MT's label spelling
    (src, tgt), = data.read_translations(str(tmp_path), 'xnli', 'train', 'de')
    assert src == {'a': 'A b .', 'b': 'C d .', 'label': 'contradiction'} and tgt['a'] == 'E f .'


def test_translations_are_matched_to_their_originals_by_text(tmp_path, capsys):
    """Rows out of order, a pair that occurs twice, spacing that differs, a translation of no
    original and an original with no translation: each translation goes to its own original."""
    english = [('One .', 'Uno .', 'entailment'), ('Two  .', 'Dos .', 'neutral'), ('One .', 'Uno .', 'neutral'),
               ('Three .', 'Tres .', 'contradiction'), ('Four .', 'Cuatro .', 'entailment')]
    write_xtreme_tsv(tmp_path / 'xnli' / 'train-en.tsv', english)
    translated = [('Three .', 'Tres .', 'Drei .', 'Drei !', 'contradiction'), ('Two .', 'Dos .', 'Zwei .', 'Zwei !', 'neutral'),
                  ('Stray .', 'Nada .', 'Streuner .', 'Nichts .', 'neutral'), ('One .', 'Uno .', 'Eins .', 'Eins !', 'entailment'),
                  ('One .', 'Uno .', 'Eins ?', 'Eins ?', 'neutral')]
    write_xtreme_tsv(tmp_path / 'xnli' / 'translate-train' / 'en-de-translated.tsv', translated)
    pairs = data.read_translations(str(tmp_path), 'xnli', 'train', 'de')
    assert [o['a'] for o, _ in pairs] == [e[0] for e in english]  # one per original, in its order
    assert [t and t['a'] for _, t in pairs] == ['Eins .', 'Zwei .', 'Eins ?', 'Drei .', None]
    assert [o['label'] for o, _ in pairs] == [e[2] for e in english]  # the original's label
    out = capsys.readouterr().out
    assert 'en-de-translated.tsv: 1 of 5 examples of the original have no translation here, 1 translations match no original (the first at line 3)' in out


def test_empty_translations_are_skipped_with_a_count(tmp_path, capsys):
    write_xtreme_tsv(tmp_path / 'pawsx' / 'dev-de.tsv', [('Eins .', 'Zwei .', '1'), ('Drei .', 'Vier .', '0'), ('Fünf .', 'Sechs .', '1')])
    write_xtreme_tsv(tmp_path / 'pawsx' / 'translate-dev' / 'dev-de-en-translated.tsv',
                     [('Eins .', 'Zwei .', 'One .', 'Two .', '1'), ('Drei .', 'Vier .', '', 'Four .', '0'),
                      ('Fünf .', 'Sechs .', 'Five .', ' ', '1')])
    pairs = data.read_translations(str(tmp_path), 'pawsx', 'dev', 'de')
    assert [t and (t['a'], t['b']) for _, t in pairs] == [('One .', 'Two .'), None, None]
    assert 'dev-de-en-translated.tsv: 2 rows with an empty sentence skipped (the first at line 2)' in capsys.readouterr().out


def test_tagging_reader_and_translations(tmp_path):
    (tmp_path / 'panx').mkdir()
    (tmp_path / 'panx' / 'train-en.tsv').write_text('Anna\tB-PER\nlives\tO\n\nParis\tB-LOC\n', encoding='utf-8')
    (tmp_path / 'panx' / 'test-de.tsv').write_text('Anna\nwohnt\n\n\nParis\n', encoding='utf-8')
    assert data.read_split(str(tmp_path), 'panx', 'train') == [
        {'words': ['Anna', 'lives'], 'tags': ['B-PER', 'O']}, {'words': ['Paris'], 'tags': ['B-LOC']}]
    assert data.read_split(str(tmp_path), 'panx', 'test', 'de') == [
        {'words': ['Anna', 'wohnt'], 'tags': None}, {'words': ['Paris'], 'tags': None}]
    (tmp_path / 'panx' / 'translate-train').mkdir()
    (tmp_path / 'panx' / 'translate-train' / 'train-en-de.tsv').write_text('Anna\nwohnt\n', encoding='utf-8')
    with pytest.raises(data.DataError, match='1 sentences for 2 in the original'):
        data.read_translations(str(tmp_path), 'panx', 'train', 'de')


def test_qa_reader_on_the_mock_files():
    for path in MOCK_QA:
        examples = data.read_squad(path)
        assert examples and all(ex['context'][a['answer_start']:a['answer_start'] + len(a['text'])] == a['text']
                                for ex in examples for a in ex['answers'])


def test_retrieval_readers(tmp_path):
    (tmp_path / 'bucc2018').mkdir()
    (tmp_path / 'bucc2018' / 'de-en.dev.de').write_text('de-000001\tHallo Welt\n', encoding='utf-8')
    (tmp_path / 'bucc2018' / 'de-en.dev.en').write_text('en-000007\tHello world\n', encoding='utf-8')
    (tmp_path / 'bucc2018' / 'de-en.dev.gold').write_text('de-000001\ten-000007\n', encoding='utf-8')
    assert data.read_retrieval(str(tmp_path), 'bucc2018', 'dev', 'de') == (
        {'de-000001': 'Hallo Welt'}, {'en-000007': 'Hello world'}, [('de-000001', 'en-000007')])


@pytest.mark.parametrize('task,name,text,message', [
    ('xnli', 'dev-de.tsv', 'only one column\n', r'dev-de.tsv, line 1: 1 tab-separated columns, expected 2 or 3'),
    ('xnli', 'dev-de.tsv', 'a\tb\tneutral\na\tb\tmaybe\n', r'dev-de.tsv, line 2: label .maybe. is not one of'),
    ('panx', 'dev-de.tsv', 'Anna\tB-PER\nlives\n', r'dev-de.tsv, line 2: expected word<TAB>tag'),
    ('panx', 'dev-de.tsv', 'Anna\tB-XYZ\n', r'dev-de.tsv, line 1: label .B-XYZ. is not one of'),
    ('xquad', 'xquad/xquad.de.json', '{"data": [{"paragraphs": [{"context": "", "qas": [{"id": "1"}]}]}]}',
     "not in SQuAD format \\(no 'question' field\\)"),
    ('xquad', 'xquad/xquad.de.json', '{"data": [\n oops', r'xquad.de.json, line 2: not valid JSON'),
])
def test_malformed_files_fail_in_one_line(tmp_path, task, name, text, message):
    path = tmp_path / (name if '/' in name else os.path.join(task, name))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding='utf-8')
    split = 'test' if task == 'xquad' else 'dev'
    with pytest.raises(data.DataError, match=message) as err:
        data.read_split(str(tmp_path), task, split, 'de')
    assert '\n' not in str(err.value)


def test_missing_file_and_unknown_language(tmp_path):
    with pytest.raises(data.DataError, match=r'xnli/dev-fr.tsv not found: get the xnli data'):
        data.read_split(str(tmp_path), 'xnli', 'dev', 'fr')
    with pytest.raises(data.DataError, match=r"xnli has no language 'xx'; choose from ar, bg"):
        data.read_split(str(tmp_path), 'xnli', 'dev', 'xx')
    with pytest.raises(data.DataError, match='translate-train files for de'):
        data.read_translations(str(tmp_path), 'pawsx', 'train', 'de')


# ----------------------------------------------------------------------------------------
# Features and their round trips.

def test_qa_round_trip_on_the_mock_files(mock_tok):
    """Every gold answer inside a window comes back, character for character, from its tokens."""
    answered = 0
    for path in MOCK_QA:
        examples = data.read_squad(path)
        feats = data.qa_features(mock_tok, examples, max_len=96, stride=32, train=True)
        starts, ends = [], []
        for f in feats:
            s, e = torch.zeros(len(f.ids)), torch.zeros(len(f.ids))
            if f.label != (0, 0):
                s[f.label[0]], e[f.label[1]] = 10, 10
            starts.append(s)
            ends.append(e)
        decoded = ev.decode_qa(feats, starts, ends, examples, max_answer_len=1000)
        for n, ex in enumerate(examples):
            inside = any(f.label != (0, 0) for f in feats if f.example == n)
            if inside:
                assert decoded[ex['id']] == ex['answers'][0]['text'], path
                answered += 1
    langs = {os.path.basename(p)[5:7] for p in MOCK_QA}
    assert answered >= 38 and len(langs) == 17  # of 40 questions in 17 languages; the rest are longer than a 96-token window allows


def test_qa_windows(mock_tok):
    ex = data.read_squad(os.path.join(MOCK, 'labels', 'xquad', 'test-de.json'))[:1]
    feats = data.qa_features(mock_tok, ex, max_len=64, stride=16, train=True)
    assert len(feats) > 2 and all(len(f.ids) <= 64 for f in feats)
    n_ctx = len(mock_tok.encode_with_spans(ex[0]['context'], ())[0])
    owners = sum(np.array(f.max_context, dtype=int)[[i for i, s in enumerate(f.spans) if s is not None]].sum() for f in feats)
    assert owners >= n_ctx  # every context token is "max context" in one window (answer cuts may add tokens)
    assert sum(f.label != (0, 0) for f in feats) >= 1
    # the stride reaches the windows through make_features (VECO's --doc_stride 64)
    first = lambda feats: [next(s for s in f.spans if s is not None)[0] for f in feats]  # each window's first character
    for stride in (16, 24):
        by_hand = first(data.qa_features(mock_tok, ex, 64, stride, train=True))
        assert first(data.make_features(mock_tok, 'xquad', ex, 64, True, stride)) == by_hand


def test_cuts_make_token_boundaries(spm_path):
    tok = data.Tokenizer(spm_path)
    text = SCRIPTS['japanese']
    for cut in range(1, len(text)):
        ids, spans = tok.encode_with_spans(text, (cut,))
        assert any(s == cut for s, e in spans) and any(e == cut for s, e in spans)
        assert 2 not in ids and all(i >= 3 for i in ids)


def tagging_round_trip(tok, task, examples, max_len):
    feats = data.tagging_features(tok, task, examples, max_len=max_len)
    labels = data.TASKS[task].labels
    token_preds = [[lab if lab != data.IGNORE else -1 for lab in f.label] for f in feats]
    words = data.word_predictions(feats, token_preds, len(examples))
    return [[labels[i] for i in w] for w in words], feats


def test_tagging_round_trip_in_every_script(spm_path, demo_dir):
    tok = data.Tokenizer(spm_path)
    examples = [{'words': text.split() if ' ' in text else list(text), 'tags': None} for text in SCRIPTS.values()]
    for ex in examples:
        ex['tags'] = [data.UPOS[i % len(data.UPOS)] for i in range(len(ex['words']))]
    for max_len in (128, 8):  # 8: sentences are cut into several features and joined back
        back, feats = tagging_round_trip(tok, 'udpos', examples, max_len)
        assert back == [ex['tags'] for ex in examples]
        assert all(len(f.ids) <= max_len for f in feats)
    demo_tok = data.Tokenizer(os.path.join(demo_dir, 'sentencepiece.bpe.model'))
    for lang in data.DEMO_LANGS:
        for task in ('udpos', 'panx'):
            examples = data.read_split(demo_dir, task, 'dev', lang)
            assert tagging_round_trip(demo_tok, task, examples, 128)[0] == [ex['tags'] for ex in examples]


def test_classification_truncation_is_longest_first():
    assert data.truncate_pair(list(range(10)), list(range(3)), 8) == (list(range(5)), list(range(3)))
    assert data.truncate_pair(list(range(10)), list(range(9)), 8) == (list(range(4)), list(range(4)))


# ----------------------------------------------------------------------------------------
# Batches.

def test_collate_pads_to_the_batch_not_to_a_fixed_length():
    feats = [data.Feature([0, 5, 6, 2], [data.IGNORE, 1, 2, data.IGNORE]), data.Feature([0, 7, 2], [data.IGNORE, 3, data.IGNORE])]
    b = data.collate(feats)
    assert b.ids.tolist() == [[0, 5, 6, 2], [0, 7, 2, 1]]
    assert b.mask.tolist() == [[True] * 4, [True, True, True, False]]
    assert b.labels.tolist() == [[-100, 1, 2, -100], [-100, 3, -100, -100]]
    pair = data.collate_pairs(feats, feats[::-1])
    assert pair.src.ids.shape == pair.tgt.ids.shape == (2, 4)
    qa = data.collate([data.Feature([0, 1, 2], (1, 2)), data.Feature([0, 2], (0, 0))])
    assert qa.labels.tolist() == [[1, 2], [0, 0]]


def test_length_batches_waste_little_padding(demo_dir, capsys):
    """A realistic mix of lengths (log-normal, as sentence lengths are): under 15% padding when
    batches are drawn by length, against most of the tokens when padding to 128."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(40), 0.5, 5000).astype(int), 5, 128)
    batches = data.length_batches(lengths, 32)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    share = data.pad_share(lambda c: lengths[c, None], batches, 1)  # one side each, one micro-batch a batch
    fixed = 1 - lengths.sum() / (128 * len(lengths))
    print(f'padding: {share:.1%} of tokens by length, {fixed:.1%} padded to 128')
    assert share < 0.15 < fixed


# ----------------------------------------------------------------------------------------
# The demo data.

def test_demo_is_read_by_the_real_readers(demo_dir):
    assert data.is_demo(demo_dir)
    for task, info in data.TASKS.items():
        for lang in data.languages(task, demo=True):
            if info.family == 'retrieval':
                src, eng, gold = data.read_retrieval(demo_dir, task, 'test', lang)
                assert len(src) and len(eng)
                continue
            test = data.read_split(demo_dir, task, 'test', lang)
            label = os.path.join(demo_dir, 'labels', task, f'test-{lang}.{ev.suffix(task)}')
            assert len(test) == 20 and os.path.exists(label)
            if lang != 'en':
                pairs = data.read_translations(demo_dir, task, 'test', lang)
                assert len(pairs) == 20
        assert len(data.read_split(demo_dir, task, 'train')) == 60 if info.family != 'retrieval' else True
    # a translation is the same example: classification labels agree, QA answers sit in their contexts
    for (en, de) in data.read_translations(demo_dir, 'xnli', 'train', 'de'):
        assert de is None or (en['label'] == de['label'] and en['a'] != de['a'])
    for en, zh in data.read_translations(demo_dir, 'xquad', 'train', 'zh'):
        a = zh and zh['answers'][0]
        assert zh is None or (zh['context'][a['answer_start']:][:len(a['text'])] == a['text'] and ' ' not in zh['context'])


def test_the_demo_has_the_shapes_of_the_published_files(demo_dir):
    """translate-train leaves English examples out and comes in another order (classification by
    line, QA by question); classification's translate-test rows carry the label, its test rows
    none; tagging translations carry no tags; QA translate-test carries answers, its test blanks."""
    english = data.read_split(demo_dir, 'xnli', 'train')
    rows = data.read_pairs(data.split_path(demo_dir, 'xnli', 'translate-train', 'de'), 'xnli', translated=True)
    order = [next(n for n, ex in enumerate(english) if ex['a'] == o['a'] and ex['b'] == o['b']) for o, _, _ in rows]
    assert 0 < len(english) - len(rows) < len(english) / 3 and order != sorted(order)
    squad = data.read_squad(data.split_path(demo_dir, 'xquad', 'train'))
    ids = [ex['id'] for ex in data.read_squad(data.split_path(demo_dir, 'xquad', 'translate-train', 'de'))]
    assert len(ids) < len(squad) and ids != [ex['id'] for ex in squad if ex['id'] in ids]
    test = data.read_split(demo_dir, 'xnli', 'test', 'de')
    translated = data.read_pairs(data.split_path(demo_dir, 'xnli', 'translate-test', 'de'), 'xnli', translated=True)
    assert all(ex['label'] is None for ex in test) and all(t['label'] is not None for _, t, _ in translated)
    for split in ('train', 'dev', 'test'):
        pairs = data.read_translations(demo_dir, 'panx', split, 'de')
        assert all(t['tags'] is None for _, t in pairs) and all((o['tags'] is None) == (split == 'test') for o, _ in pairs)
    assert all(t['answers'] and not o['answers'] for o, t in data.read_translations(demo_dir, 'mlqa', 'test', 'de'))


def test_a_lowercasing_tokenizer_reads_lower_case_and_keeps_character_positions(mock_tok, demo_dir):
    """As transformers 2.x's tokenizers with do_lower_case (XTREME's and FILTER's QA scripts): the
    ids of the lowercased text; QA spans still index the original context, so answers keep their
    case; a character whose lower case is longer (U+0130) is kept; the cache keeps the two apart."""
    lower = data.Tokenizer(mock_tok.path, lower=True)
    assert lower.encode('Café CRÈME à Paris') == mock_tok.encode('café crème à paris')
    text = 'İstanbul IS BIG'
    ids, spans = lower.encode_with_spans(text, (3,))
    assert (ids, spans) == mock_tok.encode_with_spans('İstanbul is big', (3,)) and len(lower.model_text(text)) == len(text)
    examples = data.read_squad(os.path.join(MOCK, 'labels', 'xquad', 'test-de.json'))[:20]
    feats = data.qa_features(lower, examples, 96, 32, train=True)
    for f in feats:
        if f.label != (0, 0):  # the answer's first and last token give back its characters, in their case
            context, answer = examples[f.example]['context'], examples[f.example]['answers'][0]['text']
            assert context[f.spans[f.label[0]][0]:f.spans[f.label[1]][1]] == answer
    assert any(f.label != (0, 0) for f in feats) and any(a.ids != b.ids for a, b in zip(feats, data.qa_features(
        mock_tok, examples, 96, 32, train=True)))
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    gold, inputs, _ = data.evaluation_set(demo_dir, 'mlqa', 'dev', 'de')
    cased, lowered = (data.evaluation_items(data.Tokenization(t, demo_dir, 'mlqa', 64), inputs, None) for t in (tok, data.Tokenizer(tok.path, True)))
    assert [cased[i].ids for i in range(len(cased))] != [lowered[i].ids for i in range(len(lowered))]


def test_qa_evaluation_reads_blind_and_small_windows_end(mock_tok):
    """Evaluation features do not depend on the answers a file holds; a question longer than a
    window leaves room for context instead of looping."""
    ex = data.read_squad(os.path.join(MOCK, 'labels', 'xquad', 'test-zh.json'))
    blank = [dict(e, answers=[]) for e in ex]
    with_answers, without = data.qa_features(mock_tok, ex, 96, 32), data.qa_features(mock_tok, blank, 96, 32)
    assert [f.ids for f in with_answers] == [f.ids for f in without] and all(f.label is None for f in without)
    long_question = [dict(ex[0], question=ex[0]['question'] * 20)]
    feats = data.qa_features(mock_tok, long_question, max_len=24, stride=8)
    assert feats and all(len(f.ids) <= 24 and any(s is not None for s in f.spans) for f in feats)


def test_mixed_label_columns_are_refused(tmp_path):
    (tmp_path / 'xnli').mkdir()
    (tmp_path / 'xnli' / 'dev-de.tsv').write_text('a\tb\tneutral\na\tb\n', encoding='utf-8')
    with pytest.raises(data.DataError, match='line 2: 2 tab-separated columns, expected 3 as in the rest of the file'):
        data.read_split(str(tmp_path), 'xnli', 'dev', 'de')


def squad_file(path, questions):
    """A SQuAD v1.1 file, one paragraph per (id, context, question, answers)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    paragraphs = [{'context': c, 'qas': [{'id': i, 'question': q, 'answers': a}]} for i, c, q, a in questions]
    with open(path, 'w', encoding='utf-8') as f:
        json.dump({'version': '1.1', 'data': [{'title': 't', 'paragraphs': paragraphs}]}, f, ensure_ascii=False)


def test_unusable_qa_examples_are_skipped_and_counted(tmp_path, capsys, mock_tok):
    good = ('q1', 'Anna lives in Paris .', 'Where ?', [{'text': 'Paris', 'answer_start': 14}])
    squad_file(tmp_path / 'squad' / 'train-v1.1.json', [
        good, ('q2', 'Ben lives in Rome .', 'Where ?', [{'text': 'Rome', 'answer_start': 3}]),  # not at answer_start
        ('q3', '', 'Where ?', [{'text': 'x', 'answer_start': 0}]), ('q4', 'No answer here .', 'Who ?', []),
        ('q5', 'Carl lives in Oslo .', 'Where ?', [{'text': 'Oslo', 'answer_start': 14}])])
    train = data.read_split(str(tmp_path), 'xquad', 'train')
    assert [ex['id'] for ex in train] == ['q1', 'q5']
    out = capsys.readouterr().out
    assert ('train-v1.1.json: 3 of 5 questions skipped (1 no answer, 1 empty context, 1 answer text not at answer_start)'
            in out)
    squad_file(tmp_path / 'squad' / 'translate-train' / 'squad.translate.train.en-de.json',
               [('q1', 'Anna wohnt in Paris .', 'Wo ?', [{'text': 'Paris', 'answer_start': 14}])])
    pairs = data.read_translations(str(tmp_path), 'xquad', 'train', 'de')
    assert [(o['id'], t and t['id']) for o, t in pairs] == [('q1', 'q1'), ('q5', None)]  # q5 has no translation
    assert '1 of 2 questions of the original have no translation here' in capsys.readouterr().out
    # evaluation keeps every question: one with no context answers ''
    squad_file(tmp_path / 'xquad' / 'xquad.de.json', [good, ('q9', '', 'Wo ?', [{'text': '', 'answer_start': 0}])])
    test = data.read_split(str(tmp_path), 'xquad', 'test', 'de')
    feats = data.qa_features(mock_tok, test, 64, 32)
    answers = ev.decode_qa(feats, [torch.randn(len(f.ids)) for f in feats], [torch.randn(len(f.ids)) for f in feats], test)
    assert set(answers) == {'q1', 'q9'} and answers['q9'] == ''


def test_files_that_are_not_utf8_fail_in_one_line_and_bom_crlf_are_read(tmp_path):
    (tmp_path / 'xnli').mkdir()
    (tmp_path / 'xnli' / 'dev-de.tsv').write_bytes('Ein Satz .\tNoch einer .\tneutral\r\n'.encode('utf-8')
                                                  + 'Grüße .\tZwei .\tneutral\r\n'.encode('latin-1'))
    with pytest.raises(data.DataError, match=r'dev-de.tsv, line 2: not UTF-8 \(byte 0xfc\); convert the file to UTF-8'):
        data.read_split(str(tmp_path), 'xnli', 'dev', 'de')
    bom = lambda text: b'\xef\xbb\xbf' + text.replace('\n', '\r\n').encode('utf-8')
    (tmp_path / 'xnli' / 'dev-de.tsv').write_bytes(bom('"Er sagt ""ja"" ."\tZwei .\tneutral\nDrei .\tVier .\tentailment\n'))
    assert data.read_split(str(tmp_path), 'xnli', 'dev', 'de') == [
        {'a': 'Er sagt "ja" .', 'b': 'Zwei .', 'label': 'neutral'}, {'a': 'Drei .', 'b': 'Vier .', 'label': 'entailment'}]
    (tmp_path / 'panx').mkdir()
    (tmp_path / 'panx' / 'dev-de.tsv').write_bytes(bom('Anna\tB-PER\nwohnt\tO\n\nParis\tB-LOC\n'))
    assert data.read_split(str(tmp_path), 'panx', 'dev', 'de')[1] == {'words': ['Paris'], 'tags': ['B-LOC']}
    (tmp_path / 'xquad').mkdir()
    (tmp_path / 'xquad' / 'xquad.de.json').write_bytes(bom(json.dumps({'data': [{'paragraphs': [
        {'context': 'Anna lebt in Paris .', 'qas': [{'id': 'a', 'question': 'Wo ?', 'answers': []}]}]}]})))
    assert data.read_split(str(tmp_path), 'xquad', 'test', 'de')[0]['context'] == 'Anna lebt in Paris .'
    (tmp_path / 'labels.tsv').write_bytes(bom('neutral\nentailment\n'))
    assert ev.read_labels(str(tmp_path / 'labels.tsv')) == ['neutral', 'entailment']
    (tmp_path / 'bad.json').write_bytes('{"data": "Grüße"}'.encode('latin-1'))
    with pytest.raises(data.DataError, match='bad.json, line 1: not UTF-8'):
        ev.read_qa_file(str(tmp_path / 'bad.json'))
    (tmp_path / 'bom-only.txt').write_bytes(b'\xef\xbb\xbf')  # a BOM alone: no line, as an empty file
    assert list(data.read_lines(str(tmp_path / 'bom-only.txt'))) == [] and data.read_text(str(tmp_path / 'bom-only.txt')) == ''


# ----------------------------------------------------------------------------------------
# Training sets on disk (data.training_set): tokenized once, memory-mapped, rebuilt when anything they depend on changes.

def pair_features(tok, task, pairs, max_len=None, train=False):
    """The paired methods' tuples by hand, from make_features of each side of (English, target[,
    round trip]) examples: an example's sides' features one by one, in training as many as its
    longest side has (a shorter side's last one repeating), in evaluation one per target feature;
    none for an example the English or the target lacks; a round trip without features gives way
    to the English."""
    sides = []
    for side in range(len(pairs[0])):
        by_example = {}
        for f in data.make_features(tok, task, [p[side] for p in pairs], max_len, train):
            by_example.setdefault(f.example, []).append(f)
        sides.append(by_example)
    out = []
    for n in sorted(set(sides[0]) & set(sides[1])):
        lists = [side.get(n, sides[0][n]) for side in sides]
        out += [tuple(f[min(i, len(f) - 1)] for f in lists) for i in range(max(map(len, lists)) if train else len(lists[1]))]
    return out


def features_by_hand(tok, data_dir, task, paired, round_trip, max_len=None, langs=('de', 'zh')):
    """translate-train-all's features, or a paired method's tuples, from the readers and
    make_features / pair_features, as training_set gave them before it kept them on disk."""
    english = data.read_split(data_dir, task, 'train')
    pairs = {lang: data.read_translations(data_dir, task, 'train', lang, english) for lang in langs}
    if not paired:
        return data.make_features(tok, task, english + [t for lang in langs for _, t in pairs[lang] if t], max_len, True)
    tuples = [(e, e, e)[:2 + round_trip] for e in english]
    for lang in langs:
        trip = data.read_round_trip(data_dir, task, lang, pairs[lang]) if round_trip else None
        tuples += [(e, t, r)[:2 + round_trip] for (e, t), r in zip(pairs[lang], trip or [e for e, _ in pairs[lang]]) if t]
    return pair_features(tok, task, tuples, max_len, True)


def same_features(items, feats, example=True):
    sides = lambda item: item if isinstance(item, tuple) else (item,)
    fields = lambda f: (f.ids, f.label, f.words) + ((f.example,) if example else ())
    assert len(items) == len(feats) > 0
    assert all([fields(f) for f in sides(items[i])] == [fields(f) for f in sides(feats[i])] for i in range(len(feats)))
    assert data.item_lengths(items).tolist() == [[len(f.ids) for f in sides(item)] for item in feats]


@pytest.mark.parametrize('task, paired, round_trip, max_len, slice_', [
    ('xnli', False, False, None, 7), ('panx', False, False, 6, 2000), ('mlqa', False, False, 20, 2000),
    ('xnli', True, True, None, 2000), ('panx', True, False, 6, 7), ('mlqa', True, True, 20, 5)])
def test_training_sets_on_disk_hold_the_features_of_the_readers(demo_dir, monkeypatch, task, paired, round_trip, max_len,
                                                                slice_):
    """Every field of every item as make_features / pair_features give it, cached or not. Short
    max_len cut the demo's sentences into 3-5 tagging chunks and 1-3 QA windows, English and
    translation apart; a small SLICE sends slices to worker processes."""
    monkeypatch.setattr(data, 'SLICE', slice_)
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    langs = [] if data.TASKS[task].family == 'tagging' and not paired else ['de', 'zh']  # untagged translations: English
    feats = features_by_hand(tok, demo_dir, task, paired, round_trip, max_len, langs)
    for cache in (False, True):
        items = data.training_set(data.Tokenization(tok, demo_dir, task, max_len, cache=cache), langs, 'every_lang', paired, round_trip)
        same_features(items, feats, example=not paired)  # a pair's sides number their examples apart


@pytest.mark.parametrize('task, paired, max_len, slice_', [
    ('xnli', False, None, 7), ('panx', True, 6, 2000), ('mlqa', False, 20, 3), ('mlqa', True, 20, 2000)])
def test_evaluation_sets_on_disk_hold_the_features_of_the_readers(demo_dir, monkeypatch, task, paired, max_len, slice_):
    """Every field of every evaluation feature, QA's spans and fullest-context flags among them, as
    make_features / pair_features give them in evaluation: a pair's every target feature once,
    with its English; a feature's example is its input's number."""
    monkeypatch.setattr(data, 'SLICE', slice_)
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    gold, inputs, pairs = data.evaluation_set(demo_dir, task, 'dev', 'de', paired=paired)
    feats = pair_features(tok, task, pairs, max_len) if paired else data.make_features(tok, task, inputs, max_len)
    sides = lambda item: item[1:] if isinstance(item, tuple) else (item,)  # the target side's every field
    fields = lambda f: (f.ids, f.label, f.words, f.example, f.spans, f.max_context)
    for cache in (False, True):
        items = data.evaluation_items(data.Tokenization(tok, demo_dir, task, max_len, cache=cache), inputs, pairs)
        assert len(items) == len(feats) > len(inputs) * (max_len is not None)  # short max_len: several a sentence
        assert [fields(f) for i in range(len(items)) for f in sides(items[i])] == [fields(f) for i in feats for f in sides(i)]
        if paired:  # the English side too
            assert [items[i][0].ids for i in range(len(items))] == [f[0].ids for f in feats]


def test_paired_items_repeat_a_shorter_sides_last_feature_and_skip_what_a_side_lacks():
    """English examples of 1, 2 and 0 features (0; 1-2; none), translated with 3, 1 and 1 (3-5;
    6; 7); round trips of 0, 2 and 1 (none, its English stands in; 8-9; 10).
    The third example gives no tuple: its English has no feature."""
    sides = lambda: {'en': (np.array([0, 1, 3]), np.array([1, 2, 0]), None),
                     'de': (np.array([3, 6, 7]), np.array([3, 1, 1]), [0, 1, 2]),
                     'de round trip': (np.array([8, 8, 10]), np.array([0, 2, 1]), [0, 1, 2])}
    expected = [[0, 0, 0], [1, 1, 1], [2, 2, 2],  # English with itself
                [0, 3, 0], [0, 4, 0], [0, 5, 0],  # a tuple for each of the translation's 3 features
                [1, 6, 8], [2, 6, 9]]
    assert data.item_index(sides(), 3).tolist() == expected
    assert data.item_index({k: v for k, v in sides().items() if k != 'de round trip'}, 2).tolist() == [
        [0, 0], [1, 1], [2, 2], [0, 3], [0, 4], [0, 5], [1, 6], [2, 6]]


# ----------------------------------------------------------------------------------------
# Labels per side: each feature carries its own example's label, or None, whatever its pair holds.

def labels_by_hand(task, examples, feats):
    """What a feature's label must be, from the readers' examples: its example's class, or None."""
    label = lambda ex: None if ex.get('label') is None else data.TASKS[task].labels.index(ex['label'])
    return [label(examples[f.example]) for f in feats]


def test_a_labelled_english_side_beside_an_unlabelled_target_reads_each_side_s_own(demo_dir):
    """XNLI's translate-test rows carry the label and its test rows none: the English side of each
    pair has its label, the target None; a batch of them has labels on the English side alone."""
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    gold, inputs, pairs = data.evaluation_set(demo_dir, 'xnli', 'test', 'de', paired=True)
    items = data.evaluation_items(data.Tokenization(tok, demo_dir, 'xnli', cache=False), inputs, pairs)
    english, target = zip(*(items[i] for i in range(len(items))))
    assert [f.label for f in target] == [None] * len(inputs)
    assert [f.label for f in english] == labels_by_hand('xnli', [en for en, _ in pairs], target)
    assert None not in [f.label for f in english]
    batch = data.collate_items(True)([items[i] for i in range(len(items))])
    assert batch.tgt.labels is None and batch.src.labels.tolist() == [f.label for f in english]


def test_a_labelled_target_with_an_unlabelled_or_missing_translation(tmp_path, spm_path):
    """A dev set with labels whose translate-dev rows have none (4 columns), one row untranslated:
    that example pairs with itself and keeps its label on both sides; a batch of the English side
    mixes labelled and unlabelled features and carries no labels."""
    rows = [('A man sleeps .', 'Nobody sleeps .', 'contradiction'), ('She reads .', 'She reads a book .', 'neutral'),
            ('It rains .', 'Water falls .', 'entailment')]
    write_xtreme_tsv(tmp_path / 'xnli' / 'dev-de.tsv', rows)
    write_xtreme_tsv(tmp_path / 'xnli' / 'translate-dev' / 'dev-de-en-translated.tsv',
                     [(a, b, f'{a} (en)', f'{b} (en)') for a, b, _ in rows[:2]])
    gold, inputs, pairs = data.evaluation_set(str(tmp_path), 'xnli', 'dev', 'de', paired=True)
    items = data.evaluation_items(data.Tokenization(data.Tokenizer(spm_path), str(tmp_path), 'xnli', cache=False), inputs, pairs)
    classes = data.TASKS['xnli'].labels
    assert [(en.label, t.label) for en, t in (items[i] for i in range(3))] == [
        (None, classes.index('contradiction')), (None, classes.index('neutral')), (classes.index('entailment'),) * 2]
    batch = data.collate_items(True)([items[i] for i in range(3)])
    assert batch.src.labels is None and batch.tgt.labels.tolist() == [classes.index(l) for *_, l in rows]


def test_qa_translate_test_with_answers_on_one_side_reads_blind_and_scores_the_translations(demo_dir):
    """MLQA's translate-test questions carry answers and its test questions none: evaluation
    features hold no answer on either side, and translate-test scores the translations' answers."""
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    gold, inputs, pairs = data.evaluation_set(demo_dir, 'mlqa', 'test', 'de', paired=True)
    assert all(en['answers'] and not ex['answers'] for en, ex in pairs)
    items = data.evaluation_items(data.Tokenization(tok, demo_dir, 'mlqa', 20, cache=False), inputs, pairs)
    assert len(items) > len(inputs) and all(f.label is None for i in range(len(items)) for f in items[i])
    gold, inputs, _ = data.evaluation_set(demo_dir, 'mlqa', 'test', 'de', translate_test=True)
    assert gold is inputs and all(ex['answers'] for ex in gold)


def test_tagging_translations_without_tags_train_filter_on_the_english_side(demo_dir):
    """FILTER's tagging translations have no tags: a pair (English, translation) has English's tags
    on its source side and None on its target; English with itself has them on both."""
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    items = data.training_set(data.Tokenization(tok, demo_dir, 'panx', cache=False), ['de', 'zh'], 'every_lang', paired=True)
    english = data.read_split(demo_dir, 'panx', 'train')
    tags = lambda f: [data.TASKS['panx'].labels.index(t) for t in english[f.example]['tags']]
    first = lambda f: [f.label[i] for i in f.words]  # the label on each word's first piece
    assert len(items) == 3 * len(english)  # one feature a sentence; every sentence translated
    for i in range(len(items)):
        src, tgt = items[i]
        assert first(src) == tags(src) and (tgt.label is None) == (i >= len(english))
    batch = data.collate_items(True)([items[0], items[len(english)]])
    assert batch.tgt.labels is None and batch.src.labels.ne(data.IGNORE).any()
    with pytest.raises(data.DataError, match=f'^panx: {2 * len(english)} of {3 * len(english)} training examples have no label: translations without tags'):
        data.training_set(data.Tokenization(tok, demo_dir, 'panx', cache=False), ['de', 'zh'], 'every_lang')  # a single-text method's set


def test_a_missing_round_trip_pairs_the_english_with_itself_and_is_said_at_every_start(tmp_path, capsys):
    demo = data.make_demo(str(tmp_path / 'demo'), n_train=30, n_eval=5)
    os.remove(data.split_path(demo, 'panx', 'round-trip', 'zh'))
    tok = data.Tokenizer(f'{demo}/sentencepiece.bpe.model')
    for start in ('built', 'read from the cache'):
        items = data.training_set(data.Tokenization(tok, demo, 'panx'), ['de', 'zh'], 'every_lang', True, True)
        assert capsys.readouterr().out.count('warning: no round-trip data for panx in zh') == 1, start
    same_features(items, features_by_hand(tok, demo, 'panx', True, True), example=False)
    assert data.item_lengths([]).shape == (0, 1)  # no items (XLA's peers agreeing on nothing): no lengths


def test_the_cache_is_built_once_and_again_when_a_file_the_tokenizer_or_a_setting_changes(tmp_path, spm_path, capsys):
    demo = data.make_demo(str(tmp_path / 'demo'), n_train=30, n_eval=5)
    tok, other = data.Tokenizer(f'{demo}/sentencepiece.bpe.model'), data.Tokenizer(spm_path)
    builds = lambda: capsys.readouterr().out.count('tokenizing the training data into')
    load = lambda tok=tok, max_len=None: data.training_set(data.Tokenization(tok, demo, 'panx', max_len), ['de', 'zh'], 'every_lang', True)
    load(), load()
    assert builds() == 1
    load(max_len=16)
    load(other)
    assert builds() == 2
    translations = data.split_path(demo, 'panx', 'translate-train', 'zh')
    with open(translations, encoding='utf-8') as f:
        text = f.read()
    with open(translations, 'a', encoding='utf-8') as f:
        f.write('\nNeu\n')  # one more sentence in the translations, of one word
    with pytest.raises(data.DataError, match='sentences for'):  # read, not taken from the cache: it no longer aligns
        load()
    with open(translations, 'w', encoding='utf-8') as f:
        f.write(text.replace('\tB-LOC', '\tB-ORG', 1))  # the same length, one tag changed
    same_features(load(), features_by_hand(tok, demo, 'panx', True, False), example=False)
    assert builds() == 2  # the one that failed, and the one after the mend
    assert len(os.listdir(os.path.join(demo, '.cache'))) == 5  # four sets and the lock


def build_in_a_process(demo, kill_after=None, together=None):
    """training_set in a new process: killed (SIGKILL) once kill_after arrays are written, or,
    with together (a folder), building only once two processes have started (each leaves a file
    there), so that without the lock both would build."""
    script = f'''
import glob, os, signal, sys, time
sys.path.insert(0, {ROOT!r})
import data
write, written, together = data.append, [], {together!r}
def append(folder, files, arrays):
    while together and len(glob.glob(together + '/started-*')) < 2:
        time.sleep(0.01)  # waits for the other process to start
    write(folder, files, arrays)
    written.append(1)
    if len(written) == {kill_after}:
        os.kill(os.getpid(), signal.SIGKILL)
data.append = append
if together:
    open(f'{{together}}/started-{{os.getpid()}}', 'w').close()
tok = data.Tokenizer({demo!r} + '/sentencepiece.bpe.model')
print(len(data.training_set(data.Tokenization(tok, {demo!r}, 'xnli'), ['de', 'zh'], 'every_lang')))
'''
    return subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_build_killed_halfway_is_never_read_and_two_processes_build_once(tmp_path):
    demo, cache = data.make_demo(str(tmp_path / 'demo'), n_train=30, n_eval=5), tmp_path / 'demo' / '.cache'
    killed = build_in_a_process(demo, kill_after=2)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL  # killed in the first translations
    assert [n for n in os.listdir(cache) if n != '.lock'][0].count('.tmp') == 1  # its folder was never moved into place
    starts = [build_in_a_process(demo, together=str(tmp_path)) for _ in range(2)]
    outs = [p.communicate()[0] for p in starts]
    assert all(p.returncode == 0 for p in starts) and outs[0].split()[-1] == outs[1].split()[-1]
    assert sum(out.count('tokenizing the training data into') for out in outs) == 1
    assert len(os.listdir(cache)) == 2 and not any('.tmp' in n for n in os.listdir(cache))  # the lock and one set
    tok = data.Tokenizer(f'{demo}/sentencepiece.bpe.model')
    same_features(data.training_set(data.Tokenization(tok, demo, 'xnli'), ['de', 'zh'], 'every_lang'),
                  features_by_hand(tok, demo, 'xnli', False, False))


FLOCK_SUCCEEDS = """import fcntl, os, sys
sys.path.insert(0, {root!r})
import data, train
fcntl.flock = lambda *args: None  # NFS local_lock=flock, Lustre localflock: every node gets the lock
rank, world, device = train.setup_distributed()
say = lambda line: sys.stdout.write(line + '\\n') and sys.stdout.flush()  # one write: the processes' lines whole
write = data.write_items
for case, folders in {cases!r}.items():
    demo = folders[rank]
    data.write_items = lambda path, *args: say(f'{{case}}: built by process {{rank}}') or write(path, *args)
    tok = data.Tokenizer(os.path.join(demo, 'sentencepiece.bpe.model'))
    say(f"{{case}}: features {{len(data.training_set(data.Tokenization(tok, demo, 'xnli'), ['de', 'zh'], 'every_lang'))}}")
"""


@pytest.mark.slow
def test_under_ddp_one_process_of_those_sharing_the_folder_builds_though_flock_succeeds_everywhere(tmp_path):
    """Two processes under torchrun, flock made to succeed in both: with one data folder (a filesystem every node
    mounts) process 0 builds and process 1 waits and reads; with a folder each (each node's own disk) each builds."""
    demo = data.make_demo(str(tmp_path / 'demo'), n_train=30, n_eval=5)
    own = [shutil.copytree(demo, str(tmp_path / name)) for name in ('node0', 'node1')]
    script = tmp_path / 'build.py'
    script.write_text(FLOCK_SUCCEEDS.format(root=ROOT, cases={'shared': [demo, demo], 'own': own}))
    out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                          str(script)], capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sorted(line for line in lines if 'built by' in line) == [
        'own: built by process 0', 'own: built by process 1', 'shared: built by process 0']
    assert len({line for line in lines if line.startswith('shared: features')}) == 1
    assert len({line.split(': ', 1)[1] for line in lines if 'features' in line}) == 1  # the same set everywhere
    for folder in (demo, *own):  # one set in each, the lock beside it, and no mark of the choice of builder left
        assert len(os.listdir(os.path.join(folder, '.cache'))) == 2


STUCK = """import datetime, os, sys, threading
sys.path.insert(0, {root!r})
import data, train
data.PATIENCE = datetime.timedelta(seconds=3)
rank, world, device = train.setup_distributed()
if rank == 1:
    threading.Event().wait()  # stuck for good: never at the barrier
try:
    data.barrier()
except data.DataError as e:
    print(e, flush=True)
    raise SystemExit(1)
"""


@pytest.mark.slow
def test_under_ddp_a_stuck_process_fails_the_wait_on_data_in_its_patience_and_is_named(tmp_path):
    """Process 1 never reaches data.barrier: process 0 stops once PATIENCE (here 3 s) has passed, naming it."""
    script = tmp_path / 'stuck.py'
    script.write_text(STUCK.format(root=ROOT))
    out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                          str(script)], capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode != 0
    assert out.stdout.splitlines() == ['Ranks 1 failed to pass monitoredBarrier in 3000 ms: stuck, or stopped by an '
                                       'error of its own'], out.stdout + out.stderr[-2000:]


def test_in_windows_gives_every_positions_results_in_order(monkeypatch):
    """Batches sorted by length within windows of WINDOW batches, each position's results (of
    several lengths, none for some) joined back in position order, one field apart from another."""
    monkeypatch.setattr(data, 'WINDOW', 2)
    lengths = np.random.default_rng(0).integers(1, 50, 23)
    seen = []

    def fn(batch):
        seen.append(batch)
        assert len(batch) <= 3 and list(lengths[batch]) == sorted(lengths[batch])
        return [(torch.full((i % 3,), i), torch.tensor([float(-i)])) for i in batch]
    blocks = data.in_windows(fn, lengths, range(4, 21), 3, 'test')
    assert sorted(i for b in seen for i in b) == list(range(4, 21)) and len(blocks) == 3  # windows of 6 positions
    values, scores = (data.Ragged.joined([b[f] for b in blocks]) for f in (0, 1))
    assert [r.tolist() for r in values] == [[i] * (i % 3) for i in range(4, 21)]
    assert scores.values.tolist() == [-i for i in range(4, 21)] and len(scores) == 17


def test_a_torn_cache_is_built_again(tmp_path, capsys):
    """Each array of a built set cut short in turn (to half, and by one int32, which would read as a
    shorter array): the next load says so in one line, builds it again, and gives the same features."""
    demo = data.make_demo(str(tmp_path / 'demo'), n_train=30, n_eval=6)
    tok = data.Tokenizer(f'{demo}/sentencepiece.bpe.model')
    features = lambda: (lambda items: [items[i] for i in range(len(items))])(data.training_set(data.Tokenization(tok, demo, 'panx', 64), []))
    first = features()
    folder = next(p for p in (tmp_path / 'demo' / '.cache').iterdir() if p.is_dir())
    arrays = sorted(p.name for p in folder.iterdir() if p.suffix == '.bin' and p.stat().st_size)
    assert {'ids.bin', 'label.bin', 'items.bin', 'ends.bin', 'words.bin'} <= set(arrays)
    for name in arrays:
        for cut in (lambda n: n // 2, lambda n: n - 4):
            size = (folder / name).stat().st_size
            os.truncate(folder / name, cut(size))
            capsys.readouterr()
            assert features() == first
            assert f'{folder} is torn ({name} holds {cut(size)} bytes, not {size}): building it again' in capsys.readouterr().out
    os.remove(folder / 'meta.json')
    with pytest.raises(data.DataError, match='is torn \\(its meta.json is missing or unreadable\\): remove it and run again'):
        data.Items(str(folder))


def test_in_language_reads_each_languages_own_first_examples(tmp_path, capsys):
    """in-language: --train_lang's own training data (its first N: XTREME's few-shot); in-language-all: English's
    and every target language's that has some (a language without, as UD's Thai, is said and left out)."""
    demo = data.make_demo(str(tmp_path / 'demo'), n_train=30, n_eval=5)
    tok = data.WordPiece(f'{demo}/vocab.txt')
    own = lambda lang: data.read_split(demo, 'tydiqa', 'train', lang)
    items = data.training_set(data.Tokenization(tok, demo, 'tydiqa', cache=False), ['de'], 'own_lang', first=7)
    questions = {tuple(tok.encode(ex['question'])) for ex in own('de')[:7]}
    assert {tuple(items[i].ids[1:items[i].ids.index(tok.eos)]) for i in range(len(items))} == questions
    assert len(questions) == 7 and questions.isdisjoint(tuple(tok.encode(ex['question'])) for ex in own('de')[7:])
    os.remove(data.split_path(demo, 'panx', 'train', 'zh'))
    items = data.training_set(data.Tokenization(tok, demo, 'panx', cache=False), ['de', 'zh'], 'every_own')
    expected = [tok.encode_words(ex['words']) for lang in ('en', 'de') for ex in data.read_split(demo, 'panx', 'train', lang)]
    assert [items[i].ids for i in range(len(items))] == [[tok.bos] + sum(words, []) + [tok.eos] for words in expected]
    assert 'panx has no training data in zh' in capsys.readouterr().out


def test_a_file_to_predict_on_is_read_in_the_tasks_columns_and_every_bad_line_named(tmp_path):
    path = tmp_path / 'mine.tsv'
    path.write_text('A\tB\nC\tD\tneutral\n\n')
    assert data.read_input(str(path), 'xnli') == ([{'a': 'A', 'b': 'B', 'label': None},
                                                   {'a': 'C', 'b': 'D', 'label': 'neutral'}], None)
    path.write_text('A\tB\tA en\tB en\n')  # a paired method: the English translation after the text
    assert data.read_input(str(path), 'xnli', paired=True) == (
        [{'a': 'A', 'b': 'B', 'label': None}], [({'a': 'A en', 'b': 'B en', 'label': None}, {'a': 'A', 'b': 'B',
                                                                                                'label': None})])
    path.write_text('Anna lebt\tBerlin lives\tB-PER O\n')
    assert data.read_input(str(path), 'panx', paired=True)[1] == [({'words': ['Berlin', 'lives'], 'tags': None},
                                                                  {'words': ['Anna', 'lebt'], 'tags': ['B-PER', 'O']})]
    for text, task, bad in (('A\tB\nC\tD\tmaybe\nE\n\t\n', 'xnli', 'lines 2, 3, 4: not a<TAB>b<TAB>[label]'),
                            ('Anna lebt\tB-PER O\nx y\tB-PER\n', 'panx', 'line 2: not words<TAB>[label]')):
        path.write_text(text)
        with pytest.raises(data.DataError, match=f'mine.tsv, {re.escape(bad)} with labels of {task}; fix') as err:
            data.read_input(str(path), task)
        assert '\n' not in str(err.value)


def test_tydiqa_with_squad_adds_squads_english_after_tydiqas_each_with_itself(demo_dir):
    """--with_squad (FILTER's --use_squad_for_tydiqa): SQuAD's English training examples after TyDiQA's, a paired
    method's each with itself; TyDiQA's translations still pair with their own English."""
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    spec = data.Tokenization(tok, demo_dir, 'tydiqa', 64, cache=False)
    without = data.training_set(spec, ['de'], 'every_lang', paired=True)
    with_squad = data.training_set(spec, ['de'], 'every_lang', paired=True, squad=True)
    squad = data.make_features(tok, 'tydiqa', data.read_split(demo_dir, 'xquad', 'train'), 64, train=True)
    assert len(with_squad) == len(without) + len(squad) and len(squad) > 0
    ids = lambda item: [f.ids for f in item]
    english = [tuple(f.ids) for i in range(len(without)) for f in without[i][:1]]
    tydiqa_english = len([1 for i in range(len(without)) if ids(without[i])[0] == ids(without[i])[1]])
    added = [with_squad[i] for i in range(tydiqa_english, tydiqa_english + len(squad))]
    assert [tuple(src.ids) for src, _ in added] == [tuple(f.ids) for f in squad]
    assert all(src.ids == tgt.ids for src, tgt in added)  # SQuAD's English with itself
    assert [tuple(f.ids) for i in range(len(with_squad)) for f in with_squad[i][:1]
            if i < tydiqa_english or i >= tydiqa_english + len(squad)] == english  # TyDiQA's items as without


def test_a_share_is_drawn_by_its_seed_and_xla_draws_anew_for_each_seed(demo_dir):
    """--share_seed: the draw of --train_share (XLA's 5%: English and the target text disjoint) follows its seed, by
    default the run's --seed, so that each seed draws anew, as XLA's paper; XLA's warm-ups draw as their run."""
    examples = list(range(100))
    draws = {seed: (data.share_of(examples, 0.05, 0, seed), data.share_of(examples, 0.05, 1, seed)) for seed in (0, 1, 2)}
    assert len({tuple(english) for english, _ in draws.values()}) == 3
    assert all(not set(english) & set(target) and len(english) == len(target) == 5 for english, target in draws.values())
    import train
    import xlt
    xla = train.parse_args(['--method', 'xla', '--task', 'xnli', '--train_lang', 'de', '--seed', '3'])
    assert {stage['share_seed'] for stage in xlt.XLA.stages(xla).values()} == {3}  # the warm-ups, seeds 9-11: the run's
    assert {stage['seed'] for stage in xlt.XLA.stages(xla).values()} == {3, 2003, 3003}  # UXLA's offsets
    tok = data.Tokenizer(f'{demo_dir}/sentencepiece.bpe.model')
    sets = [data.training_set(data.Tokenization(tok, demo_dir, 'xnli', cache=False, draw=seed), [], share=0.2)
            for seed in (1, 2)]
    ids = lambda items: sorted(tuple(items[i].ids) for i in range(len(items)))
    assert len(sets[0]) == len(sets[1]) and ids(sets[0]) != ids(sets[1])


def test_with_squad_is_refused_where_no_english_tydiqa_is_trained_on(capsys):
    import train
    for argv in (['--task', 'xnli'], ['--method', 'translate-train', '--task', 'tydiqa', '--train_lang', 'ko'],
                 ['--method', 'in-language', '--task', 'tydiqa', '--train_lang', 'ko']):
        with pytest.raises(SystemExit, match='--with_squad adds SQuAD to the English of TyDiQA'):
            train.parse_args(argv + ['--with_squad'])
    assert train.parse_args(['--method', 'filter', '--task', 'tydiqa', '--with_squad']).with_squad


def test_an_epoch_of_one_draw_takes_one_item_of_each_english_example():
    """global_batches' sources (--epoch_draw one, FILTER's tagging: English with one of its translations, drawn anew
    each epoch): every English example once an epoch, by a draw the seed fixes."""
    sources = [0, 1, 2, 3] * 3  # English 0-3 with itself, then with two translations
    drawn = {}
    for seed in range(20):
        batches = data.global_batches(12, 3, seed, 1, sources=sources)
        flat = [i for b in batches for i in b]
        assert sorted(sources[i] for i in flat) == [0, 1, 2, 3] and all(len(b) <= 3 for b in batches)
        drawn[seed] = sorted(flat)
    assert data.global_batches(12, 3, 5, 1, sources=sources) == data.global_batches(12, 3, 5, 1, sources=sources)
    assert {i for d in drawn.values() for i in d} == set(range(12))  # every translation is drawn in some epoch
    assert len(data.global_batches(12, 3, 5, 1)) == 4  # without sources: every item


def test_the_sets_a_checkpoint_is_kept_by_are_the_methods(tmp_path):
    """X-Mixup's release keeps XQuAD's model by MLQA's dev sets, TyDiQA's by the English test file, tagging's by each
    language's first 1000 dev sentences (selects_on); the run's dev sets are those, read and checked beforehand."""
    import argparse
    import xlt
    demo = data.make_demo(str(tmp_path / 'demo'), n_train=20, n_eval=6)
    args = lambda task: argparse.Namespace(task=task, translations='xmixup')
    assert xlt.XMixup.selects_on(args('xquad')) == ('mlqa', 'dev', None, None)
    assert xlt.XMixup.selects_on(args('tydiqa')) == ('tydiqa', 'test', ('en',), None)
    assert xlt.XMixup.selects_on(args('panx')) == ('panx', 'dev', None, 1000)
    assert xlt.XMixup.selects_on(args('xnli')) is None and xlt.Filter.selects_on(args('xquad')) is None
    xquad = data.evaluation_sets(demo, 'xquad', paired=True, dev=xlt.XMixup.selects_on(args('xquad')))
    assert set(xquad['dev']) == set(data.languages('mlqa', demo=True))
    assert xquad['dev']['de'][0] == data.read_split(demo, 'mlqa', 'dev', 'de')
    tydiqa = data.evaluation_sets(demo, 'tydiqa', dev=('tydiqa', 'test', ('en',), None))
    assert list(tydiqa['dev']) == ['en'] and tydiqa['dev']['en'][0] == tydiqa['test']['en'][0]
    panx = data.evaluation_sets(demo, 'panx', paired=True, dev=('panx', 'dev', None, 4))
    assert all(len(gold) == len(inputs) == len(pairs) == 4 for gold, inputs, pairs in panx['dev'].values())
    assert panx['dev']['de'][0] == data.read_split(demo, 'panx', 'dev', 'de')[:4]


@pytest.mark.parametrize('task', ['xnli', 'udpos', 'xquad'])
def test_a_batch_with_padding_goes_to_a_gpu_aligned_and_no_score_changes(task):
    """On a GPU a padded batch is padded on to a multiple of 8 positions (data.aligned_for, from Batch.to; asked with
    device 'cuda', nothing moved): ids the pad id, mask and word starts False, tags IGNORE. The method's outputs at the
    real positions and its loss are those of the batch as collated; a batch without padding, and any on the CPU, stay
    as they are."""
    import layers
    import xlt
    torch.manual_seed(0)
    method = xlt.Baseline(layers.Encoder(layers.Config(vocab_size=40, n_layer=2, n_head=2, dim=16, ffn_dim=32)), task)
    method.eval()
    family, lengths = data.TASKS[task].family, (11, 6, 9)
    label = lambda n: {'classification': 1, 'tagging': [2] * n, 'qa': (1, 3)}[family]
    features = [data.Feature(torch.randint(3, 40, (n,)).tolist(), label(n), words=[0, 2] if family == 'tagging'
                             else None) for n in lengths]
    batch = data.collate(features, pad_id=1)
    wide = data.aligned_for(batch, 'cuda')
    assert batch.ids.shape == (3, 11) and wide.ids.shape == (3, 16) and wide.padded
    assert wide.ids[:, 11:].eq(1).all() and not wide.mask[:, 11:].any() and torch.equal(wide.ids[:, :11], batch.ids)
    if family == 'tagging':
        assert wide.labels[:, 11:].eq(data.IGNORE).all() and not wide.first[:, 11:].any()
    else:
        assert torch.equal(wide.labels, batch.labels)
    with torch.no_grad():
        narrow_out, wide_out = method.predict(batch), method.predict(wide)
        if family != 'classification':
            wide_out = wide_out[:, :11]
        assert torch.allclose(narrow_out, wide_out, atol=1e-5)
        assert torch.allclose(method.loss(batch)[0], method.loss(wide)[0], atol=1e-6)
    assert data.aligned_for(batch, 'cpu') is batch
    whole = data.collate(features[:1], pad_id=1)
    assert data.aligned_for(whole, 'cuda') is whole and not whole.padded


def test_a_build_that_fails_stops_keeping_the_warnings_for_itself(tmp_path, capsys):
    """A build keeps the readers' warnings for its meta.json rather than printing them; one that fails while it reads
    its sources stops keeping them, so that a later warning is printed as ever."""
    def jobs():  # a source that cannot be read
        raise data.DataError('unreadable')
        yield
    with pytest.raises(data.DataError, match='unreadable'):
        data.write_items(str(tmp_path / 'set'), None, jobs(), None, None, {})
    data.warn('said after the build')
    assert 'warning: said after the build' in capsys.readouterr().out
