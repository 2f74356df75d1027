"""Every method on every task family it declares, end to end on the demo's files, which have the
published files' shapes (test labels stripped, translate-test rows labelled, translate-train
leaving examples out in another order, tagging translations without tags): each run reaches
results.json and a prediction file per test language, in the leaderboard's layout. On the tiny
BERT every method that runs there, on a task of each family in turn, and the seeds' BERT rows'
options (XLA's confidence penalty, translate-test, in-language few-shot)."""
import argparse
import json
import os

import pytest

import data
import layers
import xlt
from conftest import demo_run, quick_pretrained

pytestmark = pytest.mark.slow  # every test here runs the trainer
VARIANTS = {'veco': [[], ['--translate_train_all']]}  # VECO's NLU, and its translate-train-all (VecoAll)
QUICK = ['--from_scratch', '--epochs', '1', '--batch_size', '16', '--max_len', '48']  # QA: windows of 48 tokens


def runs():
    """(method, its variant's options, task): a task of each family the class declares, the tasks of a
    family taken in turn across the methods, so that every task is met."""
    turn, out = {}, []
    for name, method in xlt.METHODS.items():
        for options in VARIANTS.get(name, [[]]):
            cls = method.resolve(train_args(name, method.TASKS[0], options))
            for family in dict.fromkeys(data.TASKS[t].family for t in cls.TASKS if t in data.TASKS):
                tasks = [t for t in cls.TASKS if t in data.TASKS and data.TASKS[t].family == family]
                turn[family] = turn.get(family, -1) + 1
                out.append((name, options, tasks[turn[family] % len(tasks)]))
    return out


def bert_runs():
    """(method, options, task) of the tiny BERT: each method that runs on BERT on a family in turn, then
    the options of the seeds' BERT rows."""
    out = []
    for name, method in [(name, method) for name, method in xlt.METHODS.items() if not method.NOT_ON_BERT]:
        tasks = [t for t in method.TASKS if t in data.TASKS and data.TASKS[t].family != 'retrieval']
        families = list(dict.fromkeys(data.TASKS[t].family for t in tasks))
        family = families[len(out) % len(families)]
        out.append((name, [], next(t for t in tasks if data.TASKS[t].family == family)))
    return out + [('zeroshot', ['--conf_penalty', '1'], 'panx'), ('zeroshot', ['--translate_test'], 'xnli'),
                  ('in-language', ['--few_shot', '10'], 'panx')]


def train_args(method, task, options):
    import train
    return train.parse_args(['--method', method, '--task', task, '--demo', *options])


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo') / 'demo-data'), n_train=32, n_eval=6)


@pytest.fixture(scope='module')
def finished(demo, tmp_path_factory):
    """Runs that others start from (a retrieval encoder, X-Mixup's tagging teacher), made once."""
    done, root = {}, tmp_path_factory.mktemp('finished')

    def run(task):  # a zero-shot run of task, or the demo's briefly pre-trained masked LM
        if task not in done:
            made = quick_pretrained(demo, root / task, steps=20) if task == 'pretrain' else None
            made or demo_run(root / task, demo, ['--method', 'zeroshot', '--task', task, *QUICK])
            done[task] = made or str(root / task)
        return done[task]
    return run


def needs(method, task, finished):
    """What a run needs beyond the demo: an encoder to retrieve with; X-Mixup's tagging teacher; the
    language a method trains on where it takes one; XLA's masked LM, and its stages kept short."""
    family = data.TASKS[task].family
    if family == 'retrieval':
        return ['--init', os.path.join(finished('xnli'), 'best.pt')]
    quick = QUICK[1:] if method == 'xla' else QUICK  # XLA's vicinal samples come from a masked LM
    more = ['--teacher', finished(task)] if method == 'xmixup' and family == 'tagging' else []
    more += ['--train_lang', 'de'] * ('train_lang' in {o.name for o in xlt.METHODS[method].OPTIONS})
    return quick + more + ['--init', finished('pretrain'), '--xla_epochs', '1', '--xla_batch_size', '16'] * (method == 'xla')


@pytest.mark.parametrize('method, options, task', runs(), ids=lambda v: ' '.join(v) if isinstance(v, list) else v)
def test_every_method_reaches_results_and_predictions_on_every_family(demo, finished, tmp_path, method, options, task):
    out = tmp_path / 'run'
    demo_run(out, demo, ['--method', method, '--task', task, *options, *needs(method, task, finished)])
    results = json.load(open(out / 'results.json'))
    langs = data.languages(task, demo=True)
    assert set(results['test']) >= set(langs)
    predictions_written(out, task, langs)
    if data.TASKS[task].family != 'retrieval':
        config = argparse.Namespace(**json.load(open(out / 'config.json')))
        predicted_by_hand(out, demo, xlt.method_class(config).paired, task)


def predictions_written(out, task, langs):
    """The run's predictions folder holds each language's test predictions and, where its dev sets are the task's
    own (the method's selects_on chooses none), each dev language's (those of results.json's dev scores)."""
    config = argparse.Namespace(**json.load(open(out / 'config.json')))
    dev = [lang for lang in json.load(open(out / 'results.json'))['dev'] if lang not in ('avg', 'gap')]
    dev = dev if xlt.method_class(config).selects_on(config) is None else []
    expected = [f'{split}-{lang}.{data.suffix(task)}' for split, chosen in (('test', langs), ('dev', dev))
                for lang in chosen]
    assert sorted(os.listdir(out / 'predictions' / task)) == sorted(expected)


def predicted_by_hand(out, demo, paired, task):
    """train.py --predict on German's test set written out by hand (its English translations beside it for a paired
    method) gives the run's own German test predictions; a line of the wrong shape is named."""
    import train
    family, examples = data.TASKS[task].family, data.read_split(demo, task, 'test', 'de')
    files = [data.split_path(demo, task, 'test', 'de')] + [data.split_path(demo, task, 'translate-test', 'de')] * paired
    if family != 'qa':
        side = lambda ex: [ex['a'], ex['b']] if family == 'classification' else [' '.join(ex['words'])]
        pairs = data.read_translations(demo, task, 'test', 'de', examples) if paired else [(ex, None) for ex in examples]
        files = [str(out / 'mine.tsv')]
        with open(files[0], 'w') as f:
            f.writelines('\t'.join(side(ex) + side(t or ex) * paired) + '\n' for ex, t in pairs)
    text = lambda ex: {k: v for k, v in ex.items() if k not in ('label', 'tags', 'answers')}  # the test files': none
    texts = lambda examples, pairs: ([text(ex) for ex in examples], pairs and [(text(a), text(b)) for a, b in pairs])
    assert texts(*data.read_input(*files[:1], task, paired, *files[1:])) == texts(
        *data.evaluation_set(demo, task, 'test', 'de', paired=paired)[1:])  # what the run evaluated, and in its order
    train.main(['--out', str(out), '--predict', *files])
    name = os.path.splitext(os.path.basename(files[0]))[0]
    read = lambda path: json.load(open(path)) if family == 'qa' else open(path).read()
    assert read(out / 'predicted' / f'{name}.{data.suffix(task)}') == read(out / 'predictions' / task /
                                                                           f'test-de.{data.suffix(task)}')
    details = json.load(open(out / 'predicted' / f'{name}.scores.json'))
    assert len(details['predictions']) == len(examples) and details['scores'] is None  # test files carry no labels


@pytest.mark.parametrize('method, options, task', bert_runs(), ids=lambda v: ' '.join(v) if isinstance(v, list) else v)
def test_every_method_that_runs_on_bert_reaches_results_and_predictions(demo, finished, tmp_path, method, options,
                                                                         task):
    out = tmp_path / 'run'
    more = ['--teacher', finished(task)] if method == 'xmixup' and data.TASKS[task].family == 'tagging' else []
    more += ['--train_lang', 'de'] * ('train_lang' in {o.name for o in xlt.METHODS[method].OPTIONS})
    demo_run(out, demo, ['--method', method, '--task', task, '--model', 'tiny-bert', *options, *QUICK, *more])
    results = json.load(open(out / 'results.json'))
    assert set(results['test']) >= set(data.DEMO_LANGS)
    predictions_written(out, task, data.DEMO_LANGS)
    assert layers.load_checkpoint(str(out / 'best.pt'))['meta']['tokenizer'] == [str(out / 'demo-data' / 'vocab.txt')]
