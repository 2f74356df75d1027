"""From runs to the papers' tables: the printed progress, --collect into one submission that
eval.py scores as each run scored itself, --plot, --dry_run of every command of docs/reproducing.md's
reproduction table, and the equation index naming only code that exists."""
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import sys

import pytest
import torch

import data
import eval as ev
import layers
import train
import xlt
from conftest import demo_run, doc, write_bert_vocab



@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Demo runs of all nine tasks: PAN-X trained for 2 epochs (its printed output kept), the other
    eight evaluating its encoder with fresh heads (--eval_only --init), which is enough to score."""
    root = tmp_path_factory.mktemp('runs')
    demo = data.make_demo(str(root / 'demo-data'), n_train=300, n_eval=40)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        demo_run(root / 'panx', demo, ['--task', 'panx', '--epochs', '2'])
        demo_run(root / 'tydiqa', demo, ['--task', 'tydiqa', '--epochs', '1'])  # QA, and no dev set
        for task in data.XTREME:
            if task not in ('panx', 'tydiqa'):
                demo_run(root / task, demo, ['--task', task, '--eval_only', '--init', str(root / 'panx' / 'best.pt')])
        demo_run(root / 'pretrain', demo, ['--method', 'veco', '--task', 'pretrain', '--steps', '4', '--eval_every', '2'])
    return root, demo, printed.getvalue()


@pytest.mark.slow
def test_a_run_writes_its_dev_predictions_and_they_score_as_its_dev_results(runs):
    """Beside its test predictions a run writes its dev predictions (predictions/<task>/dev-<lang>.<ext>), which
    eval.py --analyse reads: read back and scored against each language's dev set, they give results.json's dev."""
    root, demo, _ = runs
    for task in ('panx', 'xnli', 'udpos', 'mlqa'):
        dev = json.load(open(root / task / 'results.json'))['dev']
        for lang in data.languages(task, True):
            preds = ev.run_predictions(root / task, task, 'dev', lang)
            scores = ev.scores_of(task, lang, data.read_split(demo, task, 'dev', lang), preds)
            assert scores['score'] == pytest.approx(dev[lang], abs=1e-9), (task, lang)
    assert not os.path.exists(root / 'tydiqa' / 'predictions' / 'tydiqa' / 'dev-en.json')  # TyDiQA has no dev set


@pytest.mark.slow
def test_each_epoch_prints_one_line_and_the_run_ends_with_its_table(runs):
    root, _, printed = runs
    log = [json.loads(line) for line in open(root / 'panx' / 'log.jsonl')]
    epochs = [line for line in printed.splitlines() if line.startswith('epoch ')][:3]  # PAN-X's, then TyDiQA's
    assert [line[:9] for line in epochs] == ['epoch 1/2', 'epoch 2/2', 'epoch 1/1']
    epochs = epochs[:2]
    records = [r for r in log if 'dev' in r]
    for n, (line, record) in enumerate(zip(epochs, records), 1):
        start = records[n - 2]['step'] if n > 1 else 0
        steps = [r for r in log if 'loss' in r and start < r['step'] <= record['step']]  # this epoch's lines
        bounds = [start] + [r['step'] for r in steps]
        loss = sum(r['loss'] * (b - a) for r, a, b in zip(steps, bounds, bounds[1:])) / (record['step'] - start)
        assert f'epoch {n}/2  step {record["step"]}  ' in line
        assert f'train loss {loss:.4f}' in line  # each line's mean weighted by its steps: the epoch's mean
        assert f'dev avg {sum(record["dev"].values()) / 3:.1f}  dev en {record["dev"]["en"]:.1f}' in line
        assert f'best {max(r["dev"]["en"] for r in log if "dev" in r and r["epoch"] <= n):.1f} (en)' in line
    results = json.load(open(root / 'panx' / 'results.json'))
    tail = printed.split(epochs[-1])[1].split('tydiqa')[0]
    assert f'{results["test"]["de"]:7.1f}' in tail and 'the kept model in best.pt' in tail
    assert re.search(r'\d+:\d\d:\d\d in all', tail)


def run_eval(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ev.main(argv)
    return out.getvalue()


def test_collect_makes_a_submission_that_scores_as_the_runs(runs, tmp_path):
    root, demo, _ = runs
    folders = [str(root / task) for task in data.XTREME]
    printed = run_eval(['--collect', *folders, '--out', str(tmp_path / 'sub'), '--labels', os.path.join(demo, 'labels')])
    assert 'missing' not in printed and '9 of 9 tasks complete' in printed
    figure = tmp_path / 'sub.png'  # beside the submission, which holds task folders alone
    assert f'the test scores by language: {figure}' in printed and figure.read_bytes()[:4] == b'\x89PNG'
    assert figure.stat().st_size > 20000 and sorted(os.listdir(tmp_path / 'sub')) == sorted(data.XTREME)
    run_eval(['--predictions', str(tmp_path / 'sub'), '--labels', os.path.join(demo, 'labels'), '--demo',
              '--out', str(tmp_path / 'scores.json')])
    scores = json.load(open(tmp_path / 'scores.json'))
    for task in data.XTREME:
        own = json.load(open(root / task / 'results.json'))['test']
        per_lang = {lang: ev.main_score({m: v[lang] for m, v in scores[task].items() if isinstance(v, dict)})
                    for lang in data.languages(task, demo=True)}
        assert per_lang == pytest.approx({k: v for k, v in own.items() if k not in ('avg', 'gap')}, abs=1e-9)
        assert scores[task]['avg_metric'] == pytest.approx(own['avg'], abs=1e-9)
        assert f'{task} (' in printed  # the table has every task, then the groups and the overall score
    # the printed table: each task's languages with the run's own scores, then the groups by hand
    lines = printed.splitlines()
    for task in data.XTREME:
        own = json.load(open(root / task / 'results.json'))['test']
        at = next(i for i, line in enumerate(lines) if line.startswith(f'{task} ('))
        assert lines[at].split(': ')[1].startswith(f'{own["avg"]:.1f}')
        assert dict(zip(lines[at + 1].split(), lines[at + 2].split())) == {k: f'{v:.1f}' for k, v in own.items()
                                                                           if k not in ('avg', 'gap')}
    avg = {t: json.load(open(root / t / 'results.json'))['test']['avg'] for t in data.XTREME}
    groups = {'classification': ('pawsx', 'xnli'), 'tagging': ('udpos', 'panx'), 'qa': ('xquad', 'mlqa', 'tydiqa'),
              'retrieval': ('bucc2018', 'tatoeba')}
    expected = [f'{g} {sum(avg[t] for t in ts) / len(ts):.1f}' for g, ts in groups.items()]
    assert lines[-1] == 'groups: ' + ', '.join(expected) + f', XTREME score {sum(avg.values()) / 9:.1f}'


def test_qa_results_give_em_and_f1_per_language(runs, tmp_path):
    root, demo, _ = runs
    run_eval(['--predictions', str(root / 'tydiqa' / 'predictions'), '--labels', os.path.join(demo, 'labels'), '--demo',
              '--out', str(tmp_path / 'scores.json')])
    official = json.load(open(tmp_path / 'scores.json'))['tydiqa']
    rows = {line.split('  ')[0]: line.split()[2:] for line in open(root / 'tydiqa' / 'results.txt') if line.startswith('test ')}
    langs = data.languages('tydiqa', demo=True)
    assert rows['test EM'][:len(langs)] == [f'{official["exact_match"][lang]:.1f}' for lang in langs]
    assert rows['test F1'][:len(langs)] == [f'{official["f1"][lang]:.1f}' for lang in langs]
    assert 'QA: each score is the mean of exact match (EM) and F1' in open(root / 'tydiqa' / 'results.txt').read()


def test_collect_replaces_a_submission_and_refuses_unfinished_runs(runs, tmp_path):
    root, demo, _ = runs
    run_eval(['--collect', str(root / 'xnli'), '--out', str(tmp_path / 'sub')])
    run_eval(['--collect', str(root / 'panx'), '--out', str(tmp_path / 'sub') + '/'])  # the trailing slash too
    assert sorted(os.listdir(tmp_path)) == ['sub', 'sub.png'] and os.listdir(tmp_path / 'sub') == ['panx']  # replaced
    shutil.copytree(root / 'xnli', tmp_path / 'stopped', symlinks=True)
    os.remove(tmp_path / 'stopped' / 'results.json')  # a run started again and stopped: its predictions are stale
    with pytest.raises(SystemExit, match='stopped is not a finished run .no results.json.'):
        run_eval(['--collect', str(tmp_path / 'stopped'), '--out', str(tmp_path / 'other')])


def test_epoch_line_and_clock_by_hand():
    state = {'epoch': 2, 'step': 40, 'best': 71.0}
    dev = {'en': {'score': 80.0}, 'de': {'score': 60.0}, 'zh': {'score': 52.0}}
    line = ev.epoch_line(state, 4, [(1.0, 10), (0.4, 10), (0.1, 5)], dev, 'average', 3725)
    assert line == 'epoch 2/4  step 40  train loss 0.5800  dev avg 64.0  best 71.0 (avg)  1:02:05'  # (10 + 4 + 0.5) / 25
    held_out = {'mono': {'score': -3.0}, 'para': {'score': -5.0}}
    line = ev.epoch_line({**state, 'best': -3.5}, 4, [(2.0, 4)], held_out, 'loss', 90000)
    assert line == 'epoch 2/4  step 40  train loss 2.0000  held-out loss 4.0000  best 3.5000  25:00:00'


def test_collect_reports_each_gap_and_scores_only_complete_tasks(runs, tmp_path):
    root, demo, _ = runs
    shutil.copytree(root / 'xnli', tmp_path / 'xnli', symlinks=True)
    os.remove(tmp_path / 'xnli' / 'predictions' / 'xnli' / 'test-de.tsv')
    printed = run_eval(['--collect', str(tmp_path / 'xnli'), str(root / 'panx'), '--out', str(tmp_path / 'sub'),
                        '--labels', os.path.join(demo, 'labels')])
    missing = [line for line in printed.splitlines() if line.startswith('missing: ')]
    assert len(missing) == 8 and 'missing: xnli: no de predictions' in printed  # 7 tasks without a run, 1 language
    assert 'panx (F1)' in printed and 'xnli (' not in printed
    # two runs of a task (a grid search's points): the one with the better average dev score
    shutil.copytree(root / 'panx', tmp_path / 'better', symlinks=True)
    results = json.load(open(tmp_path / 'better' / 'results.json'))
    results['dev']['avg'] += 0.1
    test, results['test'] = results['test'], {lang: score + 2 for lang, score in results['test'].items()}
    (tmp_path / 'better' / 'results.json').write_text(json.dumps(results))
    (tmp_path / 'better' / 'predictions' / 'panx' / 'test-de.tsv').write_text('mine\n')
    for order in ([root / 'panx', tmp_path / 'better'], [tmp_path / 'better', root / 'panx']):
        printed = run_eval(['--collect', *map(str, order), '--out', str(tmp_path / 'other')])
        assert (tmp_path / 'other' / 'panx' / 'test-de.tsv').read_text() == 'mine\n'
        # and the two runs' mean ± std (np.std: half their distance), as the papers report seeds
        assert 'panx, zeroshot, test, mean ± std over 2 runs (--seed 1, 1):\n  the run: ' + ', '.join(
            f'{lang} {score + 1:.1f} ± 1.0' for lang, score in test.items()) in printed
    shutil.copytree(root / 'panx', tmp_path / 'lr', symlinks=True)  # another command (its settings): not a seed of these
    config = json.load(open(tmp_path / 'lr' / 'config.json'))
    (tmp_path / 'lr' / 'config.json').write_text(json.dumps({**config, 'lr': 1.0, 'seed': 2, 'out': 'elsewhere'}))
    printed = run_eval(['--collect', str(root / 'panx'), str(tmp_path / 'better'), str(tmp_path / 'lr'), '--out', str(tmp_path / 'o2')])
    assert 'over 2 runs (--seed 1, 1)' in printed and 'over 3' not in printed


def is_png(path):
    with open(path, 'rb') as f:
        return f.read(8) == b'\x89PNG\r\n\x1a\n'


@pytest.mark.slow
def test_plot_writes_the_figures(runs, tmp_path):
    plt = pytest.importorskip('matplotlib.pyplot')
    root, _, _ = runs
    printed = run_eval(['--plot', str(root / 'panx')])
    for name in ('loss.png', 'dev.png', 'test.png'):
        path = root / 'panx' / 'plots' / name
        assert is_png(path) and plt.imread(str(path)).shape[0] > 100 and str(path) in printed
    printed = run_eval(['--plot', str(root / 'panx'), str(root / 'xnli'), '--out', str(tmp_path / 'both')])
    assert is_png(tmp_path / 'both' / 'test.png') and 'xnli: no log.jsonl' in printed  # evaluation only: test scores
    run_eval(['--plot', str(root / 'pretrain'), '--out', str(tmp_path / 'pretrain')])  # held-out losses, no test
    run_eval(['--plot', str(root / 'tydiqa'), '--out', str(tmp_path / 'tydiqa')])  # no dev set
    assert sorted(os.listdir(tmp_path / 'pretrain')) == ['dev.png', 'loss.png']
    assert sorted(os.listdir(tmp_path / 'tydiqa')) == ['loss.png', 'test.png']


def test_plot_without_matplotlib_says_how_to_install_it(runs, monkeypatch, tmp_path):
    root, _, _ = runs
    monkeypatch.setitem(sys.modules, 'matplotlib', None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as err:
        run_eval(['--plot', str(root / 'panx'), '--out', str(tmp_path / 'figures')])
    assert str(err.value).count('\n') == 0 and 'pip install matplotlib' in str(err.value)
    assert not os.path.exists(tmp_path / 'figures')


# ----------------------------------------------------------------------------------------
# The reproduction page: every command passes --dry_run on the data layout of docs/data.md.

def section(page, title=None):
    """A page of docs/, or its section `title` (to the next '## ' heading)."""
    return doc(os.path.join('docs', page), title)


def reproduction_commands(labelled=False):
    """Every train.py command of the reproduction page, `for X in ...; do` loops
    unrolled: (processes, argv), or with labelled (its group's label, processes, argv)."""
    text = section('reproducing.md').replace('\\\n', ' ')
    commands, loop, label = [], None, None
    for line in text.splitlines():
        if m := re.match(r'# \[(\w+)\]', line):
            label = m.group(1)
        elif m := re.match(r'\s*for (\w+) in ([\w .-]+); do$', line):
            loop = m.group(1), m.group(2).split()
        elif line.strip() == 'done':
            loop = None
        elif m := re.match(r'\s*(?:torchrun (?:--nnodes (\d+) )?--nproc_per_node (\d+) (?:--rdzv_\w+ \S+\s+)*)?(?:python )?train\.py (.*?)\s*(?:#.*)?$', line):
            world = int(m.group(1) or 1) * int(m.group(2) or 1)
            for value in loop[1] if loop else [None]:
                text_ = m.group(3).replace(f'${loop[0]}', value) if loop else m.group(3)
                commands.append((label, world, text_.split()) if labelled else (world, text_.split()))
    return commands


def write_layout(root, langs_of):
    """Tiny files under the names of docs/data.md's layout (not the package's own paths)."""
    files = ['sentencepiece.bpe.model', 'squad/train-v1.1.json', 'squad/dev-v1.1.json',
             'tydiqa/tydiqa-goldp-v1.1-train/tydiqa.goldp.en.train.json']
    for task in ('xnli', 'pawsx'):
        files += [f'{task}/train-en.tsv'] + [f'{task}/{s}-{lang}.tsv' for lang in langs_of(task) for s in ('dev', 'test')]
        files += [f'{task}/translate-train/en-{lang}-translated.tsv' for lang in langs_of(task)]
        files += [f'{task}/translate-{s}/{s}-{lang}-en-translated.tsv' for lang in langs_of(task) for s in ('dev', 'test')]
        files += [f'{task}/round-trip/train-en-{lang}-en.tsv' for lang in langs_of(task)]
    for task in ('udpos', 'panx', 'conll'):
        files += [f'{task}/train-{lang}.tsv' for lang in langs_of(task)]  # English, and XLA's target text
        files += [f'{task}/{s}-{lang}.tsv' for lang in langs_of(task) for s in ('dev', 'test')]
        files += [f'{task}/translate-train/train-en-{lang}.tsv' for lang in langs_of(task)]
        files += [f'{task}/translate-train-soft/train-en-{lang}.tsv' for lang in langs_of(task)]  # X-Mixup's
        files += [f'{task}/translate-{s}/{s}-{lang}-en.tsv' for lang in langs_of(task) for s in ('dev', 'test')]
    for lang in langs_of('xquad'):
        files += [f'xquad/xquad.{lang}.json', f'squad/translate-train/squad.translate.train.en-{lang}.json',
                  f'xquad/translate-test/xquad.translate.test.{lang}-en.json']
    for lang in langs_of('mlqa'):
        files += [f'mlqa/MLQA_V1/{s}/{s}-context-{lang}-question-{lang}.json' for s in ('dev', 'test')]
        files += [f'squad/translate-train/squad.translate.train.en-{lang}.json',
                  f'mlqa/translate-test/mlqa.translate.test.{lang}-en.json', f'mlqa/translate-dev/mlqa.translate.dev.{lang}-en.json']
    for lang in langs_of('tydiqa'):
        files += [f'tydiqa/tydiqa-goldp-v1.1-dev/tydiqa.goldp.{lang}.dev.json',
                  f'tydiqa/tydiqa-goldp-v1.1-train/tydiqa.goldp.{lang}.train.json',  # in-language's
                  f'tydiqa/translate-train/tydiqa.translate.train.en-{lang}.json',
                  f'tydiqa/translate-test/tydiqa.translate.test.{lang}-en.json']
    files += [f'bucc2018/{lang}-en.test.{side}' for lang in langs_of('bucc2018') for side in (lang, 'en')]
    files += [f'bucc2018/{lang}-en.dev.{side}' for lang in langs_of('bucc2018') for side in (lang, 'en', 'gold')]
    files += [f'tatoeba/{lang}-en.{side}' for lang in langs_of('tatoeba') for side in (lang, 'en')]
    files += ['pretrain/mono/en.txt', 'pretrain/parallel/en-de.en', 'pretrain/parallel/en-de.de']
    files += [f'translation/en-{t}/{s}.{lang}' for t in ('de', 'fr') for s in ('train', 'valid', 'test') for lang in ('en', t)]
    for name in files:
        os.makedirs(os.path.dirname(os.path.join(root, name)) or root, exist_ok=True)
        open(os.path.join(root, name), 'w').write('x\n')


@pytest.mark.slow  # about 500 commands
def test_every_reproduction_command_passes_dry_run(tmp_path, monkeypatch, capsys, spm_path):
    commands = reproduction_commands()
    assert len(commands) >= 80  # every method and task of the table, loops unrolled
    monkeypatch.chdir(tmp_path)
    for folder in ('data', 'data/filter', 'data/xmixup'):  # XTREME's data, FILTER's and X-Mixup's (their defaults)
        write_layout(folder, lambda task: data.TASKS[task].langs)
        shutil.copy(spm_path, f'{folder}/sentencepiece.bpe.model')  # the dry run reads it
    made = set()  # what the runs before a command would have left: the checkpoints and teachers it reads
    for name in {arg for _, argv in commands for arg in argv if arg.endswith('.pt')}:
        os.makedirs(os.path.dirname(name) or '.', exist_ok=True)
        torch.save({}, name)  # a torch checkpoint's format: the dry run reads no tensor
        made.add(name)
    inits = {argv[argv.index('--init') + 1] for _, argv in commands if '--init' in argv}
    for folder in [init for init in inits if init.endswith('/')]:  # a Hugging Face BERT folder, its vocab.txt
        write_bert_vocab(folder, ['x'])
    for _, argv in commands:
        for teacher in argv[argv.index('--teacher') + 1:][:1] if '--teacher' in argv else []:
            os.makedirs(teacher, exist_ok=True)  # a finished run of the task
            open(os.path.join(teacher, 'results.json'), 'w').write('{}')
            open(os.path.join(teacher, 'config.json'), 'w').write(json.dumps({'task': argv[argv.index('--task') + 1]}))
            backbone = layers.CONFIGS[argv[argv.index('--model') + 1]].backbone  # its meta and its model's backbone alone
            layers.save_checkpoint(os.path.join(teacher, 'best.pt'), {'task': argv[argv.index('--task') + 1]},
                                   config={'backbone': backbone})
            made |= {os.path.join(teacher, name) for name in ('results.json', 'config.json', 'best.pt')}
    outs = [train.parse_args(argv).out for _, argv in commands]
    assert len(set(outs)) == len(outs)  # no two commands write the same folder
    for world, argv in commands:  # and each training fits a 40 GB GPU, by the plan's estimate
        monkeypatch.setenv('WORLD_SIZE', str(world))
        train.main([*argv, '--dry_run', '--gpu_memory', '40'])
        out = capsys.readouterr().out
        assert out.splitlines()[0].endswith(': dry run, nothing is trained or written'), argv
        assert 'fits the 40.00 GiB GPU' in out or 'memory    none trained' in out, (argv, out)
    assert {os.path.join(d, f) for d, _, names in os.walk('runs') for f in names} == {p for p in made if p.startswith('runs')}


LEDGER_STATUS = ('as run', 'departure', 'none')


def ledger_rows():
    """The ledger's rows: (paper, row, status, the command groups it cites)."""
    rows, paper = [], None
    for line in section('reproducing.md', 'The ledger').splitlines():
        if line.startswith('### '):
            paper = line[4:]
        elif line.startswith('| ') and not line.startswith(('| row', '|---')):
            cells = [cell.strip() for cell in line.strip('|').split('|')]
            rows.append((paper, cells[0], cells[2], re.findall(r'\[(\w+)\]', cells[3])))
    return rows


def test_the_ledger_counts_its_rows_and_cites_commands_that_exist():
    """Every row of the ledger says how its command runs it (as run, a departure, none), a row with a command cites
    labelled groups of the commands' page, a row without says why; the counts stated are the rows'."""
    rows, page = ledger_rows(), section('reproducing.md')
    labels = set(re.findall(r'^# \[(\w+)\]', page, flags=re.M))
    assert {paper for paper, *_ in rows} == {'XTREME (Hu et al., 2020)', 'FILTER (Fang et al., 2021)',
                                            'X-Mixup (Yang et al., 2022)', 'VECO (Luo et al., 2020)',
                                            'XLA (Bari et al., 2021)'}
    counts = dict.fromkeys(LEDGER_STATUS, 0)
    for paper, row, status, cited in rows:
        kind = next((k for k in LEDGER_STATUS if status.startswith(k)), None)
        assert kind, (paper, row, status)
        counts[kind] += 1
        assert (kind == 'none') == (not cited), (paper, row)  # a command, or why none
        assert kind != 'none' or len(status) > len('none: '), (paper, row)
        assert set(cited) <= labels, (paper, row, set(cited) - labels)
    stated = re.search(r'Counts: (\d+) rows; (\d+) as run, (\d+) with a departure, (\d+) without a command', page)
    assert tuple(map(int, stated.groups())) == (len(rows), counts['as run'], counts['departure'], counts['none'])
    assert counts["as run"] >= 100
    print(f'ledger: {len(rows)} rows; {counts["as run"]} as run, {counts["departure"]} with a departure, '
          f'{counts["none"]} without a command')


def test_dry_run_names_a_missing_file_in_one_line(tmp_path, monkeypatch, capsys, spm_path):
    monkeypatch.chdir(tmp_path)
    write_layout('data', lambda task: data.TASKS[task].langs)
    shutil.copy(spm_path, 'data/sentencepiece.bpe.model')
    torch.save({}, 'xlmr-large.pt')
    os.remove('data/xnli/translate-test/test-sw-en-translated.tsv')
    with pytest.raises(SystemExit) as err:
        train.main(['--method', 'filter', '--task', 'xnli', '--model', 'large', '--init', 'xlmr-large.pt', '--dry_run',
                    '--translations', 'xtreme'])
    assert str(err.value).startswith('error: data/xnli/translate-test/test-sw-en-translated.tsv not found: ')
    open('not-a-checkpoint.pt', 'w').write('101')
    with pytest.raises(SystemExit, match='not-a-checkpoint.pt is not a PyTorch file'):
        train.main(['--task', 'xnli', '--model', 'large', '--init', 'not-a-checkpoint.pt', '--dry_run'])


def test_the_plan_says_whether_a_run_fits_the_gpu_and_what_would(tmp_path, capsys):
    """The plan's memory line: the estimates at --grad_accum 1 and 2, with and without --grad_checkpoint, read from their
    plans; a GPU that holds a run at --grad_accum 2 with a tenth to spare, not at 1, is told so (and --grad_checkpoint,
    which needs less); one that holds nothing, so."""
    def memory(*argv, gpu=1000.0):  # planned for a GPU (of 1000 GiB: the estimate alone)
        train.main(['--demo', '--model', 'small', '--batch_size', '64', '--out', str(tmp_path), '--dry_run', *argv,
                    '--gpu_memory', str(gpu)])
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith('  memory'))
        number, unit = re.search(r'memory +([\d.]+) (GiB|MiB) a process', line).groups()
        return float(number) * 2 ** (30 if unit == 'GiB' else 20), line
    (one, _), (two, _) = memory(), memory('--grad_accum', '2')
    (kept, _), (kept_two, _) = memory('--grad_checkpoint'), memory('--grad_checkpoint', '--grad_accum', '2')
    assert kept_two < kept < two < one
    holding = lambda need: need * 1.01 / 0.9 / 2 ** 30  # a GPU that holds `need` with a tenth to spare
    assert memory(gpu=holding(two))[1].endswith(': --grad_accum 2 or --grad_checkpoint')
    assert memory('--grad_checkpoint', gpu=holding(kept_two))[1].endswith(': --grad_accum 2')
    assert memory(gpu=0.001)[1].endswith(': neither more --grad_accum nor --grad_checkpoint fits it: a lower --max_len, '
                                         'a smaller model')


def test_the_plan_warns_when_ddp_puts_fewer_than_16_rows_on_a_gpu(tmp_path, capsys, monkeypatch):
    """A dry run as torchrun's process 0 of 8: XNLI's batch of 32 is 4 rows a GPU, and the plan says so and what to do
    instead; 128 rows (16 a GPU) and one process are not warned."""
    def training(batch, world):
        monkeypatch.setenv('RANK', '0')
        monkeypatch.setenv('WORLD_SIZE', str(world))
        train.main(['--demo', '--task', 'xnli', '--batch_size', str(batch), '--out', str(tmp_path), '--dry_run'])
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith('  training'))
    assert training(32, 8).endswith('; warning: DDP puts 4 rows on a GPU (fewer than 16), so each step\'s all-reduce '
                                    'of every gradient (4 bytes a parameter) outweighs its compute: run one '
                                    'configuration a GPU instead (--gpus N with --seeds or --search, or a job array of '
                                    '--commands)')
    assert 'warning' not in training(128, 8) and 'warning' not in training(8, 1)


# ----------------------------------------------------------------------------------------
# The equation index: every numbered equation the code implements, and only real code.

INDEX_PAPERS = {'FILTER': 6, 'X-Mixup': 13, 'VECO': 8, 'XLA': 9}  # the papers' numbered equations


def index_rows():
    """(paper, equation numbers or 'Algorithm 1', the implementing cell) of docs/reading.md's equation index."""
    rows = []
    for line in section('reading.md', 'Equation index').splitlines():
        cells = [c.strip() for c in re.split(r'(?<!\\)\|', line.strip().strip('|'))]  # '\|' is a pipe in a cell
        if len(cells) >= 4 and cells[0] in INDEX_PAPERS:
            eq = cells[1].split(' (')[0]
            rows.append((cells[0], [int(n) for n in re.findall(r'\d+', eq)] if eq.startswith('Eq.') else eq, cells[-1]))
    return rows


def test_equation_index_covers_the_papers_and_names_only_existing_code():
    rows = index_rows()
    for paper, n in INDEX_PAPERS.items():
        assert sorted(x for p, eq, _ in rows if p == paper and isinstance(eq, list) for x in eq) == list(range(1, n + 1)), paper
    assert {p for p, eq, _ in rows if eq == 'Algorithm 1'} == {'FILTER', 'XLA'}  # the papers with an algorithm
    for paper, eq, cell in rows:
        names = re.findall(r'`(\w+)\.py: ([\w.]+)`', cell)
        assert names or cell.startswith('not implemented'), (paper, eq)
        for module, name in names:
            obj = importlib.import_module(module)
            for part in name.split('.'):
                assert hasattr(obj, part), f'{paper} {eq}: {module}.py has no {name}'
                obj = getattr(obj, part)
            assert callable(obj), f'{paper} {eq}: {module}.{name}'


@pytest.mark.parametrize('argv', [
    ['--method', 'filter', '--task', 'xnli', '--translations', 'xtreme'],
    ['--method', 'xmixup', '--task', 'pawsx', '--translations', 'xtreme'],
    ['--method', 'translate-train-all', '--task', 'tydiqa'], ['--task', 'mlqa', '--translate_test'],
    ['--task', 'bucc2018'], ['--method', 'veco', '--task', 'pretrain', '--steps', '2', '--eval_every', '2']])
def test_the_dry_run_checks_exactly_the_files_a_run_reads(tmp_path, monkeypatch, argv):
    """A real run on data in the layout of docs/data.md (the demo's files, without --demo) opens every
    file the dry run requires, and no file of the data folder the dry run does not list (the
    cache of tokenized training sets, .cache, aside: made from them)."""
    import builtins
    demo = data.make_demo(str(tmp_path / 'data'), n_train=40, n_eval=8)
    argv = [*argv, '--data_dir', demo, '--model', 'tiny', '--from_scratch', '--out', str(tmp_path / 'run'),
            '--batch_size', '16', '--max_len', '64'] + ['--epochs', '1'] * ('--steps' not in argv)  # small steps
    args = train.parse_args(argv)
    planned = {os.path.realpath(p): needed for p, _, needed in train.planned_files(args, xlt.method_class(args))}
    opened, real_open = set(), builtins.open
    def recording_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.realpath(file).startswith(os.path.realpath(demo)) and \
                not os.path.realpath(file).startswith(os.path.realpath(os.path.join(demo, '.cache'))):
            opened.add(os.path.realpath(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, 'open', recording_open)
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(argv)
    spm = os.path.realpath(os.path.join(demo, 'sentencepiece.bpe.model'))  # read by sentencepiece's own code
    assert opened <= set(planned)
    assert {p for p, needed in planned.items() if needed and p != spm} <= opened


# ----------------------------------------------------------------------------------------
# The settings tables of the method pages: every ledger command's settings as a dry run resolves them are its row's,
# each value has a source (a key defined under the table), and a row that uses one of ours ('o' keys) runs no
# command of a ledger row marked "as run".

SETTINGS_PAGES = ('baselines.md', 'filter-xmixup.md', 'veco.md', 'xla.md')
SETTINGS = ('lr', 'length', 'batch', 'max len', 'warm-up', 'weight decay', 'clip', 'seed', 'precision', 'kept', 'other')


def settings_rows():
    """[(page, row: {column: (value, [source keys])}, its key cells)], and {page: {key: what it says}}."""
    rows, sources = [], {}
    for page in SETTINGS_PAGES:
        text, header = doc(os.path.join('docs', page)), None
        sources[page] = dict(re.findall(r'^- \[(\w+)\] (.+)$', text, re.M))
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip('|').split('|')] if line.startswith('|') else None
            if cells and cells[:3] == ['method', 'tasks', 'model']:
                header = cells
            elif cells and header and not line.startswith('|---') and len(cells) == len(header):
                keys = lambda cell: [k for group in re.findall(r'\[([\w, ]+)\]', cell) for k in group.split(', ')]
                row = {name: (c.split(' [')[0].strip(), keys(c)) for name, c in zip(header[3:], cells[3:])}
                rows.append((page, row, cells[:3]))
            elif not line.startswith('|'):
                header = None
    return rows, sources


def number(x):
    return f'{x:g}'.replace('e-0', 'e-').replace('e+0', 'e+')


def effective(argv, world, monkeypatch):
    """The settings of a ledger command as parse_args resolves them on a GPU: {column: value}, as the tables write them."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    args = train.parse_args(argv)
    cls = xlt.method_class(args)
    grid = xlt.search_grid(cls.GRID, args.search) if getattr(args, 'search', None) is not None else {}
    listed = lambda name, one: ', '.join(map(number, grid[name])) if name in grid else number(one)
    qa = args.task in data.TASKS and data.TASKS[args.task].family == 'qa'
    rule = args.select or cls.select
    kept = {'en': 'best en dev', 'average': 'best dev average', 'last': 'last', 'loss': 'lowest held-out loss',
            'train_lang': 'best dev of --train_lang'}[rule]
    task, split, langs, first = cls.selects_on(args) or (args.task, 'dev', None, None)
    kept += f' on {task} {split}' * ((task, split) != (args.task, 'dev')) + (f' ({", ".join(langs)})' if langs else '')
    kept += f' (its first {first} a language)' * bool(first)
    every = args.eval_every if rule == 'loss' else args.eval_steps
    kept += (f' every {every} steps' if every else ' each epoch') * (rule != 'last')
    if getattr(args, 'average_last', None):
        kept = f'the mean of the last {args.average_last} checkpoints, one every {args.eval_every} steps'
    seeds = args.seeds or ([s['seed'] for s in cls.stages(args).values()] if args.method == 'xla' else [args.seed])
    return args, cls, {
        'lr': listed('lr', args.lr),
        'length': f'{args.steps} steps' if args.steps else f'{listed("epochs", args.epochs)} epochs',
        'batch': f'{args.max_tokens * world * args.grad_accum} tokens' if args.max_tokens else listed(
            'batch_size', args.batch_size),
        'max len': f'{args.max_len}' + f', stride {args.doc_stride}' * qa,
        'warm-up': f'{args.warmup_steps} steps' if args.warmup_steps else f'{args.warmup:.0%}' if args.warmup else '0',
        'weight decay': number(args.weight_decay) + ', every parameter' * (cls.DECAY_ALL and args.weight_decay > 0),
        'clip': number(args.clip) + ' by value' * (args.clip_by == 'value'),
        'seed': ', '.join(map(str, seeds)), 'precision': args.precision,
        'kept': ('each point ' + kept + '; the grid\'s best dev average') if grid else kept}


def row_of(rows, argv, args):
    """The settings row of a command: its method (with the flags the row names), task and preset; the most flags."""
    found = []
    for page, row, (methods, tasks, models) in rows:
        for entry in methods.replace('`', '').split(', '):
            name, *flags = entry.split()
            given = [(a, b) for a, b in zip(argv, argv[1:] + [''])]  # each option with what follows it
            named = all((f, v) in given if v and not v.startswith('--') else f in argv  # the row's flags, as given
                        for f, v in zip(flags, flags[1:] + ['']) if f.startswith('--'))
            listed = lambda cell, value: value in cell.replace('`', '').split(', ')
            if name == args.method and named and listed(tasks, args.task) and listed(models, args.model):
                found.append((len(flags), page, row))
    found.sort(key=lambda f: -f[0])
    assert found and (len(found) == 1 or found[0][0] > found[1][0]), (argv, [(n, p) for n, p, _ in found])
    return found[0][1], found[0][2]


def test_every_ledger_command_runs_its_methods_settings_as_the_table_says(monkeypatch):
    """Every training command of the ledger, resolved as a dry run resolves it, has each setting its method page's
    table gives (lr, length, batch, length of inputs, warm-up, weight decay, clipping, seed, precision, the kept
    checkpoint, and the options its 'other' cell names); every value there has a source defined under the table."""
    rows, sources = settings_rows()
    assert len(rows) >= 25
    for page, row, _ in rows:
        assert set(row) == set(SETTINGS), (page, row)
        for column, (value, keys) in row.items():
            assert value and (keys or value == '-'), (page, column, value)
            assert set(keys) <= set(sources[page]), (page, column, set(keys) - set(sources[page]))
    for page, defined in sources.items():
        for key, what in defined.items():
            assert (what.startswith('ours') if key.startswith('o') else re.search(
                r'[0-9a-f]{7,10}|paper|Table|Section|Appendix|README', what)), (page, key, what)
    for label, world, argv in reproduction_commands(labelled=True):
        args, cls, got = effective(argv, world, monkeypatch)
        if xlt.task_family(args) == 'retrieval':
            continue  # nothing trained: its settings are docs/evaluation.md's
        page, row = row_of(rows, argv, args)
        for column, value in got.items():
            assert row[column][0] == value, (label, argv, page, column, row[column][0], value)
        for pair in filter(None, row['other'][0].split('; ')) if row['other'][0] != '-' else []:
            name, value = pair.split(' ', 1)
            assert str(getattr(args, name)) == value or number(getattr(args, name)) == value, (argv, name, value)


def test_no_command_of_an_as_run_row_uses_a_setting_of_ours(monkeypatch):
    """A ledger row "as run" runs its paper's settings: none of its commands' settings rows cites one of ours."""
    rows, _ = settings_rows()
    as_run = {group for _, _, status, cited in ledger_rows() if status.startswith('as run') for group in cited}
    for label, world, argv in reproduction_commands(labelled=True):
        args, _, _ = effective(argv, world, monkeypatch)
        if label in as_run and xlt.task_family(args) != 'retrieval':
            page, row = row_of(rows, argv, args)
            ours = [column for column, (_, keys) in row.items() if any(k.startswith('o') for k in keys)]
            assert not ours, (label, argv, page, ours)
