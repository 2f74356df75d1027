"""The command line as a user meets it: twenty mistakes, each one line on stderr and nothing left
behind; Ctrl-C says how to go on; default folders keep runs apart and a finished run of other
settings is not replaced silently; errors name the real problem; progress bars only on a terminal."""
import io
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import data
import layers
import train
import xlt
from conftest import demo_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A folder as a user has it: a finished demo run, a file, an empty folder, files that are not
    checkpoints (text, empty, a torch file holding a list)."""
    root = tmp_path_factory.mktemp('user')
    demo_run(root / 'finished', data.make_demo(str(root / 'demo-data'), n_train=200, n_eval=30), ['--task', 'pawsx', '--epochs', '1'])
    (root / 'notes.txt').write_text('a file\n')
    (root / 'empty').mkdir()
    (root / 'bad.pt').write_text('101\n')
    (root / 'empty.pt').write_text('')
    torch.save([1, 2], root / 'list.pt')
    return root


MISTAKES = [  # (the command, what its one line must say)
    ('train.py --task xnlii', "unknown task 'xnlii'"),
    ('train.py --method filtr --demo', "unknown method 'filtr'"),
    ('train.py --demo --lr -1', '--lr -1.0 is out of range'),
    ('train.py --demo --epochs 0', '--epochs 0 is out of range'),
    ('train.py --demo --colour red', 'unrecognized arguments: --colour red'),
    ('train.py --demo --out notes.txt', '--out notes.txt: notes.txt is a file'),
    ('train.py --demo --out notes.txt/run', 'notes.txt is a file; give a folder for the run'),
    ('train.py --data_dir notes.txt', '--data_dir notes.txt is a file'),
    ('train.py --data_dir empty --spm demo-data/sentencepiece.bpe.model', 'empty holds no xnli data'),
    ('train.py --data_dir demo-data --spm notes.txt --from_scratch --model tiny', 'notes.txt is not a sentencepiece model'),
    ('train.py --demo --spm notes.txt', 'notes.txt is not a sentencepiece model'),  # found once the demo data is made
    ('train.py --demo --task pawsx --resume --out nothing-here', 'nothing to resume in nothing-here'),
    ('train.py --demo --method filter --task xnli --teacher finished', '--teacher finished is a run of pawsx, not xnli'),
    ('eval.py --predictions finished/predictions --labels demo-data/labels --out notes.txt/s.json --demo', 'Not a directory'),
    ('train.py --data_dir nowhere', 'nowhere holds no xnli data'),
    ('train.py --data_dir empty', 'empty holds no xnli data'),
    ('train.py --demo --init bad.pt', 'bad.pt is not a PyTorch file: a checkpoint is'),
    ('train.py --demo --init empty.pt', 'empty.pt is empty: a checkpoint is'),
    ('train.py --demo --init list.pt', 'list.pt holds a list, not XLM-R weights'),  # found only once demo data is made
    ('train.py --demo --model huge', "unknown model 'huge'"),
    ('train.py --demo --batch_size 1 --grad_accum 2', 'cannot be cut into 1 processes x --grad_accum 2'),
    ('train.py --demo --method translate-train', 'translate-train needs --train_lang, one of de, zh'),
    ('train.py --demo --method zeroshot --self_teach', '--self_teach belongs to --method filter or xmixup'),
    ('train.py --demo --method filter --k 9', '--k 9 + --m 1 does not fit'),
    ('train.py --demo --task pawsx --out finished --lr 5e-4', 'finished holds a finished run with --lr 0.001'),
    ('train.py --demo --eval_only --out nothing-here', 'best.pt not found: --eval_only evaluates a finished run'),
    ('eval.py --collect empty --out submission', 'empty is not a finished run (no results.json)'),
    ('data.py download --task panx --out data', 'PAN-X alone is converted from a file you hold'),
    ('train.py --out empty --predict notes.txt', 'empty has no results.json; give the run\'s folder'),
    ('train.py --out finished --predict notes.txt notes.txt', '--predict takes FILE, and for a paired method on QA'),
    ('train.py --out finished --predict notes.txt', 'notes.txt, line 1: not a<TAB>b<TAB>[label] with labels of pawsx'),
    ('train.py --demo --task panx --langs de,xx', "--langs: panx has no language 'xx'; choose from en, de, zh"),
    ('train.py --demo --method veco --task pretrain --langs de', 'pretrain has no language \'de\'; it is not an XTREME'),
    ('layers.py convert bad.pt xlmr.pt', 'bad.pt is not a PyTorch file'),
    ('train.py --demo --method translate-train --train_lang en', 'translate-train needs --train_lang, one of de, zh (not en)'),
    ('train.py --demo --method in-language --task udpos --train_lang fr', 'in-language needs --train_lang, one of en, de, zh (not'),
]


def files_under(folder):
    return {os.path.join(d, f) for d, _, names in os.walk(folder) for f in names} | {d for d, _, _ in os.walk(folder)}


@pytest.mark.slow
def test_user_mistakes_each_end_in_one_line_and_leave_nothing(workdir, monkeypatch, capsys):
    """Each command's main in this process (a process for each took 19 s): it ends in SystemExit
    with one line and writes nothing to stderr; two commands run as a user runs them show that
    such an exit is one line on stderr and no traceback."""
    import eval as ev
    before, mains = files_under(workdir), {'train.py': train.main, 'eval.py': ev.main, 'data.py': data.main,
                                           'layers.py': layers.main}
    monkeypatch.chdir(workdir)
    for command, message in MISTAKES:
        with pytest.raises(SystemExit) as end:
            mains[command.split()[0]](command.split()[1:])
        line, err = str(end.value), capsys.readouterr().err
        assert line.startswith('error: ') and '\n' not in line and message in line and not err, (command, line, err)
    for command, message in (MISTAKES[4], MISTAKES[12]):  # a usage mistake, and one found once a run is set up
        res = subprocess.run([sys.executable, os.path.join(ROOT, command.split()[0]), *command.split()[1:]], cwd=workdir,
                             capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
        assert res.returncode != 0 and res.stderr.count('\n') == 1 and message in res.stderr and 'Traceback' not in res.stderr
    assert files_under(workdir) == before  # no run folder, demo data, submission or download folder left


@pytest.mark.slow
def test_ctrl_c_names_the_last_checkpoint_and_how_to_resume(tmp_path):
    """A real SIGINT once the first epoch's line is out (an event, not a sleep). The child gets
    SIGINT's default action back: a shell that starts pytest in the background (`cmd &` in a
    script) hands its children SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    os.makedirs(tmp_path / 'run')
    os.symlink(data.make_demo(str(tmp_path / 'demo-data'), n_train=200, n_eval=30), tmp_path / 'run' / 'demo-data')
    proc = subprocess.Popen([sys.executable, 'train.py', '--demo', '--task', 'pawsx', '--epochs', '50', '--save_minutes', '0', '--log_every', '5',
                             '--out', str(tmp_path / 'run')], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:  # last.pt is written at every log line (5 steps), so it exists before epoch 1 ends
        if line.startswith('epoch 1/50 '):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert line.startswith('epoch 1/50 '), out + err
    step = torch.load(tmp_path / 'run' / 'last.pt', weights_only=True)['state']['step']
    assert proc.returncode != 0 and err.count('\n') == 1 and 'Traceback' not in err
    assert f'the last checkpoint is step {step} ({tmp_path / "run" / "last.pt"})' in err and '--resume' in err
    assert 'epoch 50/50' not in out



def test_ctrl_c_after_a_training_ended_says_that_resume_goes_on(tmp_path):
    """A training that ended has left its last.pt for trained.json: Ctrl-C after it names that."""
    args = train.parse_args(['--demo', '--task', 'pawsx', '--out', str(tmp_path / 'run')])
    os.makedirs(tmp_path / 'run' / 'teacher')
    (tmp_path / 'run' / 'teacher' / 'trained.json').write_text('{"step": 8, "epoch": 1, "best": 50.0}')
    assert train.interrupted(args) == (f'interrupted after a training ended ({tmp_path / "run" / "teacher"}): run the '
                                       'same command with --resume to go on')


def test_default_folders_keep_apart_what_changes_the_result():
    folder = lambda *argv: train.parse_args(['--task', 'xnli', *argv]).out
    runs = [folder('--method', 'filter'), folder('--method', 'filter', '--self_teach'), folder('--translate_test'),
            folder(), folder('--seed', '2'), folder('--model', 'large'), folder('--method', 'translate-train', '--train_lang', 'de'),
            folder('--method', 'veco', '--translate_train_all'), folder('--demo'),
            folder('--method', 'xmixup', '--seen_langs', 'bg,el')]
    assert len(set(runs)) == len(runs)
    assert runs[:5] == ['runs/xnli-filter', 'runs/xnli-filter-self-teach', 'runs/xnli-zeroshot-translate-test',
                        'runs/xnli-zeroshot', 'runs/xnli-zeroshot-seed2']


def test_a_check_that_fails_in_a_stage_is_one_line_not_one_a_process(tmp_path, monkeypatch):
    """A stage's run is checked inside its parent's one_process_errors: what its checks find, every process finds
    alike, so process 1 of 2 stays silent instead of naming itself."""
    os.makedirs(tmp_path / 'data' / 'xnli')
    args = train.parse_args(['--task', 'xnli', '--data_dir', str(tmp_path / 'data'), '--out', str(tmp_path / 'run')])
    monkeypatch.setenv('RANK', '1')
    monkeypatch.setenv('WORLD_SIZE', '2')
    with pytest.raises(SystemExit) as stopped, train.one_process_errors():
        train.check(args, 2)
    assert stopped.value.code == 1
    monkeypatch.setenv('RANK', '0')
    with pytest.raises(SystemExit, match=r'^error: .* holds no xnli data'), train.one_process_errors():
        train.check(args, 2)


def test_seen_langs_train_on_those_languages_alone_and_evaluate_on_all():
    """X-Mixup's Table 6: --seen_langs keeps the other languages' translations out of training, not out of the test."""
    def planned(*argv):
        args = train.parse_args(['--task', 'xnli', '--demo', *argv])
        return {os.path.basename(path) for path, _, _ in train.planned_files(args, xlt.method_class(args))}

    seen, every = planned('--method', 'xmixup', '--seen_langs', 'de'), planned('--method', 'xmixup')
    assert every - seen == {'en-zh-translated.tsv', 'train-en-zh-en.tsv'}
    assert {'en-de-translated.tsv', 'test-zh.tsv', 'test-de.tsv'} <= seen
    assert planned('--method', 'translate-train-all', '--seen_langs', 'zh') & {'en-de-translated.tsv'} == set()
    for wrong in (['--method', 'zeroshot', '--seen_langs', 'de'], ['--method', 'xmixup', '--seen_langs', 'xx']):
        with pytest.raises(SystemExit, match='--seen_langs .*: name some of de,zh, with a method that trains on every'):
            planned(*wrong)


def test_a_finished_run_is_replaced_only_with_its_settings_or_overwrite(workdir, tmp_path, capsys):
    out = tmp_path / 'run'
    demo_run(out, os.path.join(workdir, 'demo-data'), ['--task', 'pawsx', '--epochs', '1'])
    first = json.load(open(out / 'results.json'))
    with pytest.raises(SystemExit, match='holds a finished run with --epochs 1 .this run: 2.: give another --out, or add --overwrite'):
        demo_run(out, os.path.join(workdir, 'demo-data'), ['--task', 'pawsx', '--epochs', '2'])
    assert json.load(open(out / 'results.json')) == first
    demo_run(out, os.path.join(workdir, 'demo-data'), ['--task', 'pawsx', '--eval_only'])  # no training options to repeat
    with pytest.raises(SystemExit, match='holds a finished run with --translate_test False .this run: True.'):
        demo_run(out, os.path.join(workdir, 'demo-data'), ['--task', 'pawsx', '--eval_only', '--translate_test'])
    demo_run(out, os.path.join(workdir, 'demo-data'), ['--task', 'pawsx', '--epochs', '2', '--overwrite'])
    assert json.load(open(out / 'config.json'))['epochs'] == 2
    assert len([line for line in open(out / 'log.jsonl') if '"dev"' in line]) == 2  # the new run's log alone
    printed = capsys.readouterr().out
    assert 'zeroshot on pawsx in ' in printed and ': a new run\n  model     tiny, from random weights' in printed


@pytest.mark.parametrize('content,message', [
    (b'101\n', 'is not a PyTorch file'), (b'', 'is empty'), ([1, 2], 'holds a list, not XLM-R weights'),
    ({'method': {}, 'optimizer': {}}, 'holds a dict with the keys method, optimizer, not XLM-R weights')])
def test_a_file_that_is_not_a_checkpoint_is_named_as_such(tmp_path, content, message):
    path = tmp_path / 'x.pt'
    path.write_bytes(content) if isinstance(content, bytes) else torch.save(content, path)
    with pytest.raises(layers.CheckpointError) as err:
        layers.load_pretrained(str(path))
    assert message in str(err.value) and 'a checkpoint is a file python layers.py convert wrote' in str(err.value)
    assert 'convert it' not in str(err.value)  # convert would give the same advice back


def test_progress_bars_only_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    for stream, shown in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, 'stderr', stream)
        bar = data.bar(range(3), desc='x', file=stream)
        list(bar)
        bar.close()
        assert ('3/3' in stream.getvalue()) == shown


@pytest.mark.parametrize('command', ['data.py download --help', 'layers.py convert --help'])
def test_the_other_commands_explain_themselves(command, capsys):
    """Their mains in this process (test_download and test_layers run each as a command)."""
    main = {'data.py': data.main, 'layers.py': layers.main}[command.split()[0]]
    with pytest.raises(SystemExit) as end:
        main(command.split()[1:])
    out = capsys.readouterr().out
    assert end.value.code in (0, None) and 'example:\n  python ' + command.split()[0] in out
    assert out.count('\n') > 12  # what it does, what it takes and writes, an example


@pytest.mark.slow
def test_a_demo_from_the_pre_trained_model_runs_again_evaluates_and_resumes(tmp_path):
    """The demo's pre-trained start is the same --init for every run of a folder: the same command
    again replaces its run, --eval_only evaluates it, and --resume goes on."""
    from conftest import quick_pretrained
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=60, n_eval=10)
    quick_pretrained(demo, tmp_path / 'pretrain-veco-demo', steps=10)  # where the demo keeps its pre-trained model
    argv = ['--method', 'xmixup', '--task', 'pawsx', '--epochs', '1']
    for extra in ([], [], ['--eval_only'], ['--resume']):
        demo_run(tmp_path / 'xmixup', demo, argv + extra)
    config = json.load(open(tmp_path / 'xmixup' / 'config.json'))
    assert config['init'] == str(tmp_path / 'pretrain-veco-demo' / 'best.pt')


@pytest.mark.slow
def test_overwrite_trains_a_teacher_of_the_new_settings(workdir, tmp_path):
    demo = os.path.join(workdir, 'demo-data')
    argv = ['--method', 'filter', '--task', 'pawsx', '--self_teach', '--epochs', '1']
    demo_run(tmp_path / 'st', demo, argv)
    first = torch.load(tmp_path / 'st' / 'p_teacher.pt', weights_only=True)
    demo_run(tmp_path / 'st', demo, argv + ['--lr', '5e-4', '--overwrite'])
    assert json.load(open(tmp_path / 'st' / 'teacher' / 'config.json'))['lr'] == 5e-4  # the teacher was trained again
    assert not all(torch.equal(a, b) for a, b in zip(first, torch.load(tmp_path / 'st' / 'p_teacher.pt', weights_only=True)))


def test_the_banner_says_the_demo_s_pre_trained_model_is_made_only_when_it_is(tmp_path):
    argv = ['--method', 'xla', '--task', 'panx', '--demo', '--out', str(tmp_path / 'run')]
    planned = lambda args: train.plan(args, 1)
    made = lambda *more: 'made first' in planned(train.parse_args([*argv, *more]))['model']
    assert made() and not made('--init', str(tmp_path / 'converted.pt'))  # a checkpoint of the user's is not made
