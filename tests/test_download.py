"""`python data.py download`: no network means one line at once; the conversion of each task's
official files, tested on small archives in their real layout placed where the download would put them."""
import io
import json
import os
import shutil
import tarfile
import zipfile

import pytest

import data


def test_unreachable_source_fails_at_once_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(data.SOURCES, 'pawsx', ['http://127.0.0.1:9/x-final.tar.gz'])  # nothing listens there
    with pytest.raises(data.DataError, match='cannot download .*without network') as err:
        data.download('pawsx', str(tmp_path))
    assert '\n' not in str(err.value) and os.listdir(tmp_path) == []  # no empty folders left behind
    with pytest.raises(SystemExit, match='error: PAN-X alone is converted .* --from AmazonPhotos.zip') as err:
        data.main(['download', '--task', 'panx', '--out', str(tmp_path)])  # PAN-X without --from
    assert '\n' not in str(err.value)


def archive(path, members):
    """members {name: text} -> a .zip, .tar.gz/.tgz or .tar.bz2 at path."""
    if path.endswith('.zip'):
        with zipfile.ZipFile(path, 'w') as z:
            for name, text in members.items():
                z.writestr(name, text)
        return
    with tarfile.open(path, 'w:bz2' if path.endswith('bz2') else 'w:gz') as t:
        for name, text in members.items():
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            t.addfile(info, io.BytesIO(raw))


def place(out, task, name, members=None, text=None):
    folder = os.path.join(out, 'downloads', task)
    os.makedirs(folder, exist_ok=True)
    if members is None:
        open(os.path.join(folder, name), 'w', encoding='utf-8').write(text)
    else:
        archive(os.path.join(folder, name), members)


def squad(qid, context='Anna lives in Paris.', answer='Paris'):
    return json.dumps({'version': '1.1', 'data': [{'title': 't', 'paragraphs': [{'context': context, 'qas': [
        {'id': qid, 'question': 'Where?', 'answers': [{'text': answer, 'answer_start': context.index(answer)}]}]}]}]})


def test_classification_conversions(tmp_path):
    out = str(tmp_path)
    header = 'id\tsentence1\tsentence2\tlabel\n'
    place(out, 'pawsx', 'x-final.tar.gz', {f'x-final/{lang}/{name}.tsv': header + f'1\tA {lang} "q"\tB\t1\n2\tC\tD\t0\n'
                                           for lang in data.TASKS['pawsx'].langs for name in ('train', 'dev_2k', 'test_2k')})
    data.download('pawsx', out)
    assert data.read_split(out, 'pawsx', 'dev', 'ja')[0] == {'a': 'A ja "q"', 'b': 'B', 'label': '1'}
    assert data.read_split(out, 'pawsx', 'test', 'de')[1] == {'a': 'C', 'b': 'D', 'label': None}
    assert open(tmp_path / 'labels' / 'pawsx' / 'test-de.tsv').read() == '1\n0\n'
    xnli_rows = ''.join(f'{lang}\t{label}\tx\tx\tx\tx\tP {lang}\tH\n' for lang in data.TASKS['xnli'].langs
                        for label in ('neutral', 'entailment'))
    place(out, 'xnli', 'XNLI-1.0.zip', {f'XNLI-1.0/xnli.{s}.tsv': 'language\tgold_label\t...\n' + xnli_rows for s in ('dev', 'test')})
    place(out, 'xnli', 'XNLI-MT-1.0.zip', {'XNLI-MT-1.0/multinli/multinli.train.en.tsv': 'premise\thypo\tlabel\nA\tB\tcontradictory\n'})
    data.download('xnli', out)
    assert data.read_split(out, 'xnli', 'train') == [{'a': 'A', 'b': 'B', 'label': 'contradiction'}]
    assert [ex['a'] for ex in data.read_split(out, 'xnli', 'dev', 'sw')] == ['P sw', 'P sw']
    assert open(tmp_path / 'labels' / 'xnli' / 'test-th.tsv').read() == 'neutral\nentailment\n'


def conllu(*sentences):
    """CoNLL-U text: each sentence a list of (id, form, upos, head, deps) tokens, '#' comments and 'a-b' ranges."""
    line = lambda t: t if isinstance(t, str) else f'{t[0]}\t{t[1]}\t_\t{t[2]}\t_\t_\t{t[3]}\tdep\t{t[4]}\t_'
    return ''.join(''.join(line(t) + '\n' for t in s) + '\n' for s in sentences)


def test_udpos_conversion_as_xtreme_makes_it(tmp_path):
    """ud-conversion-tools' fused forms, then utils_preprocess's udpos rules, each case written out by hand."""
    out, mwt = str(tmp_path), lambda span, form: f'{span}\t{form}\t_\t_\t_\t_\t_\t_\t_\t_'
    spanish = conllu(
        ['# text = Vamos del parque.', (1, 'Vamos', 'VERB', 0, '_'), mwt('2-3', 'del'), (2, 'de', 'ADP', 4, '_'),
         (3, 'el', 'DET', 4, '_'), (4, 'parque', 'NOUN', 1, '_'), (5, '.', 'PUNCT', 1, '_')],
        [(1, 'Quiero', 'VERB', 0, '_'), mwt('2-3', 'haberlo'), (2, 'haber', 'AUX', 4, '_'), (3, 'lo', 'PRON', 4, '_'),
         (4, 'visto', 'VERB', 1, '_')])  # a tie of AUX and PRON: Spanish's list puts AUX first, the default PRON
    german = conllu(
        [mwt('1-2', 'zum'), (1, 'zu', 'ADP', 2, '_'), (2, 'dem', 'DET', 3, '_'), (3, 'Haus', 'NOUN', 0, '_'),
         '5.1\tist\t_\tAUX\t_\t_\t_\t_\t3:cop\t_', (4, 'a\u200cb c', 'X', 3, '3:dep|5.1:x')],
        [(1, 'Er', 'PRON', 0, '_'), mwt('2-3', 'xy'), (2, 'x', 'DET', 4, '4:det'), (3, 'y', 'ADP', 4, '4:case|5:x'),
         (4, 'Tag', 'NOUN', 1, '_'), (5, 'da', 'ADV', 1, '_')],  # 5, a DEPS head of y, makes x the highest
        [(1, '_', 'NOUN', 0, '_'), (2, '_', 'VERB', 1, '_'), (3, 'x', 'X', 1, '_')],  # all but one '_': dropped
        [(1, '_', 'NOUN', 0, '_'), (2, 'ja', 'INTJ', 1, '_'), (3, 'x', 'X', 1, '_')])  # one '_' of three: kept
    english = lambda word: conllu([(1, word, 'INTJ', 0, '_')])
    place(out, 'udpos', 'ud-treebanks-v2.5.tgz', {
        'ud-treebanks-v2.5/UD_Spanish-AnCora/es_ancora-ud-test.conllu': spanish,
        'ud-treebanks-v2.5/UD_German-GSD/de_gsd-ud-train.conllu': german,
        'ud-treebanks-v2.5/UD_English-PUD/en_pud-ud-test.conllu': english('second'),  # joined in file name order,
        'ud-treebanks-v2.5/UD_English-ParTUT/en_partut-ud-test.conllu': english('first'),  # not folder order
        'ud-treebanks-v2.5/UD_Old_Church_Slavonic-PROIEL/cu_proiel-ud-train.conllu': english('not XTREME\'s')})
    data.download('udpos', out)
    assert (tmp_path / 'udpos' / 'test-es.tsv').read_text() == 'Vamos\ndel\nparque\n.\n\nQuiero\nhaberlo\nvisto\n'
    assert (tmp_path / 'labels' / 'udpos' / 'test-es.tsv').read_text() == 'VERB\nADP\nNOUN\nPUNCT\n\nVERB\nAUX\nVERB\n'
    assert (tmp_path / 'udpos' / 'train-de.tsv').read_text() == ('zum\tDET\nHaus\tNOUN\nabc\tX\n\nEr\tPRON\nxy\tDET\n'
                                                                 'Tag\tNOUN\nda\tADV\n\n_\tNOUN\nja\tINTJ\nx\tX\n')
    assert (tmp_path / 'udpos' / 'test-en.tsv').read_text() == 'first\n\nsecond\n'
    assert sorted(os.listdir(tmp_path / 'udpos')) == ['test-en.tsv', 'test-es.tsv', 'train-de.tsv']


def test_panx_conversion_from_the_zip_its_folder_or_one_archive(tmp_path):
    """XTREME's panx_preprocess by hand: the word after the first ':', a line without one dropped, the last blank
    line dropped, test words alone with their tags in labels/; languages outside XTREME's 40 left out. Blank lines
    in a row are one and an empty word is dropped, so that a test file's sentences and its tags' line up."""
    raw = '\nen:Anna\tB-PER\nen:\tO\nen:Smith\tI-PER\nen:lives\tO\n\n\nen:Paris:Nord\tB-LOC\nnoprefix\tO\n\n'
    folder = tmp_path / 'panx_dataset'
    folder.mkdir()
    for lang in ('en', 'de', 'xx'):  # xx: one of Pan et al.'s languages that XTREME does not take
        archive(str(folder / f'{lang}.tar.gz'), {s: raw.replace('en:', f'{lang}:') for s in ('train', 'dev', 'test')})
    with zipfile.ZipFile(tmp_path / 'AmazonPhotos.zip', 'w') as z:
        for lang in ('en', 'de', 'xx'):
            z.write(folder / f'{lang}.tar.gz', f'panx_dataset/{lang}.tar.gz')
    tagged, words, tags = ('Anna\tB-PER\nSmith\tI-PER\nlives\tO\n\nParis:Nord\tB-LOC\n', 'Anna\nSmith\nlives\n\n'
                           'Paris:Nord\n', 'B-PER\nI-PER\nO\n\nB-LOC\n')
    for source, langs in (('AmazonPhotos.zip', ['de', 'en']), ('panx_dataset', ['de', 'en']),
                          ('panx_dataset/de.tar.gz', ['de'])):
        out = tmp_path / ('out-' + source.replace('/', '-'))
        data.main(['download', '--task', 'panx', '--from', str(tmp_path / source), '--out', str(out)])
        assert sorted(os.listdir(out / 'panx')) == sorted(f'{s}-{lang}.tsv' for s in ('train', 'dev', 'test')
                                                          for lang in langs)
        assert (out / 'panx' / 'dev-de.tsv').read_text() == tagged and (out / 'panx' / 'test-de.tsv').read_text() == words
        assert (out / 'labels' / 'panx' / 'test-de.tsv').read_text() == tags
    assert data.read_split(str(out), 'panx', 'train', 'de')[1] == {'words': ['Paris:Nord'], 'tags': ['B-LOC']}
    archive(str(tmp_path / 'fi.tar.gz'), {'train': raw, 'test': raw})
    for source, message in (('fi.tar.gz', 'fi.tar.gz in .* is not PAN-X\'s .*\'dev\''),
                            ('panx_dataset/de.tar', 'is not AmazonPhotos.zip, its panx_dataset folder or')):
        with pytest.raises(SystemExit, match=message) as err:
            data.main(['download', '--task', 'panx', '--from', str(tmp_path / source), '--out', str(tmp_path / 'x')])
        assert '\n' not in str(err.value)


def test_conll_ner_is_read_as_uxla_reads_it_iob1_made_iob2(tmp_path):
    """CoNLL-2003's English (IOB1, four columns, -DOCSTART-), its German (Latin-1, five columns), CoNLL-2002's
    Spanish (IOB2) and UXLA's fi.train.iob2, each line's tag written out by hand in IOB2."""
    source = tmp_path / 'ner'
    (source / 'fi').mkdir(parents=True)
    (source / 'eng.train').write_text(
        '-DOCSTART- -X- -X- O\n\nEU NNP I-NP I-ORG\nrejects VBZ I-VP O\nGerman JJ I-NP I-MISC\ncall NN I-NP O\n'
        '. . O O\n\nPeter NNP I-NP I-PER\nBlackburn NNP I-NP I-PER\nBen NNP I-NP B-PER\nCarl NNP I-NP I-PER\n'
        'UN NNP I-NP I-ORG\nGeneva NNP I-NP I-LOC\n')  # B- in IOB1: an entity right after one of its type
    (source / 'deu.testb').write_bytes('-DOCSTART- -X- -X- -X- O\n\nÖsterreich österreich NE I-NC I-LOC\n'
                                       'sagt sagen VVFIN I-VC O\n'.encode('latin-1'))
    (source / 'esp.testa').write_text('Melbourne B-LOC\n( O\nAustralia B-LOC\n) O\n\nLa B-ORG\nONU I-ORG\n')
    (source / 'fi' / 'fi.train.iob2').write_text('Helsinki B-LOC\n')
    out = tmp_path / 'data'
    data.main(['download', '--task', 'conll', '--from', str(source), '--out', str(out)])
    assert (out / 'conll' / 'train-en.tsv').read_text() == (
        'EU\tB-ORG\nrejects\tO\nGerman\tB-MISC\ncall\tO\n.\tO\n\nPeter\tB-PER\nBlackburn\tI-PER\nBen\tB-PER\n'
        'Carl\tI-PER\nUN\tB-ORG\nGeneva\tB-LOC\n')
    assert (out / 'conll' / 'test-de.tsv').read_text() == 'Österreich\nsagt\n'
    assert (out / 'labels' / 'conll' / 'test-de.tsv').read_text() == 'B-LOC\nO\n'
    assert (out / 'conll' / 'dev-es.tsv').read_text() == 'Melbourne\tB-LOC\n(\tO\nAustralia\tB-LOC\n)\tO\n\nLa\tB-ORG\n' \
                                                          'ONU\tI-ORG\n'
    assert data.read_split(str(out), 'conll', 'train', 'fi') == [{'words': ['Helsinki'], 'tags': ['B-LOC']}]
    (source / 'eng.testb').write_text('Monday NNP I-NP I-DATE\n')
    with pytest.raises(SystemExit, match='eng.testb, line 1: label .B-DATE. is not one of O, B-MISC, I-MISC, B-PER'):
        data.main(['download', '--task', 'conll', '--from', str(source), '--out', str(out)])
    with pytest.raises(SystemExit, match='CoNLL NER is converted from the files you hold'):
        data.main(['download', '--task', 'conll', '--out', str(out)])


@pytest.fixture
def bucket(monkeypatch):
    """XTREME's bucket on a server at 127.0.0.1: {object name: text}, its JSON listing two names a page (the next
    page's token in nextPageToken), each object at /xtreme_translations/<name>; a listed name without text is 404."""
    import http.server
    import threading
    import urllib.parse
    objects = {}

    class Bucket(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            name = urllib.parse.unquote(url.path.removeprefix('/xtreme_translations/'))
            if url.path == '/storage/v1/b/xtreme_translations/o':
                names = sorted(n for n in objects if n.startswith(query['prefix'][0]))
                start = int(query.get('pageToken', ['page 0'])[0].split()[1])
                page = {'kind': 'storage#objects', 'items': [{'name': n, 'size': str(len(objects[n] or ''))}
                                                             for n in names[start:start + 2]]}
                page.update({'nextPageToken': f'page {start + 2}'} if start + 2 < len(names) else {})
                body = json.dumps(page).encode()
            elif objects.get(name) is not None:
                body = objects[name].encode()
            else:
                return self.send_error(404)
            self.send_response(200)
            self.send_header('Content-Length', str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Bucket)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()  # shutdown waits one poll
    monkeypatch.setattr(data, 'STORAGE', f'http://127.0.0.1:{server.server_port}')
    yield objects
    server.shutdown()


def test_translations_come_from_the_bucket_listing_then_each_object(tmp_path, bucket):
    bucket.update({'SQuAD/': '', 'SQuAD/translate-train/squad.translate.train.en-de.json': '{"data": []}',
                   'XQuAD/translate-test/xquad.translate.test.de-en.json': '{"data": [1]}',
                   'XQuAD/translate-test/xquad.translate.test.el-en.json': '{"data": [2]}',
                   'XQuAD/pseudo-test-set/xquad.pseudo.en-de.json': squad('q1', 'Anna wohnt in Paris.'),
                   'XQuAD/pseudo-test-set/not-read.json': 'no language in its name', 'XQuAD/README': 'left'})
    data.main(['download', '--task', 'xquad', '--translations', '--out', str(tmp_path)])  # a listing of two pages
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*.json') if 'pseudo-test-set' not in str(p)) == [
        'squad/translate-train/squad.translate.train.en-de.json', 'xquad/pseudo-test/pseudo-test-de.json',
        'xquad/translate-test/xquad.translate.test.de-en.json', 'xquad/translate-test/xquad.translate.test.el-en.json']
    assert data.read_split(str(tmp_path), 'xquad', 'pseudo-test', 'de')[0]['context'] == 'Anna wohnt in Paris.'
    bucket.update({'XNLI/pseudo-test-set/en-de-pseudo-translated.csv': 'A de\tB de\tcontradictory\nC de\tD de\tneutral\n'})
    data.main(['download', '--task', 'xnli', '--translations', '--out', str(tmp_path)])  # XTREME's get_pseudo_test_examples
    assert data.read_split(str(tmp_path), 'xnli', 'pseudo-test', 'de') == [
        {'a': 'A de', 'b': 'B de', 'label': 'contradiction'}, {'a': 'C de', 'b': 'D de', 'label': 'neutral'}]
    bucket.update({'XNLI/pseudo-test-set/en-fr-pseudo-translated.csv': 'A fr\tB fr\n'})  # no label
    with pytest.raises(SystemExit, match='en-fr-pseudo-translated.csv, line 1: expected premise, hypothesis and label'):
        data.main(['download', '--task', 'xnli', '--translations', '--out', str(tmp_path)])
    assert (tmp_path / 'xquad' / 'translate-test' / 'xquad.translate.test.el-en.json').read_text() == '{"data": [2]}'
    bucket['XQuAD/translate-test/xquad.translate.test.ar-en.json'] = None  # listed, but the download fails
    with pytest.raises(SystemExit, match='cannot download .*/xquad.translate.test.ar-en.json .*: get it with gsutil '
                                         'cp gs://xtreme_translations/XQuAD/translate-test/xquad.translate.test.ar-en.json '
                                         f'{tmp_path}/xquad/translate-test/') as err:
        data.main(['download', '--task', 'xquad', '--translations', '--out', str(tmp_path)])
    assert '\n' not in str(err.value) and not list(tmp_path.rglob('*.part'))
    with pytest.raises(SystemExit, match='XTREME publishes no translations of panx'):
        data.main(['download', '--task', 'panx', '--translations', '--out', str(tmp_path)])


def test_qa_conversions(tmp_path):
    out = str(tmp_path)
    for name in ('train-v1.1.json', 'dev-v1.1.json'):
        for task in ('xquad', 'mlqa'):
            place(out, task, name, text=squad('s1'))
    for lang in data.TASKS['xquad'].langs:
        place(out, 'xquad', f'xquad.{lang}.json', text=squad(f'x-{lang}'))
    place(out, 'mlqa', 'MLQA_V1.zip', {f'MLQA_V1/{s}/{s}-context-{l}-question-{l}.json': squad(f'm-{s}-{l}')
                                       for s in ('dev', 'test') for l in data.TASKS['mlqa'].langs})
    names = ['arabic', 'bengali', 'english', 'finnish', 'indonesian', 'korean', 'russian', 'swahili', 'telugu']
    train = json.loads(squad('english-1-1'))
    train['data'][0]['paragraphs'][0]['qas'].append(dict(train['data'][0]['paragraphs'][0]['qas'][0], id='finnish-2-1'))
    place(out, 'tydiqa', 'tydiqa-goldp-v1.1-train.json', text=json.dumps(train))
    place(out, 'tydiqa', 'tydiqa-goldp-v1.1-dev.tgz', {f'tydiqa-goldp-v1.1-dev/tydiqa-goldp-dev-{n}.json': squad(f'{n}-9')
                                                        for n in names})
    for task in ('xquad', 'mlqa', 'tydiqa'):
        data.download(task, out)
    assert data.read_split(out, 'xquad', 'train')[0]['answers'][0]['text'] == 'Paris'
    assert data.read_split(out, 'xquad', 'test', 'th')[0]['answers'] == []  # blanked, as XTREME's test files
    assert json.load(open(tmp_path / 'labels' / 'xquad' / 'test-th.json'))['data'][0]['paragraphs'][0]['qas'][0]['id'] == 'x-th'
    assert data.read_split(out, 'mlqa', 'dev', 'hi')[0]['id'] == 'm-dev-hi'
    assert [ex['id'] for ex in data.read_split(out, 'tydiqa', 'train')] == ['english-1-1']
    assert [ex['id'] for ex in data.read_split(out, 'tydiqa', 'train', 'fi')] == ['finnish-2-1']  # in-language's
    assert data.read_split(out, 'tydiqa', 'test', 'sw')[0]['id'] == 'swahili-9'


def test_retrieval_conversions(tmp_path):
    out = str(tmp_path)
    for lang in data.TASKS['bucc2018'].langs:
        for part in ('sample', 'training'):
            stem = f'bucc2018/{lang}-en/{lang}-en.{part}'
            place(out, 'bucc2018', f'bucc2018-{lang}-en.{part}-gold.tar.bz2', {
                f'{stem}.{lang}': f'{lang}-000001\tSatz\n', f'{stem}.en': 'en-000002\tSentence\n',
                f'{stem}.gold': f'{lang}-000001\ten-000002\n'})
    data.download('bucc2018', out)
    assert data.read_retrieval(out, 'bucc2018', 'dev', 'ru')[2] == [('ru-000001', 'en-000002')]
    assert data.read_retrieval(out, 'bucc2018', 'test', 'ru')[2] is None  # test gold goes to labels/ only
    assert open(tmp_path / 'labels' / 'bucc2018' / 'test-zh.tsv').read() == 'zh-000001\ten-000002\n'
    place(out, 'tatoeba', 'main.zip', {
        f'LASER-main/data/tatoeba/v1/tatoeba.{iso}-eng.{side}': text
        for iso in data.TATOEBA_ISO3.values() for side, text in ((iso, 'one\ntwo\nthree\n'), ('eng', 'c\na\nb\n'))})
    data.download('tatoeba', out)
    src, eng, _ = data.read_retrieval(out, 'tatoeba', 'test', 'fa')
    assert src == ['one', 'two', 'three'] and eng == ['a', 'b', 'c']
    assert open(tmp_path / 'labels' / 'tatoeba' / 'test-fa.tsv').read() == '1\n2\n0\n'  # source line of each sorted English line


# ---------------------------------------------------------------------------------------
# FILTER's data (its download_data.sh): XNLI-MT-1.0, PAWS-X's translated_train.tsv and FILTER's own archives, into
# OUT/filter (train.py --translations filter), built here in the shapes its runners read (yuwfan/FILTER 6dac390).

def xtreme_xnli(tmp_path):
    out = str(tmp_path / 'data')
    rows = ''.join(f'{lang}\t{label}\tx\tx\tx\tx\tP {n} {lang}\tH {lang}\n' for lang in data.TASKS['xnli'].langs
                   for n, label in enumerate(('neutral', 'entailment')))
    place(out, 'xnli', 'XNLI-1.0.zip', {f'XNLI-1.0/xnli.{s}.tsv': 'language\tgold_label\t...\n' + rows for s in ('dev', 'test')})
    place(out, 'xnli', 'XNLI-MT-1.0.zip', {'XNLI-MT-1.0/multinli/multinli.train.en.tsv': MNLI['en']})
    data.download('xnli', out)
    return out


MNLI = {lang: 'premise\thypo\tlabel\n' + (f'A {lang}\tB {lang}\tcontradictory\nC {lang}\tD {lang}\tneutral\n'
                                           if lang != 'en' else 'A\tB\tcontradictory\nC\tD\tneutral\n')
        for lang in data.TASKS['xnli'].langs}


def test_filters_xnli_data_into_a_folder_of_its_own(tmp_path):
    """XNLI-MT-1.0's multinli.train.{lang}.tsv, line i translating line i of the English file (a header; 'contradictory'
    read as contradiction, as FILTER's XnliProcessor does), and FILTER's xnli.zip: xtreme.msft.{lang}-en.{dev,test},
    the target's rows in the order of XTREME's dev and test files, 'a b [label]', no header."""
    out = xtreme_xnli(tmp_path)
    archive(str(tmp_path / 'XNLI-MT-1.0.zip'), {f'XNLI-MT-1.0/multinli/multinli.train.{lang}.tsv': text
                                                for lang, text in MNLI.items()})
    msft = lambda lang, split: ''.join(f'P{n} in English\tH in English' + (f'\t{label}' if split == 'dev' else '')
                                       + '\n' for n, label in enumerate(('neutral', 'entailment')))
    archive(str(tmp_path / 'xnli.zip'), {f'xnli/xtreme.msft.{lang}-en.{split}': msft(lang, split)
                                         for lang in data.TASKS['xnli'].langs if lang != 'en' for split in ('dev', 'test')})
    data.main(['download', '--task', 'xnli', '--translations', 'filter', '--from', str(tmp_path / 'XNLI-MT-1.0.zip'),
               '--from', str(tmp_path / 'xnli.zip'), '--out', out])
    theirs = os.path.join(out, 'filter')
    pairs = data.read_translations(theirs, 'xnli', 'train', 'de')
    assert [(e['a'], t['a'], t['b'], t['label']) for e, t in pairs] == [('A', 'A de', 'B de', 'contradiction'),
                                                                         ('C', 'C de', 'D de', 'neutral')]
    test = data.read_translations(theirs, 'xnli', 'test', 'sw')  # XTREME's test rows, each with FILTER's English
    assert [(e['a'], t['a'], t['b']) for e, t in test] == [('P 0 sw', 'P0 in English', 'H in English'),
                                                           ('P 1 sw', 'P1 in English', 'H in English')]
    assert [t['label'] for _, t in data.read_translations(theirs, 'xnli', 'dev', 'sw')] == ['neutral', 'entailment']
    assert data.read_split(theirs, 'xnli', 'dev', 'de') == data.read_split(out, 'xnli', 'dev', 'de')  # the rest linked
    assert os.path.isdir(os.path.join(theirs, 'labels', 'xnli'))
    args = train_args(['--task', 'xnli', '--translations', 'filter', '--data_dir', out])
    assert args.data_dir == theirs and args.out.endswith('xnli-zeroshot-filter-translations')
    for planted, message in (({'de': MNLI['de'].split('\n', 1)[1]}, 'does not begin with the header premise hypo label'),
                             ({'fr': MNLI['fr'].replace('premise\thypo', 'hypo\tpremise')}, 'header premise hypo'),
                             ({'ar': MNLI['ar'] + 'E ar\tF ar\tneutral\n'}, '3 rows for 2 English ones')):
        archive(str(tmp_path / 'bad.zip'), {f'XNLI-MT-1.0/multinli/multinli.train.{lang}.tsv': planted.get(lang, text)
                                            for lang, text in MNLI.items()})
        shutil.rmtree(os.path.join(out, 'downloads', 'filter'))
        with pytest.raises(SystemExit, match=message):
            data.main(['download', '--task', 'xnli', '--translations', 'filter', '--from', str(tmp_path / 'bad.zip'),
                       '--out', out])


def train_args(argv):
    import train
    return train.parse_args(argv)


PAWSX_HEADER = 'id\tsentence1\tsentence2\tlabel\n'


def download_pawsx(out):
    """PAWS-X downloaded into out from an x-final.tar.gz of two pairs a language, with its own translations of the
    training set (translated_train.tsv, in another order: ids 2, 1) -> the archive's members."""
    members = {f'x-final/{lang}/{name}.tsv': PAWSX_HEADER + f'1\tA {lang}\tB {lang}\t1\n2\tC {lang}\tD {lang}\t0\n'
               for lang in data.TASKS['pawsx'].langs for name in ('train', 'dev_2k', 'test_2k')}
    members.update({f'x-final/{lang}/translated_train.tsv': PAWSX_HEADER + f'2\tC {lang}\tD {lang}\t0\n'
                    f'1\tA {lang}\tB {lang}\t1\n' for lang in data.TASKS['pawsx'].langs if lang != 'en'})
    place(out, 'pawsx', 'x-final.tar.gz', members)
    data.download('pawsx', out)
    return members


def test_filters_pawsx_tagging_and_qa_data(tmp_path):
    """PAWS-X's translated_train.tsv matched to English by id; FILTER's pawsx.zip (a header, id a b label); its
    tagging archive (a sentence a line, words at spaces; an empty line: the original's words, as utils_tag.py reads
    it); its TyDiQA translate-test JSON; and for XQuAD and MLQA the benchmark's own English, paired by question id."""
    out = str(tmp_path / 'data')
    members = download_pawsx(out)
    archive(str(tmp_path / 'x-final.tar.gz'), members)
    archive(str(tmp_path / 'pawsx.zip'), {f'pawsx/xtreme.msft.{lang}-en.test': PAWSX_HEADER + f'1\tA in en\tB in en\t1\n'
                                          f'2\tC in en\tD in en\t0\n' for lang in data.TASKS['pawsx'].langs})
    data.main(['download', '--task', 'pawsx', '--translations', 'filter', '--from', str(tmp_path / 'x-final.tar.gz'),
               '--from', str(tmp_path / 'pawsx.zip'), '--out', out])
    theirs = os.path.join(out, 'filter')
    assert [(e['a'], t['a']) for e, t in data.read_translations(theirs, 'pawsx', 'train', 'ko')] == [
        ('A en', 'A ko'), ('C en', 'C ko')]  # by id, whatever the order
    assert [(e['a'], t['a']) for e, t in data.read_translations(theirs, 'pawsx', 'test', 'ja')] == [
        ('A ja', 'A in en'), ('C ja', 'C in en')]
    swapped = {**members, 'x-final/de/translated_train.tsv': 'sentence1\tid\tsentence2\tlabel\nC de\t2\tD de\t0\n'}
    archive(str(tmp_path / 'swapped.tar.gz'), swapped)
    with pytest.raises(SystemExit, match='translated_train.tsv does not begin with the header id sentence1'):
        data.main(['download', '--task', 'pawsx', '--translations', 'filter', '--from', str(tmp_path / 'swapped.tar.gz'),
                   '--out', out])
    archive(str(tmp_path / 'short.zip'), {'pawsx/xtreme.msft.de-en.test': PAWSX_HEADER + '1\tA in en\tB in en\t1\n'})
    with pytest.raises(SystemExit, match='xtreme.msft.de-en.test has 1 lines for the 2 examples of pawsx test de'):
        data.main(['download', '--task', 'pawsx', '--translations', 'filter', '--from', str(tmp_path / 'x-final.tar.gz'),
                   '--from', str(tmp_path / 'short.zip'), '--out', out])
    assert [(e['a'], t['a']) for e, t in data.read_translations(theirs, 'pawsx', 'test', 'de')] == [
        ('A de', 'A in en'), ('C de', 'C in en')]  # the refused conversions left the folder as it was
    # tagging: XTREME's files (here by hand), FILTER's udpos.zip
    for name, text in (('train-en.tsv', 'I\tPRON\nrun\tVERB\n\nGo\tVERB\n'), ('test-de.tsv', 'Ich\nlaufe\n\nGeh\n'),
                       ('test-eu.tsv', 'Etxea\n')):  # Basque: FILTER left it untranslated
        os.makedirs(os.path.join(out, 'udpos'), exist_ok=True)
        open(os.path.join(out, 'udpos', name), 'w').write(text)
    archive(str(tmp_path / 'udpos.zip'), {'udpos/train-en-de.tsv': 'Ich laufe\n\n', 'udpos/test-de-en.tsv': 'I run\nGo\n'})
    data.main(['download', '--task', 'udpos', '--translations', 'filter', '--from', str(tmp_path / 'udpos.zip'),
               '--out', out])
    assert [t['words'] for _, t in data.read_translations(theirs, 'udpos', 'train', 'de')] == [['Ich', 'laufe'], ['Go']]
    assert [t['words'] for _, t in data.read_translations(theirs, 'udpos', 'test', 'de')] == [['I', 'run'], ['Go']]
    assert [t['words'] for _, t in data.read_translations(theirs, 'udpos', 'test', 'eu')] == [['Etxea']]  # itself
    assert not os.path.exists(data.split_path(theirs, 'udpos', 'translate-train', 'eu'))  # trained without
    archive(str(tmp_path / 'short.zip'), {'udpos/train-en-de.tsv': 'Ich laufe\n'})
    with pytest.raises(SystemExit, match='has 1 lines for the 2 examples of udpos train en'):
        data.main(['download', '--task', 'udpos', '--translations', 'filter', '--from', str(tmp_path / 'short.zip'),
                   '--out', out])
    # MLQA: each question paired by id with the benchmark's English one
    for lang, text in (('en', 'Paris is big.'), ('de', 'Paris ist groß.')):
        for split in ('dev', 'test'):
            path = data.split_path(out, 'mlqa', split, lang)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            json.dump(json.loads(squad('q1', text, 'Paris')), open(path, 'w'))
    os.makedirs(os.path.join(out, 'squad'), exist_ok=True)
    data.main(['download', '--task', 'mlqa', '--translations', 'filter', '--out', out])
    (english, translation), = data.read_translations(theirs, 'mlqa', 'test', 'de')
    assert (english['context'], translation['context']) == ('Paris ist groß.', 'Paris is big.')
    links = [os.path.join(d, n) for d, dirs, names in os.walk(theirs) for n in dirs + names]
    assert all(not os.path.isabs(os.readlink(p)) for p in links if os.path.islink(p))  # relative: the folder moves
    shutil.move(out, str(tmp_path / 'moved'))
    assert [t['words'] for _, t in data.read_translations(str(tmp_path / 'moved' / 'filter'), 'udpos', 'test', 'de')] == [
        ['I', 'run'], ['Go']]
    with pytest.raises(SystemExit, match='FILTER has no data of bucc2018'):
        data.main(['download', '--task', 'bucc2018', '--translations', 'filter', '--out', str(tmp_path / 'moved')])


def test_udpos_converts_the_archive_a_user_holds(tmp_path):
    """--from ud-treebanks-v2.5.tgz (or its folder) reads the archive in place of the download."""
    archive(str(tmp_path / 'ud-treebanks-v2.5.tgz'), {
        'ud-treebanks-v2.5/UD_German-GSD/de_gsd-ud-test.conllu': conllu([(1, 'Haus', 'NOUN', 0, '_')])})
    data.main(['download', '--task', 'udpos', '--from', str(tmp_path / 'ud-treebanks-v2.5.tgz'),
               '--out', str(tmp_path / 'out')])
    assert (tmp_path / 'out' / 'udpos' / 'test-de.tsv').read_text() == 'Haus\n'
    assert (tmp_path / 'out' / 'labels' / 'udpos' / 'test-de.tsv').read_text() == 'NOUN\n'


# ---------------------------------------------------------------------------------------
# X-Mixup's data (its README's Step 2: a Google Drive folder, laid out as its Structure; read as xmixup/data/datasets
# reads it, yhy1117/X-Mixup b9730dc), into OUT/xmixup (train.py --method xmixup), built here in those shapes.

def xmixup_convert(out, folder, task):
    data.main(['download', '--task', task, '--translations', 'xmixup', '--from', str(folder), '--out', out])
    return os.path.join(out, 'xmixup')


def write(root, files):
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        open(os.path.join(root, name), 'w', encoding='utf-8').write(text)


def test_xmixups_round_trips_of_xnli_pawsx_and_squad_are_aligned_with_english(tmp_path):
    """XNLI: translate-train-en/multinli.train.{lang}-en.tsv, a header, line i the round trip of XNLI-MT's line i;
    PAWS-X: translated_train.{lang}-en.tsv, a header, id s1 s2 in the order of PAWS-X's translated_train.tsv;
    SQuAD: its JSON by question id. XNLI and PAWS-X train on the datasets' own translations."""
    out, folder = xtreme_xnli(tmp_path), tmp_path / 'X-Mixup-data'
    trip = lambda lang: 'premise\thypo\n' + f'A {lang} back\tB {lang} back\nC {lang} back\tD {lang} back\n'
    write(folder, {f'xnli/translate-train-en/multinli.train.{lang}-en.tsv': trip(lang)
                   for lang in data.TASKS['xnli'].langs if lang != 'en'})
    write(folder, {f'xnli/XNLI-MT-1.0/multinli/multinli.train.{lang}.tsv': text for lang, text in MNLI.items()})
    theirs = xmixup_convert(out, folder, 'xnli')
    pairs = data.read_translations(theirs, 'xnli', 'train', 'de')
    assert [(e['a'], t['a'], t['label']) for e, t in pairs] == [('A', 'A de', 'contradiction'), ('C', 'C de', 'neutral')]
    assert [(r['a'], r['b'], r['label']) for r in data.read_round_trip(theirs, 'xnli', 'de', pairs)] == [
        ('A de back', 'B de back', 'contradiction'), ('C de back', 'D de back', 'neutral')]
    assert data.read_split(theirs, 'xnli', 'test', 'de') == data.read_split(out, 'xnli', 'test', 'de')  # the rest linked
    args = train_args(['--method', 'xmixup', '--task', 'xnli', '--data_dir', out])  # its own data, by default
    assert args.data_dir == theirs and args.out == 'runs/xnli-xmixup' and args.translations == 'xmixup'
    assert train_args(['--method', 'xmixup', '--task', 'xnli', '--data_dir', out, '--translations', 'xtreme']
                      ).out == 'runs/xnli-xmixup-xtreme-translations'  # XTREME's translations: a departure, named
    write(folder, {'xnli/translate-train-en/multinli.train.ar-en.tsv': trip('ar') + 'E\tF\n'})  # a line too many
    with pytest.raises(SystemExit, match='multinli.train.ar-en.tsv has 3 rows of two sentences for 2 English training '
                                         'examples') as err:
        xmixup_convert(out, folder, 'xnli')
    assert '\n' not in str(err.value) and data.read_round_trip(theirs, 'xnli', 'de', pairs)  # the folder as it was
    # PAWS-X: the round trips in the order of translated_train.tsv (ids 2, 1), English by id
    download_pawsx(out)
    write(folder, {f'pawsx/translate-train-en/translated_train.{lang}-en.tsv': PAWSX_HEADER + f'2\tC {lang} back\tD\t0\n'
                   f'1\tA {lang} back\tB\t1\n' for lang in data.TASKS['pawsx'].langs if lang != 'en'})
    xmixup_convert(out, folder, 'pawsx')
    pairs = data.read_translations(theirs, 'pawsx', 'train', 'ko')
    assert [r['a'] for r in data.read_round_trip(theirs, 'pawsx', 'ko', pairs)] == ['A ko back', 'C ko back']
    # SQuAD's round trips (XQuAD's and MLQA's), by question id
    for name in ('train-v1.1.json', 'dev-v1.1.json'):
        place(out, 'xquad', name, text=squad('s1'))
    for lang in data.TASKS['xquad'].langs:
        place(out, 'xquad', f'xquad.{lang}.json', text=squad('q1'))
    data.download('xquad', out)
    write(folder, {'squad/translate-train-en/squad.translate.train.en-de-en.json': squad('s1', 'Anna wohnt in Paris.')})
    xmixup_convert(out, folder, 'xquad')
    pairs = [(e, None) for e in data.read_split(out, 'xquad', 'train')]
    assert data.read_round_trip(theirs, 'xquad', 'de', pairs)[0]['context'] == 'Anna wohnt in Paris.'
    english = open(data.split_path(out, 'xquad', 'test', 'en')).read()  # its runner's English side: XQuAD's own
    assert open(data.split_path(theirs, 'xquad', 'translate-test', 'de')).read().strip() == english.strip()
    write(folder, {'squad/translate-train-en/squad.translate.train.en-el-en.json': squad('not-in-squad')})
    with pytest.raises(SystemExit, match='en-el-en.json: questions of ids not in SQuAD.s English training set'):
        xmixup_convert(out, folder, 'xquad')
    with pytest.raises(SystemExit, match='X-Mixup.s data is a Google Drive folder .its README, Step 2.: download it'):
        data.main(['download', '--task', 'xquad', '--translations', 'xmixup', '--out', out])


TAGS = sorted(data.TASKS['udpos'].labels, reverse=True)  # labels.txt's order (XTREME's is sorted, as TASKS')


def released_tagging(folder, lang, sentences, soft):
    """X-Mixup's tagging files of a language: translate-train-logits (word, its distribution over labels.txt's tags,
    ';'-separated), the round trip and the dev and test sets translated into English (word, a second column)."""
    line = lambda word, p: f'{word}\t{";".join(f"{x:g}" for x in p)}\n'
    write(folder, {f'udpos/translate-train-logits/{lang}.txt': '\n'.join(
        ''.join(line(w, p) for w, p in zip(words, probs)) for words, probs in zip(sentences, soft)) + '\n',
        'udpos/labels.txt': '\n'.join(TAGS) + '\n'})
    for name in ('translate-train-en-token', 'translate-dev-token', 'translate-test-token'):
        write(folder, {f'udpos/{name}/{lang}.txt': '\n'.join(''.join(f'{w}\t_\n' for w in words)
                                                              for words in (['Back', 'here'], ['Go'])) + '\n'})


def test_xmixups_tagging_data_its_distributions_in_our_tag_order(tmp_path):
    out, folder = str(tmp_path / 'data'), tmp_path / 'X-Mixup-data'
    write(out, {'udpos/train-en.tsv': 'I\tPRON\nrun\tVERB\n\nGo\tVERB\n', 'udpos/dev-de.tsv': 'Ich\tPRON\n\nGeh\tVERB\n',
                'udpos/test-de.tsv': 'Ich\n\nGeh\n'})
    soft = [[[n / 153 for n in range(17)], [1.0] + [0.0] * 16], [[0.0] * 16 + [1.0]]]
    released_tagging(folder, 'de', [['Ich', 'laufe'], ['Geh']], soft)
    theirs = xmixup_convert(out, folder, 'udpos')
    assert [t['words'] for _, t in data.read_translations(theirs, 'udpos', 'train', 'de')] == [['Ich', 'laufe'], ['Geh']]
    rows = [line.split() for line in open(data.soft_path(theirs, 'udpos', 'de')).read().split('\n')]
    ours = [float(x) for x in rows[0]]  # the first word's distribution, in TASKS' order
    assert ours == pytest.approx([soft[0][0][TAGS.index(tag)] for tag in data.TASKS['udpos'].labels], abs=1e-6)
    assert rows[2] == [] and len(rows[3]) == 17  # a blank line between sentences
    assert [t['words'] for _, t in data.read_translations(theirs, 'udpos', 'test', 'de')] == [['Back', 'here'], ['Go']]
    assert [r['words'] for r in data.read_round_trip(theirs, 'udpos', 'de', [None, None])] == [['Back', 'here'], ['Go']]
    for planted, message in (([[p[:16] for p in s] for s in soft], 'a word.s distribution has not the 17 tags of udpos'),
                             (soft[:1], 'has 1 sentences for the 2 English training sentences here')):
        released_tagging(folder, 'de', [['Ich', 'laufe'], ['Geh']][:len(planted)], planted)
        with pytest.raises(SystemExit, match=message) as err:
            xmixup_convert(out, folder, 'udpos')
        assert '\n' not in str(err.value)


def test_a_task_comes_with_what_every_method_of_it_reads(tmp_path, bucket, monkeypatch, capsys):
    """python data.py download --task T: the task, then XTREME's translations (translate-train(-all), translate-test)
    and FILTER's data (--method filter) fetched too, each that cannot be in a line of what to run; X-Mixup's data,
    a Google Drive folder, a line of how to convert it."""
    out, header = str(tmp_path / 'data'), 'id\tsentence1\tsentence2\tlabel\n'
    place(out, 'pawsx', 'x-final.tar.gz', {f'x-final/{lang}/{name}.tsv': header + '1\tA\tB\t1\n'
                                           for lang in data.TASKS['pawsx'].langs for name in ('train', 'dev_2k', 'test_2k')})
    bucket.update({'PAWSX/translate-train/en-de-translated.tsv': 'A\tB\tA de\tB de\t1\n'})
    monkeypatch.setitem(data.FILTER_URLS, 'pawsx', ['http://127.0.0.1:9/x-final.tar.gz'])  # nothing listens there
    data.main(['download', '--task', 'pawsx', '--out', out])
    printed = capsys.readouterr().out
    assert os.path.exists(os.path.join(out, 'pawsx', 'translate-train', 'en-de-translated.tsv'))
    assert (f'FILTER\'s data of pawsx not fetched (cannot download http://127.0.0.1:9/x-final.tar.gz' in printed
            and f'): python data.py download --task pawsx --translations filter --out {out}\n' in printed)
    assert (f'X-Mixup\'s data of pawsx: download the folder its README\'s Step 2 gives, then python data.py download '
            f'--task pawsx --translations xmixup --from FOLDER --out {out}') in printed
