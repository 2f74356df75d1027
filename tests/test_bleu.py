"""eval.py's BLEU: number for number against sacreBLEU (the reference implementation, needed only
here), multi-bleu.perl's formula worked out by hand, and the --bleu command line."""
import json
import math
import random

import pytest

import eval as ev

# A small vocabulary, so that random sentences share n-grams, with what 13a treats specially:
# symbols, '.' ',' '-' next to digits, HTML entities (double-escaped too), <skipped>, a hyphen
# before a line break, and text that is not ASCII (umlauts, CJK, emoji, Arabic-Indic digits).
VOCAB = ['the', 'The', 'cat', 'Haus', 'Straße', 'Über', 'über', 'Mädchen', 'naïve', '東京', '天気は', '良い',
         '😀', '👍🏽', 'e.g.', 'U.S.', '3.5', '1,000', '1.000,50', '1990-2000', '3-4', '-5', '5.', ',7', 'x-ray',
         "don't", '&amp;', '&quot;', '&lt;b&gt;', '&amp;lt;', '&amp;quot;', '&', '&gt', '<skipped>', 'co-\nop',
         '\n', '.', ',', '!', '?', '...', '--', '(', ')', '"', "'", '$', '%', '/', '@', '#', '[', ']', '{', '}',
         '~', '`', '^', '_', '|', '\\', '+', '*', '=', ';', ':', '–', '«', '»', '¿', '٣.٤', 'A', 'a']
SEPARATORS = [' '] * 6 + ['', '  ', '\t', '\xa0']


def random_line(rng, longest=14):
    words = rng.choices(VOCAB, k=rng.randint(0, longest))
    line = ''.join(w + rng.choice(SEPARATORS) for w in words)
    return line + rng.choice(['', '', ' ', ' \t', '\u3000'])  # trailing whitespace now and then


def variant(rng, line):
    """A hypothesis near the reference: some words replaced, dropped or added, so that
    matches of every order occur, and sometimes none."""
    words = line.split(' ')
    out = []
    for w in words:
        roll = rng.random()
        if roll < 0.2:
            out.append(rng.choice(VOCAB))
        elif roll < 0.3:
            out += [w, rng.choice(VOCAB)]
        elif roll >= 0.4:  # else dropped
            out.append(w)
    return ' '.join(out)


def random_corpus(rng):
    refs = [random_line(rng) for _ in range(rng.randint(1, 6))]
    hyps = [variant(rng, r) if rng.random() < 0.8 else random_line(rng) for r in refs]
    return hyps, refs


ADVERSARIAL = {
    'both empty': ([''], ['']),
    'empty hypothesis': (['', 'a b c d'], ['x y', 'a b c d']),
    'empty reference': (['a b c d e'], ['']),
    'empty lines in both': (['', 'a b c d', ''], ['', 'a b c d', '']),
    'punctuation runs': (['!!!...,,,??? ..5 ,,3 --4 &amp;&amp;', '((()))'], ['!!! ... ,,, ..5 3-4', '(( ))']),
    'hypothesis far longer': (['the cat ' * 60], ['the cat sat on the mat']),
    'hypothesis shorter': (['the cat sat'], ['the cat sat on the mat today']),
    'no match': (['a b c'], ['x y z']),
    'one token each': (['a'], ['a']),
    '1-grams only (smoothing)': (['a x b y c z d'], ['d q c r b s a']),
    '1- and 2-grams only': (['a b x c d y e f'], ['a b q c d r e f']),
    'no 4-gram': (['a b c', 'd e f'], ['a b c', 'd e f']),
    'trailing whitespace': (['a b c d  \t', 'x y\xa0', 'z \u3000'], ['a b c d', 'x y', 'z']),
    'leading whitespace': (['  a b c d'], ['a b c d']),
    'identical': (['Der Mädchen-Chor sang 3.5 Std., dann 10-12 Lieder!'] * 2,
                  ['Der Mädchen-Chor sang 3.5 Std., dann 10-12 Lieder!'] * 2),
}


def sacre(hyps, refs, lowercase=False):
    sacrebleu = pytest.importorskip('sacrebleu')
    metric = sacrebleu.BLEU(lowercase=lowercase)
    score = metric.corpus_score(hyps, [refs])
    signature = str(metric.get_signature()).replace(f'version:{sacrebleu.__version__}', 'version:xlt')
    return score, signature


def assert_same(hyps, refs, lowercase=False):
    ours = ev.bleu(hyps, refs, lowercase=lowercase)
    theirs, signature = sacre(hyps, refs, lowercase)
    assert abs(ours['bleu'] - theirs.score) <= 1e-6, (hyps, refs, ours, theirs)
    assert ours['precisions'] == pytest.approx(theirs.precisions, abs=1e-9), (hyps, refs)
    assert (ours['counts'], ours['totals'], ours['sys_len'], ours['ref_len']) == (
        theirs.counts, theirs.totals, theirs.sys_len, theirs.ref_len), (hyps, refs)
    assert ours['bp'] == pytest.approx(theirs.bp, abs=1e-12)
    assert ours['signature'] == signature
    assert ev.bleu_line(ours) == theirs.format()


def test_random_corpora_equal_sacrebleu():
    rng = random.Random(0)
    for k in range(300):
        hyps, refs = random_corpus(rng)
        assert_same(hyps, refs, lowercase=k % 5 == 0)


@pytest.mark.parametrize('case', list(ADVERSARIAL))
def test_adversarial_cases_equal_sacrebleu(case):
    hyps, refs = ADVERSARIAL[case]
    assert_same(hyps, refs)
    assert_same(hyps, refs, lowercase=True)


def test_adversarial_cases_reach_the_edges():
    """The cases above engage what they are named after."""
    by_name = {name: ev.bleu(*pair) for name, pair in ADVERSARIAL.items()}
    smoothed = by_name['1-grams only (smoothing)']
    assert smoothed['counts'] == [4, 0, 0, 0] and smoothed['bleu'] > 0
    assert by_name['no match']['bleu'] == 0 and by_name['one token each']['bleu'] == 0
    assert by_name['no 4-gram']['totals'][3] == 0 and by_name['no 4-gram']['bleu'] == 0
    assert by_name['hypothesis shorter']['bp'] < 1 and by_name['empty reference']['ref_len'] == 0
    assert by_name['identical']['bleu'] == pytest.approx(100)


def test_tokenizer_equals_sacrebleu_13a():
    tokenizer_13a = pytest.importorskip('sacrebleu.tokenizers.tokenizer_13a').Tokenizer13a()
    rng = random.Random(1)
    lines = [random_line(rng, longest=20) for _ in range(1000)]
    lines += ['..5', 'a.,b', '&amp;lt; &amp;quot;', 'co-\noperate', 'x<skipped>y', '٣.٤', '1990-2000', ' . ']
    for line in lines:
        assert ev.tokenize_13a(line) == tokenizer_13a(line), repr(line)
    assert ev.tokenize_13a('&amp;lt; &amp;quot;') == '< & quot ;'  # entities in mteval's order


def test_tokenized_bleu_by_hand():
    hyps = ['The THE cat\tsat on  the mat', 'a b']
    refs = ['the cat sat on the red mat', 'A B c d e']
    # Lower-cased whitespace tokens. Line 1: hyp the the cat sat on the mat (7), ref the cat sat on the red mat (7).
    #   1-grams: the x3 clipped to the ref's 2, + cat sat on mat = 6 of 7
    #   2-grams: the-cat cat-sat sat-on on-the match, the-the the-mat do not = 4 of 6
    #   3-grams: the-cat-sat cat-sat-on sat-on-the = 3 of 5;  4-grams: the-cat-sat-on cat-sat-on-the = 2 of 4
    # Line 2: hyp a b (2), ref a b c d e (5): 1-grams 2 of 2, 2-grams 1 of 1, no 3- or 4-grams.
    # Corpus: 8/9, 5/7, 3/5, 2/4; hyp length 9 < ref length 12: BP = exp(1 - 12/9) = exp(-1/3).
    # BLEU = 100 * exp(-1/3) * (8/9 * 5/7 * 3/5 * 2/4) ** (1/4) = 100 * exp(-1/3) * (4/21) ** (1/4) = 47.336...
    s = ev.tokenized_bleu(hyps, refs)
    assert s['counts'] == [8, 5, 3, 2] and s['totals'] == [9, 7, 5, 4]
    assert (s['sys_len'], s['ref_len']) == (9, 12)
    assert s['precisions'] == pytest.approx([100 * 8 / 9, 100 * 5 / 7, 100 * 3 / 5, 100 * 2 / 4])
    assert s['bp'] == pytest.approx(math.exp(-1 / 3))
    assert s['bleu'] == pytest.approx(100 * math.exp(-1 / 3) * (4 / 21) ** 0.25) == pytest.approx(47.33641316)
    assert s['signature'] == 'multi-bleu.perl -lc (whitespace tokens)'


def test_tokenized_bleu_without_a_4gram_match_is_zero():
    # 1-grams 4/4, 2-grams a-b b-c 2/3, 3-grams a-b-c 1/2, 4-grams a-b-c-d 0/1: no smoothing, so 0.
    s = ev.tokenized_bleu(['a b c d'], ['a b c x d'])
    assert s['counts'] == [4, 2, 1, 0] and s['bleu'] == 0


def test_different_counts_are_one_line_errors():
    with pytest.raises(ev.EvalError, match=r'^2 hypotheses for 1 references') as e:
        ev.bleu(['a', 'b'], ['a'])
    assert '\n' not in str(e.value)
    with pytest.raises(ev.EvalError, match=r'^0 hypotheses for 1 references'):
        ev.tokenized_bleu([], ['a'])


def test_command_line(tmp_path, capsys):
    hyp, ref, out = tmp_path / 'hyp.txt', tmp_path / 'ref.txt', tmp_path / 'bleu.json'
    # An empty line is an empty hypothesis; a final newline adds no segment (ref.txt has none).
    hyp.write_text('The cat sat on the mat.\n\nDas Mädchen singt 3.5 Stunden.\n', encoding='utf-8')
    ref.write_text('The cat sat on a mat.\nA dog barked.\nDas Mädchen sang 3.5 Stunden.', encoding='utf-8')
    ev.main(['--bleu', str(hyp), '--ref', str(ref), '--out', str(out)])
    printed = capsys.readouterr().out.splitlines()
    scores = json.loads(out.read_text(encoding='utf-8'))
    expected = ev.bleu(['The cat sat on the mat.', '', 'Das Mädchen singt 3.5 Stunden.'],
                       ['The cat sat on a mat.', 'A dog barked.', 'Das Mädchen sang 3.5 Stunden.'])
    assert scores == expected and scores['bleu'] > 0
    assert printed == [ev.bleu_line(expected), 'nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:xlt']
    assert printed[0].startswith(f"BLEU = {scores['bleu']:.2f} ")

    ev.main(['--bleu', str(hyp), '--ref', str(ref), '--tokenized'])
    assert capsys.readouterr().out.splitlines()[1] == 'multi-bleu.perl -lc (whitespace tokens)'

    ref.write_text('one line\n', encoding='utf-8')
    with pytest.raises(SystemExit) as e:
        ev.main(['--bleu', str(hyp), '--ref', str(ref)])
    assert str(e.value.code) == f'error: {hyp} has 3 lines, {ref} has 1: write one hypothesis per reference line'


def test_command_line_needs_its_arguments(tmp_path):
    for argv in (['--out', str(tmp_path / 's.json')], ['--bleu', 'hyp.txt'], ['--ref', 'ref.txt'],
                 ['--bleu', 'hyp.txt', '--ref', 'ref.txt', '--predictions', 'p']):
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        assert str(e.value.code).startswith('error: ') and '\n' not in str(e.value.code), argv
    with pytest.raises(SystemExit, match='^error: .*missing.txt is not there'):
        ev.main(['--bleu', str(tmp_path / 'missing.txt'), '--ref', str(tmp_path / 'missing.txt')])
