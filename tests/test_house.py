"""The house's shape, held: each module teaching first and machinery below one divider; the functions the README's
tour, docs/reading.md's flagship path and its equation index name all above it; the line budgets; one mechanism
for what an option changes, --group_by_length too."""
import ast
import functools
import json
import os
import re

import pytest

import train
import xlt
from conftest import doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ('layers', 'data', 'eval', 'xlt', 'train')
DIVIDER = re.compile(r'# === Machinery: .+ ===')


@functools.lru_cache
def lines_of(module):
    return open(os.path.join(ROOT, f'{module}.py'), encoding='utf-8').read().splitlines()


@functools.lru_cache
def divider(module):
    """The line number of the module's one divider."""
    found = [n for n, line in enumerate(lines_of(module), 1) if DIVIDER.fullmatch(line)]
    assert len(found) == 1, f'{module}.py has {len(found)} machinery dividers, not one'
    return found[0]


@functools.lru_cache
def definitions(module):
    """{name or Class.name: (first line, its non-blank lines)} of a module's functions and classes (a class's own:
    its line and docstring)."""
    lines, out = lines_of(module), {}
    for node in ast.parse('\n'.join(lines)).body:
        for n in [node] + (node.body if isinstance(node, ast.ClassDef) else []):
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                name = n.name if n is node else f'{node.name}.{n.name}'
                start = min([d.lineno for d in n.decorator_list] + [n.lineno])
                end = n.body[1].lineno - 1 if isinstance(n, ast.ClassDef) and len(n.body) > 1 else n.end_lineno
                out[name] = (start, [line for line in lines[start - 1:end] if line.strip()])
    return out


def tour_names():
    """(module, name) of every function the README's tour names: `module.py: name` and (module.name)."""
    block = re.search(r'```\n(.*?)```', doc('README.md', 'A tour'), re.S).group(1)
    named = re.findall(r'\b(\w+)\.py: ([\w.]+)', block)
    named += re.findall(r'\b(data|eval|layers|xlt|train)\.(?!py\b)([A-Za-z_][\w.]*\w)', block)
    return named


def flagship_rows():
    """(module, name, lines) of docs/reading.md's table of the flagship command's path."""
    return [(m, n, int(c)) for m, n, c in re.findall(r'^\| `(\w+)\.py: ([\w.]+)` \| (\d+) \|',
                                                      doc('docs/reading.md', 'The flagship path'), re.M)]


def index_names():
    return re.findall(r'`(\w+)\.py: ([\w.]+)`', doc('docs/reading.md', 'Equation index'))


def test_every_module_reads_teaching_first_and_what_the_guides_name_sits_above_its_divider():
    """One divider a module, and every function the tour, the flagship path and the equation index name, above it:
    a reader who follows them never meets the machinery."""
    named = tour_names() + [(m, n) for m, n, _ in flagship_rows()] + index_names()
    assert len(tour_names()) >= 15 and len(flagship_rows()) >= 30 and len(index_names()) >= 40
    for module in MODULES:
        divider(module)
    for module, name in named:
        found = definitions(module)
        assert name.split('.')[0] in found, f'{module}.py has no {name}'
        assert found[name.split('.')[0]][0] < divider(module), f'{module}.py: {name} is below the divider'


def test_the_flagship_path_is_the_code_s_own_and_names_no_other_method():
    """docs/reading.md's table: every function of the path with its line count the code's own, the sum stated; the
    trainer's functions there name no method."""
    rows, text = flagship_rows(), doc('docs/reading.md', 'The flagship path')
    assert {('train', 'main'), ('train', 'train'), ('train', 'Run.fit'), ('xlt', 'Filter.loss'), ('train', 'Run.stage'),
            ('xlt', 'Taught.train_teacher'), ('xlt', 'Taught.soft_labels'), ('xlt', 'teacher_kl')} <= {
        (m, n) for m, n, _ in rows}  # the teacher's stage and Eq. 6's KL branch too
    for module, name, count in rows:
        lines = definitions(module)[name][1]
        assert len(lines) == count, f'{module}.py: {name} has {len(lines)} lines, the table says {count}'
        if module == 'train':
            assert not re.search(r'\b(xla|veco|xmixup|filter|pretrain|teacher|warmup_dir|self_teach)\b',
                                 '\n'.join(lines), re.I), name
    assert f'{sum(c for _, _, c in rows)} lines in all' in text


def test_the_budgets_hold():
    """Non-blank lines (no statement joined to save one, lines of at most 120 characters: tests of their own): above
    the dividers at most 3,450, train.py's part at most 400, the flagship path (the teacher's run and the student's)
    at most 520, the package 8,260: issue 60's 8,200, the 37 lines its last analyses (XLA's figures, VECO's curve,
    X-Mixup's representations, XTREME's Table 5) could not fit after a trimming pass that took 223, and 22 of the
    review's mends (lines of CJK text wrapped again, a stage's checks one line under DDP, --predict's demo data)."""
    above = {m: sum(1 for line in lines_of(m)[:divider(m) - 1] if line.strip()) for m in MODULES}
    whole = sum(1 for m in MODULES for line in lines_of(m) if line.strip())
    assert sum(above.values()) <= 3450, above
    assert above['train'] <= 400
    assert sum(c for _, _, c in flagship_rows()) <= 520
    assert whole <= 8260, whole


def test_every_trainer_option_says_what_it_changes():
    """One mechanism: each option of the trainer and of every method is an Option whose `changes` says whether
    results, scores or nothing depend on it; --group_by_length (and --no_group_by_length) is one of them."""
    options = train.OPTIONS + tuple(o for c in xlt.classes() for o in c.OPTIONS)
    assert all(o.changes in ('results', 'scores', 'nothing') for o in options)
    assert {o.name for o in options if o.changes == 'nothing'} >= {'out', 'grad_accum', 'resume', 'dry_run'}
    assert {o.name for o in options if o.changes == 'scores'} >= {'task', 'max_len', 'translate_test', 'beam'}
    grouping = next(o for o in train.OPTIONS if o.name == 'group_by_length')
    assert grouping.negated and grouping.changes == 'results'
    assert [train.parse_args(['--demo', *flag]).group_by_length for flag in ([], ['--group_by_length'],
                                                                             ['--no_group_by_length'])] == [
        False, True, False]  # the releases' random batches by default, and either flag
    assert train.parse_args(['--group_by_length']).group_by_length and not train.parse_args([]).group_by_length


def test_a_finished_stage_batched_the_other_way_is_not_reused(tmp_path):
    """--group_by_length is compared as every option is: XLA's warm-ups kept in --warmup_dir for other runs, finished
    with random batches, are refused by a run that groups by length, and serve one of the same batching."""
    argv = ['--method', 'xla', '--task', 'panx', '--train_lang', 'de', '--demo', '--out', str(tmp_path / 'run'),
            '--warmup_dir', str(tmp_path / 'warm')]
    args = train.parse_args(argv + ['--group_by_length'])
    cls = xlt.method_class(args)
    for name in cls.stages(args):  # the finished warm-ups, batched at random
        stage = train.stage_settings(train.parse_args(argv + ['--no_group_by_length']), cls, name)
        os.makedirs(stage.out)
        open(os.path.join(stage.out, 'config.json'), 'w').write(json.dumps(vars(stage)))
        open(os.path.join(stage.out, 'results.json'), 'w').write('{}')
    assert train.differences(train.read_config(stage.out), train.stage_settings(args, cls, name)) == ['group_by_length']
    with pytest.raises(SystemExit, match=r'holds a finished warmup-1 with --group_by_length False \(this run: True\)'):
        train.check_stages(args, cls)
    train.check_stages(train.parse_args(argv + ['--no_group_by_length']), cls)  # the same batching: reused


def test_the_loop_is_short_and_no_module_holds_state_set_at_run_time():
    """train() reads as pseudo-code in at most 30 lines; no module of the package has a global statement; xlt.py
    reads an option's value or default in one place (given_or), never by getattr(args, ...) elsewhere."""
    assert len(definitions('train')['train'][1]) <= 30
    for module in MODULES:
        tree = ast.parse('\n'.join(lines_of(module)))
        found = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Global)]
        assert not found, f'{module}.py has a global statement at line {found[0]}'
    start, body = definitions('xlt')['given_or']
    reads = [n for n, line in enumerate(lines_of('xlt'), 1) if 'getattr(args' in line]
    assert reads and all(start <= n < start + len(body) for n in reads), f'xlt.py reads getattr(args, ...) at {reads}'


def test_no_conditional_expression_is_split_over_lines_above_the_dividers():
    """A reader meets `a if c else b` on one line: one split over lines is written as an if statement instead."""
    for module in MODULES:
        tree = ast.parse('\n'.join(lines_of(module)))
        split = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.IfExp) and n.lineno != n.end_lineno
                 and n.lineno < divider(module)]
        assert not split, f'{module}.py splits a conditional expression over lines at line {split[0]}'
