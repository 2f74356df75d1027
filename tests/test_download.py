"""`python data.py download`: no network means one line at once; the conversion of each task's
official files, tested on small archives in their real layout placed where the download would put them."""
import io
import json
import os
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


def test_udpos_conversion(tmp_path):
    out = str(tmp_path)
    conllu = ('# text = Anna lives.\n1\tAnna\tAnna\tPROPN\t_\t_\t2\tnsubj\t_\t_\n2-3\tlives.\t_\t_\t_\t_\t_\t_\t_\t_\n'
              '2\tlives\tlive\tVERB\t_\t_\t0\troot\t_\t_\n3\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_\n\n'
              '1\tGo\tgo\tVERB\t_\t_\t0\troot\t_\t_\n\n')
    place(out, 'udpos', 'ud-treebanks-v2.5.tgz', {
        f'ud-treebanks-v2.5/UD_{name}/{code}-ud-{split}.conllu': conllu
        for name, code in (('English-EWT', 'en_ewt'), ('German-GSD', 'de_gsd')) for split in ('train', 'test')})
    data.download('udpos', out)
    assert data.read_split(out, 'udpos', 'train') == [{'words': ['Anna', 'lives', '.'], 'tags': ['PROPN', 'VERB', 'PUNCT']},
                                                      {'words': ['Go'], 'tags': ['VERB']}]
    assert data.read_split(out, 'udpos', 'test', 'de')[0] == {'words': ['Anna', 'lives', '.'], 'tags': None}
    assert open(tmp_path / 'labels' / 'udpos' / 'test-de.tsv').read() == 'PROPN\nVERB\nPUNCT\n\nVERB\n'


def test_panx_conversion_from_the_zip_its_folder_or_one_archive(tmp_path):
    """XTREME's panx_preprocess by hand: the word after the first ':', a line without one dropped, the last blank
    line dropped, test words alone with their tags in labels/; languages outside XTREME's 40 left out."""
    raw = 'en:Anna\tB-PER\nen:Smith\tI-PER\nen:lives\tO\n\nen:Paris:Nord\tB-LOC\nnoprefix\tO\n\n'
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
