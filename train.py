"""Train a cross-lingual transfer method on an XTREME task, then evaluate it in every language.

    python train.py --method filter --task xnli --demo             # built-in data, tiny model, CPU
    python train.py --method translate-train-all --task pawsx --init xlmr-base.pt --data_dir data/
    torchrun --nproc_per_node 8 train.py ...                       # the same run on 8 GPUs (DDP)

The trainer: the command line, the run folder, one training loop for every method and the stages
a method's procedure asks for (xlt.Method.procedure, handed a Run). A run writes to --out:
config.json, log.jsonl, last.pt (resume point), best.pt (the kept model), results.json and .txt,
and the test predictions in the leaderboard layout (predictions/<task>/test-<lang>.<ext>).
"""
import argparse
import datetime
import functools
import gc
import json
import math
import os
import shutil
import signal
import socket
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import data
import eval as ev
import layers
import xlt
from xlt import AT_LEAST_1, NON_NEGATIVE, POSITIVE, SHARE, Option

# The demo: a tiny model from scratch, no warm-up (a ramp from 0 leaves it on a plateau for some seeds), random batches
# (length tells the demo's labels: grouped batches would each hold one); 8 epochs, QA 15; a method's DEMO changes these.
DEMO = {'model': 'tiny', 'lr': 1e-3, 'warmup': 0.0, 'batch_size': 32, 'group_by_length': False}
OPTIONS = (  # the trainer's options; each method's own are its class's OPTIONS (xlt.py)
    Option('method', str, f'one of {", ".join(xlt.METHODS)}', default='zeroshot'),
    Option('task', str, f'one of {", ".join(data.TASKS)}; with --method veco also pretrain, translate', default='xnli'),
    Option('demo', bool, 'generated data and a tiny model: runs in a minute on a CPU'),
    Option('model', str, f'preset: {", ".join(layers.CONFIGS)} (default base; tiny with --demo)'),
    Option('init', str, 'converted XLM-R checkpoint (python layers.py convert) or a run\'s best.pt', path='checkpoint'),
    Option('from_scratch', bool, 'random weights: real data without --init, a demo that would start pre-trained'),
    Option('spm', str, 'XLM-R\'s sentencepiece model (default: the one in --data_dir)'),
    Option('vocab', str, 'BERT\'s vocab.txt (default: the one beside --init, else in --data_dir)'),
    Option('dict', str, 'fairseq dict.txt --init was trained with (default: one beside it, as VECO\'s NLG model)'),
    Option('data_dir', str, 'XTREME data in the layout of docs/data.md', default='data'),
    Option('out', str, 'run folder (default runs/<task>-<method>-<each choice that changes the result>)'),
    Option('lr', help='peak learning rate (default: per task, from the papers)', valid=POSITIVE),
    Option('epochs', int, 'default 4 (2 for xquad and mlqa)', AT_LEAST_1),
    Option('batch_size', int, 'global batch size, over all processes (default 64)', AT_LEAST_1),
    Option('grad_accum', int, 'micro-batches per process and step', AT_LEAST_1, default=1),
    Option('max_len', int, 'max tokens per input (default 128; QA 384)', (lambda v: 8 <= v <= 512, '8 to 512 tokens')),
    Option('warmup', help='share of the steps with a rising learning rate (default 0.1; demo 0)', valid=SHARE),
    Option('warmup_steps', int, 'the warm-up in steps instead (VECO\'s SQuAD script: 500)', NON_NEGATIVE),
    Option('doc_stride', int, 'QA: tokens between a context\'s window starts (default 128; VECO 64)', AT_LEAST_1),
    Option('weight_decay', help='default 0.01 (VECO: its scripts\' values)', valid=NON_NEGATIVE),
    Option('clip', help='gradient norm clipping (default 1.0; translation 0.1)', valid=POSITIVE),
    Option('dropout', help='override the model\'s dropout', valid=SHARE),
    Option('attn_dropout', help='override the attention dropout (default: --dropout\'s value)', valid=SHARE),
    Option('seed', int, 'seed of the head, the batches and dropout (default 1)', NON_NEGATIVE, default=1),
    Option('precision', str, 'bf16, fp16 (with a loss scaler) or fp32 (default: bf16 on a GPU that has it, fp16 on one '
           'that has not, fp32 on the CPU)', choices=('bf16', 'fp16', 'fp32')),
    Option('translate_test', bool, 'evaluate on the test sets translated into English'),
    Option('langs', lambda text: [lang for lang in text.split(',') if lang], 'the target languages to run, e.g. de,sw '
           '(XTREME\'s --predict_languages): the others\' files are not read; English, the source, runs too'),
    Option('layer', int, 'retrieval: layer pooled (default XTREME\'s: BUCC 20, Tatoeba 14 of 24; 8 of 12)', AT_LEAST_1),
    Option('grad_checkpoint', bool, 'recompute each block in backward: less memory, about a third more compute'),
    Option('gpu_memory', help='GiB of the GPU to plan for (default: the GPU found): the plan estimates a process\'s '
           'peak and says whether it fits, or what would make it fit', valid=POSITIVE),
    Option('eval_batch_size', int, 'examples per evaluation batch', AT_LEAST_1, default=64),
    Option('save_minutes', help='minutes between resume checkpoints (last.pt; also at each epoch\'s end and when '
           'SIGTERM asks); 0: at every log line', valid=NON_NEGATIVE, default=30.0),
    Option('no_cache', bool, 'tokenize the data into a temporary folder, not once into <data_dir>/.cache'),
    Option('eval_steps', int, 'also select within an epoch, every N steps (VECO: XNLI 500, SQuAD 200)', AT_LEAST_1),
    Option('log_every', int, 'steps between log.jsonl lines, each their mean (one host sync)', AT_LEAST_1, default=10),
    Option('compile', bool, 'torch.compile each block (the first steps compile; outputs as without, to 1e-5)'),
    Option('resume', bool, 'continue from --out/last.pt'),
    Option('eval_only', bool, 'evaluate --out/best.pt (or --init) without training'),
    Option('predict', str, 'FILE [TRANSLATION]: the finished run in --out predicts FILE, a TSV of the task\'s '
           'columns or a QA JSON (docs/runs.md), into --out/predicted/; nothing else is read', nargs='+'),
    Option('overwrite', bool, 'replace a finished run of other settings in --out (else such a folder is refused)'),
    Option('dry_run', bool, 'check the options and every file the run reads, print the plan, stop (writes nothing)'),
    Option('halt_after', int, argparse.SUPPRESS),  # tests: die abruptly after this many steps
    Option('term_after', int, argparse.SUPPRESS))  # tests: a SIGTERM to itself after this many steps
# the trainer's options that leave results alike (FREE), and those --eval_only's scores depend on (SCORED)
FREE = ('spm', 'vocab', 'data_dir', 'out', 'grad_accum', 'grad_checkpoint', 'gpu_memory', 'eval_batch_size',
        'save_minutes', 'log_every', 'compile', 'no_cache', 'resume', 'eval_only', 'predict', 'overwrite', 'dry_run',
        'halt_after', 'term_after')
SCORED = ('method', 'task', 'model', 'max_len', 'translate_test', 'layer', 'doc_stride', 'dict')
OPTIONS = tuple(o._replace(changes='nothing' if o.name in FREE else 'scores' if o.name in SCORED else 'results')
                for o in OPTIONS)


UNDER_WAY = False  # a run's checks passed: from here on an error may be one process's own


def fail(message, own=False):
    """One line on stderr: from the first process, for what every process finds alike; under DDP an error of one
    process's own (own) from each process that meets it, naming it."""
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    if own and world > 1:
        raise SystemExit(f'error (process {rank} of {world}): {message}')
    raise SystemExit(f'error: {message}' if rank == 0 else 1)


# ----------------------------------------------------------------------------------------
# The run of a command: check everything, hold the folder, set up the processes, run.

START = time.time()  # when main() began, for the total time a run reports


def main(argv=None):
    global START
    START = time.time()
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision != 'fp32'  # off autocast
    rank, world, device = setup_distributed() if not args.dry_run else (  # a dry run starts no process group
        int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1)), None)
    data.VERBOSE = rank == 0  # warnings about skipped data, once
    try:
        (predict if args.predict else execute)(args, rank, world, device)
    except (data.DataError, ev.EvalError, layers.CheckpointError, OSError) as e:  # once under way, maybe one's own
        fail(f'{e.filename}: {e.strerror}' if isinstance(e, OSError) and e.strerror else str(e), own=UNDER_WAY)
    except KeyboardInterrupt:
        fail(interrupted(args))
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# The command line: the trainer's options and each method's (xlt), checked, then the defaults.

def parse_args(argv=None):
    p = layers.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for o in OPTIONS:
        add_option(p, o)
    p.add_argument('--group_by_length', action='store_true', default=None, help='training batches of similar lengths, '
                   'little padding (the default but in the demo)')
    p.add_argument('--no_group_by_length', dest='group_by_length', action='store_false', default=None,
                   help='random training batches, as the papers\' scripts (the demo\'s default)')
    owners = {}  # a method option -> the classes that declare it; --help groups them by the first
    for c in xlt.classes():
        new = [o for o in c.OPTIONS if o.name not in owners]
        group = p.add_argument_group(f'options of {xlt.called([c])}') if new else None
        for o in c.OPTIONS:
            owners.setdefault(o.name, []).append(c)
        for o in new:
            add_option(group, o._replace(default=None))  # a method's defaults once it is the one that runs
    args = p.parse_args(argv)
    for o in OPTIONS + tuple(o for c in xlt.classes() for o in c.OPTIONS):  # before the defaults: 0 is not 'not given'
        value = getattr(args, o.name)
        if o.valid and value is not None and not all(math.isfinite(v) and o.valid[0](v) for v in np.atleast_1d(value)):
            fail(f'--{o.name} {" ".join(map(str, value)) if o.nargs else value} is out of range: give {o.valid[1]}')
    return configure(args, owners)


def add_option(parser, o):
    if o.type is bool:
        parser.add_argument(f'--{o.name}', action='store_true', help=o.help)
    else:
        parser.add_argument(f'--{o.name}', type=o.type, nargs=o.nargs, choices=o.choices, default=o.default,
                            help=o.help)



def configure(args, owners):
    """The method's class checks and fills its options (xlt), then the trainer's defaults and the run folder."""
    tasks = list(dict.fromkeys(task for c in xlt.classes() for task in c.TASKS))
    if args.task not in tasks:
        fail(f'unknown task {args.task!r}: choose one of {", ".join(tasks)}')
    if args.method not in xlt.METHODS:
        fail(f'unknown method {args.method!r}: choose one of {", ".join(xlt.METHODS)}')
    cls = xlt.method_class(args)
    if args.task not in cls.TASKS:
        others = [c for c in xlt.classes() if args.task in c.TASKS and args.task not in data.TASKS]
        hint = f': pass {xlt.called(others)}' if others else ''
        fail(f'{args.method} runs {", ".join(cls.TASKS)}, not {args.task}{hint}')
    for name, classes in owners.items():
        if getattr(args, name) is not None and getattr(args, name) is not False and cls not in classes:  # 0 is given
            fail(f'--{name} belongs to {xlt.called(classes)}, not to {args.method} on {args.task}')
    if args.translate_test and (family(args) not in ('classification', 'qa') or cls.paired):
        fail('--translate_test needs a method that reads one text and a task whose labels survive translation '
             '(tags would need a word alignment): drop --translate_test')
    demo = {**DEMO, **cls.DEMO} if args.demo else None
    args.model = args.model or (demo or {}).get('model', 'base')
    if args.model not in layers.CONFIGS:
        fail(f'unknown model {args.model!r}: choose one of {", ".join(layers.CONFIGS)}')
    args.stage = None  # a stage's own run says which it is; a method may name its run's (xlt)
    try:
        cls.configure(args, demo)
    except ValueError as e:
        fail(str(e))
    args.out = args.out or os.path.join('runs', '-'.join(cls.folder(args) + default_folder(args)))
    args.dict = args.dict or data.beside(args.init, 'dict.txt')
    if args.demo and not args.init and not args.from_scratch and cls.pretrained_start and args.model == demo['model']:
        args.init = demo_start(args.out)  # made by the run when missing; recorded alike by every run of the folder
    return args


def family(args):
    return data.TASKS[args.task].family if args.task in data.TASKS else xlt.method_class(args).family


def default_folder(args):
    """The rest of a default folder's name: translate-test, a preset or seed not the default, the demo."""
    return (['translate-test'] * args.translate_test + [args.model] * (args.model != ('tiny' if args.demo else 'base'))
            + [f'seed{args.seed}'] * (args.seed != 1) + ['demo'] * args.demo)


def demo_start(out):
    """The demo's pre-trained model: VECO pre-trained on the demo's text, beside the run folder."""
    return os.path.join(os.path.dirname(os.path.abspath(out)), 'pretrain-veco-demo', 'best.pt')


def makes_demo_start(args):
    """Does the run start from the demo's pre-trained model, which it makes first?"""
    return args.demo and args.init == demo_start(args.out) and not is_finished(os.path.dirname(args.init))


# ----------------------------------------------------------------------------------------
# Checks before anything is made, and the plan.

def check(args, world):
    """Everything that can be checked before anything is made: --out, the processes, the options against the model,
    every file the run reads, the checkpoints and runs it names, what --out holds. -> (files, meta-device model)."""
    cls = xlt.method_class(args)
    parent = os.path.dirname(first_missing(args.out) or os.path.abspath(args.out))
    if os.path.exists(args.out) and not os.path.isdir(args.out) or not os.path.isdir(parent):
        file = args.out if os.path.exists(args.out) else parent
        fail(f'--out {args.out}: {file} is a file; give a folder for the run')
    if not os.access(parent if not os.path.exists(args.out) else args.out, os.W_OK):
        fail(f'--out {args.out} cannot be written here: give a folder you can write to')
    if not args.demo and os.path.isfile(args.data_dir):
        fail(f'--data_dir {args.data_dir} is a file: give the data folder (the layout of docs/data.md)')
    for option, size in xlt.batch_sizes(args).items():
        if size < world * args.grad_accum:
            fail(f'--{option} {size} cannot be cut into {world} processes x --grad_accum {args.grad_accum}: raise '
                 f'--{option} or lower --grad_accum')
    model = check_options(args, cls)
    files = [] if args.demo else planned_files(args, cls)
    data.check_files(args.data_dir, args.task, args.method, files, model_family(args))
    check_init(args)
    for o in OPTIONS + cls.OPTIONS:  # the checkpoints and runs it names (the demo's start is made by the run)
        value = getattr(args, o.name)
        if value and o.path == 'run':
            check_run(args, o.name, value)
        elif value and o.path == 'checkpoint' and not (args.demo and value == demo_start(args.out)):
            layers.check_format(value)  # a CheckpointError: main()'s one line
    kept = os.path.exists(os.path.join(args.out, cls.KEEPS)) or args.init and cls.KEEPS == 'best.pt'
    if args.eval_only and not kept:
        fail(f'{args.out}/{cls.KEEPS} not found: --eval_only evaluates a finished run in --out (or the --init weights)')
    demo_began = lambda: args.init == demo_start(args.out) and began(os.path.dirname(args.init))  # the demo's start
    if args.resume and not (began(args.out) or demo_began()):
        fail(f'nothing to resume in {args.out} (no run began there): drop --resume to start a new run, or give the '
             'folder of the stopped run')
    check_stages(args, cls)
    if args.resume or is_finished(args.out):  # a first run meets neither
        check_finished(args)
    return files, model


def check_stages(args, cls):
    """A finished stage kept outside the run's folder (--warmup_dir) serves other runs: other settings are refused."""
    for name, changes in cls.stages(args).items():
        settings = stage_settings(args, cls, name)
        found = read_config(settings.out) if 'out' in changes and is_finished(settings.out) else None
        if found and (differ := differences(found, settings)):
            fail(f'{settings.out} holds a finished {name} with --{differ[0]} {found.get(differ[0])} '
                 f'(this run: {getattr(settings, differ[0])}): give another folder, or remove that one')


def check_options(args, cls):
    """What needs the data's languages or a model: translate-train's language, and the method's
    own layer counts, tried on its model on the meta device (no memory, no time) -> that model (retrieval: None)."""
    langs = target_langs(args) if args.task in data.TASKS or args.langs else ()  # --langs checked
    if cls.trains_on in ('train_lang', 'own_lang') and family(args) != 'retrieval':
        if args.train_lang not in langs:
            fail(f'{args.method} needs --train_lang, one of {", ".join(langs)}')
    if family(args) != 'retrieval':
        try:
            with torch.device('meta'):
                return cls.sketch(args, planned_config(args))
        except ValueError as e:
            fail(str(e))


def check_init(args):
    """Real data needs pre-trained weights, unless --from_scratch says otherwise."""
    if not (args.init or args.demo or args.from_scratch):
        fail(f'no --init: this would train {args.model} from random weights for hours. Pass its weights as --init '
             '(docs/weights.md: XLM-R\'s from python layers.py convert, BERT\'s folder as it is), or --from_scratch')


def target_langs(args):
    return [lang for lang in data.languages(args.task, args.demo or data.is_demo(args.data_dir), args.langs)
            if lang != 'en']


def planned_files(args, cls):
    """-> [(path, what it is, needed)] of the data a run of the method class cls reads (data.task_files
    and the method's own), the tokenizer's file last; not needed: read where it is there."""
    files = []
    if args.task in data.TASKS:
        langs = cls.train_langs(args, target_langs(args))
        files = data.task_files(args.data_dir, args.task, langs, cls.round_trip, cls.paired or args.translate_test,
                                not args.eval_only, args.method, cls.trains_on, args.langs)
    return files + cls.reads(args) + [data.tokenizer_file(model_family(args), args.data_dir, args.spm, args.vocab,
                                                          args.init)]


def check_run(args, name, folder):
    """--name is a finished run of this task: its results.json, and its best.pt's meta says so."""
    if not is_finished(folder):
        fail(f'--{name} {folder} is not a finished run (no results.json): give the folder of a finished run')
    try:
        ckpt = layers.load_checkpoint(os.path.join(folder, 'best.pt'), mmap=True)
    except layers.CheckpointError as e:
        fail(f'--{name} {folder}: {e}')
    task, family = ckpt['meta']['task'], (ckpt.get('config') or {}).get('family', 'xlmr')
    if task != args.task:
        fail(f'--{name} {folder} is a run of {task}, not {args.task}: give a {args.task} run')
    if family != model_family(args):  # its ids would be another tokenizer's
        fail(f'--{name} {folder} is a run of {family}, this one of {model_family(args)}: give a run of the same model')


def plan(args, world, files, model):
    """The run in a few named lines, for the banner and --dry_run."""
    cls, found = xlt.method_class(args), [path for path, _, _ in files if os.path.isfile(path)]
    options = [(o.name, getattr(args, o.name, None)) for o in cls.OPTIONS]
    stages = [f'{name} in {stage_settings(args, cls, name).out}' for name in cls.stages(args)]
    made = ' (the demo\'s pre-trained model, made first)' if makes_demo_start(args) else ''
    return {'model': f'{args.model}, from {args.init or "random weights"}{made}',
            'data': 'generated into the run folder (--demo)' if args.demo else
                    f'{args.data_dir}: {len(found)} files found, {len(files) - len(found)} optional ones missing',
            'training': training_plan(args, world), 'memory': memory_plan(args, world, model),
            'method': ', '.join(f'{o} {" ".join(map(str, v)) if isinstance(v, list) else v}' for o, v in options
                                if v not in (None, False)) or 'its defaults',
            'stages': ', '.join(stages + ['then this run']) if stages else 'one',
            'kept': 'nothing trained' if family(args) == 'retrieval' else 'the ' + xlt.SELECTED_BY[cls.select]}


def training_plan(args, world):
    """The plan's line of the training: its length, batch, learning rate and schedule."""
    if args.eval_only or family(args) == 'retrieval':
        return 'none (--eval_only)' if args.eval_only else 'none (retrieval: mean-pooled states, nearest neighbours)'
    length = f'{args.steps} steps' if args.steps else f'{args.epochs} epoch(s)'
    tokens = args.max_tokens and f'micro-batches of at most {args.max_tokens} tokens'
    split = f' ({world} processes x {args.grad_accum} micro-batches)' if world * args.grad_accum > 1 else ''
    warmup = f'{args.warmup_steps} steps' if args.warmup_steps else f'{args.warmup:g}'
    return (f'{length}, {tokens or f"global batch {args.batch_size}"}{split}, lr {args.lr:g}, warm-up {warmup}, '
            f'weight decay {args.weight_decay:g}, up to {args.max_len} tokens, seed {args.seed}')


def memory_plan(args, world, model):
    """The plan's line of memory: a process's peak in training at its largest micro-batch, estimated from the shapes
    (layers.peak_bytes of the passes of the method's model, on the meta device), and whether it fits the GPU
    (--gpu_memory, or the one found) with a tenth to spare, or which --grad_accum (--max_tokens) or --grad_checkpoint
    would make it fit."""
    if args.eval_only or model is None:  # nothing trained, or retrieval
        return 'none trained'
    cls, cuda = xlt.method_class(args), torch.cuda.is_available()
    gpu = (args.gpu_memory or 0) * 2 ** 30 or cuda and torch.cuda.get_device_properties(0).total_memory
    precision = args.precision if cuda or not gpu else 'bf16'  # planned on a CPU for a GPU: a GPU's default
    params, room = sum(p.numel() for p in model.parameters()), 0.9 * gpu
    size = lambda n: f'{n / 2 ** 30:.2f} GiB' if n >= 2 ** 30 else f'{n / 2 ** 20:.0f} MiB'

    def peak(times=1, checkpointed=args.grad_checkpoint):  # -> (bytes, rows, lengths), `times` x the micro-batches
        shapes = cls.micro_batches(args, world * args.grad_accum * times, args.max_tokens and args.max_tokens // times)
        if min(rows for rows, _ in shapes) < 1:
            return math.inf, 0, ()
        return max((layers.peak_bytes(model.encoder.cfg, *model.passes(rows, lengths), params, 'cuda' if gpu else 'cpu',
                                      precision, world > 1, checkpointed), rows, lengths) for rows, lengths in shapes)
    need, rows, lengths = peak()
    line = f'{size(need)} a process at its largest micro-batch ({rows} x {" + ".join(map(str, lengths))} tokens, '
    line += precision + ')'
    if not gpu or need <= room:
        return line + (f', fits the {size(gpu)} GPU' if gpu else ' (on this CPU; --gpu_memory GiB plans for a GPU)')
    times = next((t for t in (2 ** k for k in range(1, 12)) if peak(t)[0] <= room), None)
    tokens = f'--max_tokens {args.max_tokens // times} ' if args.max_tokens and times else ''
    ways = [f'{tokens}--grad_accum {args.grad_accum * times}'] if times else []
    ways += ['--grad_checkpoint'] * (not args.grad_checkpoint and peak(1, True)[0] <= room)
    fix = ' or '.join(ways) or ('neither more --grad_accum nor --grad_checkpoint fits it: a lower --max_len, a '
                                'smaller model')
    return f'{line}, does not fit the {size(gpu)} GPU: {fix}'


def planned_config(args):
    """The model's shape as the run will have it: the preset's, --dropout and --attn_dropout (with dropout, attention
    on a CPU keeps its weights), and for the demo at most the tiny preset's vocabulary (its own is smaller)."""
    cfg, given = layers.CONFIGS[args.model], lambda *values: next(v for v in values if v is not None)
    return replace(cfg, dropout=given(args.dropout, cfg.dropout),
                   attn_dropout=given(args.attn_dropout, args.dropout, cfg.attn_dropout),  # as Run.encoder sets them
                   vocab_size=layers.CONFIGS['tiny'].vocab_size if args.demo else cfg.vocab_size)


def setup_distributed():
    """-> (rank, world size, device); under torchrun one process per device."""
    if 'RANK' not in os.environ:
        return 0, 1, torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    cuda, local = torch.cuda.is_available(), int(os.environ.get('LOCAL_RANK', 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group('nccl' if cuda else 'gloo', timeout=datetime.timedelta(hours=2),  # not NCCL's 10 minutes:
                            device_id=torch.device('cuda', local) if cuda else None)  # one process may tokenize long
    return dist.get_rank(), dist.get_world_size(), torch.device(f'cuda:{local}' if cuda else 'cpu')


# ----------------------------------------------------------------------------------------
# A run: one folder, held for the run's life; its data; the method's procedure, handed a Run.

def execute(args, rank, world, device):
    """The run of args in args.out (the command's, or a stage's): check, banner (a dry run stops there), hold the
    folder, the data, the demo's pre-trained start, then the method's procedure."""
    global UNDER_WAY
    UNDER_WAY, (files, model) = False, check(args, world)
    UNDER_WAY = True
    if rank == 0:
        status = ('dry run, nothing is trained or written' if args.dry_run else 'evaluating' if args.eval_only
                  else 'resuming' if args.resume else 'a new run')
        title = f'{args.method} on {args.task}{f" ({args.stage})" if args.stage else ""} in {args.out}: {status}'
        lines = [f'  {name:<9} {value}' for name, value in plan(args, world, files, model).items()]
        print('\n'.join([title] + lines))
    if args.dry_run:
        return
    with hold(args.out, rank):
        tok = prepare_data(args, rank)
        if makes_demo_start(args) and not args.eval_only:
            demo_pretrained(args, rank, world, device)
        run = Run(args, rank, world, device, tok)
        if family(args) == 'retrieval':
            return run.cls.retrieval(run)
        run.cls.procedure(run)


def predict(args, rank, world, device):
    """--predict FILE [TRANSLATION]: the finished run in --out, in its settings, predicts FILE (data.read_input) with
    the model its method predicts with (xlt's predictor) -> --out/predicted/<FILE's name>.<tsv|json>, in the
    leaderboard's format, and .scores.json: each prediction's probability, the scores where FILE has labels."""
    if not is_finished(args.out):
        fail(f'--predict FILE predicts with a finished run: {args.out} has no results.json; give the run\'s folder')
    settings = argparse.Namespace(**{**read_config(args.out), 'out': args.out, 'eval_only': True, 'resume': False,
                                     'precision': args.precision, 'eval_batch_size': args.eval_batch_size})
    cls, demo = xlt.method_class(settings), os.path.join(args.out, 'demo-data')
    if settings.task not in data.TASKS or family(settings) == 'retrieval':
        fail(f'--predict is for the runs of a task with labels to predict, not {settings.task}')
    if len(args.predict) > 1 + (family(settings) == 'qa' and cls.paired):
        fail('--predict takes FILE, and for a paired method on QA its TRANSLATION; a TSV holds its translation')
    if not os.path.exists(os.path.join(args.out, cls.KEEPS)):
        fail(f'{args.out} keeps no {cls.KEEPS} (an --eval_only run of --init): predict with the run that trained it')
    if settings.demo and not data.is_demo(demo, current=True):
        fail(f'{args.out} is a run of an older demo, whose tokenizer has changed since: run it again')
    tok = prepare_data(settings, rank)
    examples, pairs = data.read_input(args.predict[0], settings.task, cls.paired, (args.predict + [None])[1])
    run = Run(settings, rank, world, device, tok, sets={'dev': {}, 'test': {}})
    model = cls.predictor(run)
    items = data.evaluation_items(tok, settings.data_dir, settings.task, examples, pairs if model.paired else None,
                                  settings.max_len, settings.doc_stride, cache=False)
    feats, outputs = [item[1] if model.paired else item for item in items], run.outputs(model, items)
    stem = os.path.join(args.out, 'predicted', os.path.splitext(os.path.basename(args.predict[0]))[0])
    scores = ev.write_predicted(stem, settings.task, feats, outputs, examples) if rank == 0 else None
    if rank == 0:
        print(f'{len(examples)} predictions in {stem}.{data.suffix(settings.task)}, each with its probability in '
              f'{stem}.scores.json' + (f'; score {scores["score"]:.1f}' if scores else ''))


def prepare_data(args, rank):
    if args.demo:
        args.data_dir = os.path.join(args.out, 'demo-data')
        if rank == 0 and not data.is_demo(args.data_dir, current=True):
            data.make_demo(args.data_dir, seed=0)
        if dist.is_initialized():
            dist.barrier()
    tok = data.tokenizer_file(model_family(args), args.data_dir, args.spm, args.vocab, args.init)[0]
    return data.tokenizer(model_family(args), tok, args.qa_case == 'lower', args.dict)


def model_family(args):  # the preset's, 'xlmr' or 'bert': it picks the tokenizer
    return layers.CONFIGS[args.model].family


def demo_pretrained(args, rank, world, device):
    """The demo's pre-trained tiny model (demo_start): VECO's pre-training (Section 2.2) on the demo's text, a run of
    its own beside this one (--resume goes on with it), for the methods that start from a trained encoder."""
    folder = os.path.dirname(demo_start(args.out))
    if rank == 0:
        print(f'{args.method} starts from a pre-trained model: pre-training the demo model into {folder} first')
    argv = ['--method', 'veco', '--task', 'pretrain', '--demo', '--out', folder]
    argv += ['--resume'] * (args.resume and began(folder))
    argv += ['--halt_after', str(args.halt_after)] * bool(args.halt_after)
    execute(parse_args(argv), rank, world, device)


# ----------------------------------------------------------------------------------------
# The run folder: held by one run at a time (hold); its config.json (Run.begin) says that a run began there and
# with which settings, its results.json that it finished. A run that stops before it began leaves nothing behind.

@contextmanager
def hold(folder, rank):
    """The folder, locked (.lock) for the run's life and released when its process ends, however it ends (under DDP by
    the first process): a second run there stops in one line naming the holder; a run never begun leaves nothing."""
    folder, lock, holder = os.path.abspath(folder), None, None
    if rank == 0:
        made = first_missing(folder) or first_missing(os.path.join(folder, 'demo-data'))
        fresh = not os.path.exists(os.path.join(folder, '.lock'))
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, '.lock'), 'a+')
        try:
            data.locked(lock, wait=False)
            lock.truncate(0)
            print(f'{os.getpid()} on {socket.gethostname()}', file=lock, flush=True)
            os.fsync(lock.fileno())  # seen by the other nodes (shared_hold)
        except BlockingIOError:
            lock.seek(0)
            holder, lock = lock.read().strip() or 'unknown', lock.close()
    try:  # a holder found is another run: no lock is held, nothing is discarded
        if dist.is_initialized():
            holder = shared_hold(folder, holder)
        if holder:
            fail(f'{folder} is in use by another run (pid {holder}): wait for it to end, or give another --out')
        yield
    except BaseException:
        if lock and not began(folder):  # a run that stopped before it began leaves nothing, its .lock neither
            discard_if_unbegun(folder, made, fresh)
        raise
    finally:
        if lock:
            lock.close()  # the lock goes with it


def shared_hold(folder, holder):
    """Under DDP, what process 0 found: the folder's holder, and whether every process sees the folder as it holds it
    (its .lock as process 0 wrote it): --out on a filesystem every node mounts, else the others would read and resume
    nothing of the run's."""
    dist.broadcast_object_list(shared := [holder])
    lock, seen = os.path.join(folder, '.lock'), [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), data.read_text(lock) if os.path.exists(lock) else None))
    blind = sorted({host for host, stamp in seen if stamp != seen[0][1]})
    if blind and not shared[0]:
        fail(f'--out {folder} is not the folder process 0 holds, as {", ".join(blind)} see it (a disk of its own?): '
             'give --out on a filesystem every node mounts')
    return shared[0]


def first_missing(path):
    """The outermost folder of path that does not exist yet (None if path does)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


def began(folder):
    """Did a run begin in folder, or in a stage below it (its config.json is written by Run.begin)?"""
    return any('config.json' in names for _, _, names in os.walk(folder))


def is_finished(folder):
    return os.path.exists(os.path.join(folder, 'results.json'))


def discard_if_unbegun(out, made, fresh_lock=False):
    """A run that stops before it began (no config.json in its folder or below) leaves nothing
    behind: what this process made goes (the run folder and the parents it made, the demo data
    in a folder that was there, the .lock it made), and nothing else."""
    lock = os.path.join(os.path.abspath(out), '.lock')
    if began(out):
        return
    if fresh_lock and os.path.exists(lock):
        os.remove(lock)
    if not made or not os.path.isdir(made):
        return
    path = made if made == os.path.join(os.path.abspath(out), 'demo-data') else os.path.abspath(out)
    shutil.rmtree(path)
    while path != made and not os.listdir(os.path.dirname(path)):  # parents made for it, if nothing else is in them
        path = os.path.dirname(path)
        os.rmdir(path)


def changing(what):
    """The options that change `what`: 'scores' (what --eval_only's scores depend on), or 'nothing'."""
    options = OPTIONS + tuple(o for c in xlt.classes() for o in c.OPTIONS)
    return list(dict.fromkeys(o.name for o in options if o.changes == what))


def read_config(folder):
    path = os.path.join(folder, 'config.json')
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        fail(f'{path} is not a run\'s config (not valid JSON): remove it, or give another folder')


def differences(found, args, keys=None):
    """The settings of args that differ from a run's config.json (found), paths compared as files: the
    trainer's options and the run's method's (keys: only those), but for those that leave results alike."""
    now = json.loads(json.dumps(vars(args)))
    same = lambda a, b: a == b or (isinstance(a, str) and isinstance(b, str)
                                   and os.path.realpath(a) == os.path.realpath(b))
    keys = keys or [o.name for o in OPTIONS + xlt.method_class(args).OPTIONS]
    return [k for k in keys if k not in changing('nothing') and k in found and k in now and not same(found[k], now[k])]


def check_finished(args):
    """A finished run in --out (or the stopped one --resume goes on with) is replaced only by a run
    of the same settings, or with --overwrite; --eval_only compares what its results depend on."""
    config = os.path.join(args.out, 'config.json')
    if args.overwrite or not os.path.exists(config) or not (args.resume or is_finished(args.out)):
        return
    found = read_config(args.out)
    differ = differences(found, args, changing('scores') if args.eval_only else None)
    if differ:
        now, more = vars(args), f', and {len(differ) - 1} more' if len(differ) > 1 else ''
        fail(f'{args.out} holds a {"stopped" if args.resume else "finished"} run with --{differ[0]} {found[differ[0]]} '
             f'(this run: {now[differ[0]]}{more}): give another --out, or add --overwrite to replace it')


class Run:
    """What a procedure is handed: args, tok, rank, world, device, out; the trainer's parts: model (build, restore,
    encoder), data and loop (items, fit), evaluation (evaluate, outputs, map), results (report, finish), stages."""

    def __init__(self, args, rank, world, device, tok, sets=None, cache=None):
        self.args, self.rank, self.world, self.device, self.tok = args, rank, world, device, tok
        self.out, self.cls, self.chunks, self.begun = args.out, xlt.method_class(args), world * args.grad_accum, False
        evaluated = args.task in data.TASKS and family(args) != 'retrieval'
        self.sets = sets if sets is not None else data.evaluation_sets(args.data_dir, args.task, args.translate_test,
                                                                     self.cls.paired, args.langs) if evaluated else {}
        self.cache = cache if cache is not None else {'dev': {}, 'test': {}}  # features, made once per language

    def build(self, cls=None, encoder=None, settings=None):
        """The method (the run's class, or cls) on the device: its encoder from --init (from random
        weights for the demo and --from_scratch), its head seeded by --seed."""
        encoder = self.encoder()[0] if encoder is None else encoder
        torch.manual_seed(self.args.seed)  # the head's initialisation follows --seed, with --init too
        try:
            return (cls or self.cls)(encoder, self.args.task, settings or self.args).to(self.device)
        except ValueError as e:
            fail(str(e))

    def encoder(self, cross=False, init=None, decoder=False):
        """-> (encoder, MLM head or None) from init (default --init), or random for the demo and --from_scratch.
        cross: blocks with a cross-attention (the checkpoint's, or new), else a checkpoint's is left out; decoder:
        a translation checkpoint's decoder (or None) too (layers.load_pretrained)."""
        args, init = self.args, init or self.args.init
        cfg, mlm, dec = layers.CONFIGS[args.model], None, [None] * decoder
        if init:
            encoder, mlm, *dec = layers.load_pretrained(init, cross, decoder)  # a CheckpointError: main()'s one line
        else:
            check_init(args)
            torch.manual_seed(args.seed)
            encoder = layers.Encoder(layers.Config(**{**cfg.__dict__, 'vocab_size': self.tok.vocab_size}), cross)
        got, tok, shape = encoder.cfg, self.tok, lambda c: (c.family, c.n_layer, c.dim, c.n_head, c.ffn_dim)
        if shape(got) != shape(cfg):
            fail(f'--init {init} is {got.family} {got.n_layer} x {got.dim}, not the {args.model} preset '
                 f'({cfg.family} {cfg.n_layer} x {cfg.dim}): pass the --model it was made for')
        if (got.vocab_size, got.pad_id, got.sep_id) != (tok.vocab_size, tok.pad, tok.eos):
            fail(f'the tokenizer has {tok.vocab_size} ids (padding {tok.pad}, separator {tok.eos}), the model '
                 f'{got.vocab_size} ({got.pad_id}, {got.sep_id}): pass its own (--spm, --dict; --vocab)')
        layers.set_dropout(encoder, args.dropout, args.dropout if args.attn_dropout is None else args.attn_dropout)
        return (self.ready(encoder), mlm, *dec)

    def ready(self, encoder):
        """An encoder with --grad_checkpoint and --compile applied."""
        encoder.grad_checkpoint = self.args.grad_checkpoint
        if self.args.compile:
            layers.compile_blocks(encoder)
        return encoder

    def items(self, method):
        """The training data of a method (or its class: data.training_set); None with --eval_only."""
        args = self.args
        if args.eval_only:
            return None
        items = data.training_set(self.tok, args.data_dir, args.task, method.train_langs(args, target_langs(args)),
                                  method.trains_on, method.paired, method.round_trip, args.max_len, args.train_share,
                                  args.doc_stride, not args.no_cache, args.few_shot)
        if not items:
            fail(f'no training examples for {args.task} in {args.data_dir}')
        return items

    def fit(self, method, items, validate=None, batches_of=None, keep_last=0):
        """Train method on items (train), resumable from last.pt. validate() -> the scores best.pt is kept by (default:
        the dev sets); batches_of(epoch) -> its global batches (default: shuffled); keep_last: N epochs' to average."""
        if self.args.eval_only:
            return
        self.begin()
        if keep_last and not self.args.resume:  # an earlier run's are not to be averaged with these
            self.drop('checkpoints')
        validate = validate or (lambda: self.evaluate(method, 'dev')[0])
        train(self, method, items, validate, batches_of or self.shuffled(items), keep_last)

    def begin(self):
        """All input read: the run begins, and results of an earlier run in its folder are no
        longer its; a new run (not --resume) also drops the earlier run's checkpoints."""
        if self.rank == 0 and not self.begun:
            new = not self.args.resume
            kept = data.lines_of(self.path('kept.txt')) if new and os.path.exists(self.path('kept.txt')) else []
            self.drop('results.json', 'results.txt', *['last.pt', 'best.pt', 'kept.txt', 'trained.json'] * new, *kept)
            config = {**vars(self.args), 'changes_nothing': changing('nothing')}  # eval.py --collect groups by the rest
            layers.atomic_write(self.path('config.json'), json.dumps(config, indent=2))
        self.begun = True

    def keep(self, name):
        """Record a file or folder the run computed for itself (kept.txt): --resume reads it back, and
        the next new run in the folder removes it first (an earlier run's results are not its)."""
        if not self.args.eval_only:  # an evaluation changes no run
            self.begin()
            if self.rank == 0:
                with open(self.path('kept.txt'), 'a') as f:
                    f.write(name + '\n')

    def shuffled(self, items):
        """-> batches_of(epoch): a permutation fixed by (--seed, epoch), grouped by length unless --no_group_by_length,
        or in tokens (--max_tokens); a run counted in --steps reads pass after pass, an --eval_every steps 'epoch'."""
        args = self.args
        lengths = data.item_lengths(items) if args.group_by_length or args.max_tokens else None

        @functools.lru_cache(maxsize=1)  # one pass in memory at a time
        def cut(p):
            return data.global_batches(len(items), args.batch_size, args.seed * 1000 + p, self.chunks, lengths,
                                       args.max_tokens)
        return data.stepped(cut, args.steps, args.eval_every, f'--batch_size {args.batch_size}') if args.steps else cut

    def evaluate(self, method, split, langs=None):
        """-> ({lang: scores}, {lang: predictions}) in every language of the split (eval_sets), or in langs."""
        scores, preds = {}, {}
        for lang, (gold, inputs, pairs) in ((k, v) for k, v in self.sets[split].items() if langs is None or k in langs):
            key, args = (lang, method.paired), self.args
            if key not in self.cache[split]:  # the features, kept on disk (data.evaluation_items), open for the run
                self.cache[split][key] = data.evaluation_items(self.tok, args.data_dir, args.task, inputs,
                                                               pairs if method.paired else None, args.max_len,
                                                               args.doc_stride, not args.no_cache)
            items = self.cache[split][key]
            feats = (item[1] if method.paired else item for item in items)  # the target side, read as it is scored
            preds[lang] = ev.predictions(self.args.task, feats, self.outputs(method, items), inputs)
            if ev.labelled(gold):
                scores[lang] = ev.scores_of(self.args.task, lang, gold, preds[lang])
        return scores, preds

    def outputs(self, method, items, then=lambda output: output):
        """The method's outputs for every item on its target side (a single-text method reads a pair's
        second alone), each cut to its tokens and passed through then -> a data.Ragged of them."""
        method.eval()
        collate, tuples = data.collate_items(method.paired, self.tok.pad), len(items) and isinstance(items[0], tuple)

        def of(index):
            batch = collate([items[i] if method.paired or not tuples else items[i][1] for i in index], index)
            lengths = (batch.tgt if method.paired else batch).mask.sum(1).tolist()
            result = method.predict(batch.to(self.device)).float().cpu()
            return [(then(r if method.family == 'classification' else r[:n]),) for r, n in zip(result, lengths)]
        return self.map(of, data.item_lengths(items)[:, int(tuples)])[0]

    @torch.no_grad()
    def map(self, fn, lengths, desc='eval', fields=1, everywhere=True):
        """data.shared_out over the run's processes, in its precision, the blocks passing through its folder."""
        with layers.autocast(self.device, self.args.precision):
            return data.shared_out(fn, lengths, (self.rank, self.world, self.out), self.args.eval_batch_size, desc,
                                   fields, everywhere)

    def report(self, method):
        """The kept model's dev and test scores in every language and its test predictions:
        results.json, results.txt, predictions/."""
        self.load_best(method)
        dev = self.evaluate(method, 'dev')[0]
        test, preds = self.evaluate(method, 'test')
        scored = self.test_scores(preds)
        if self.args.translate_test and method.family == 'qa':  # English answers: scored on the translations' answers
            scored = {**scored, **{lang: s for lang, s in test.items() if lang != 'en'}}
        self.finish(dev, scored, xlt.selection(method.select, dev)[1])

    def load_best(self, method):
        """best.pt's weights into method, when the run kept one -> whether it had."""
        if os.path.exists(self.path('best.pt')):
            method.load_state_dict(layers.load_checkpoint(self.path('best.pt'), identity(self.args))['method'])
            return True

    def test_scores(self, preds):
        """Write the test predictions in the leaderboard layout and score them (eval.py) against
        labels/<task>/test-<lang>.* where the data folder has them."""
        labels = os.path.join(self.args.data_dir, 'labels')
        return ev.score_predictions(self.path('predictions'), labels, self.args.task, preds) if self.rank == 0 else {}

    def finish(self, dev, test, selected_by=None, runs=None, name=None):
        """results.json and the table of the run's scores (eval.results); runs: other rows, first
        (several models of one run), the run's then named `name`."""
        args = self.args
        results, table = ev.results(args.task, args.method, dev, test, selected_by, runs, args.stage, name, args.langs)
        kept = ', the kept model in best.pt' if os.path.exists(self.path('best.pt')) else ''
        self.write_results(results, table, f'results in {self.out}/results.json and results.txt, predictions in '
                                           f'{self.out}/predictions/{kept}')

    def write_results(self, results, table, where, files=None):
        """results.json, results.txt and files {name: text} by process 0, the table printed; every process waits."""
        if self.rank == 0:
            files = {**(files or {}), 'results.json': json.dumps(results, indent=2), 'results.txt': table + '\n'}
            for name, text in files.items():
                layers.atomic_write(self.path(name), text)
            print(f'{table}\n{where}; {ev.clock(time.time() - START)} in all')
        if dist.is_initialized():
            dist.barrier()

    def path(self, name):
        return os.path.join(self.out, name)

    def restore(self, weights, cls=None):
        """The method of a checkpoint, or of a finished run's folder (its best.pt), with its settings
        and weights; as cls, given one, a model of this run's preset (XLA trains a warm-up's model)."""
        path = os.path.join(weights, 'best.pt') if os.path.isdir(weights) else weights
        expect = {'task': identity(self.args)['task'], **({'model': self.args.model} if cls else {})}
        ckpt = layers.load_checkpoint(path, expect)
        settings = argparse.Namespace(**ckpt['meta']['settings'])
        encoder = layers.Encoder(layers.Config(**ckpt['config']))
        method = self.build(cls or xlt.method_class(settings), encoder, settings)
        method.load_state_dict(ckpt['method'])
        return method

    def stage(self, name):
        """Run the method's stage `name` (its stages()) unless it finished with these settings;
        --resume goes on with one that began. -> its folder, relative to this run's."""
        self.begin()
        settings = stage_settings(self.args, self.cls, name)
        if is_finished(settings.out) and not differences(read_config(settings.out), settings):
            self.say(f'{name}: reused, the finished run in {settings.out} has these settings')
        else:
            execute(settings, self.rank, self.world, self.device)
        return os.path.relpath(settings.out, self.out)

    def results_of(self, name):
        """The results of the stage `name`, or None when it has not finished."""
        folder = stage_settings(self.args, self.cls, name).out
        return json.load(open(os.path.join(folder, 'results.json'))) if is_finished(folder) else None

    def sub(self, name, **changes):
        """A run in the folder `name` of this one, with changed settings, sharing its evaluation sets."""
        self.keep(name)
        args = argparse.Namespace(**{**vars(self.args), 'out': self.path(name), **changes})
        return Run(args, self.rank, self.world, self.device, self.tok, self.sets, self.cache)

    def cached(self, name, compute):
        """compute() once, kept as `name` (JSON for .json, else torch.save, read memory-mapped):
        --resume and --eval_only read it back; a new run computes it again. compute() may give None
        on processes other than 0, which then read what process 0 kept."""
        path, as_json = self.path(name), name.endswith('.json')
        read = lambda: json.loads(data.read_text(path)) if as_json else torch.load(path, weights_only=True, mmap=True)
        if (self.args.resume or self.args.eval_only) and os.path.exists(path):
            return read()
        if self.args.eval_only:
            fail(f'{path} not found: --eval_only evaluates a finished run in --out')
        value = compute()
        self.keep(name)
        if self.rank == 0:
            layers.atomic_write(path, json.dumps(value, indent=2) if as_json else value)
        if dist.is_initialized():
            dist.barrier()
        return read() if value is None else value

    def drop(self, *names):
        """Remove the files and folders of the run's folder under names, which nothing reads any more."""
        for path in [self.path(name) for name in names] * (self.rank == 0):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)

    def say(self, message):
        if self.rank == 0:
            print(message)

    fail = staticmethod(fail)


def stage_settings(args, cls, name):
    """The settings of the method's stage `name` (cls.stages): the run's with the stage's changes,
    in --out/<name> unless the stage says where; options of other methods dropped."""
    settings = argparse.Namespace(**{**vars(args), 'out': os.path.join(args.out, name), 'demo': False,
                                     'overwrite': True, 'from_scratch': args.from_scratch or args.demo,
                                     **cls.stages(args)[name]})
    own = {o.name for o in xlt.method_class(settings).OPTIONS}
    for o in (o for c in xlt.classes() for o in c.OPTIONS if o.name not in own):
        setattr(settings, o.name, False if o.type is bool else None)
    settings.resume = args.resume and began(settings.out)
    return settings


def identity(args):
    """What a run's checkpoint says it is and must say to be loaded (a translation's task names its pair)."""
    return {'method': args.method, 'task': xlt.method_class(args).folder(args)[0], 'model': args.model}


# ----------------------------------------------------------------------------------------
# The training loop of every method and stage.

SCARCE = ('cuda',)  # devices whose memory a run watches: the largest batch tried before step 1 (probe), a finished
# training's cycles collected at once for the next stage; on a CPU neither is worth its time (a collection takes
# seconds in a process of many objects, the probe a step)


def train(run, method, items, validate, batches_of, keep_last=0):
    """Train for --epochs epochs of batches_of(epoch), resuming from last.pt with --resume; after
    each epoch validate(), best.pt kept by the method's selection rule, and last.pt."""
    with ResumePoints(run) as points:  # its SIGTERM handler given back however the loop ends
        loop(run, method, items, validate, batches_of, keep_last, points)
    if run.device.type in SCARCE:  # the loop's DDP wrapper and optimiser hold reference cycles: freed now
        gc.collect()


def loop(run, method, items, validate, batches_of, keep_last, points):
    """train()'s epochs and steps; points: its ResumePoints."""
    args, rank, world = run.args, run.rank, run.world
    per_epoch = len(batches_of(0))
    opt, sched = optimizer_and_schedule(method, args, args.steps or per_epoch * args.epochs)
    model = wrapped(method, run.device) if world > 1 else method
    precision = layers.Precision(args.precision, run.device)
    state = args.resume and resumed(run, method, opt, sched, precision.scaler)
    state = state or {'step': 0, 'epoch': 0, 'best': -math.inf}  # a new run (or nothing to resume)
    log = open_log(run.path('log.jsonl'), state['step']) if rank == 0 else None
    started, collate = time.time(), data.collate_items(method.paired, run.tok.pad)
    method.step = first = state['step']  # read by schedules (X-Mixup's p*, frozen phases); first: this process's
    while state['epoch'] < args.epochs:
        # since: the logs of the steps since the last line; epoch_loss: (mean loss, steps) of each line of the epoch
        batches, since, epoch_loss = batches_of(state['epoch']), [], []
        padding = data.pad_share(functools.partial(data.item_lengths, items), batches, run.chunks)
        start = state['step'] % per_epoch  # a resumed epoch goes on where it stopped
        bar = data.bar(total=len(batches), initial=start, desc=f'epoch {state["epoch"] + 1}/{args.epochs}')
        for batch in batches[start:]:
            if state['step'] == first and run.device.type in SCARCE:  # the largest batch first, once
                probe(run, model, items, batches, state['step'], precision, collate)
            since.append(train_step(model, items, batch, args, state['step'], rank, world, precision, collate))
            since[-1].update(optimizer_step(method, opt, sched, precision, state, args.clip, bar, log))
            bar.update()
            asked = (False, False)  # (a resume point, then a stop): the processes agree on them at a log line
            if state['step'] % args.log_every == 0 or batch is batches[-1]:  # the one host sync (and each epoch's end)
                line, asked = log_line(run, log, bar, since, state, sched.get_last_lr()[0], started, points.wishes())
                epoch_loss.append(line)
                since = []
            if args.eval_steps and state['step'] % args.eval_steps == 0 and state['step'] % per_epoch:  # in the epoch
                end_epoch(run, method, validate, state, 0, epoch_loss, time.time() - started, log, padding,
                          round(state['step'] / per_epoch, 2))
            if any(asked) and state['step'] % per_epoch:  # an epoch's last step saves after its validation
                points.save(resume_point(method, opt, sched, state, precision.scaler), stop=asked[1])
            if args.halt_after or args.term_after:
                planted_stops(args, state['step'], points)
        bar.close()
        state['epoch'] += 1
        end_epoch(run, method, validate, state, keep_last, epoch_loss, time.time() - started, log, padding)
        if state['epoch'] < args.epochs or asked[1]:  # after the last epoch trained.json holds the end, unless a stop
            points.save(resume_point(method, opt, sched, state, precision.scaler), stop=asked[1])
    points.writer.wait()  # before last.pt goes
    if rank == 0:  # the training is over and best.pt holds what it kept: the resume point (optimiser state too) goes
        layers.atomic_write(run.path('trained.json'), json.dumps(state))
        run.drop('last.pt')
    if dist.is_initialized():
        dist.barrier()  # every process reads best.pt (and the kept checkpoints) only once they are written


def optimizer_step(method, opt, sched, precision, state, clip, bar, log):
    """The optimiser's step, the schedule's, the step counted. -> fp16's log of it (whether the scaler skipped it)."""
    frozen = method.frozen()
    for p in frozen:
        p.grad = None  # AdamW leaves a parameter without a gradient as it is
    logs = precision.step(opt, method.parameters(), clip)
    sched.step()
    opt.zero_grad(set_to_none=True)
    state['step'] += 1
    method.step = state['step']  # does the method's frozen phase end here?
    if frozen and not method.frozen() and log:  # log: the first process's
        bar.write(f'step {state["step"]}: every parameter trains from here on')
        log.write(json.dumps({'step': state['step'], 'event': 'every parameter trains from here on'}) + '\n')
    return logs


def wrapped(method, device):
    """The method in DDP, its gradients in DDP's communication buckets (no copies)."""
    return DDP(method, device_ids=[device.index] if device.type == 'cuda' else None, gradient_as_bucket_view=True)


def probe(run, model, items, batches, step, precision, collate):
    """The epoch's largest batch (data.largest_batch) run beside AdamW's moments to come: out of memory at step 1."""
    moments_to_come = torch.empty(0 if step else 2 * sum(p.numel() for p in model.parameters()), device=run.device)
    largest = data.largest_batch(functools.partial(data.item_lengths, items), batches, run.chunks)
    train_step(model, items, largest, run.args, step, run.rank, run.world, precision, collate, probe=True)
    model.zero_grad(set_to_none=True)


def out_of_memory(args, items, batch, step, world, probe=False):
    """The out-of-memory error's line: the step, its largest micro-batch's shape, and the options that make less."""
    lengths_of = functools.partial(data.item_lengths, items)
    largest = data.largest_micro_batch(lengths_of, batch, world * args.grad_accum)[0]
    shape = (len(largest), *lengths_of(largest).max(0))
    ways = [f'--grad_accum {2 * args.grad_accum}'] + ['--grad_checkpoint'] * (not args.grad_checkpoint)
    ways += [f'--max_len {args.max_len // 2}'] + ['--precision bf16 or fp16'] * (args.precision == 'fp32')
    what = 'the epoch\'s largest micro-batch, tried before it' if probe else 'a micro-batch'
    return (f'out of memory in step {step}, {what}: {" + ".join(f"{shape[0]} x {n}" for n in shape[1:])} tokens; try '
            f'{", ".join(ways)}')


def log_line(run, log, bar, since, state, lr, started, wishes):
    """A line of log.jsonl every --log_every steps (the loop's one host sync): each logged value's mean since the last
    line; a mean loss not finite on any process stops the run first, in one line. wishes: this process's (resume point,
    stop), agreed with the others'. -> ((the mean loss, its steps), the wishes any process had)."""
    logs = {k: float(sum(s[k] for s in since if k in s)) / sum(k in s for s in since)
            for k in dict.fromkeys(k for s in since for k in s)}
    sums = torch.tensor([logs['loss'], *wishes], dtype=torch.float64, device=run.device)  # large losses stay finite
    if run.world > 1:
        dist.all_reduce(sums)  # every process stops together, and saves together
    loss, wishes = sums[0], tuple(sums[1:].gt(0).tolist())
    if not torch.isfinite(loss):
        fail(diverged(run, loss.item(), state['step'] - len(since) + 1, state['step']))
    bar.set_postfix(loss=f'{logs["loss"]:.3f}')
    if log:
        log.write(json.dumps({'step': state['step'], 'epoch': state['epoch'], 'lr': lr,
                              'time': round(time.time() - started, 2), **logs}) + '\n')
        log.flush()
    return (logs['loss'], len(since)), wishes


def diverged(run, loss, first, last):
    """The line of a training loss that is not finite in steps first to last."""
    checkpoint = run.path('last.pt')
    kept = f'the last checkpoint is {checkpoint}' if os.path.exists(checkpoint) else 'no checkpoint was kept'
    return (f'the training loss is {loss} in steps {first}-{last}: {kept}; start again with a lower --lr (now '
            f'{run.args.lr:g}) or a lower --clip (now {run.args.clip:g})')


def optimizer_and_schedule(method, args, total_steps):
    decay = [p for n, p in method.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in method.named_parameters() if p.dim() < 2]  # biases and LayerNorms
    betas, eps = method.ADAM.get(args.model, ((0.9, 0.999), 1e-8))
    # fused: one kernel over all parameters (CPU and CUDA), the same update up to rounding, and several times faster
    opt = torch.optim.AdamW([{'params': decay, 'weight_decay': args.weight_decay},
                             {'params': no_decay, 'weight_decay': 0.0}], lr=args.lr, betas=betas, eps=eps, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, method.schedule(args, total_steps))


def resumed(run, method, opt, sched, scaler):
    """--resume: the loop's state from last.pt (the method, optimiser, schedule, fp16's loss scale and random state as
    they were), or from the start when it is not there."""
    last, trained = run.path('last.pt'), run.path('trained.json')
    if os.path.exists(trained):  # a finished training: best.pt holds what it kept
        return json.loads(data.read_text(trained))
    if not os.path.exists(last):
        run.say(f'note: {last} not found: starting from the beginning')
        return None  # the loop starts afresh
    ckpt = layers.load_checkpoint(last, identity(run.args))
    for part, name in ((method, 'method'), (opt, 'optimizer'), (sched, 'schedule'), (scaler, 'scaler')):
        part.load_state_dict(ckpt.get(name, {}))  # the scaler reads {} unless fp16's
    torch.set_rng_state(ckpt['rng'])
    return ckpt['state']


def train_step(model, items, batch, args, step, rank, world, precision, collate, probe=False):
    """One optimiser step's gradients: the global batch cut into world x grad_accum chunks, chunk c on process c %
    world with its own dropout seed, so that any split over processes and micro-steps computes the same gradient;
    out of memory, one line (probe: the step's trial of the largest batch)."""
    chunks = np.array_split(np.array(batch), world * args.grad_accum)
    mine = sum(len(chunks[a * world + rank]) for a in range(args.grad_accum))
    logs = {}
    model.train()  # validation leaves it in eval mode
    try:
        for a in range(args.grad_accum):
            c = a * world + rank
            torch.manual_seed(args.seed * 1_000_003 + step * 1009 + c)
            sync = a == args.grad_accum - 1 or not isinstance(model, DDP)
            micro = collate([items[i] for i in chunks[c]], chunks[c].tolist()).to(precision.device)
            with (nullcontext() if sync else model.no_sync()), precision.autocast():
                loss, chunk_logs = model(micro)
            precision.backward(loss * len(chunks[c]) * world / len(batch))
            for k, v in chunk_logs.items():  # this process's micro-batches, weighted by their size
                logs[k] = logs.get(k, 0.0) + v * len(chunks[c]) / mine
    except torch.OutOfMemoryError:
        fail(out_of_memory(args, items, batch, step + 1, world, probe), own=True)
    return logs


def end_epoch(run, method, validate, state, keep_last, epoch_loss, seconds, log, padding, within=None):
    """An epoch's end (or, with --eval_steps, a point `within` it, in epochs): the weights kept for
    averaging, validate(), best.pt when the selection score is the best so far, the printed line and the log's."""
    if keep_last:  # fairseq's --save-interval-updates and --keep-interval-updates
        save(run, f'checkpoints/step{state["step"]:07d}.pt', {'method': method.state_dict()}, run.args, keep=keep_last)
    dev = validate()
    score = xlt.selection(method.select, dev)[0]
    score = state['epoch'] if score is None else score  # no dev set: keep the last
    if score > state['best']:
        state['best'] = float(score)
        parts = {**layers.encoder_parts(method.encoder, method.mlm), 'method': method.state_dict()}
        save(run, 'best.pt', parts, run.args)
    if run.rank == 0:
        at = {**state, 'epoch': within or state['epoch']}
        print(ev.epoch_line(at, run.args.epochs, epoch_loss, dev, method.select, seconds), flush=True)
    if log:
        scores = {k: v if method.select == 'loss' else v['score'] for k, v in dev.items()}  # the held-out losses whole
        log.write(json.dumps({'step': state['step'], 'epoch': state['epoch'], 'dev': scores, 'dev_avg': float(score),
                              'pad_share': round(padding, 4)}) + '\n')
        log.flush()


class ResumePoints(AbstractContextManager):
    """last.pt every --save_minutes, at each epoch's end but the last, at SIGTERM (a scheduler's), by layers.Writer."""

    def __init__(self, run):
        self.run, self.saved, self.signalled, self.writer = run, time.time(), False, layers.Writer()
        self.default = signal.signal(signal.SIGTERM, lambda number, frame: setattr(self, 'signalled', True))

    def wishes(self):  # this process's: a resume point due by its clock, a stop asked by a signal (agreed in log_line)
        return time.time() - self.saved >= 60 * self.run.args.save_minutes, self.signalled

    def save(self, point, stop=False):
        self.saved = time.time()
        save(self.run, 'last.pt', point, self.run.args, self.writer)
        if stop:
            self.stop(point['state']['step'])

    def __exit__(self, *exception):
        self.writer.wait()
        signal.signal(signal.SIGTERM, self.default)

    def stop(self, step):
        """SIGTERM's end, once its resume point is saved: one line, and the signal's exit status."""
        self.writer.wait()
        self.run.say(f'stopped by SIGTERM at step {step}: {self.run.path("last.pt")} holds it; run the same command '
                     'with --resume to go on')
        raise SystemExit(128 + signal.SIGTERM)


def planted_stops(args, step, points):
    """The tests' stops at a known step: a SIGTERM to itself, or death as if killed once the last resume point is
    written."""
    if args.term_after and step == args.term_after:
        os.kill(os.getpid(), signal.SIGTERM)
    if args.halt_after and step == args.halt_after:
        points.writer.wait()
        os._exit(3)


def resume_point(method, opt, sched, state, scaler):
    return {'method': method.state_dict(), 'optimizer': opt.state_dict(), 'schedule': sched.state_dict(),
            'state': dict(state), 'rng': torch.get_rng_state(), 'scaler': scaler.state_dict()}


def save(run, name, parts, args, writer=None, keep=0):
    """A checkpoint (layers.save_checkpoint: atomic), from the first process, by a writer's thread when given one;
    keep: the last `keep` of its folder."""
    if run.rank == 0:
        exported = xlt.method_class(args).exported(args, run.tok)  # what python layers.py export reads
        meta = {**identity(args), 'settings': json.loads(json.dumps(vars(args))), **exported}
        (writer.save if writer else layers.save_checkpoint)(run.path(name), meta, **parts)
        layers.keep_last(os.path.dirname(run.path(name)), keep)


def open_log(path, step):
    """log.jsonl from `step` on: a resumed run drops the lines written after its checkpoint."""
    lines = data.read_text(path).splitlines(keepends=True) if step and os.path.exists(path) else []
    layers.atomic_write(path, ''.join(line for line in lines if json.loads(line)['step'] <= step))
    return open(path, 'a')


# ----------------------------------------------------------------------------------------
# Stopping: what Ctrl-C says.

def interrupted(args):
    """Ctrl-C's line: the last checkpoint this run wrote, and how to go on from it."""
    if args.eval_only:
        return 'interrupted while evaluating: nothing was changed; run the same command again'
    found = [os.path.join(d, n) for d, _, names in os.walk(args.out) for n in names if n in ('last.pt', 'trained.json')]
    found = [p for p in found if os.path.getmtime(p) >= START]  # not an earlier run's
    if not found:
        return f'interrupted before the first checkpoint in {args.out}: run the same command again'
    last, go_on = max(found, key=os.path.getmtime), 'run the same command with --resume to go on'
    if last.endswith('trained.json'):  # a training ended, its model in best.pt
        return f'interrupted after a training ended ({os.path.dirname(last)}): {go_on}'
    step = layers.load_checkpoint(last, mmap=True)['state']['step']  # mapped: the weights are not read
    return f'interrupted: the last checkpoint is step {step} ({last}); {go_on} from it'


if __name__ == '__main__':
    main()
