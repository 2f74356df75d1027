"""The training engine end to end on the demo data: every family learns and writes predictions
that eval.py scores to the numbers in results.json; DDP equals one process; a killed run
resumes exactly; bad set-ups stop with one line."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import data
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def demo_data(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo') / 'demo-data'))


def run(out, demo_data, *args):
    """A demo run in `out` that reuses the module's demo data instead of generating it again."""
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(out, 'demo-data')):
        os.symlink(demo_data, os.path.join(out, 'demo-data'))
    train.main(['--demo', '--out', str(out), *args])
    return json.load(open(os.path.join(out, 'results.json')))


def eval_cli(out, demo_data):
    res = subprocess.run([sys.executable, 'eval.py', '--predictions', os.path.join(out, 'predictions'), '--labels',
                          os.path.join(demo_data, 'labels'), '--out', os.path.join(out, 'scores.json'), '--demo'],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.load(open(os.path.join(out, 'scores.json')))


@pytest.mark.parametrize('task,method,epochs,chance', [
    ('xnli', 'zeroshot', 4, 100 / 3), ('panx', 'translate-train-all', 2, 0.0), ('xquad', 'zeroshot', 6, 0.0)])
def test_demo_learns_and_eval_agrees(tmp_path, demo_data, task, method, epochs, chance):
    results = run(tmp_path, demo_data, '--task', task, '--method', method, '--epochs', str(epochs))
    assert results['dev']['en'] > chance + 15  # clearly learnt
    scores = eval_cli(tmp_path, demo_data)[task]
    metric = {'xnli': 'accuracy', 'panx': 'f1'}.get(task)
    for lang in data.DEMO_LANGS:
        official = (scores['exact_match'][lang] + scores['f1'][lang]) / 2 if metric is None else scores[metric][lang]
        assert results['test'][lang] == pytest.approx(official, abs=1e-9)
    for name in ('config.json', 'log.jsonl', 'last.pt', 'best.pt', 'results.txt'):
        assert os.path.exists(tmp_path / name)


def test_retrieval_evaluates_a_trained_encoder(tmp_path, demo_data):
    run(tmp_path / 'tagger', demo_data, '--task', 'panx', '--epochs', '1')
    for task in ('bucc2018', 'tatoeba'):
        results = run(tmp_path / task, demo_data, '--task', task, '--init', str(tmp_path / 'tagger' / 'best.pt'))
        scores = eval_cli(tmp_path / task, demo_data)[task]
        metric = 'f1' if task == 'bucc2018' else 'accuracy'
        assert results['test'] == pytest.approx({**scores[metric], 'avg': scores[f'avg_{metric}']}, abs=1e-9)


def final_weights(out):
    return torch.load(os.path.join(out, 'last.pt'), weights_only=True)['method']


def test_ddp_on_two_processes_equals_one_process(tmp_path, demo_data):
    """Same global batch (16) and seed: 2 processes x 1 micro-batch against 1 process x 2 micro-batches."""
    common = ['--task', 'pawsx', '--epochs', '1', '--batch_size', '16', '--eval_batch_size', '128']
    os.makedirs(tmp_path / 'ddp')
    os.symlink(demo_data, tmp_path / 'ddp' / 'demo-data')
    subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                    'train.py', '--demo', '--out', str(tmp_path / 'ddp'), *common], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    one = run(tmp_path / 'one', demo_data, *common, '--grad_accum', '2')
    a, b = final_weights(tmp_path / 'ddp'), final_weights(tmp_path / 'one')
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert json.load(open(tmp_path / 'ddp' / 'results.json'))['test'] == pytest.approx(one['test'], abs=1e-9)


def test_killed_run_resumes_exactly(tmp_path, demo_data):
    common = ['--task', 'udpos', '--epochs', '2', '--save_every', '5']
    whole = run(tmp_path / 'whole', demo_data, *common)
    os.makedirs(tmp_path / 'cut')
    os.symlink(demo_data, tmp_path / 'cut' / 'demo-data')
    killed = subprocess.run([sys.executable, 'train.py', '--demo', '--out', str(tmp_path / 'cut'), *common,
                             '--halt_after', '43'], cwd=ROOT, capture_output=True)
    assert killed.returncode == 3 and torch.load(tmp_path / 'cut' / 'last.pt', weights_only=True)['state']['step'] == 40
    resumed = run(tmp_path / 'cut', demo_data, *common, '--resume')
    a, b = final_weights(tmp_path / 'whole'), final_weights(tmp_path / 'cut')
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert resumed['test'] == pytest.approx(whole['test'], abs=1e-6)


def one_line_failure(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        train.main(argv)
    assert str(err.value).startswith('error: ') and '\n' not in str(err.value)
    assert message in str(err.value)


def test_bad_set_ups_stop_with_one_line(tmp_path, demo_data, capsys):
    one_line_failure(capsys, ['--task', 'xnlii'], "unknown task 'xnlii': choose one of pawsx, xnli")
    one_line_failure(capsys, ['--method', 'magic'], "unknown method 'magic': choose one of zeroshot")
    one_line_failure(capsys, ['--data_dir', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'o')],
                     'data folder')
    broken = tmp_path / 'broken'
    shutil.copytree(demo_data, broken)
    os.remove(broken / 'xnli' / 'translate-train' / 'en-zh-translated.tsv')
    one_line_failure(capsys, ['--task', 'xnli', '--method', 'translate-train-all', '--model', 'tiny',
                              '--data_dir', str(broken), '--out', str(tmp_path / 'o')],
                     'en-zh-translated.tsv not found: xnli needs translate-train files for zh')
    run(tmp_path / 'tiny', demo_data, '--task', 'pawsx', '--epochs', '1')
    one_line_failure(capsys, ['--task', 'pawsx', '--model', 'small', '--data_dir', demo_data, '--out', str(tmp_path / 'o'),
                              '--init', str(tmp_path / 'tiny' / 'best.pt')], 'not the small preset')


def test_translate_train_and_translate_test(tmp_path, demo_data):
    """translate-train on the German translation learns German, not Chinese; translate-test runs the
    English model on the (perfect) demo translations, so every language scores as English does."""
    tt = run(tmp_path / 'tt', demo_data, '--task', 'xnli', '--method', 'translate-train', '--train_lang', 'de',
             '--epochs', '4')
    assert tt['dev']['de'] > tt['dev']['zh'] + 15
    test = run(tmp_path / 'ttest', demo_data, '--task', 'xnli', '--translate_test', '--epochs', '4')
    assert test['test']['de'] == test['test']['zh'] == test['test']['en'] > 45
    with pytest.raises(SystemExit, match='translate-train needs --train_lang, one of de, zh'):
        run(tmp_path / 'x', demo_data, '--task', 'xnli', '--method', 'translate-train')


def test_set_up_errors_before_training(tmp_path, demo_data, capsys):
    one_line_failure(capsys, ['--demo', '--batch_size', '1', '--grad_accum', '2', '--out', str(tmp_path / 'b')],
                     'cannot be cut into 1 processes x --grad_accum 2')
    one_line_failure(capsys, ['--demo', '--max_len', '1024', '--out', str(tmp_path / 'm')], '--max_len 1024 is outside 8 to 512')
    broken = tmp_path / 'broken'
    shutil.copytree(demo_data, broken)
    os.remove(broken / 'xnli' / 'translate-dev' / 'dev-zh-en-translated.tsv')
    one_line_failure(capsys, ['--task', 'xnli', '--method', 'filter', '--model', 'tiny', '--data_dir', str(broken),
                              '--out', str(tmp_path / 'f')], 'dev-zh-en-translated.tsv not found: filter needs translate-dev')
    assert not os.path.exists(tmp_path / 'f' / 'log.jsonl')  # stopped before any training
    run(tmp_path / 'zs', demo_data, '--task', 'xnli', '--epochs', '1')
    with pytest.raises(SystemExit, match='holds zeroshot on xnli with the tiny preset, not filter on xnli'):
        run(tmp_path / 'zs', demo_data, '--task', 'xnli', '--method', 'filter', '--eval_only')


def test_translate_test_qa_is_scored_on_the_translations(tmp_path, demo_data):
    results = run(tmp_path / 'qa', demo_data, '--task', 'tydiqa', '--translate_test', '--epochs', '3')
    # the demo's translations are exact: every language scores as English does
    assert results['test']['de'] == results['test']['zh'] == results['test']['en']


def test_ddp_with_every_parameter_unused_sometimes(tmp_path, demo_data):
    """X-Mixup's --fixed_lambda leaves no parameter without a gradient under DDP."""
    os.makedirs(tmp_path / 'x')
    os.symlink(demo_data, tmp_path / 'x' / 'demo-data')
    res = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                          'train.py', '--demo', '--out', str(tmp_path / 'x'), '--task', 'pawsx', '--method', 'xmixup',
                          '--fixed_lambda', '--epochs', '1', '--batch_size', '64'], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert res.returncode == 0, res.stderr[-2000:]
