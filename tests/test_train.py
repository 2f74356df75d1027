"""The training engine end to end on the demo data: every family learns and writes predictions
that eval.py scores to the numbers in results.json; DDP equals one process; a killed run
resumes exactly; bad set-ups stop with one line."""
import argparse
import errno
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import threading

import pytest
import torch

import data
import eval as ev
import layers
import train
import xlt
from conftest import quick_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def demo_data(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo') / 'demo-data'))


@pytest.fixture(scope='module')
def small_demo(tmp_path_factory):
    """A fifth of the demo, for runs that check processes, set-ups and files rather than learning."""
    return data.make_demo(str(tmp_path_factory.mktemp('small') / 'demo-data'), n_train=200, n_eval=30)


def run(out, demo_data, *args):
    """A demo run in `out` that reuses the module's demo data instead of generating it again."""
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(out, 'demo-data')):
        os.symlink(demo_data, os.path.join(out, 'demo-data'))
    train.main(['--demo', '--out', str(out), *args])
    return json.load(open(os.path.join(out, 'results.json')))


def eval_cli(out, demo_data):
    """eval.py's command line (in this process) on a run's predictions."""
    ev.main(['--predictions', os.path.join(out, 'predictions'), '--labels', os.path.join(demo_data, 'labels'),
             '--out', os.path.join(out, 'scores.json'), '--demo'])
    return json.load(open(os.path.join(out, 'scores.json')))


@pytest.mark.parametrize('task,method,epochs,chance', [
    ('xnli', 'zeroshot', 4, 100 / 3), ('panx', 'zeroshot', 2, 0.0), ('xquad', 'zeroshot', 6, 0.0)])
@pytest.mark.slow
def test_demo_learns_and_eval_agrees(tmp_path, demo_data, task, method, epochs, chance):
    results = run(tmp_path, demo_data, '--task', task, '--method', method, '--epochs', str(epochs))
    assert results['dev']['en'] > chance + 15  # clearly learnt
    scores = eval_cli(tmp_path, demo_data)[task]
    metric = {'xnli': 'accuracy', 'panx': 'f1'}.get(task)
    for lang in data.DEMO_LANGS:
        official = (scores['exact_match'][lang] + scores['f1'][lang]) / 2 if metric is None else scores[metric][lang]
        assert results['test'][lang] == pytest.approx(official, abs=1e-9)
    for name in ('config.json', 'log.jsonl', 'trained.json', 'best.pt', 'results.txt'):
        assert os.path.exists(tmp_path / name)
    assert not os.path.exists(tmp_path / 'last.pt')  # the finished training's resume point is gone


@pytest.mark.slow
def test_retrieval_evaluates_a_trained_encoder(tmp_path, demo_data):
    run(tmp_path / 'tagger', demo_data, '--task', 'panx', '--epochs', '1')
    for task in ('bucc2018', 'tatoeba'):
        results = run(tmp_path / task, demo_data, '--task', task, '--init', str(tmp_path / 'tagger' / 'best.pt'))
        scores = eval_cli(tmp_path / task, demo_data)[task]
        metric = 'f1' if task == 'bucc2018' else 'accuracy'
        assert results['test'] == pytest.approx({**scores[metric], 'avg': scores[f'avg_{metric}']}, abs=1e-9)


def final_weights(out):
    return torch.load(os.path.join(out, 'best.pt'), weights_only=True)['method']


PLANT = """import os, sys
sys.path.insert(0, {root!r})
import data, train
if os.environ['RANK'] == '1' and {where!r} == 'data':  # a file only this process cannot read
    data.training_set = lambda *args, **kwargs: (_ for _ in ()).throw(data.DataError('planted: unreadable here'))
if os.environ['RANK'] == '1' and {where!r} == 'folder':  # a disk of its own: --out (relative) is another folder
    os.chdir({other!r})
if {where!r} == 'no locks':  # Lustre without flock: process 0 tokenizes, process 1 waits and reads
    import errno, fcntl
    fcntl.flock = lambda *args: (_ for _ in ()).throw(OSError(errno.ENOSYS, 'Function not implemented'))
    if os.environ['RANK'] == '1':
        data.write_items = lambda *args: (_ for _ in ()).throw(data.DataError('process 1 tokenized'))
train.main(sys.argv[1:])
"""


def test_ddp_bf16_grads_leave_each_gradient_rounded_to_bf16_in_the_buckets(tmp_path):
    """--ddp_bf16_grads: DDP with its hook (train.bf16_gradients) on a gloo group of one process, two steps: every
    gradient is the plain one rounded to bf16 (the mean over one process is itself), some of them changed by it."""
    torch.distributed.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': 60, 'dropout': 0.0, 'attn_dropout': 0.0})
        method = xlt.Baseline(layers.Encoder(cfg), 'pawsx')
        plain = xlt.Baseline(layers.Encoder(cfg), 'pawsx')
        plain.load_state_dict(method.state_dict())
        model = train.wrapped(method, torch.device('cpu'), bf16=True)
        for step in range(2):
            ids = torch.randint(4, 60, (3, 9), generator=torch.Generator().manual_seed(step))
            batch = data.Batch(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([0, 1, 1]))
            model(batch)[0].backward()
            plain(batch)[0].backward()
            pairs = [(p.grad, q.grad) for p, q in zip(method.parameters(), plain.parameters())]
            assert all(torch.equal(g, h.bfloat16().float()) for g, h in pairs)
            assert sum(not torch.equal(g, h) for g, h in pairs) > len(pairs) // 2
            method.zero_grad(set_to_none=False)  # as the loop does under DDP
            plain.zero_grad(set_to_none=True)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_on_two_processes_equals_one_process(tmp_path, small_demo):
    """Same global batch (16) and seed: 2 processes x 1 micro-batch against 1 process x 2 micro-batches."""
    common = ['--task', 'pawsx', '--epochs', '1', '--batch_size', '16', '--eval_batch_size', '128', '--group_by_length']
    shutil.copytree(small_demo, tmp_path / 'ddp' / 'demo-data', ignore=shutil.ignore_patterns('.cache'))  # built anew
    script = tmp_path / 'plant.py'  # a filesystem without file locks, too: process 0 tokenizes, process 1 waits
    script.write_text(PLANT.format(root=ROOT, where='no locks', other=''))
    ddp = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                          str(script), '--demo', '--out', str(tmp_path / 'ddp'), *common], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert 'without file locks: nothing keeps two runs' in ddp.stdout
    one = run(tmp_path / 'one', small_demo, *common, '--grad_accum', '2')
    a, b = final_weights(tmp_path / 'ddp'), final_weights(tmp_path / 'one')
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert json.load(open(tmp_path / 'ddp' / 'results.json'))['test'] == pytest.approx(one['test'], abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize('where', ['data', 'folder'])
def test_one_process_failing_says_so_and_every_process_must_see_the_folder(tmp_path, where):
    """Under torchrun, an error of process 1 alone is its one line, naming it; a process that does not see the folder
    process 0 holds stops the run in one line, before anything is trained (nothing left behind)."""
    script, other = tmp_path / 'plant.py', tmp_path / 'elsewhere'
    script.write_text(PLANT.format(root=ROOT, where=where, other=str(other)))
    os.makedirs(other / 'run')
    argv = ['--demo', '--task', 'pawsx', '--epochs', '1', '--out', 'run']
    res = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                          str(script), *argv], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    lines = [line for line in res.stderr.splitlines() if line.startswith('error')]
    assert res.returncode != 0
    if where == 'data':
        assert lines == ['error (process 1 of 2): planted: unreadable here'], res.stderr
    else:
        assert lines == [f'error: --out {tmp_path / "run"} is not the folder process 0 holds, as '
                         f'{socket.gethostname()} see it (a disk of its own?): give --out on a filesystem every node '
                         'mounts'], res.stderr
        assert not os.path.exists(tmp_path / 'run')


@pytest.mark.slow
def test_killed_run_resumes_exactly(tmp_path, demo_data):
    """Killed at step 43 (resume points by time, at every log line: step 42), then stopped by a real SIGTERM at step
    50 (saved and stopped at the next log line, 51): each --resume goes on to the numbers of the run never stopped."""
    common = ['--task', 'udpos', '--epochs', '2', '--save_minutes', '0', '--log_every', '3', '--group_by_length',  # grouped: the real runs' batches
              '--eval_steps', '10']  # and the dev set scored within the epochs too
    whole = run(tmp_path / 'whole', demo_data, *common)
    os.makedirs(tmp_path / 'cut')
    os.symlink(demo_data, tmp_path / 'cut' / 'demo-data')
    killed = subprocess.run([sys.executable, 'train.py', '--demo', '--out', str(tmp_path / 'cut'), *common,
                             '--halt_after', '43'], cwd=ROOT, capture_output=True)
    last_step = lambda: torch.load(tmp_path / 'cut' / 'last.pt', weights_only=True)['state']['step']
    assert killed.returncode == 3 and last_step() == 42
    stopped = subprocess.run([sys.executable, 'train.py', '--demo', '--out', str(tmp_path / 'cut'), *common, '--resume',
                              '--term_after', '50'], cwd=ROOT, capture_output=True, text=True)
    assert stopped.returncode == 128 + signal.SIGTERM and last_step() == 51, stopped.stderr
    assert f'stopped by SIGTERM at step 51: {tmp_path / "cut" / "last.pt"} holds it' in stopped.stdout
    # --term_grace 0: no time for a new last.pt, the run stops at its last resume point (51, none since), named
    stopped = subprocess.run([sys.executable, 'train.py', '--demo', '--out', str(tmp_path / 'cut'), *common, '--resume',
                              '--term_after', '55', '--term_grace', '0', '--save_minutes', '30'], cwd=ROOT,
                             capture_output=True, text=True)
    assert stopped.returncode == 128 + signal.SIGTERM and last_step() == 51, stopped.stderr
    assert ('stopped by SIGTERM at step 57: a new last.pt would outlast --term_grace, so the run stops at its last '
            f'resume point, step 51 in {tmp_path / "cut" / "last.pt"}') in stopped.stdout
    resumed = run(tmp_path / 'cut', demo_data, *common, '--resume')
    a, b = final_weights(tmp_path / 'whole'), final_weights(tmp_path / 'cut')
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert resumed['test'] == pytest.approx(whole['test'], abs=1e-6)
    # the log reads as one run: the lines after the checkpoint (step 42) were dropped and written again once
    steps = lambda out: [(r['step'], 'dev' in r) for r in map(json.loads, open(out / 'log.jsonl'))]
    assert steps(tmp_path / 'cut') == steps(tmp_path / 'whole')
    logged = [json.loads(line) for line in open(tmp_path / 'whole' / 'log.jsonl')]
    per_epoch = logged[-1]['step'] // 2
    assert [r['step'] for r in logged if 'loss' in r] == sorted(set(range(3, 2 * per_epoch + 1, 3)) | {per_epoch, 2 * per_epoch})
    assert all(0 <= r['pad_share'] < 0.1 for r in logged if 'dev' in r)  # grouped: little padding
    dev = [r for r in logged if 'dev' in r]  # every 10 steps and at each epoch's end; the kept model is the best of them
    assert [r['step'] for r in dev] == sorted({s for s in range(10, 2 * per_epoch, 10) if s % per_epoch} | {per_epoch, 2 * per_epoch})
    assert whole['dev']['en'] == pytest.approx(max(r['dev_avg'] for r in dev)) and len(set(r['dev_avg'] for r in dev)) > 1


def test_a_run_counted_in_steps_reads_pass_after_pass_and_ends_at_its_step(tmp_path, small_demo):
    """--steps N: N optimiser steps over passes of the data, the dev set scored at each pass's end and at step N, the
    learning rate's linear decay reaching 0 at step N (the demo has no warm-up)."""
    run(tmp_path / 'pass', small_demo, '--task', 'pawsx', '--epochs', '1')
    per_pass = json.loads(open(tmp_path / 'pass' / 'log.jsonl').readlines()[-1])['step']
    steps = per_pass + 3
    run(tmp_path / 'steps', small_demo, '--task', 'pawsx', '--steps', str(steps), '--log_every', '1')
    logged = [json.loads(line) for line in open(tmp_path / 'steps' / 'log.jsonl')]
    trained = [r for r in logged if 'loss' in r]
    assert [r['step'] for r in trained] == list(range(1, steps + 1))
    assert [r['step'] for r in logged if 'dev' in r] == [per_pass, steps]
    assert [r['lr'] for r in trained] == pytest.approx([1e-3 * (steps - k) / (steps - 1) for k in range(1, steps + 1)])
    xla = lambda *more: train.parse_args(['--method', 'xla', '--task', 'panx', '--train_lang', 'de', *more])
    assert (xla().steps, xla().epochs, xla().batch_size) == (3000, None, 20)  # Table 8's warm-up: 3,000 steps of 20
    assert (xla('--epochs', '3').steps, xla('--epochs', '3').epochs) == (None, 3)  # counted in passes, as asked
    with pytest.raises(SystemExit, match='--steps counts the training in optimiser steps, --epochs in passes'):
        train.parse_args(['--task', 'xnli', '--steps', '10', '--epochs', '2'])
    with pytest.raises(SystemExit, match='--eval_every counts the steps between evaluations of a run counted in'):
        train.parse_args(['--task', 'xnli', '--eval_every', '10'])


@pytest.mark.slow
def test_seeds_run_as_the_separate_runs_and_report_their_mean_and_std(tmp_path, small_demo, capsys):
    """--seeds 1,2 gives each seed's run exactly as --seed s does alone, and seeds.json their mean and np.std (of two
    numbers: half their distance), written out here by hand; run again, it reuses both."""
    common = ['--task', 'udpos', '--epochs', '2']
    for seed in (1, 2):
        for folder in (tmp_path / 'seeds' / f'seed{seed}', tmp_path / 'alone' / f'seed{seed}'):
            os.makedirs(folder)
            os.symlink(small_demo, folder / 'demo-data')
        run(tmp_path / 'alone' / f'seed{seed}', small_demo, *common, '--seed', str(seed))
    train.main(['--demo', '--out', str(tmp_path / 'seeds'), *common, '--seeds', '1,2'])
    results = lambda folder: json.load(open(folder / 'results.json'))
    for seed in (1, 2):
        together, alone = results(tmp_path / 'seeds' / f'seed{seed}'), results(tmp_path / 'alone' / f'seed{seed}')
        assert (together['dev'], together['test']) == (alone['dev'], alone['test'])
        assert (tmp_path / 'seeds' / f'seed{seed}' / 'predictions' / 'udpos' / 'test-de.tsv').read_bytes() == (
            tmp_path / 'alone' / f'seed{seed}' / 'predictions' / 'udpos' / 'test-de.tsv').read_bytes()
    a, b = (results(tmp_path / 'alone' / f'seed{seed}') for seed in (1, 2))
    summary = json.load(open(tmp_path / 'seeds' / 'seeds.json'))
    assert a['test']['de'] != b['test']['de'] and summary['seeds'] == [1, 2]
    for split in ('dev', 'test'):
        for lang in a[split]:
            assert summary['mean'][split][lang] == pytest.approx((a[split][lang] + b[split][lang]) / 2, abs=1e-9)
            assert summary['std'][split][lang] == pytest.approx(abs(a[split][lang] - b[split][lang]) / 2, abs=1e-9)
    capsys.readouterr()
    train.main(['--demo', '--out', str(tmp_path / 'seeds'), *common, '--seeds', '1,2'])
    said = capsys.readouterr().out
    assert said.count(': reused, the finished run in') == 2 and 'epoch 1/2' not in said
    train.main(['--demo', '--out', str(tmp_path / 'seeds'), *common, '--seeds', '1,2', '--dry_run'])
    said = capsys.readouterr().out  # finished or not, the first seed's run is planned
    assert 'dry run, nothing is trained or written' in said and '--seeds: the same run for seed 2 too' in said
    with pytest.raises(SystemExit, match='--seeds 1,2,1 repeats a seed: give each once'):
        train.main(['--demo', '--out', str(tmp_path / 'seeds'), *common, '--seeds', '1,2,1'])


@pytest.mark.slow
def test_train_langs_run_each_language_as_its_own_run_and_gather_each_one_s_own_score(tmp_path, small_demo, capsys):
    """--train_langs de,zh: translate-train once a language in --out/<lang>, each exactly the run of --train_lang alone;
    langs.json and langs.txt: each language's score from its own run and their average, by hand; --commands lists
    the two runs; --train_lang with it, or a method without --train_lang, is refused in one line."""
    common = ['--method', 'translate-train', '--task', 'pawsx', '--epochs', '2']
    for folder in (tmp_path / 'sweep' / 'de', tmp_path / 'sweep' / 'zh'):
        os.makedirs(folder)
        os.symlink(small_demo, folder / 'demo-data')
    train.main(['--demo', '--out', str(tmp_path / 'sweep'), *common, '--train_langs', 'de,zh'])
    alone = run(tmp_path / 'alone', small_demo, *common, '--train_lang', 'zh')
    a, b = final_weights(tmp_path / 'sweep' / 'zh'), final_weights(tmp_path / 'alone')
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0
    own = {lang: json.load(open(tmp_path / 'sweep' / lang / 'results.json')) for lang in ('de', 'zh')}
    assert own['zh']['test'] == alone['test']
    c = final_weights(tmp_path / 'sweep' / 'de')  # trained on another translation
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-3
    gathered = json.load(open(tmp_path / 'sweep' / 'langs.json'))
    for split in ('dev', 'test'):
        expected = {'de': own['de'][split]['de'], 'zh': own['zh'][split]['zh']}
        assert gathered[split] == pytest.approx({**expected, 'avg': (expected['de'] + expected['zh']) / 2})
    assert "test (each language's own run)" in (tmp_path / 'sweep' / 'langs.txt').read_text()
    capsys.readouterr()
    train.main(['--demo', '--out', str(tmp_path / 'listed'), *common, '--train_langs', 'de,zh', '--commands'])
    assert [line.split()[-4:] for line in capsys.readouterr().out.splitlines()] == [
        ['--train_lang', lang, '--out', str(tmp_path / 'listed' / lang)] for lang in ('de', 'zh')]
    for folder, resumed in (('sweep', True), ('listed', False)):  # --resume only for runs that began
        train.main(['--demo', '--out', str(tmp_path / folder), *common, '--train_langs', 'de,zh', '--commands',
                    '--resume'])
        assert ['--resume' in line for line in capsys.readouterr().out.splitlines()] == [resumed, resumed]
    for more in (['--train_lang', 'de'], ['--method', 'zeroshot']):
        with pytest.raises(SystemExit, match='--train_langs runs .* once a language: drop --train_lang and --seeds'):
            train.parse_args(['--task', 'pawsx', *common[:2], '--train_langs', 'de,zh', *more])
    with pytest.raises(SystemExit, match=r'translate-train needs --train_lang, one of de, zh \(not fr\)'):
        train.main(['--demo', '--out', str(tmp_path / 'fr'), *common, '--train_langs', 'de,fr'])


def test_the_stages_two_runs_of_a_sweep_share_fan_out_before_the_runs(tmp_path, monkeypatch):
    """XLA's warm-ups kept in --warmup_dir serve each language of --train_langs: shared_stages finds the three, and
    with --gpus 2 the sweep fans them out first (a train.py process of one stage each), then the runs; in each run's
    own folder they are not shared."""
    def runs(*more):
        args = train.parse_args(['--method', 'xla', '--task', 'panx', '--train_langs', 'de,zh', '--out',
                                 str(tmp_path / 'xla'), *more])
        return {lang: argparse.Namespace(**{**vars(args), 'train_lang': lang, 'out': str(tmp_path / 'xla' / lang)})
                for lang in args.train_langs}
    warm = [str(tmp_path / 'warm' / f'warmup-{m}') for m in (1, 2, 3)]
    shared = train.shared_stages(runs('--warmup_dir', str(tmp_path / 'warm')))
    assert shared == {out: ('de', f'warmup-{m}') for m, out in zip((1, 2, 3), warm)}
    assert train.shared_stages(runs()) == {}
    fanned = []
    monkeypatch.setattr(train, 'fan_out', lambda todo, gpus: fanned.append([(out, line) for _, out, line in todo]))
    monkeypatch.setattr(train, 'langs_table', lambda *table: None)
    train.main(['--method', 'xla', '--task', 'panx', '--train_langs', 'de,zh', '--out', str(tmp_path / 'xla'),
                '--warmup_dir', str(tmp_path / 'warm'), '--gpus', '2', '--from_scratch'])
    stages, languages = fanned
    assert [out for out, _ in stages] == warm and [out for out, _ in languages] == [str(tmp_path / 'xla' / lang)
                                                                                  for lang in ('de', 'zh')]
    for m, (_, line) in enumerate(stages, 1):
        assert line[-6:] == ['--train_lang', 'de', '--out', str(tmp_path / 'xla' / 'de'), '--only_stage', f'warmup-{m}']


def test_a_sweep_s_processes_get_the_gpus_and_cores_this_process_may_use(tmp_path, monkeypatch):
    """On GPUs (CUDA_VISIBLE_DEVICES 5,7; six cores in this process's cpuset, as Slurm gives): each child gets a GPU of
    those and three threads, read in each child's own environment; the blocks this process cached go back to the GPUs
    before the first child starts. --gpus above the visible GPUs is refused in one line naming both counts."""
    events, popen = [], subprocess.Popen
    monkeypatch.setattr(torch.cuda, 'empty_cache', lambda: events.append('emptied'))
    monkeypatch.setattr(subprocess, 'Popen', lambda *a, **k: events.append('started') or popen(*a, **k))
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(6)), raising=False)
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '5,7')
    show = [sys.executable, '-c', 'import os; print(os.environ["OMP_NUM_THREADS"], os.environ["CUDA_VISIBLE_DEVICES"])']
    train.fan_out([(name, str(tmp_path / name), show) for name in ('a', 'b')], 2)
    assert [(tmp_path / name / 'sweep.log').read_text() for name in ('a', 'b')] == ['3 5\n', '3 7\n']
    assert events == ['emptied', 'started', 'started']
    with pytest.raises(SystemExit, match=r'--gpus 3 asks for more GPUs than the 2 this process sees'):
        train.parse_args(['--task', 'udpos', '--seeds', '1,2,3', '--gpus', '3'])


@pytest.mark.slow
def test_seeds_fan_out_over_processes_and_make_the_table_of_the_runs_one_after_another(tmp_path, small_demo, capsys):
    """--seeds 1,2,3 --gpus 2 on a CPU: three train.py processes, two at a time, each with one thread; the table,
    each seed's results and predictions equal the same runs one after another in this process (one thread too).
    --commands prints the three command lines and runs none."""
    common = ['--task', 'udpos', '--epochs', '2', '--seeds', '1,2,3']
    for sweep in ('apart', 'together'):
        for seed in (1, 2, 3):
            os.makedirs(tmp_path / sweep / f'seed{seed}')
            os.symlink(small_demo, tmp_path / sweep / f'seed{seed}' / 'demo-data')
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main(['--demo', '--out', str(tmp_path / 'together'), *common])
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    train.main(['--demo', '--out', str(tmp_path / 'apart'), *common, '--gpus', '2'])
    said = capsys.readouterr().out
    assert said.count(': running in') == 3 and said.count(': finished in') == 3 and '1 CPU threads' in said
    summary = lambda sweep: json.load(open(tmp_path / sweep / 'seeds.json'))
    for stat in ('mean', 'std'):
        for split in ('dev', 'test'):
            assert summary('apart')[stat][split] == pytest.approx(summary('together')[stat][split], abs=1e-6)
    for seed in (1, 2, 3):
        files = lambda sweep: (tmp_path / sweep / f'seed{seed}' / 'predictions' / 'udpos' / 'test-de.tsv').read_bytes()
        assert files('apart') == files('together')
    train.main(['--demo', '--out', str(tmp_path / 'listed'), *common, '--commands'])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-4:] for line in lines] == [['--seed', str(s), '--out', str(tmp_path / 'listed' / f'seed{s}')]
                                                     for s in (1, 2, 3)]
    assert '--seeds' not in lines[0] and not os.path.exists(tmp_path / 'listed')
    with pytest.raises(SystemExit, match='--gpus and --commands spread the runs of a sweep: add --seeds'):
        train.parse_args(['--task', 'udpos', '--gpus', '2'])


def test_the_step_loop_does_not_wait_for_a_slow_writer(tmp_path, small_demo, monkeypatch):
    """best.pt goes through the training's writer thread: its write within an epoch (--eval_steps), made to wait until
    the loop has taken another step, completes; were the loop waiting for the write, that step would never come (the
    wait times out). One write is in flight at a time: the next checkpoint waits for it."""
    import threading
    writing, stepped, waited = threading.Event(), threading.Event(), []
    real_save, real_step = layers.save_checkpoint, train.train_step

    def step(t, batch, probe=False):
        out = real_step(t, batch, probe)
        if writing.is_set():  # a step taken while best.pt is being written
            stepped.set()
        return out

    def slow_save(path, meta, **parts):
        if os.path.basename(path) == 'best.pt' and not stepped.is_set():
            writing.set()
            waited.append(stepped.wait(timeout=20))
        real_save(path, meta, **parts)
    monkeypatch.setattr(train, 'train_step', step)
    monkeypatch.setattr(layers, 'save_checkpoint', slow_save)
    results = run(tmp_path, small_demo, '--task', 'pawsx', '--epochs', '1', '--eval_steps', '2', '--save_minutes', '1000')
    assert waited == [True] and (tmp_path / 'best.pt').exists() and results['test']


def test_a_write_in_flight_outlives_a_ctrl_c_that_stops_the_wait_for_it(tmp_path):
    """Ctrl-C lands while the training waits for the writer's checkpoint: the write still counts as running (the
    interpreter's exit waits for it), and the next wait returns once it is written. Python 3.11's Thread.join, stopped
    so, marked the thread as ended: the exit tore the write down mid-way (SIGABRT)."""
    waiting, go, written = threading.Event(), threading.Event(), []

    def after():  # in the writer's thread, once the checkpoint is written
        waiting.wait()
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the main thread waits for this write
        go.wait()
        written.append(True)

    def ctrl_c(number, frame):
        raise KeyboardInterrupt
    default, writer = signal.signal(signal.SIGINT, ctrl_c), layers.Writer()
    try:
        with pytest.raises(KeyboardInterrupt):
            writer.save(str(tmp_path / 'last.pt'), {'task': 'xnli'}, after, weights={'w': torch.ones(3)})
            waiting.set()
            writer.wait()
        assert [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    finally:
        signal.signal(signal.SIGINT, default)
        go.set()
    writer.wait()
    assert written == [True] and layers.load_checkpoint(str(tmp_path / 'last.pt'))['weights']['w'].tolist() == [1] * 3


def test_a_failed_write_stops_the_run_and_resume_finishes_it_as_never_failed(tmp_path, small_demo, monkeypatch):
    """best.pt's write fails in the writer's thread (a full disk): the run stops at the next wait in one line naming
    the file and the error, keeps the last resume point and writes no trained.json; once the disk has room, --resume
    finishes with the numbers of the run whose write never failed."""
    common = ['--task', 'pawsx', '--epochs', '2', '--save_minutes', '0', '--log_every', '2']
    whole = run(tmp_path / 'whole', small_demo, *common)
    write, failures = layers.save_checkpoint, []

    def full_disk(path, meta, **parts):
        if os.path.basename(path) == 'best.pt' and not failures:
            failures.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, meta, **parts)
    monkeypatch.setattr(layers, 'save_checkpoint', full_disk)
    with pytest.raises(SystemExit) as stop:
        run(tmp_path / 'cut', small_demo, *common)
    line = str(stop.value)
    assert line.startswith(f'error: {tmp_path / "cut" / "best.pt"} could not be written (No space left on device)')
    assert '\n' not in line and '--resume' in line and len(failures) == 1
    assert (tmp_path / 'cut' / 'last.pt').exists() and not (tmp_path / 'cut' / 'trained.json').exists()
    resumed = run(tmp_path / 'cut', small_demo, *common, '--resume')
    assert resumed['dev'] == whole['dev'] and resumed['test'] == whole['test']
    a, b = final_weights(tmp_path / 'whole'), final_weights(tmp_path / 'cut')
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def one_line_failure(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        train.main(argv)
    assert str(err.value).startswith('error: ') and '\n' not in str(err.value)
    assert message in str(err.value)


def test_bad_set_ups_stop_with_one_line(tmp_path, small_demo, capsys):
    one_line_failure(capsys, ['--task', 'xnlii'], "unknown task 'xnlii': choose one of pawsx, xnli")
    one_line_failure(capsys, ['--method', 'magic'], "unknown method 'magic': choose one of zeroshot")
    one_line_failure(capsys, ['--task', 'panx', '--translate_test'], 'tags would need a word alignment): drop --translate_test')
    one_line_failure(capsys, ['--data_dir', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'o')],
                     'nowhere holds no xnli data')
    broken = tmp_path / 'broken'
    shutil.copytree(small_demo, broken)
    os.remove(broken / 'xnli' / 'translate-train' / 'en-zh-translated.tsv')
    one_line_failure(capsys, ['--task', 'xnli', '--method', 'translate-train-all', '--model', 'tiny', '--from_scratch',
                              '--data_dir', str(broken), '--out', str(tmp_path / 'o')],
                     'en-zh-translated.tsv not found: xnli needs translate-train files for zh')
    run(tmp_path / 'tiny', small_demo, '--task', 'pawsx', '--epochs', '1')
    one_line_failure(capsys, ['--task', 'pawsx', '--model', 'small', '--data_dir', small_demo, '--out', str(tmp_path / 'o'),
                              '--init', str(tmp_path / 'tiny' / 'best.pt')], 'not the small preset')


@pytest.mark.slow
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


def test_set_up_errors_before_training(tmp_path, small_demo, capsys):
    one_line_failure(capsys, ['--demo', '--batch_size', '1', '--grad_accum', '2', '--out', str(tmp_path / 'b')],
                     'cannot be cut into 1 processes x --grad_accum 2')
    one_line_failure(capsys, ['--demo', '--max_len', '1024', '--out', str(tmp_path / 'm')], '--max_len 1024 is out of range: give 8 to 512')
    broken = tmp_path / 'broken'
    shutil.copytree(small_demo, broken)
    os.remove(broken / 'xnli' / 'translate-dev' / 'dev-zh-en-translated.tsv')
    one_line_failure(capsys, ['--task', 'xnli', '--method', 'filter', '--model', 'tiny', '--from_scratch', '--data_dir', str(broken),
                              '--translations', 'xtreme', '--out', str(tmp_path / 'f')],
                     'dev-zh-en-translated.tsv not found: filter needs translate-dev')
    assert not os.path.exists(tmp_path / 'f' / 'log.jsonl')  # stopped before any training
    run(tmp_path / 'zs', small_demo, '--task', 'xnli', '--epochs', '1')
    with pytest.raises(SystemExit, match='zs holds a finished run with --method zeroshot .this run: filter'):
        run(tmp_path / 'zs', small_demo, '--task', 'xnli', '--method', 'filter', '--eval_only')
    with pytest.raises(SystemExit, match='holds zeroshot on xnli with the tiny preset, not filter on xnli'):
        run(tmp_path / 'zs', small_demo, '--task', 'xnli', '--method', 'filter', '--eval_only', '--overwrite')


@pytest.mark.slow
def test_translate_test_qa_is_scored_on_the_translations(tmp_path, demo_data):
    results = run(tmp_path / 'qa', demo_data, '--task', 'tydiqa', '--translate_test', '--epochs', '3')
    # the demo's translations are exact: every language scores as English does
    assert results['test']['de'] == results['test']['zh'] == results['test']['en']


@pytest.mark.slow
def test_ddp_with_every_parameter_unused_sometimes(tmp_path, small_demo):
    """X-Mixup's --fixed_lambda leaves no parameter without a gradient under DDP."""
    init = quick_pretrained(small_demo, tmp_path / 'pretrained', steps=10)
    os.makedirs(tmp_path / 'x')
    os.symlink(small_demo, tmp_path / 'x' / 'demo-data')
    res = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                          'train.py', '--demo', '--out', str(tmp_path / 'x'), '--task', 'pawsx', '--method', 'xmixup',
                          '--fixed_lambda', '--epochs', '1', '--batch_size', '64', '--init', init], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize('method,task,model,lr', [
    ('zeroshot', 'xnli', 'base', 2e-5), ('zeroshot', 'xnli', 'large', 2e-5), ('translate-train-all', 'pawsx', 'large', 2e-5),
    ('zeroshot', 'panx', 'base', 2e-5), ('zeroshot', 'mlqa', 'large', 3e-5), ('translate-train', 'tydiqa', 'base', 3e-5),
    ('filter', 'xnli', 'large', 3e-6), ('filter', 'pawsx', 'base', 1e-5), ('filter', 'udpos', 'base', 5e-6),
    ('filter', 'xquad', 'base', 5e-6), ('filter', 'tydiqa', 'large', 1e-5),
    ('xmixup', 'xnli', 'large', 5e-6), ('xmixup', 'pawsx', 'base', 5e-6), ('xmixup', 'panx', 'base', 5e-6),
    ('xmixup', 'mlqa', 'base', 5e-6), ('xmixup', 'tydiqa', 'large', 3e-5)])
def test_learning_rate_per_method(method, task, model, lr):
    """The released scripts' rates: XTREME's for the baselines, FILTER's train.sh, X-Mixup's scripts."""
    taught = ['--self_teach'] * (method == 'xmixup' and task == 'panx')  # X-Mixup on tagging learns from a teacher
    assert train.parse_args(['--method', method, '--task', task, '--model', model, *taught]).lr == lr
    assert train.parse_args(['--method', method, '--task', task, '--model', model, '--lr', '7e-6', *taught]).lr == 7e-6


@pytest.mark.parametrize('method,task,expected', [
    ('zeroshot', 'mlqa', {'warmup_steps': 500, 'weight_decay': 1e-4, 'max_len': 384}),  # XTREME's train_qa.sh
    ('translate-train-all', 'tydiqa', {'warmup_steps': 500, 'weight_decay': 1e-4}),
    ('zeroshot', 'xnli', {'warmup_steps': None, 'warmup': 0.0, 'weight_decay': 0.0, 'max_len': 128}),
    ('filter', 'xnli', {'max_len': 256, 'weight_decay': 0.0}), ('filter', 'pawsx', {'max_len': 256}),  # FILTER's train.sh
    ('filter', 'panx', {'max_len': 128}), ('xmixup', 'xnli', {'max_len': 128}), ('filter', 'mlqa', {'warmup_steps': None}),
    ('zeroshot', 'xquad', {'qa_case': 'lower'}), ('filter', 'tydiqa', {'qa_case': 'lower'}),  # --do_lower_case
    ('xmixup', 'mlqa', {'qa_case': 'cased'}), ('veco', 'xquad', {'qa_case': 'cased'}), ('zeroshot', 'xnli', {'qa_case': 'cased'})])
def test_released_settings_per_method(method, task, expected):
    """The released scripts' settings beside the learning rate; the demo keeps its own, an option overrides."""
    args = train.parse_args(['--method', method, '--task', task])
    assert {k: getattr(args, k) for k in expected} == expected
    assert train.parse_args(['--method', method, '--task', task, '--max_len', '64']).max_len == 64
    assert train.parse_args(['--method', method, '--task', task, '--demo']).warmup_steps is None
    assert train.parse_args(['--method', method, '--task', task, '--demo']).qa_case == 'cased'
    with pytest.raises(SystemExit, match='--qa_case lower lowercases the text of QA tasks, not of xnli: drop it'):
        train.parse_args(['--method', 'zeroshot', '--task', 'xnli', '--qa_case', 'lower'])


@pytest.mark.parametrize('option,value', [
    ('batch_size', '0'), ('batch_size', '-4'), ('lr', '-1'), ('lr', '0'), ('lr', 'nan'), ('lr', 'inf'), ('epochs', '0'),
    ('grad_accum', '0'), ('max_len', '0'), ('max_len', '1024'), ('warmup', '1.5'), ('warmup', '-0.1'),
    ('weight_decay', '-0.01'), ('clip', '0'), ('dropout', '1'), ('seed', '-1'), ('m', '-1'), ('k', '-2'),
    ('kl_weight', '1.5'), ('temperature', '0'), ('mixup_layer', '0'), ('p_k', '-5'), ('layer', '0'),
    ('eval_batch_size', '0'), ('save_minutes', '-1')])
def test_numeric_options_out_of_range_stop_with_one_line(option, value):
    with pytest.raises(SystemExit) as err:
        train.main(['--demo', f'--{option}', value])
    message = str(err.value)
    assert message.startswith(f'error: --{option} ') and 'is out of range: give ' in message and '\n' not in message


def test_selection_rule(tmp_path, small_demo):
    """Baselines keep the checkpoint with the best English dev score, X-Mixup the best average over the dev
    languages, FILTER its last epoch (as their releases); results.json says which."""
    import argparse
    import layers
    import xlt
    enc = layers.Encoder(layers.CONFIGS['tiny'])
    dev = {'en': {'score': 50.0}, 'de': {'score': 90.0}, 'zh': {'score': 70.0}}
    assert xlt.selection(xlt.Baseline(enc, 'xnli').select, dev) == (50.0, 'best English dev score')
    assert xlt.selection(xlt.XMixup(enc, 'xnli', argparse.Namespace()).select, dev) == (
        70.0, 'best average dev score over languages')
    assert xlt.selection(xlt.Filter(enc, 'xnli', argparse.Namespace()).select, dev) == (None, 'last epoch')
    assert xlt.selection(xlt.Baseline(enc, 'tydiqa').select, {})[1] == 'last epoch (no dev set)'
    results = run(tmp_path, small_demo, '--task', 'pawsx', '--epochs', '1')
    assert results['selected_by'] == 'best English dev score'


def test_qa_head_has_no_dropout_and_tagging_head_has():
    import xlt
    enc = layers.Encoder(layers.Config(vocab_size=10, n_layer=1, n_head=2, dim=16, ffn_dim=32, dropout=0.5))
    h, mask = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.bool)
    qa, tag = xlt.Head('qa', enc, ()).train(), xlt.Head('tagging', enc, 'abcde').train()
    assert torch.equal(qa(h, mask), qa.out(h))  # training mode: still no dropout before the span layer
    assert not torch.equal(tag(h, mask), tag.out(h))


@pytest.mark.slow
@pytest.mark.parametrize('method', ['filter', 'xmixup'])
def test_paired_methods_train_on_english_english_pairs_too(demo_data, method):
    args = train.parse_args(['--demo', '--method', method, '--task', 'mlqa', '--data_dir', demo_data])
    args.data_dir = demo_data
    tok = data.Tokenizer(os.path.join(demo_data, 'sentencepiece.bpe.model'))
    items = train.Run(args, 0, 1, torch.device('cpu'), tok).items(xlt.method_class(args))  # what it trains on: class attributes
    english = data.read_split(demo_data, 'mlqa', 'train')
    same = [item for item in items if item[0].ids == item[1].ids]
    assert len(same) == len(data.make_features(tok, 'mlqa', english, args.max_len, train=True))  # English with itself
    assert method == 'filter' or all(item[2].ids == item[0].ids for item in same)  # its round trip is itself
    assert len(items) > len(same)  # and with its translations


def test_bad_evaluation_input_stops_before_anything_is_written(tmp_path, demo_data, capsys):
    """Every evaluation file is read before training: a bad label in one dev file stops the run with
    one line, and --out holds nothing that looks like a run (no config, log, checkpoint, results)."""
    broken = tmp_path / 'broken'
    shutil.copytree(demo_data, broken)
    path = broken / 'xnli' / 'dev-zh.tsv'
    lines = path.read_text(encoding='utf-8').splitlines()
    lines[7] = lines[7].rsplit('\t', 1)[0] + '\tmaybe'
    path.write_text('\n'.join(lines) + '\n', encoding='utf-8')
    out = tmp_path / 'run'
    one_line_failure(capsys, ['--task', 'xnli', '--model', 'tiny', '--from_scratch', '--data_dir', str(broken),
                              '--out', str(out)], "dev-zh.tsv, line 8: label 'maybe' is not one of")
    labels = broken / 'labels' / 'xnli' / 'test-de.tsv'
    shutil.copy(os.path.join(demo_data, 'xnli', 'dev-zh.tsv'), path)
    labels.write_text('neutral\n' * 3, encoding='utf-8')
    one_line_failure(capsys, ['--task', 'xnli', '--model', 'tiny', '--from_scratch', '--data_dir', str(broken),
                              '--out', str(out)], 'test-de.tsv has 3 labelled examples for 150 in the test set')
    assert not os.path.exists(out) or not os.listdir(out)


def test_real_data_without_init_needs_from_scratch(tmp_path, demo_data, capsys):
    one_line_failure(capsys, ['--task', 'xnli', '--model', 'tiny', '--data_dir', demo_data, '--out', str(tmp_path / 'o')],
                     'no --init: this would train tiny from random weights for hours. Pass its weights as --init '
                     '(docs/weights.md: XLM-R\'s from python layers.py convert, BERT\'s folder as it is), or --from_scratch')
    assert not os.path.exists(tmp_path / 'o' / 'config.json')


@pytest.mark.slow
def test_a_panx_archive_converts_and_trains_on_the_languages_chosen(tmp_path, small_demo, capsys):
    """PAN-X as AmazonPhotos.zip ships it, made from the demo's NER files, converts to the same sentences; with the
    other languages' files absent, a run of --langs de reads English's and German's, says so, and is no submission."""
    import tarfile
    import zipfile
    sentences = lambda lang, split, folder=small_demo: [dict(ex, tags=ex['tags'] or tags) for ex, tags in zip(
        data.read_split(folder, 'panx', split, lang),
        data.read_tag_file(os.path.join(folder, 'labels', 'panx', f'test-{lang}.tsv')) if split == 'test'
        else [None] * 10 ** 4)]
    with zipfile.ZipFile(tmp_path / 'AmazonPhotos.zip', 'w') as z:
        for lang in ('en', 'de'):
            with tarfile.open(tmp_path / f'{lang}.tar.gz', 'w:gz') as tar:
                for split in ('train', 'dev', 'test'):
                    raw = ''.join(''.join(f'{lang}:{w}\t{t}\n' for w, t in zip(ex['words'], ex['tags'])) + '\n'
                                  for ex in sentences(lang, split)).encode()
                    info = tarfile.TarInfo(split)
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
            z.write(tmp_path / f'{lang}.tar.gz', f'panx_dataset/{lang}.tar.gz')
    converted = str(tmp_path / 'data')
    data.main(['download', '--task', 'panx', '--from', str(tmp_path / 'AmazonPhotos.zip'), '--out', converted])
    for lang, split in ((lang, split) for lang in ('en', 'de') for split in ('train', 'dev', 'test')):
        assert sentences(lang, split, converted) == sentences(lang, split)
    shutil.copy(os.path.join(small_demo, 'sentencepiece.bpe.model'), converted)
    argv = ['--task', 'panx', '--data_dir', converted, '--model', 'tiny', '--from_scratch', '--epochs', '1',
            '--out', str(tmp_path / 'run')]
    one_line_failure(capsys, argv, 'panx/test-ar.tsv not found (and 37 more, listed above): python data.py download '
                     f'--task panx --from AmazonPhotos.zip --out {converted}, or run the languages there are (--langs)')
    train.main(argv + ['--langs', 'de'])
    results = json.load(open(tmp_path / 'run' / 'results.json'))
    assert results['langs'] == ['de'] and set(results['test_metrics']) == set(results['dev_metrics']) == {'en', 'de'}
    assert '--langs de: these and English alone' in open(tmp_path / 'run' / 'results.txt').read()
    with pytest.raises(SystemExit, match=r'error: .*/run ran panx in de alone \(--langs\), not in ar and 37 more:'):
        ev.main(['--collect', str(tmp_path / 'run'), '--out', str(tmp_path / 'submission')])
    assert not os.path.exists(tmp_path / 'submission')


def test_messages_say_where_translations_are(tmp_path, demo_data, capsys):
    one_line_failure(capsys, ['--method', 'filter', '--data_dir', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'o'),
                              '--translations', 'xtreme'],
                     'filter reads translations too: get XTREME\'s translations with python data.py download --task xnli --translations')
    one_line_failure(capsys, ['--method', 'filter', '--data_dir', str(tmp_path / 'nowhere'), '--out', str(tmp_path / 'o')],
                     f'{tmp_path / "nowhere" / "filter"} not found: filter reads its release\'s data there (python data.py '
                     f'download --task xnli --translations filter --out {tmp_path / "nowhere"}); --translations xtreme runs '
                     'it on XTREME\'s translations')
    held = tmp_path / 'held'  # a data folder with FILTER's data in filter/: --method filter reads it by default
    os.makedirs(held)
    for entry in os.listdir(demo_data):
        os.symlink(os.path.join(demo_data, entry), held / entry)
    os.symlink(demo_data, held / 'filter')
    train.main(['--method', 'filter', '--data_dir', str(held), '--model', 'tiny', '--from_scratch', '--dry_run',
                '--out', str(tmp_path / 'o')])
    assert f"data      {held / 'filter'}: 17 files found, 0 optional ones missing; filter's translations" in (
        capsys.readouterr().out)
    broken = tmp_path / 'broken'
    shutil.copytree(demo_data, broken)
    os.remove(broken / 'pawsx' / 'translate-train' / 'en-de-translated.tsv')
    with pytest.raises(data.DataError, match='pawsx needs translate-train files for de; get XTREME.s translations with python data.py download'):
        data.read_translations(str(broken), 'pawsx', 'train', 'de')


@pytest.mark.slow
@pytest.mark.parametrize('task', ['xnli', 'pawsx'])
def test_demo_classification_is_learnt_in_english_and_leaves_a_gap(tmp_path, demo_data, task):
    """The demo's zero-shot run learns English (>= 90% dev, every label predicted) and transfer
    still has a gap for the other methods to close."""
    results = run(tmp_path, demo_data, '--task', task)
    assert results['dev']['en'] >= 90 and results['test']['gap'] > 15
    predicted = open(tmp_path / 'predictions' / task / 'test-en.tsv').read().split()
    assert set(predicted) == set(data.TASKS[task].labels)


def test_a_score_within_an_epoch_is_kept_when_it_is_the_best(tmp_path):
    """--eval_steps: end_epoch's keep rule (strictly better) holds within an epoch as at its end."""
    args = train.parse_args(['--method', 'zeroshot', '--task', 'pawsx', '--demo', '--out', str(tmp_path)])
    run = train.Run(args, 0, 1, torch.device('cpu'), argparse.Namespace(files=[], lower=False, pad=1), sets={})  # a tokenizer's files
    method = run.build(encoder=layers.Encoder(layers.CONFIGS['tiny']))
    scores = iter([70.0, 60.0, 70.0])
    validate = lambda: {'en': {'score': next(scores)}, 'de': {'score': 50.0}}
    training = train.Training(run, method, [], validate, 20, args.epochs)
    state = training.state
    state['step'] = 5
    train.end_epoch(training, within=0.5)  # 70 at half an epoch: kept
    training.writer.wait()  # written by the training's writer thread
    kept = torch.load(tmp_path / 'best.pt', weights_only=True)['method']
    for score_step in (10, 15):  # the epoch's end (60) and later an equal 70: neither replaces it
        with torch.no_grad():
            next(method.parameters()).add_(1.0)
        state['step'] = score_step
        train.end_epoch(training)
    assert state['best'] == 70.0
    training.writer.wait()
    now = torch.load(tmp_path / 'best.pt', weights_only=True)['method']
    assert all(torch.equal(now[k], v) for k, v in kept.items())


def test_a_loss_that_is_not_finite_stops_the_run_in_one_line(tmp_path, demo_data):
    """The demo at --lr 1e4 with weight decay: the mean loss of the first log line is NaN; the run stops there in one
    line naming the steps and what to change, keeps no model and writes no results."""
    os.makedirs(tmp_path / 'nan')
    os.symlink(demo_data, tmp_path / 'nan' / 'demo-data')
    with pytest.raises(SystemExit) as err:
        train.main(['--demo', '--out', str(tmp_path / 'nan'), '--task', 'xnli', '--epochs', '2', '--lr', '1e4',
                    '--weight_decay', '0.01'])
    said = str(err.value)
    assert said.startswith('error: the training loss is nan in steps 1-10: no checkpoint was kept; start again with a '
                           'lower --lr (now 10000) or a lower --clip (now 1)') and '\n' not in said
    assert sorted(os.listdir(tmp_path / 'nan')) == ['.lock', 'config.json', 'demo-data', 'log.jsonl']
    assert open(tmp_path / 'nan' / 'log.jsonl').read() == ''  # the NaN line is not logged either


def test_a_resume_point_is_written_from_a_copy_while_the_training_goes_on(tmp_path, monkeypatch):
    """ResumePoints.save copies the state to host memory, then a thread writes it: the weights the next step changes
    right after the call are not the ones written (the writer held back until they changed)."""
    changed, write = threading.Event(), layers.save_checkpoint
    monkeypatch.setattr(layers, 'save_checkpoint', lambda *a, **k: (changed.wait(), write(*a, **k)))
    args = train.parse_args(['--demo', '--out', str(tmp_path)])
    run = train.Run(args, 0, 1, torch.device('cpu'), argparse.Namespace(files=[], lower=False, pad=1), sets={})
    method = run.build(encoder=layers.Encoder(layers.CONFIGS['tiny']))
    weight = method.state_dict()['encoder.tok.weight']
    before = weight.clone()
    t = train.Training(run, method, [], lambda: {}, 10, args.epochs)
    t.state['step'] = 7
    with train.ResumePoints(t) as points:
        points.save()
        with torch.no_grad():
            weight += 1  # the next step, while the thread writes
        changed.set()
    saved = torch.load(tmp_path / 'last.pt', weights_only=True)
    assert torch.equal(saved['method']['encoder.tok.weight'], before) and saved['state']['step'] == 7
    assert not torch.equal(weight, before)


def test_sigusr1_stops_as_sigterm_does_and_the_grace_fits_the_launcher(tmp_path, monkeypatch, capsys):
    """SIGUSR1 (Slurm's warning ahead of the time limit, --signal=USR1@180) is a stop asked as SIGTERM's: at the next
    log line the resume point is written and the run exits with the signal's status, naming it; the handlers are given
    back. --term_grace defaults to 20 s under torchrun or Slurm (their launchers kill 30 s after their SIGTERM)."""
    args = train.parse_args(['--demo', '--out', str(tmp_path)])
    run = train.Run(args, 0, 1, torch.device('cpu'), argparse.Namespace(files=[], lower=False, pad=1), sets={})
    t = train.Training(run, run.build(encoder=layers.Encoder(layers.CONFIGS['tiny'])), [], lambda: {}, 10, args.epochs)
    t.state['step'] = 7
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as stop, train.ResumePoints(t) as points:
        points.agree(1.0)
        assert points.agreed == (False, False)
        os.kill(os.getpid(), signal.SIGUSR1)
        points.agree(1.0)
        assert points.agreed == (False, True)
        points.after_step(epoch_end=False)
    assert stop.value.code == 128 + signal.SIGUSR1 and signal.getsignal(signal.SIGUSR1) is before
    assert torch.load(tmp_path / 'last.pt', weights_only=True)['state']['step'] == 7
    assert f'stopped by SIGUSR1 at step 7: {tmp_path / "last.pt"} holds it' in capsys.readouterr().out
    for variable in ('TORCHELASTIC_RUN_ID', 'SLURM_JOB_ID'):
        monkeypatch.delenv(variable, raising=False)
    assert train.term_grace(args) == 60
    for variable in ('TORCHELASTIC_RUN_ID', 'SLURM_JOB_ID'):
        with monkeypatch.context() as launched:
            launched.setenv(variable, '4')
            assert train.term_grace(args) == 20
            assert train.term_grace(train.parse_args(['--term_grace', '45'])) == 45


def test_the_largest_micro_batch_runs_first_and_out_of_memory_is_one_line(tmp_path, small_demo, monkeypatch):
    """Before step 1 the epoch's batch of the most tokens, padding included, runs forward and backward once beside as
    many bytes as AdamW's moments will take, and the results are those of a run without it; an out-of-memory error
    there ends the run in one line naming the step, the shape and the options (the CPU played as a GPU: on a CPU no
    batch is tried)."""
    monkeypatch.setattr(train, 'SCARCE', ('cpu',))
    argv, calls, step = ['--task', 'udpos', '--epochs', '1', '--batch_size', '8', '--group_by_length'], [], train.train_step
    def recorded(t, batch, *rest, **kwargs):
        calls.append((len(batch), int(data.item_lengths(t.items, batch).max())))
        return step(t, batch, *rest, **kwargs)
    monkeypatch.setattr(train, 'train_step', recorded)
    made, empty = [], torch.empty
    monkeypatch.setattr(torch, 'empty', lambda *size, **kwargs: (made.append(size), empty(*size, **kwargs))[1])
    run(tmp_path / 'probed', small_demo, *argv)
    monkeypatch.setattr(torch, 'empty', empty)
    tokens = [n * length for n, length in calls]
    assert tokens[0] == max(tokens) > min(tokens) and calls.count(calls[0]) >= 2  # tried first, then run in its place
    with monkeypatch.context() as m:
        m.setattr(train, 'probe', lambda *args: None)
        run(tmp_path / 'plain', small_demo, *argv)
    a, b = final_weights(tmp_path / 'probed'), final_weights(tmp_path / 'plain')
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert made.count((2 * sum(v.numel() for v in a.values()),)) == 1  # AdamW's two moments a parameter, held once
    forward = xlt.Method.forward
    def out_of_memory(method, batch):  # raised where the model runs the largest micro-batch, as CUDA raises it
        if int(batch.mask.sum(1).max()) == calls[0][1]:
            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')
        return forward(method, batch)
    monkeypatch.setattr(train, 'train_step', step)
    monkeypatch.setattr(xlt.Method, 'forward', out_of_memory)
    with pytest.raises(SystemExit) as failed:
        run(tmp_path / 'oom', small_demo, *argv)
    assert str(failed.value) == (f'error: out of memory in step 1, the epoch\'s largest micro-batch, tried before it: '
                                 f'8 x {calls[0][1]} tokens; try --grad_accum 2, --grad_checkpoint, --max_len 64, '
                                 '--precision bf16 or fp16')


def test_a_finished_training_frees_its_optimiser_at_once(tmp_path, small_demo, monkeypatch):
    """The loop's optimiser and schedule (and DDP's wrapper) hold reference cycles: on a GPU train() collects them as
    it ends, so a next stage does not share the device with them (here the CPU as a GPU; automatic collection off)."""
    import gc
    monkeypatch.setattr(train, 'SCARCE', ('cpu',))
    gc.collect()
    gc.disable()
    try:
        run(tmp_path / 'run', small_demo, '--task', 'pawsx', '--epochs', '1', '--batch_size', '32')
        kinds = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
        alive = [o for o in gc.get_objects() if issubclass(type(o), kinds)]
    finally:
        gc.enable()
    assert not alive


def test_a_batch_without_padding_attends_without_a_mask(monkeypatch):
    """collate marks a batch whose rows are all as long (known on the host, no sync): its attention takes no mask,
    so SDPA may pick its fastest kernel, and the outputs are those of the masked path."""
    feats = [data.Feature([0, 5, 6, 2]), data.Feature([0, 7, 8, 2])]
    full, ragged = data.collate(feats), data.collate(feats + [data.Feature([0, 9, 2])])
    assert (full.padded, full.keys, full.to('cpu').padded) == (False, None, False) and ragged.keys is ragged.mask
    torch.manual_seed(0)
    m = xlt.Baseline(layers.Encoder(layers.CONFIGS['tiny']), 'xnli', argparse.Namespace()).eval()
    masks, sdpa = [], layers.F.scaled_dot_product_attention
    monkeypatch.setattr(layers.F, 'scaled_dot_product_attention',
                        lambda *a, **k: (masks.append(k['attn_mask'] is None), sdpa(*a, **k))[1])
    fast = m.predict(full)
    assert masks == [True] * layers.CONFIGS['tiny'].n_layer
    assert torch.allclose(fast, m.head(m.encoder(full.ids, full.mask), full.mask), atol=1e-6)



def test_a_run_scores_xtremes_pseudo_test_sets_by_predicting_them(tmp_path, small_demo):
    """XTREME's Tables 7 and 8 score one model on the gold test sets and on the pseudo test sets (the English test set
    machine-translated, python data.py download --translations): --predict on a pseudo test file scores the finished
    run's model against that file's own labels."""
    run(tmp_path / 'run', small_demo, '--task', 'xnli', '--epochs', '1')
    rows = data.read_split(small_demo, 'xnli', 'test', 'de')
    labels = [('entailment', 'neutral', 'contradiction')[n % 3] for n in range(len(rows))]
    path = data.split_path(str(tmp_path / 'data'), 'xnli', 'pseudo-test', 'de')
    os.makedirs(os.path.dirname(path))
    open(path, 'w').write(''.join(f'{r["a"]}\t{r["b"]}\t{label}\n' for r, label in zip(rows, labels)))
    train.main(['--out', str(tmp_path / 'run'), '--predict', path])
    predicted = (tmp_path / 'run' / 'predicted' / 'pseudo-test-de.tsv').read_text().split()
    scores = json.load(open(tmp_path / 'run' / 'predicted' / 'pseudo-test-de.scores.json'))['scores']
    assert len(predicted) == len(rows) and predicted != labels
    assert scores['accuracy'] == pytest.approx(100 * sum(p == g for p, g in zip(predicted, labels)) / len(labels))


UNREACHABLE = """import datetime, os, sys, threading
sys.path.insert(0, {root!r})
import data, train
data.CONNECT = datetime.timedelta(seconds=3)
if os.environ['RANK'] == '1':
    train.waits_group = lambda: threading.Event().wait()  # joins the process group, never the waits' group
train.setup_distributed()
"""


@pytest.mark.slow
def test_processes_that_cannot_reach_each_other_stop_within_connect_not_patience(tmp_path):
    """Launched as srun's tasks are (RANK, WORLD_SIZE, LOCAL_RANK and the first node's address, no torchrun): process 1
    never joins the gloo group of the waits, as a node whose name resolves to an unreachable address would not. Process
    0 stops once data.CONNECT (here 3 s) has passed, in one line naming GLOO_SOCKET_IFNAME, not after PATIENCE (2 hours)."""
    script = tmp_path / 'unreachable.py'
    script.write_text(UNREACHABLE.format(root=ROOT))
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    tasks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, 'OMP_NUM_THREADS': '1', 'RANK': str(r), 'WORLD_SIZE': '2',
                                   'LOCAL_RANK': '0', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(port)})
             for r in (0, 1)]
    try:
        out, err = tasks[0].communicate(timeout=120)
    finally:
        tasks[1].kill()
    lines = [line for line in err.splitlines() if line.startswith('error')]
    assert tasks[0].returncode != 0 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith('error: the processes could not reach each other within 3 s (wait timeout after 3000ms')
    assert 'GLOO_SOCKET_IFNAME' in lines[0]


def test_an_srun_task_takes_its_gpu_among_those_it_sees_and_the_waits_get_their_patience(tmp_path, monkeypatch):
    """srun with a GPU a task: LOCAL_RANK 3, one visible GPU, which is its GPU 0 (torchrun's 8 visible: GPU 3). A gloo
    group of one process set up from the environment: the waits' group, once checked, has data.PATIENCE (2 hours)."""
    monkeypatch.setenv('LOCAL_RANK', '3')
    for visible, gpu in ((1, 0), (8, 3)):
        monkeypatch.setattr(torch.cuda, 'device_count', lambda: visible)
        assert train.local_gpu() == gpu
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    for name, value in {'RANK': '0', 'WORLD_SIZE': '1', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(port)}.items():
        monkeypatch.setenv(name, value)
    assert train.setup_distributed() == (0, 1, torch.device('cpu'))
    try:
        assert data.WAITS._get_backend(torch.device('cpu')).options._timeout == data.PATIENCE
    finally:
        torch.distributed.destroy_process_group()
        data.WAITS = None
