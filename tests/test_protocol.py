"""The house a forker and a reader meet: a new method written only against the protocol
(xlt.Method) trains and evaluates, the README's example among them; the trainer names no
method; one run per folder at a time; a run killed inside a stage resumes to the numbers of a
run never stopped."""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import data
import layers
import train
import xlt
from conftest import demo_run, quick_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def demo_data(tmp_path_factory):
    return data.make_demo(str(tmp_path_factory.mktemp('demo') / 'demo-data'))


def readme_example():
    """The code block of the README's "Adding a method", executed: it registers its class."""
    text = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read().split('\n## Adding a method\n')[1]
    code = re.search(r'```python\n(.*?)```', text, re.S).group(1)
    namespace = {'__name__': 'readme_example'}
    exec(compile(code, 'README.md', 'exec'), namespace)
    return namespace['RDrop']


@pytest.fixture
def registered():
    """Methods a test adds to xlt.METHODS, removed afterwards."""
    before = dict(xlt.METHODS)
    yield
    xlt.METHODS.clear()
    xlt.METHODS.update(before)


def test_the_plan_counts_the_readme_example_s_two_passes(registered):
    """R-Drop runs each batch through the model twice, and both passes keep their activations for backward: the plan's
    peak for it is the zero-shot baseline's (the same encoder and head) plus one more pass's saved tensors."""
    RDrop = readme_example()
    cfg = layers.CONFIGS['tiny']
    peak = lambda m: layers.peak_bytes(cfg, *m.passes(16, (40,)), sum(p.numel() for p in m.parameters()), 'cuda', 'bf16')
    rdrop = RDrop(layers.Encoder(cfg), 'pawsx', argparse.Namespace(rdrop_alpha=1.0))
    baseline = xlt.Baseline(layers.Encoder(cfg), 'pawsx')
    one_pass = layers.pass_bytes(cfg, layers.Pass(16, 40, cfg.n_layer), 2, 'cuda')[0]  # what it keeps for backward
    assert peak(rdrop) - peak(baseline) == one_pass > 0


def test_readme_example_is_r_drop_by_hand(registered):
    RDrop = readme_example()
    args = train.parse_args(['--method', 'rdrop', '--task', 'panx'])
    assert args.rdrop_alpha == 1.0 and args.lr == 1e-5 and args.out == 'runs/panx-rdrop'
    torch.manual_seed(0)
    cfg = layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': 60})
    for task in ('pawsx', 'panx'):
        m = RDrop(layers.Encoder(cfg), task, argparse.Namespace(rdrop_alpha=0.7)).train()
        ids = torch.randint(4, 60, (3, 9))
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[2, 6:] = False
        tags = torch.randint(0, 7, (3, 9)).masked_fill(torch.rand(3, 9) < 0.3, data.IGNORE).masked_fill(~mask, data.IGNORE)
        labels = torch.tensor([0, 1, 1]) if task == 'pawsx' else tags
        batch = data.Batch(ids, mask, labels)
        torch.manual_seed(5)
        loss, logs = m.loss(batch)
        torch.manual_seed(5)
        p, q = m.predict(batch).softmax(-1), m.predict(batch).softmax(-1)  # the same two dropout masks
        kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)
        if task == 'pawsx':
            ce = (-p[torch.arange(3), labels].log() - q[torch.arange(3), labels].log()) / 2
            expected = (ce + 0.7 * (kl(p, q) + kl(q, p)) / 2).mean()
        else:  # the mean over every labelled token of the batch
            real = labels.ne(data.IGNORE)
            pick = lambda r: r.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
            ce = ((-pick(p).log() - pick(q).log()) / 2)[real]
            expected = (ce + 0.7 * ((kl(p, q) + kl(q, p)) / 2)[real]).mean()
        assert abs(loss.item() - expected.item()) < 1e-5 and logs['kl'].item() > 0
        m.eval()  # without dropout both passes agree: the KL is 0 and the loss is the cross-entropy
        assert abs(m.loss(batch)[1]['kl'].item()) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize('task', ['pawsx', 'panx'])
def test_readme_example_trains_and_evaluates_on_the_demo(registered, tmp_path, demo_data, task, capsys):
    readme_example()
    demo_run(tmp_path / 'run', demo_data, ['--method', 'rdrop', '--task', task, '--epochs', '6' if task == 'pawsx' else '3'])
    results = json.load(open(tmp_path / 'run' / 'results.json'))
    assert results['method'] == 'rdrop' and results['selected_by'] == 'best average dev score over languages'
    assert set(results['test']) >= {'en', 'de', 'zh', 'avg', 'gap'} and results['dev']['en'] > 60  # it learns English
    assert json.load(open(tmp_path / 'run' / 'config.json'))['rdrop_alpha'] == 1.0
    log = [json.loads(line) for line in open(tmp_path / 'run' / 'log.jsonl')]
    assert any('kl' in row for row in log) and os.path.exists(tmp_path / 'run' / 'predictions' / task / 'test-de.tsv')
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.parse_args(['--help'])
    assert 'options of --method rdrop:\n  --rdrop_alpha' in capsys.readouterr().out


class Consistency(xlt.Method):
    """A paired method written from the protocol alone: English and its translation through the
    encoder, the task loss on both, and the MSE between their <s> states; it predicts from the
    target side. `seen` counts the Pair batches its loss was given."""
    NAME, TASKS, paired, trains_on, select = 'consistency', ('xnli', 'pawsx'), True, 'every_lang', 'average'
    RUN = {'xnli': {'lr': 1e-5}, 'pawsx': {'lr': 1e-5}}
    seen = []

    def predict(self, pair):  # Method.__init__ made the encoder, the family and the task's head
        return self.head(self.encoder(pair.tgt.ids, pair.tgt.mask), pair.tgt.mask)

    def loss(self, pair):
        same = sum(s[a].tolist() == t[b].tolist() for s, a, t, b in zip(pair.src.ids, pair.src.mask, pair.tgt.ids, pair.tgt.mask))
        Consistency.seen.append((type(pair), pair.src.ids.shape[0], same))  # same: rows of English with itself
        h_s, h_t = self.encoder(pair.src.ids, pair.src.mask), self.encoder(pair.tgt.ids, pair.tgt.mask)
        ce = xlt.per_example_loss(self.family, self.head(h_s, pair.src.mask), pair.src.labels) + \
            xlt.per_example_loss(self.family, self.head(h_t, pair.tgt.mask), pair.tgt.labels)
        loss = ce + F.mse_loss(h_s[:, 0], h_t[:, 0], reduction='none').mean(-1)
        return loss.mean(), {'loss': loss.mean().detach()}


@pytest.mark.slow
def test_a_paired_method_from_the_protocol_alone_trains_on_pairs(registered, tmp_path, demo_data):
    xlt.METHODS['consistency'] = Consistency
    Consistency.seen.clear()
    demo_run(tmp_path / 'run', demo_data, ['--method', 'consistency', '--task', 'pawsx', '--epochs', '3'])
    results = json.load(open(tmp_path / 'run' / 'results.json'))
    losses = [row['loss'] for row in map(json.loads, open(tmp_path / 'run' / 'log.jsonl')) if 'loss' in row]
    assert set(results['test']) >= {'en', 'de', 'zh'} and losses[-1] < losses[0]  # it trains, and is evaluated
    assert all(kind is data.Pair for kind, _, _ in Consistency.seen) and sum(n for _, n, _ in Consistency.seen) > 0
    rows, same = sum(n for _, n, _ in Consistency.seen), sum(s for _, _, s in Consistency.seen)
    assert 0.2 < same / rows < 0.5  # English with itself, and with each of its two translations
    # the trainer reads its translations for training and evaluation, as for FILTER: --dry_run's files say so
    args = train.parse_args(['--method', 'consistency', '--task', 'pawsx', '--data_dir', demo_data, '--from_scratch'])
    planned = {p for p, _, _ in train.planned_files(args, Consistency)}
    assert {data.split_path(demo_data, 'pawsx', kind, lang) for kind in ('translate-train', 'translate-dev', 'translate-test')
            for lang in ('de', 'zh')} <= planned


def test_the_trainer_names_no_method():
    for module in ('train.py', 'data.py', 'eval.py'):
        source = open(os.path.join(ROOT, module), encoding='utf-8').read()
        assert not re.search(r'args\.method *(==|!=|in )', source), module
        assert not re.search(r'\bxlt\.(Baseline|Filter|XMixup|Veco\w*|XLA|TranslateTrain\w*)\b', source), module
    assert 'import train' not in open(os.path.join(ROOT, 'xlt.py')).read()


def tree(folder):
    """Every file under folder with its size and modification time."""
    return {os.path.relpath(os.path.join(d, f), folder): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, names in os.walk(folder) for f in names}


ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}


def start(argv, until):
    """A run in its own process, once it has printed a line starting with `until` (an event, not a sleep),
    or lines starting with each of a tuple of them, in order."""
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    waiting = [until] if isinstance(until, str) else list(until)
    for line in proc.stdout:
        if line.startswith(waiting[0]):
            waiting.pop(0)
        if not waiting:
            return proc
    proc.wait()
    raise AssertionError(f'{argv} ended before printing {until!r}: {proc.stderr.read()[-2000:]}')


@pytest.mark.slow
def test_one_run_per_folder_the_other_stops_in_one_line_and_touches_nothing(tmp_path):
    out = tmp_path / 'run'
    os.makedirs(out)
    os.symlink(data.make_demo(str(tmp_path / 'demo-data'), n_train=200, n_eval=30), out / 'demo-data')  # small: quick epochs
    command = ['train.py', '--demo', '--task', 'pawsx', '--epochs', '2', '--out', str(out)]
    os.makedirs(tmp_path / 'other')
    os.symlink(out / 'demo-data', tmp_path / 'other' / 'demo-data')
    train.main(['--demo', '--task', 'pawsx', '--epochs', '1', '--out', str(tmp_path / 'other')])  # weights to evaluate
    first = start(command, 'epoch 1/2 ')
    first.send_signal(signal.SIGSTOP)  # it holds the folder, and keeps still while the others try
    os.waitpid(first.pid, os.WUNTRACED)  # once every thread of it has stopped, its checkpoint writer's too
    try:
        before = tree(out)  # (its best.pt may be half written: the writer's thread stopped with it)
        evaluated = ['--eval_only', '--init', str(tmp_path / 'other' / 'best.pt')]
        for extra in ([], ['--resume'], evaluated):  # in this process: the lock is another process's
            with pytest.raises(SystemExit) as other:
                train.main(command[1:] + extra)
            assert str(other.value) == f'error: {out} is in use by another run (pid {first.pid} on {socket.gethostname()}): wait for it to end, or give another --out'
            assert tree(out) == before
    finally:
        first.kill()  # SIGKILL: the lock dies with its holder
        first.wait()
    train.main(command[1:] + ['--resume'])
    assert json.load(open(out / 'results.json'))['test']


# The demo's pre-training made short: these runs start from it as every X-Mixup demo does.
SHORT_PRETRAINING = {'steps': 20, 'eval_every': 10}


@pytest.mark.slow
def test_a_run_killed_inside_the_demo_pretraining_resumes_to_the_same_numbers(tmp_path, monkeypatch):
    """The run never stopped and the resumed one in this process, the one cut short in its own; the
    runs and their pre-trainings read one small demo, linked into their folders."""
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=100, n_eval=16)
    for name in ('whole', 'cut'):
        for folder in ('run', 'pretrain-veco-demo'):
            os.makedirs(tmp_path / name / folder)
            os.symlink(demo, tmp_path / name / folder / 'demo-data')
    argv = lambda name: ['--method', 'xmixup', '--task', 'pawsx', '--demo', '--epochs', '1', '--out', str(tmp_path / name / 'run')]
    monkeypatch.setattr(xlt.VecoPretrain, 'DEMO', {**xlt.VecoPretrain.DEMO, **SHORT_PRETRAINING})
    train.main(argv('whole'))
    # dies at step 15 of the pre-training's 20, as if killed: last.pt is step 10's, five steps are lost
    short = f'import sys, train, xlt; xlt.VecoPretrain.DEMO.update({SHORT_PRETRAINING}); train.main(sys.argv[1:])'
    threads = {'OMP_NUM_THREADS': str(torch.get_num_threads())}  # this process's: a count changes the gradients' last bits
    cut = subprocess.run([sys.executable, '-c', short, *argv('cut'), '--halt_after', '15'], cwd=ROOT, capture_output=True,
                         env={**ENV, **threads})
    assert cut.returncode == 3 and not os.path.exists(tmp_path / 'cut' / 'pretrain-veco-demo' / 'results.json')
    assert torch.load(tmp_path / 'cut' / 'pretrain-veco-demo' / 'last.pt', weights_only=True)['state']['step'] == 10
    train.main(argv('cut') + ['--resume'])
    for name in ('pretrain-veco-demo', 'run'):
        a, b = (json.load(open(tmp_path / run / name / 'results.json')) for run in ('whole', 'cut'))
        assert a == b, name
    a, b = (torch.load(tmp_path / run / 'pretrain-veco-demo' / 'best.pt', weights_only=True)['encoder'] for run in ('whole', 'cut'))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_run_killed_inside_xla_s_loop_resumes_to_the_same_numbers(tmp_path, capsys):
    demo_data = data.make_demo(str(tmp_path / 'demo-data'), n_train=60, n_eval=12)
    init = quick_pretrained(demo_data, tmp_path / 'pre', steps=20)
    argv = ['--method', 'xla', '--task', 'panx', '--init', init, '--epochs', '2', '--xla_lr', '1e-4', '--xla_epochs', '1']
    demo_run(tmp_path / 'whole', demo_data, argv)
    os.makedirs(tmp_path / 'cut')
    os.symlink(demo_data, tmp_path / 'cut' / 'demo-data')
    cut = start(['train.py', '--demo', '--out', str(tmp_path / 'cut'), *argv], ('XLA epoch 1, model 3 by 1 and 2: trained', 'XLA epoch 1, '))
    cut.kill()  # model 3 trained and kept, its new labeller labelled: inside model 2's training by 1 and 3
    cut.wait()
    assert not os.path.exists(tmp_path / 'cut' / 'final-models.json')
    capsys.readouterr()
    demo_run(tmp_path / 'cut', demo_data, argv + ['--resume'])
    assert 'model 3 by 1 and 2: trained on' not in capsys.readouterr().out  # finished before the kill: not redone
    a, b = (json.load(open(tmp_path / run / 'results.json')) for run in ('whole', 'cut'))
    assert a['runs'] == b['runs'] and a['test'] == b['test']


def test_options_of_other_methods_are_refused_even_when_zero():
    for argv, name in ((['--method', 'zeroshot', '--average_last', '0'], 'average_last'),
                       (['--method', 'filter', '--conf_penalty', '0'], 'conf_penalty'),
                       (['--task', 'xnli', '--cross_only_steps', '0'], 'cross_only_steps')):
        with pytest.raises(SystemExit, match=f'--{name} belongs to --method'):
            train.parse_args(argv)


def test_a_new_run_drops_what_an_earlier_run_kept_and_resume_reads_it_back(tmp_path, demo_data):
    args = train.parse_args(['--demo', '--task', 'pawsx', '--out', str(tmp_path / 'run')])
    args.data_dir = demo_data
    run = lambda **changes: train.Run(argparse.Namespace(**{**vars(args), **changes}), 0, 1, torch.device('cpu'), None)
    first = run()
    assert torch.equal(first.folder.cached('labels.pt', lambda: torch.arange(3)), torch.arange(3))
    first.sub('epoch1/model1').folder.begin()  # a folder of the run, with its own files
    (tmp_path / 'run' / 'epoch1' / 'model1' / 'best.pt').write_text('an earlier run\'s')
    assert set(open(tmp_path / 'run' / 'kept.txt').read().split()) == {'labels.pt', 'epoch1/model1'}
    resumed = run(resume=True)  # --resume: what was kept is read back, not computed
    assert torch.equal(resumed.folder.cached('labels.pt', lambda: torch.zeros(3)), torch.arange(3))
    run(eval_only=True).sub('model1')  # an evaluation changes nothing
    assert not os.path.exists(tmp_path / 'run' / 'model1') and (tmp_path / 'run' / 'labels.pt').exists()
    run().folder.begin()  # a new run: the earlier run's kept results are not its own
    assert not (tmp_path / 'run' / 'labels.pt').exists() and not (tmp_path / 'run' / 'epoch1' / 'model1').exists()
    assert (tmp_path / 'run' / 'config.json').exists() and not (tmp_path / 'run' / 'kept.txt').exists()


def test_one_checkpoint_format_says_what_it_holds(tmp_path):
    enc = layers.Encoder(layers.CONFIGS['tiny'])
    layers.save_checkpoint(str(tmp_path / 'best.pt'), {'method': 'filter', 'task': 'xnli', 'model': 'tiny', 'settings': {'k': 1}},
                           **layers.encoder_parts(enc), method={'w': torch.ones(2)})
    ckpt = layers.load_checkpoint(str(tmp_path / 'best.pt'), {'task': 'xnli'})
    assert ckpt['meta']['holds'] == ['config', 'encoder', 'method', 'mlm'] and ckpt['meta']['settings'] == {'k': 1}
    with pytest.raises(layers.CheckpointError, match='holds filter on xnli with the tiny preset, not a run on pawsx'):
        layers.load_checkpoint(str(tmp_path / 'best.pt'), {'task': 'pawsx'})
    assert torch.equal(layers.load_pretrained(str(tmp_path / 'best.pt'))[0].tok.weight, enc.tok.weight)  # --init reads it
    torch.save(layers.encoder_parts(enc), tmp_path / 'old.pt')  # converted before the format had its name
    assert torch.equal(layers.load_pretrained(str(tmp_path / 'old.pt'))[0].tok.weight, enc.tok.weight)
    # a translation's checkpoint names its pair: an en-de model is not read as en-fr
    pair = lambda tgt: train.checkpoint_identity(train.parse_args(['--method', 'veco', '--task', 'translate', '--tgt', tgt]))
    assert pair('de')['task'] == 'translate-en-de' != pair('fr')['task']


def test_the_modules_import_in_one_order_without_a_circle():
    """train -> xlt -> eval -> data -> layers: each module imports only modules after it, inside a
    function too, so no import circle can form."""
    import ast
    order = ['train', 'xlt', 'eval', 'data', 'layers']
    for i, name in enumerate(order):
        tree = ast.parse(open(os.path.join(ROOT, f'{name}.py'), encoding='utf-8').read())
        imported = {a.name.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert imported & set(order) <= set(order[i + 1:]), (name, imported & set(order))


MODULES = ('layers', 'data', 'eval', 'xlt', 'train')


def test_no_line_of_the_package_is_longer_than_120_characters():
    for name in MODULES:
        for n, line in enumerate(open(os.path.join(ROOT, f'{name}.py'), encoding='utf-8').read().splitlines(), 1):
            assert len(line) <= 120, f'{name}.py line {n} has {len(line)} characters'


def test_no_function_is_longer_than_60_lines():
    import ast
    for name in MODULES:
        tree = ast.parse(open(os.path.join(ROOT, f'{name}.py'), encoding='utf-8').read())
        for f in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            assert f.end_lineno - f.lineno + 1 <= 60, f'{name}.py: {f.name} has {f.end_lineno - f.lineno + 1} lines'


def test_data_takes_plain_values_never_the_trainers_settings_or_a_method():
    """data.py is handed paths, a task, languages and numbers: no function of it takes the trainer's settings
    (args) or a method class, so that what a run reads is planned in train.py, beside its other checks."""
    import ast
    tree = ast.parse(open(os.path.join(ROOT, 'data.py'), encoding='utf-8').read())
    for f in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        own_class = any(getattr(d, 'id', None) == 'classmethod' for d in f.decorator_list)  # Ragged.joined's cls
        params = {a.arg for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs} - ({'cls'} if own_class else set())
        assert not params & {'args', 'cls', 'method', 'settings'}, f'data.{f.name} takes {params}'


def test_the_protocol_names_every_attribute_of_a_method_that_the_trainer_reads():
    """Every attribute of a method (or its class) that train.py, data.py, eval.py or layers.py reads, and that Method
    defines or sets, is named in Method's docstring as a word of its own, not a quoted value."""
    import ast
    import re
    import torch.nn as nn
    read = set()
    for module in ('train', 'data', 'eval', 'layers'):
        for n in ast.walk(ast.parse(open(os.path.join(ROOT, f'{module}.py'), encoding='utf-8').read())):
            if not isinstance(n, ast.Attribute):
                continue
            owner = n.value
            if isinstance(owner, ast.Name) and owner.id in ('method', 'cls', 'model', 'student', 'teacher') or (
                    isinstance(owner, ast.Attribute) and owner.attr in ('method', 'cls')):
                read.add(n.attr)
    set_by_init = {'encoder', 'family', 'options', 'head', 'step', 'mlm'}  # Method.__init__'s
    protocol = sorted(a for a in read if (hasattr(xlt.Method, a) or a in set_by_init) and not hasattr(nn.Module, a))
    assert {'encoder', 'family', 'mlm', 'step', 'paired', 'trains_on', 'before_update', 'stepped'} <= set(protocol)
    unnamed = [a for a in protocol if not re.search(rf"(?<!')\b{a}\b(?!')", xlt.Method.__doc__)]
    assert not unnamed, f'Method\'s docstring does not name {unnamed}'
