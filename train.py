"""Train a cross-lingual transfer method on an XTREME task, then evaluate it in every language.

    python train.py --method zeroshot --task xnli --demo          # built-in data, tiny model, CPU
    python train.py --method veco --task pretrain --demo          # VECO's pre-training of the demo model
    python train.py --method veco --task translate --demo         # VECO's encoder-decoder on toy en -> de
    python train.py --method translate-train-all --task pawsx --init xlmr-base.pt \\
        --spm sentencepiece.bpe.model --data_dir data/ --out runs/pawsx
    torchrun --nproc_per_node 8 train.py ...                       # the same run on 8 GPUs (DDP)

One loop serves every method (xlt.METHODS). A run writes to --out: config.json, log.jsonl,
last.pt (resume point) and best.pt (best dev average), results.json and results.txt, and the
test predictions in the leaderboard layout (predictions/<task>/test-<lang>.<ext>).
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import eval as ev
import layers
import xlt

# The demo trains a tiny model from scratch (fine-tuning learning rates: each method's LR table in xlt.py).
# No warm-up: from random weights a ramp from 0 leaves the tiny model on a plateau for some seeds
# (XNLI's English dev stuck at 69%); p_k 50: p* decays within a short run.
# Random batches: the demo's template sentences differ by a few tokens (padding 0-15%), and there length
# tells the label (XNLI: 19, 20, 22 tokens), so grouped batches would each hold one label.
DEMO = {'model': 'tiny', 'lr': 1e-3, 'warmup': 0.0, 'batch_size': 32, 'p_k': 50, 'group_by_length': False}  # epochs: 8, QA 15
# The demo's pre-training: about a minute on a laptop CPU; segments of a sentence or two
DEMO_PRETRAIN = {'steps': 2000, 'eval_every': 500, 'max_len': 32, 'lr': 3e-3}
# The demo's translation: the tiny model's 2 layers make the decoder
DEMO_TRANSLATE = {'steps': 500, 'eval_every': 125, 'lr': 1e-3, 'batch_size': 32, 'warmup': 0.1, 'dropout': 0.1,
                  'attn_dropout': 0.0, 'label_smoothing': 0.1, 'average_last': 2, 'max_len': 64}
STEPPED = ('pretrain', 'translate')  # tasks counted in optimiser steps (--steps, --eval_every), not epochs
TRANSLATION_OPTIONS = ('src', 'tgt', 'dec_layers', 'dec_init', 'label_smoothing', 'beam', 'lenpen', 'average_last')
# Numeric options: option -> (test of a given value, its valid range as said to the user)
POSITIVE, AT_LEAST_1, NON_NEGATIVE = (lambda v: v > 0, 'a number above 0'), (lambda v: v >= 1, 'at least 1'), \
    (lambda v: v >= 0, '0 or more')
SHARE = (lambda v: 0 <= v < 1, 'at least 0 and below 1')
NUMERIC = {'lr': POSITIVE, 'epochs': AT_LEAST_1, 'batch_size': AT_LEAST_1, 'grad_accum': AT_LEAST_1,
           'warmup': SHARE, 'weight_decay': NON_NEGATIVE, 'clip': POSITIVE, 'dropout': SHARE, 'seed': NON_NEGATIVE,
           'm': NON_NEGATIVE, 'k': NON_NEGATIVE, 'kl_weight': (lambda v: 0 <= v <= 1, 'from 0 to 1'),
           'temperature': POSITIVE, 'mixup_layer': AT_LEAST_1, 'p_k': POSITIVE, 'layer': AT_LEAST_1,
           'eval_batch_size': AT_LEAST_1, 'save_every': AT_LEAST_1, 'log_every': AT_LEAST_1, 'steps': AT_LEAST_1, 'eval_every': AT_LEAST_1,
           'cross_only_steps': NON_NEGATIVE, 'max_len': (lambda v: 8 <= v <= 512, '8 to 512 tokens (XLM-R\'s positions)'),
           'attn_dropout': SHARE, 'label_smoothing': SHARE, 'dec_layers': AT_LEAST_1, 'beam': AT_LEAST_1,
           'lenpen': NON_NEGATIVE, 'average_last': NON_NEGATIVE, 'conf_penalty': NON_NEGATIVE, 'xla_lr': POSITIVE,
           'xla_batch_size': AT_LEAST_1, 'xla_epochs': AT_LEAST_1, 'posterior': (lambda v: 0 <= v <= 1, 'from 0 to 1'),
           'aug_share': (lambda v: 0 < v <= 1, 'above 0 and at most 1'), 'alpha': (lambda v: 0 <= v <= 1, 'from 0 to 1'),
           'train_share': (lambda v: 0 < v <= 1, 'above 0 and at most 1')}
XLA_OPTIONS = ('xla_lr', 'xla_batch_size', 'xla_epochs', 'eta', 'distil', 'posterior', 'aug_share', 'delta', 'alpha', 'mlm',
               'warmup_dir', 'train_share')
XLA_TASKS = ('xnli', 'pawsx', 'panx', 'udpos')  # the paper's tasks: classification of pairs, and tagging
# The XLA demo: warm-up as every demo, the XLA epochs at a lower rate; 100% of the demo's data
DEMO_XLA = {'xla_lr': 1e-4, 'xla_batch_size': 32, 'train_share': 1.0, 'train_lang': 'de'}


def fail(message):
    raise SystemExit(f'error: {message}' if os.environ.get('RANK', '0') == '0' else 1)  # one line, from one process


def family(args):
    return {'pretrain': 'pretrain', 'translate': 'translation'}.get(args.task) or data.TASKS[args.task].family


def method_class(args):
    return {'pretrain': xlt.VecoPretrain, 'translate': xlt.VecoTranslate}.get(args.task) or xlt.METHODS[args.method][0]


def parse_args(argv=None):
    p = layers.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--method', default='zeroshot', help=f'one of {", ".join(xlt.METHODS)}')
    p.add_argument('--task', default='xnli', help=f'one of {", ".join(data.TASKS)}; pretrain: VECO\'s pre-training; '
                   'translate: VECO\'s encoder-decoder on --src -> --tgt')
    p.add_argument('--demo', action='store_true', help='generated data and a tiny model: runs in a minute on a CPU')
    p.add_argument('--model', help=f'preset: {", ".join(layers.CONFIGS)} (default base; tiny with --demo)')
    p.add_argument('--init', help='converted XLM-R checkpoint (python layers.py convert) or a run\'s best.pt')
    p.add_argument('--from_scratch', action='store_true', help='train from random weights on real data (no --init); '
                   'with --demo, also where the demo starts from its pre-trained model')
    p.add_argument('--spm', help='sentencepiece model (default: the one in --data_dir)')
    p.add_argument('--data_dir', default='data', help='XTREME data in the layout of the README')
    p.add_argument('--out', help='run folder (default runs/<task>-<method>, plus each choice that changes the '
                   'result: runs/xnli-filter-self-teach-large-seed2)')
    p.add_argument('--lr', type=float, help='peak learning rate (default: per task, from the papers)')
    p.add_argument('--epochs', type=int, help='default 4 (2 for xquad and mlqa)')
    p.add_argument('--batch_size', type=int, help='global batch size, over all processes (default 64)')
    p.add_argument('--grad_accum', type=int, default=1, help='micro-batches per process and step')
    p.add_argument('--max_len', type=int, help='max tokens per input (default 128; 384 for QA)')
    p.add_argument('--warmup', type=float, help='share of the steps with a rising learning rate (default 0.1; demo 0)')
    p.add_argument('--weight_decay', type=float, help='default 0.01 (VECO: its scripts\' values)')
    p.add_argument('--clip', type=float, help='gradient norm clipping (default 1.0; translation 0.1)')
    p.add_argument('--dropout', type=float, help='override the model\'s dropout')
    p.add_argument('--attn_dropout', type=float, help='override the attention dropout (default: --dropout\'s value)')
    p.add_argument('--seed', type=int, default=1, help='seed of the head, the batches and dropout (default 1)')
    p.add_argument('--train_lang', help='translate-train: the language whose translation to train on')
    p.add_argument('--translate_test', action='store_true', help='evaluate on the test sets translated into English')
    p.add_argument('--m', type=int, help='FILTER: local layers (default 1)')
    p.add_argument('--k', type=int, help='FILTER: fusion layers (default 1; 20 for QA)')
    p.add_argument('--kl_weight', type=float, help='FILTER: self-teaching KL weight 1 - lambda (0.5 / 1.0 / 0.1)')
    p.add_argument('--temperature', type=float, help='FILTER: self-teaching KL of distributions softened by T, '
                   'times T^2 (default 1, as the paper)')
    p.add_argument('--self_teach', action='store_true', help='FILTER: train a teacher, then the student (Algorithm 1)')
    p.add_argument('--teacher', help='FILTER: train only the student, taught by this finished teacher run folder; '
                   'X-Mixup on tagging: the finished run whose predictions label the translations')
    p.add_argument('--mixup_layer', type=int, help='X-Mixup: the layer that mixes (default 1 / 4 / 16 of 24, scaled)')
    p.add_argument('--fixed_lambda', action='store_true', help='X-Mixup ablation: lambda = lambda_0')
    p.add_argument('--p_k', type=float, help='X-Mixup: scheduled sampling decay rate (1000 / 1000 / 2000; demo 50)')
    p.add_argument('--no_mixup_inference', action='store_true', help='X-Mixup ablation: predict from the target alone')
    p.add_argument('--conf_penalty', type=float, help='XLA\'s confidence penalty (Eq. 1): minus this weight times the '
                   'entropy of the predictions (the baselines and VECO; XLA warms up with 1)')
    p.add_argument('--xla_lr', type=float, help='XLA: learning rate of the XLA epochs (--lr: the warm-up\'s; Table 8)')
    p.add_argument('--xla_batch_size', type=int, help='XLA: batch size of the XLA epochs (Table 8: 16, 32)')
    p.add_argument('--xla_epochs', type=int, help='XLA: epochs of co-teaching after the warm-up (default 3, Algorithm 1)')
    p.add_argument('--eta', type=float, nargs='+', help='XLA: percent of the labelled samples each model keeps, per XLA '
                   'epoch, by confidence (the last repeats; Table 8: 80 100 100 / 50 80 100 / 80 90 80)')
    p.add_argument('--distil', choices=('confidence', 'gmm'), help='XLA: keep the top --eta percent by confidence '
                   '(default), or the samples a 2-component GMM of the losses puts in the low-loss cluster')
    p.add_argument('--posterior', type=float, help='XLA with --distil gmm: the least posterior of the low-loss '
                   'component a kept sample has (default 0.5)')
    p.add_argument('--aug_share', type=float, help='XLA: share P of a sentence\'s pieces the masked LM replaces (0.3; PAWS-X 0.4)')
    p.add_argument('--delta', type=int, nargs='+', help='XLA: vicinal samples per sentence (3), or per part of a pair '
                   '(2 2: successive cross, 4 samples)')
    p.add_argument('--alpha', type=float, help='XLA: Eq. 2\'s sampling factor over the training sets (default 0.7)')
    p.add_argument('--mlm', help='XLA: the checkpoint whose masked LM makes the vicinal samples (default --init)')
    p.add_argument('--warmup_dir', help='XLA: folder of the three warm-up runs warmup-1..3, reused when finished '
                   '(default --out; share one folder between target languages)')
    p.add_argument('--train_share', type=float, help='XLA: share of the English and target training data used (XNLI, '
                   'PAWS-X: 0.05, two disjoint random draws, as the paper\'s 5%% setting; 1 for the 100%% setting)')
    p.add_argument('--translate_train_all', action='store_true', help='VECO: fine-tune on English and its '
                   'translations into every target language (default: English alone)')
    p.add_argument('--steps', type=int, help='pre-training and translation: optimiser steps (default 240000, '
                   'Table 5; translation 100000)')
    p.add_argument('--eval_every', type=int, help='pre-training and translation: steps between held-out evaluations '
                   '(default 2000; translation 5000, each saving a checkpoint to average)')
    p.add_argument('--cross_only_steps', type=int, help='pre-training: first steps that train only the '
                   'cross-attention, the rest frozen (default: the warm-up steps from --init, 0 from scratch)')
    p.add_argument('--src', help='translate: source language (default en; the README\'s layout)')
    p.add_argument('--tgt', help='translate: target language (default de)')
    p.add_argument('--dec_layers', type=int, help='translate: decoder layers (default 6, at most the model\'s depth)')
    p.add_argument('--dec_init', choices=('last', 'first', 'random'), help='translate: the decoder copies the last '
                   '(default) or the first pre-trained layers, or is new (Table 4)')
    p.add_argument('--label_smoothing', type=float, help='translate: label smoothing (default 0.2)')
    p.add_argument('--beam', type=int, help='translate: beam size (default 5)')
    p.add_argument('--lenpen', type=float, help='translate: length penalty, score / length ** lenpen (default 1)')
    p.add_argument('--average_last', type=int, help='translate: decode with the mean of the last N checkpoints '
                   '(one every --eval_every steps; default 10; 0: best.pt, the lowest valid loss)')
    p.add_argument('--layer', type=int, help='retrieval: hidden layer to pool (default 7/12 of the depth)')
    p.add_argument('--group_by_length', action='store_true', default=None, help='training batches of similar lengths, '
                   'little padding (the default but in the demo)')
    p.add_argument('--no_group_by_length', dest='group_by_length', action='store_false', default=None,
                   help='random training batches, as the papers\' scripts (the demo\'s default)')
    p.add_argument('--grad_checkpoint', action='store_true', help='activation checkpointing: recompute each block in '
                   'backward instead of keeping its activations (less memory, about a third more compute)')
    p.add_argument('--eval_batch_size', type=int, default=64, help='examples per evaluation batch')
    p.add_argument('--save_every', type=int, default=200, help='steps between resume checkpoints')
    p.add_argument('--log_every', type=int, default=10, help='steps between lines of log.jsonl (each the mean of its '
                   'steps; the only time the loop waits for the device)')
    p.add_argument('--compile', action='store_true', help='torch.compile each transformer block (the first steps '
                   'compile; outputs as without, to 1e-5)')
    p.add_argument('--resume', action='store_true', help='continue from --out/last.pt')
    p.add_argument('--eval_only', action='store_true', help='evaluate --out/best.pt (or --init) without training')
    p.add_argument('--overwrite', action='store_true', help='replace a finished run of other settings in --out '
                   '(without it such a folder is refused)')
    p.add_argument('--dry_run', action='store_true', help='check the options and that every file the run reads is '
                   'there, print the plan, and stop: nothing is trained or written')
    p.add_argument('--halt_after', type=int, help=argparse.SUPPRESS)  # tests: die abruptly after this many steps
    args = p.parse_args(argv)
    for name, (ok, valid) in NUMERIC.items():  # before the defaults: 0 must not read as 'not given'
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and ok(value)):
            fail(f'--{name} {value} is out of range: give {valid}')
    if args.task not in data.TASKS and args.task not in STEPPED:
        fail(f'unknown task {args.task!r}: choose one of {", ".join(data.TASKS)} (or pretrain and translate, with --method veco)')
    if args.method not in xlt.METHODS:
        fail(f'unknown method {args.method!r}: choose one of {", ".join(xlt.METHODS)}')
    if args.task in STEPPED and args.method != 'veco':
        fail(f'--task {args.task} is VECO\'s: pass --method veco (not {args.method})')
    given = [f'--{o}' for o in ('steps', 'eval_every') if getattr(args, o) is not None]
    if given and args.task not in STEPPED:
        fail(f'{" and ".join(given)} belong to pre-training and translation; fine-tuning counts --epochs')
    if args.cross_only_steps is not None and args.task != 'pretrain':
        fail('--cross_only_steps belongs to pre-training (--task pretrain)')
    given = [f'--{o}' for o in TRANSLATION_OPTIONS if getattr(args, o) is not None]
    if given and args.task != 'translate':
        fail(f'{" and ".join(given)} belong to translation (--task translate)')
    if args.task == 'translate':
        args.src, args.tgt, args.dec_init = args.src or 'en', args.tgt or 'de', args.dec_init or 'last'
        args.beam, args.lenpen = args.beam or 5, 1.0 if args.lenpen is None else args.lenpen
        if args.src == args.tgt:
            fail(f'--src and --tgt are both {args.src}: translation needs two languages')
    if args.conf_penalty is not None and (args.task in STEPPED or not issubclass(method_class(args), xlt.Baseline)):
        fail(f'--conf_penalty belongs to fine-tuning a single text (the baselines, VECO), not to {args.method} on {args.task}')
    given = [f'--{o}' for o in XLA_OPTIONS if getattr(args, o) is not None]
    if given and args.method != 'xla':
        fail(f'{" and ".join(given)} belong to XLA (--method xla)')
    if args.method == 'xla' and args.task not in XLA_TASKS:
        fail(f'XLA is for {", ".join(XLA_TASKS)} (the paper\'s tasks; its vicinal samples keep a pair or a '
             f'sentence\'s words), not {args.task}')
    if args.posterior is not None and args.distil != 'gmm':
        fail('--posterior is the threshold of --distil gmm: add --distil gmm or drop --posterior')
    if any(not 0 < v <= 100 for v in args.eta or []):
        fail(f'--eta {" ".join(map(str, args.eta))} is out of range: give percents above 0 and at most 100')
    if any(v < 1 for v in args.delta or []):
        fail(f'--delta {" ".join(map(str, args.delta))} is out of range: give samples per sentence, at least 1')
    if args.translate_train_all and args.method != 'veco':
        fail(f'--translate_train_all belongs to VECO; for {args.method} use --method translate-train-all')
    if args.translate_test and (family(args) in ('tagging', 'pretrain') or method_class(args).paired):
        fail('--translate_test needs a method that reads one text and a task whose labels survive translation '
             '(tags would need a word alignment): drop --translate_test')
    demo = {**DEMO, **{'pretrain': DEMO_PRETRAIN, 'translate': DEMO_TRANSLATE}.get(args.task, {})} if args.demo else {}
    args.model = args.model or demo.get('model', 'base')
    if args.model not in layers.CONFIGS:
        fail(f'unknown model {args.model!r}: choose one of {", ".join(layers.CONFIGS)}')
    method = method_class(args)
    released = {**getattr(method, 'RUN', {}).get(args.task, {}), **getattr(method, 'PAIRS', {}).get(f'{args.src}-{args.tgt}', {})}
    if args.demo and args.method == 'xla':  # Table 8's augmentation and distillation; the warm-up as every demo's
        demo = {**{k: v for k, v in released.items() if k in XLA_OPTIONS}, **demo, **DEMO_XLA}
    for option, value in (demo or released).items():  # the demo's, or the released scripts'
        if getattr(args, option, None) is None:
            setattr(args, option, value)
    if args.lr is None:
        table = method.LR_ALL if args.translate_train_all else {**method.LR, **(method.LR_LARGE if args.model == 'large' else {})}
        args.lr = table.get(args.task, 2e-5)
    if args.task == 'pretrain':  # Table 5: 240k steps, 12k of them warm-up; 512 tokens a segment
        args.steps, args.eval_every = args.steps or 240000, args.eval_every or 2000
        args.epochs = math.ceil(args.steps / args.eval_every)  # an 'epoch' of pre-training: eval_every steps
        args.warmup = 0.05 if args.warmup is None else args.warmup
        args.batch_size, args.max_len = args.batch_size or 1024, args.max_len or 512
        if args.cross_only_steps is None:
            args.cross_only_steps = int(args.warmup * args.steps) if args.init else 0
    if args.task == 'translate':  # steps and the rest from VecoTranslate.RUN (finetune-wmt14en2de.sh)
        args.epochs = math.ceil(args.steps / args.eval_every)
        args.dec_layers = args.dec_layers or min(6, layers.CONFIGS[args.model].n_layer)
    if args.epochs is None:  # the papers: 4 (2 for XQuAD and MLQA); the demo's QA needs longer than its other tasks
        qa = family(args) == 'qa'
        args.epochs = (15 if qa else 8) if args.demo else (2 if args.task in ('xquad', 'mlqa') else 4)
    if args.warmup is None:
        args.warmup = 0.1
    if args.group_by_length is None:
        args.group_by_length = True
    if args.clip is None:
        args.clip = 1.0
    if args.weight_decay is None:
        args.weight_decay = 0.01
    if args.batch_size is None:
        args.batch_size = 64
    if args.max_len is None:
        args.max_len = 384 if family(args) == 'qa' else 128
    if args.method == 'xla':
        args.xla_epochs, args.distil, args.alpha = args.xla_epochs or 3, args.distil or 'confidence', \
            xlt.XLA.ALPHA if args.alpha is None else args.alpha
        args.posterior = 0.5 if args.posterior is None and args.distil == 'gmm' else args.posterior
        pair = family(args) == 'classification'
        if len(args.delta) != (2 if pair else 1) and not (pair and len(args.delta) == 1):
            fail(f'--delta takes {"one or two numbers (samples per part of a pair)" if pair else "one number (samples per sentence)"} '
                 f'for {args.task}, not {len(args.delta)}')
        args.delta = args.delta * 2 if pair and len(args.delta) == 1 else args.delta
        if not args.train_lang:
            fail('XLA adapts to one target language: pass --train_lang (its unlabelled training text is read)')
    args.stage = 'student' if args.self_teach or args.teacher else None  # teacher and warm-up runs set theirs
    args.out = args.out or os.path.join('runs', default_folder(args))
    if args.demo and not args.init and not args.from_scratch and method.pretrained_start:
        args.init = demo_start(args.out)  # made by the run when missing; recorded alike by every run of the folder
    return args


def demo_start(out):
    """The demo's pre-trained tiny model: VECO pre-trained on the demo's text, in
    pretrain-veco-demo beside the run folder."""
    return os.path.join(os.path.dirname(os.path.abspath(out)), 'pretrain-veco-demo', 'best.pt')


def default_folder(args):
    """A run's default folder names every choice that changes what it is: task, method, target
    language, translations, self-teaching, translate-test, a preset or seed not the default, the demo."""
    parts = [f'{args.task}-{args.src}-{args.tgt}' if args.task == 'translate' else args.task, args.method]
    parts += [args.train_lang] if args.method in ('translate-train', 'xla') and args.train_lang else []
    parts += ['translate-train-all'] * args.translate_train_all + ['self-teach'] * bool(args.self_teach or args.teacher)
    parts += ['translate-test'] * args.translate_test + [args.model] * (args.model != ('tiny' if args.demo else 'base'))
    parts += [f'seed{args.seed}'] * (args.seed != 1) + ['demo'] * args.demo
    return '-'.join(parts)


# ----------------------------------------------------------------------------------------
# --dry_run: the files a run reads, checked, and its plan, without reading a tensor.

METHOD_OPTIONS = {'filter': ('m', 'k', 'kl_weight', 'temperature'), 'xmixup': ('mixup_layer', 'p_k', 'fixed_lambda',
                  'no_mixup_inference'), 'xla': ('train_lang', 'warmup_dir') + XLA_OPTIONS,
                  'veco': ('translate_train_all', 'cross_only_steps') + TRANSLATION_OPTIONS}
SELECTED_BY = {'en': 'best English dev score', 'average': 'best average dev score over languages',
               'loss': 'lowest held-out loss'}  # the checkpoint each method.select keeps


def planned_files(args):
    """-> [(path, what it is, needed)] of the data a run reads, in the README's layout; not
    needed: read where it is there (dev sets, test labels, round trips)."""
    spm = (args.spm or os.path.join(args.data_dir, 'sentencepiece.bpe.model'), 'XLM-R\'s sentencepiece model: put it '
           'there or pass --spm', True)
    return data_files(args) + [spm]


def data_files(args):
    d, task, files = args.data_dir, args.task, []
    add = lambda path, what, needed=True: files.append((path, what, needed))
    if task == 'pretrain':
        return [(p, 'pre-training text', True) for paths in data.pretrain_files(d).values() for p in paths]
    if task == 'translate':
        return [(p, 'parallel text', True) for split in ('train', 'valid', 'test') for p in data.parallel_files(d, args.src, args.tgt, split)]
    family, langs = data.TASKS[task].family, data.languages(task, data.is_demo(d))
    get = f'python data.py download --task {task} --out {d}'
    labels = [(os.path.join(d, 'labels', task, f'test-{lang}.{ev.suffix(task)}'), 'test labels (scored when there)', False)
              for lang in langs]
    if family == 'retrieval':  # BUCC's threshold comes from its dev pairs and their gold alignment
        return [(f'{data.split_path(d, task, split, lang)}.{side}', get, True) for lang in langs
                for split, sides in (('test', (lang, 'en')), ('dev', (lang, 'en', 'gold') if task == 'bucc2018' else ()))
                for side in sides] + labels
    method, train_on = method_class(args), 'translations' if args.translate_train_all else xlt.METHODS[args.method][1]
    if not args.eval_only:
        add(data.split_path(d, task, 'train'), get)
        translated = {'translation': [args.train_lang], 'translations': target_langs(args)}.get(train_on, [])
        if args.method == 'xla':
            translated = [args.train_lang] if family == 'classification' else []
            if family == 'tagging':
                add(data.split_path(d, task, 'train', args.train_lang), f'XLA reads the unlabelled {args.train_lang} '
                    f'training text (XTREME\'s train-{args.train_lang}.tsv)')
        for lang in translated:
            add(data.split_path(d, task, 'translate-train', lang), f'{task} needs translate-train files for {lang}; '
                f'{data.TRANSLATIONS}')
            if method.round_trip:
                add(data.split_path(d, task, 'round-trip', lang), 'X-Mixup\'s round trip (the real English where missing)', False)
    for split in ('dev', 'test'):
        for lang in langs:
            path = data.split_path(d, task, split, lang)
            if path is None or (split == 'dev' and not os.path.exists(path)):
                continue  # no dev set in this language: the run evaluates what there is
            add(path, get)
            if lang != 'en' and (method.paired or args.translate_test):
                add(data.split_path(d, task, f'translate-{split}', lang), f'{args.method} needs translate-{split} files '
                    f'for {lang}; {data.TRANSLATIONS}')
    return files + labels


def check(args, world):
    """Everything that can be checked before anything is created: --out and --data_dir, the
    options against each other, the model and the processes, every file the run reads, the
    sentencepiece model, --init's and --mlm's format, the teacher, and what --out holds.
    -> the data files [(path, what, needed)]."""
    parent = os.path.dirname(first_missing(args.out) or os.path.abspath(args.out))
    if os.path.exists(args.out) and not os.path.isdir(args.out) or not os.path.isdir(parent):
        fail(f'--out {args.out}: {args.out if os.path.exists(args.out) else parent} is a file; give a folder for the run')
    if not os.access(parent if not os.path.exists(args.out) else args.out, os.W_OK):
        fail(f'--out {args.out} cannot be written here: give a folder you can write to')
    if not args.demo and os.path.isfile(args.data_dir):
        fail(f'--data_dir {args.data_dir} is a file: give the data folder (the README\'s layout)')
    check_batches(args, world)
    check_options(args)
    files = [] if args.demo else planned_files(args)
    data_needed = [path for path, _, needed in files[:-1] if needed]  # the last is the sentencepiece model
    lost = [(path, what) for path, what, needed in files if needed and not os.path.isfile(path)]
    if data_needed and all(not os.path.isfile(p) for p in data_needed):
        hint = f' ({args.method} reads translations too: {data.TRANSLATIONS})' if any(
            data.TRANSLATIONS in what for _, what, _ in files) else ''
        fail(f'{args.data_dir} holds no {args.task} data (no {lost[0][0]}): {lost[0][1]}, or pass --demo{hint}')
    for path, what in lost[1:]:
        print(f'not found: {path}')
    if lost:
        fail(f'{lost[0][0]} not found{f" (and {len(lost) - 1} more, listed above)" if len(lost) > 1 else ""}: {lost[0][1]}')
    if files:
        data.Tokenizer(files[-1][0])  # a file that is not a sentencepiece model stops here, not after a folder is made
    check_init(args)
    for path in (args.init, getattr(args, 'mlm', None)):
        if path and not (args.demo and path == demo_start(args.out)):
            try:
                layers.check_format(path)
            except layers.CheckpointError as e:
                fail(str(e))
    if args.teacher:
        check_teacher(args)
    if args.eval_only and args.method != 'xla' and not (args.init or os.path.exists(os.path.join(args.out, 'best.pt'))):
        fail(f'{args.out}/best.pt not found: --eval_only evaluates a finished run in --out (or the --init weights)')
    if args.resume and not began(args.out):
        fail(f'nothing to resume in {args.out} (no run began there): drop --resume to start a new run, or give the '
             'folder of the stopped run')
    for m in range(3) if args.method == 'xla' else ():
        warm_up_run(args, m)  # a kept warm-up of other settings stops the run here
    check_finished(args)
    return files


def check_teacher(args):
    """--teacher is a finished run of this task with a readable best.pt."""
    for name in ('results.json', 'config.json', 'best.pt'):
        if not os.path.isfile(os.path.join(args.teacher, name)):
            fail(f'--teacher {args.teacher} is not a finished run (no {name}): train the teacher first')
    try:
        layers.check_format(os.path.join(args.teacher, 'best.pt'))
    except layers.CheckpointError as e:
        fail(f'--teacher {args.teacher}: {e}')
    task = read_config(os.path.join(args.teacher, 'config.json')).get('task')
    if task != args.task:
        fail(f'the teacher {args.teacher} was trained on {task}, not {args.task}: give a {args.task} run')


def check_options(args):
    """The rules between options that argparse cannot see, and the method's own (layer counts),
    tried on a narrow model of the preset's depth."""
    method, family_ = method_class(args), family(args)
    if (args.self_teach or args.teacher) and not (args.method == 'filter' or (args.method == 'xmixup' and family_ == 'tagging')):
        fail('--self_teach and --teacher belong to FILTER, and to X-Mixup on tagging (udpos, panx)')
    if args.method == 'xmixup' and family_ == 'tagging' and not (args.self_teach or args.teacher):
        fail('X-Mixup on tagging learns T from a source-language model\'s labels: pass --teacher RUN '
             '(a finished zeroshot run) or --self_teach to train one first')
    if xlt.METHODS[args.method][1] == 'translation' and family_ not in ('retrieval', 'pretrain', 'translation'):
        langs = target_langs(args)
        if args.train_lang not in langs:
            fail(f'translate-train needs --train_lang, one of {", ".join(langs)}')
    if args.task not in STEPPED and family_ != 'retrieval':
        cfg = replace(layers.CONFIGS[args.model], dim=8, n_head=1, ffn_dim=8, vocab_size=8)
        try:
            method(layers.Encoder(cfg), args.task, args)
        except ValueError as e:
            fail(str(e))


RUN_FREE = ('out', 'resume', 'eval_only', 'dry_run', 'overwrite', 'data_dir', 'spm', 'warmup_dir', 'eval_batch_size',
            'save_every', 'log_every', 'compile', 'grad_accum', 'grad_checkpoint', 'halt_after', 'stage')  # results alike
EVALUATION = ('method', 'task', 'model', 'translate_test', 'max_len', 'layer', 'no_mixup_inference', 'beam', 'lenpen',
              'average_last')  # what --eval_only's results depend on


def read_config(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        fail(f'{path} is not a run\'s config (not valid JSON): remove it, or give another folder')


def differences(found, args, keys=None):
    """The settings of args that differ from a run's config.json (found), paths compared as files."""
    now = json.loads(json.dumps(vars(args)))
    same = lambda a, b: a == b or (isinstance(a, str) and isinstance(b, str) and os.path.realpath(a) == os.path.realpath(b))
    return [k for k in keys or now if k not in RUN_FREE and k in found and k in now and not same(found[k], now[k])]


def check_finished(args):
    """A finished run in --out (or the stopped one --resume goes on with) is replaced only by a run
    of the same settings, or with --overwrite; --eval_only compares what its results depend on."""
    config = os.path.join(args.out, 'config.json')
    if args.overwrite or not os.path.exists(config) or not (args.resume or os.path.exists(os.path.join(args.out, 'results.json'))):
        return
    found = read_config(config)
    differ = differences(found, args, EVALUATION if args.eval_only else None)
    if differ:
        now, more = vars(args), f', and {len(differ) - 1} more' if len(differ) > 1 else ''
        fail(f'{args.out} holds a {"stopped" if args.resume else "finished"} run with --{differ[0]} {found[differ[0]]} '
             f'(this run: {now[differ[0]]}{more}): give another --out, or add --overwrite to replace it')


def plan(args, world, files):
    """The run in a few named lines, for the banner and --dry_run."""
    found, method = [path for path, _, _ in files if os.path.isfile(path)], method_class(args)
    if args.method == 'xla':
        stages = f'3 warm-ups (in {args.warmup_dir or args.out}), then {args.xla_epochs} XLA epochs'
    elif args.self_teach:
        stages = f'a {"FILTER" if args.method == "filter" else "zero-shot"} teacher into {args.out}/teacher, then the student'
    else:
        stages = f'the student of the teacher {args.teacher}' if args.teacher else 'one'
    made = ' (the demo\'s pre-trained model, made first)' if args.demo and args.init and not os.path.exists(args.init) else ''
    return {'model': f'{args.model}, from {args.init or "random weights"}{made}',
            'data': 'generated into the run folder (--demo)' if args.demo else
            f'{args.data_dir}: {len(found)} files found, {len(files) - len(found)} optional ones missing',
            'training': 'none (--eval_only)' if args.eval_only else 'none (retrieval: mean-pooled states, nearest '
            'neighbours)' if family(args) == 'retrieval' else
            f'{f"{args.steps} steps" if args.task in STEPPED else f"{args.epochs} epoch(s)"}, global batch {args.batch_size}'
            f'{f" ({world} processes x {args.grad_accum} micro-batches)" if world * args.grad_accum > 1 else ""}, lr {args.lr:g}, warm-up {args.warmup:g}, '
            f'weight decay {args.weight_decay:g}, up to {args.max_len} tokens, seed {args.seed}',
            'method': ', '.join(f'{o} {" ".join(map(str, v)) if isinstance(v, list) else v}' for o in METHOD_OPTIONS.get(
                args.method, ()) if (v := getattr(args, o, None)) not in (None, False)) or 'its defaults',
            'stages': stages,
            'kept': 'nothing trained' if family(args) == 'retrieval' else 'the ' + SELECTED_BY[method.select] +
            (', and each XLA epoch unless the --train_lang dev score falls' if args.method == 'xla' else '')}


def show(title, rows):
    print(title)
    for name, value in rows.items():
        print(f'  {name:<9} {value}')


# ----------------------------------------------------------------------------------------
# Set-up: processes, data, model.

def setup_distributed():
    """-> (rank, world size, device); under torchrun one process per device."""
    if 'RANK' not in os.environ:
        return 0, 1, torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    cuda = torch.cuda.is_available()
    dist.init_process_group('nccl' if cuda else 'gloo')
    rank, local = dist.get_rank(), int(os.environ.get('LOCAL_RANK', 0))
    if cuda:
        torch.cuda.set_device(local)
    return rank, dist.get_world_size(), torch.device(f'cuda:{local}' if cuda else 'cpu')


def prepare_data(args, rank):
    if args.demo:
        args.data_dir = os.path.join(args.out, 'demo-data')
        if rank == 0 and not data.is_demo(args.data_dir, current=True):
            data.make_demo(args.data_dir, seed=0)
        if dist.is_initialized():
            dist.barrier()
    return data.Tokenizer(args.spm or os.path.join(args.data_dir, 'sentencepiece.bpe.model'))


def build_encoder(args, tok, cross=False):
    """-> (encoder, MLM head or None) from --init or, for the demo and --from_scratch, random.
    cross: VECO's blocks with cross-attention (pre-training); without, a checkpoint's
    cross-attention is left out (VECO's NLU assembly)."""
    cfg, mlm = layers.CONFIGS[args.model], None
    if args.init:
        try:
            encoder, mlm = layers.load_pretrained(args.init, cross)
        except layers.CheckpointError as e:
            fail(str(e))
        got, want = encoder.cfg, cfg
        if (got.n_layer, got.dim, got.n_head, got.ffn_dim) != (want.n_layer, want.dim, want.n_head, want.ffn_dim):
            fail(f'--init {args.init} is a {got.n_layer} x {got.dim} model, not the {args.model} preset '
                 f'({want.n_layer} x {want.dim}): pass the --model it was made for')
    else:
        check_init(args)
        torch.manual_seed(args.seed)
        encoder = layers.Encoder(layers.Config(**{**cfg.__dict__, 'vocab_size': tok.vocab_size}), cross)
    if encoder.cfg.vocab_size != tok.vocab_size:
        fail(f'the tokenizer has {tok.vocab_size} ids but the model {encoder.cfg.vocab_size}: '
             'use the sentencepiece model that came with the checkpoint (--spm)')
    if args.dropout is not None:
        for m in encoder.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = args.dropout
        encoder.cfg.dropout = args.dropout
    encoder.grad_checkpoint = args.grad_checkpoint
    if args.compile:
        layers.compile_blocks(encoder)
    attn_dropout = args.dropout if args.attn_dropout is None else args.attn_dropout
    if attn_dropout is not None:
        encoder.cfg.attn_dropout = attn_dropout
        for m in encoder.modules():
            if isinstance(m, layers.Attention):
                m.p = attn_dropout
    return encoder, mlm


def target_langs(args):
    return [lang for lang in data.languages(args.task, args.demo or data.is_demo(args.data_dir)) if lang != 'en']


def training_items(args, tok, method, rank=0):
    """Training features, or (English, translation) feature pairs for paired methods."""
    train_on = 'translations' if args.translate_train_all else xlt.METHODS[args.method][1]
    langs = [args.train_lang] if train_on == 'translation' else target_langs(args)
    english = data.read_split(args.data_dir, args.task, 'train')
    if getattr(args, 'train_share', None):  # XLA's warm-up on the 5% setting: its share of English
        english = data.share_of(english, args.train_share, part=0)
    if method.paired or train_on != 'en':
        pairs = {lang: data.read_translations(args.data_dir, args.task, 'train', lang, english) for lang in langs}
    if method.paired:  # (English, translation[, round trip]); English also pairs with itself, as both released codes do
        tuples = [(e, e) + ((e,) if method.round_trip else ()) for e in english]
        missing = []
        for lang in langs:
            trip = data.read_round_trip(args.data_dir, args.task, lang, pairs[lang]) if method.round_trip else None
            if method.round_trip and trip is None:
                missing.append(lang)
            tuples += [(e, t) + ((r,) if method.round_trip else ()) for (e, t), r in zip(pairs[lang], trip or [e for e, _ in pairs[lang]])
                       if t is not None]
        if missing and rank == 0:
            print(f'warning: no round-trip data for {args.task} in {", ".join(missing)} (see the README): '
                  'scheduled sampling feeds the real English text there')
        return data.pair_features(tok, args.task, tuples, args.max_len, train=True)
    translated = [t for lang in langs for _, t in pairs[lang] if t is not None] if train_on != 'en' else []
    return data.make_features(tok, args.task, (english if train_on != 'translation' else []) + translated, args.max_len, train=True)


def collate_items(method):
    """Batches of features, or Pairs of (English, target) features for paired methods."""
    if not method.paired:
        return data.collate
    return lambda items, index=None: data.collate_pairs([i[0] for i in items], [i[1] for i in items], index,
                                                        alt=[i[2] for i in items] if len(items[0]) > 2 else None)


# ----------------------------------------------------------------------------------------
# Evaluation: outputs for every feature, sharded over processes and gathered.

@torch.no_grad()
def outputs_of(method, items, collate, args, device, rank, world):
    method.eval()
    predicted = lambda item: item[1] if isinstance(item, tuple) else item  # paired: the target side
    batches = data.length_batches([predicted(item) for item in items], args.eval_batch_size)
    mine, out = batches[rank::world], {}
    for index in data.bar(mine, desc='eval', leave=False):
        with autocast(device):
            result = method.predict(collate([items[i] for i in index], index).to(device)).float().cpu()
        for i, r in zip(index, result):
            out[i] = r if method.family == 'classification' else r[:len(predicted(items[i]).ids)]
    return gathered(out, len(items), world)


def gathered(out, n, world):
    """This process's {item position: output} -> the outputs of all n items, from every process."""
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, out)
        out = {k: v for part in parts for k, v in part.items()}
    return [out[i] for i in range(n)]


def predictions(task, feats, outputs, examples):
    """Model outputs -> predictions in the leaderboard's form."""
    info = data.TASKS[task]
    if info.family == 'classification':
        return [info.labels[o.argmax().item()] for o in outputs]
    if info.family == 'tagging':
        words = data.word_predictions(feats, [o.argmax(-1).tolist() for o in outputs], len(examples))
        return [[info.labels[i] for i in w] for w in words]
    return ev.decode_qa(feats, [o[:, 0] for o in outputs], [o[:, 1] for o in outputs])


def scores_of(task, lang, examples, preds):
    """Scores of predictions against the examples' own labels -> {metric: value}, plus 'score'."""
    family = data.TASKS[task].family
    if family == 'classification':
        s = ev.accuracy([ex['label'] for ex in examples], preds)
    elif family == 'tagging':
        s = ev.chunk_f1([ex['tags'] for ex in examples], preds)
    else:
        s = ev.qa_scores([{'paragraphs': [{'qas': examples}]}], preds, lang if task == 'mlqa' else None)
    return dict(s, score=ev.main_score(s))


def eval_examples(args, split, lang):
    """(examples scored against, model inputs): translate-test reads the English translations
    (QA is then scored on the translations' own answers, as XTREME does)."""
    if args.translate_test and lang != 'en':
        pairs = data.read_translations(args.data_dir, args.task, split, lang)
        english = [t or o for o, t in pairs]  # an example without a translation is read as it is
        return (english if data.TASKS[args.task].family == 'qa' else [o for o, _ in pairs]), english
    examples = data.read_split(args.data_dir, args.task, split, lang)
    return examples, examples


def with_translations(args, split, lang, examples):
    """[(English translation, example)] for paired methods; English examples pair with themselves,
    and so does an example whose translation is missing."""
    if lang == 'en':
        return [(ex, ex) for ex in examples]
    pairs = data.read_translations(args.data_dir, args.task, split, lang, examples)
    return [(t or ex, ex) for ex, t in pairs]


def evaluate(method, args, tok, split, device, rank, world, sets, cache=None):
    """-> ({lang: scores}, {lang: predictions}) for every language of sets[split] (eval_sets);
    cache (a dict) keeps the features between calls (the dev set, every epoch)."""
    scores, preds = {}, {}
    cache = {} if cache is None else cache
    for lang, (gold, inputs, pairs) in sets[split].items():
        if lang not in cache:
            if method.paired:
                items = data.pair_features(tok, args.task, pairs, args.max_len)
                feats = [item[1] for item in items]
            else:
                items = feats = data.make_features(tok, args.task, inputs, args.max_len)
            cache[lang] = items, feats
        items, feats = cache[lang]
        outputs = outputs_of(method, items, collate_items(method), args, device, rank, world)
        preds[lang] = predictions(args.task, feats, outputs, inputs)
        if all(ex.get('label', ex.get('tags', ex.get('answers'))) for ex in gold):
            scores[lang] = scores_of(args.task, lang, gold, preds[lang])
    return scores, preds


def test_results(args, preds, rank):
    """Write test predictions in the leaderboard layout; score them with eval.py against
    labels/<task>/test-<lang>.* where the data folder has them."""
    scores = {}
    for lang, p in preds.items():
        if rank == 0:
            ev.write_predictions(os.path.join(args.out, 'predictions'), args.task, lang, p)
        path = os.path.join(args.out, 'predictions', args.task, f'test-{lang}.{ev.suffix(args.task)}')
        gold = os.path.join(args.data_dir, 'labels', args.task, f'test-{lang}.{ev.suffix(args.task)}')
        if os.path.exists(gold) and rank == 0:
            s = ev.score_file(args.task, path, gold, lang)
            scores[lang] = dict(s, score=ev.main_score(s))
    return scores


def retrieval(args, encoder, tok, device):
    """bucc2018 / tatoeba: mean-pooled states of one layer, cosine nearest neighbours; the BUCC
    threshold is chosen on each language's dev gold pairs."""
    layer = args.layer or max(1, round(encoder.cfg.n_layer * getattr(method_class(args), 'RETRIEVAL_DEPTH', 7 / 12)))
    embed = lambda texts: ev.embed_texts(encoder, tok, texts, layer, args.eval_batch_size, device)
    preds = {}
    for lang in data.languages(args.task, data.is_demo(args.data_dir)):
        src, eng, _ = data.read_retrieval(args.data_dir, args.task, 'test', lang)
        if args.task == 'tatoeba':  # for every English sentence, the line of its source sentence
            preds[lang] = ev.nearest(embed(eng), embed(src))[0].tolist()
            continue
        threshold = ev.bucc_dev_threshold(embed, *data.read_retrieval(args.data_dir, args.task, 'dev', lang))
        preds[lang] = ev.bucc_mine(embed, src, eng, threshold)
    return preds


# ----------------------------------------------------------------------------------------
# Training.

def autocast(device):
    return torch.autocast('cuda', dtype=torch.bfloat16) if device.type == 'cuda' else nullcontext()


def optimizer_and_schedule(method, args, total_steps):
    decay = [p for n, p in method.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in method.named_parameters() if p.dim() < 2]  # biases and LayerNorms
    betas, eps = getattr(method, 'ADAM', {}).get(args.model, ((0.9, 0.999), 1e-8))
    # fused: one kernel over all parameters (CPU and CUDA), the same update up to rounding; on XLM-R base's
    # 277M parameters on a 2-core CPU 0.07-0.12 s a step against 0.8-1.5 s (tests/bench.py --optimizer)
    opt = torch.optim.AdamW([{'params': decay, 'weight_decay': args.weight_decay},
                             {'params': no_decay, 'weight_decay': 0.0}], lr=args.lr, betas=betas, eps=eps, fused=True)
    warm = max(1, int(args.warmup * total_steps))
    ramp = lambda step: min((step + 1) / warm, max(0.0, (total_steps - step) / max(1, total_steps - warm)))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, ramp)


MEGA = 50  # length grouping sorts mega-batches of this many batches
BUCKET = 4  # by length in steps of this many tokens, not token by token: where length tells the label (the
# demo's XNLI: 19, 20 and 22 tokens, one label each), batches of one length hold one label and the tiny
# model stalls more often (at 64% English: exactly sorted 4 of seeds 1-6, in steps of 4 2 of 6; random 3 of 1-12)


def item_length(item):
    """The tokens of each side of a training item: (n,) for a feature, one per side for a pair
    (each side of a batch is padded on its own)."""
    return tuple(len(f.ids) for f in item) if isinstance(item, tuple) else (len(item.ids),)


def global_batches(n, args, epoch, chunks, lengths=None):
    """The epoch's global batches from a permutation fixed by (seed, epoch), grouped by the
    items' lengths unless --no_group_by_length (the papers' random batches)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    return cut_batches(order, args.batch_size, chunks, g, lengths if args.group_by_length else None)


def cut_batches(order, size, chunks, g, lengths=None):
    """Batches of `size` items in `order`. With lengths, each mega-batch of MEGA batches is
    sorted by length (in BUCKET steps) before it is cut, and the batches are then shuffled by g:
    a batch holds items of similar length and pads little, and the split depends on no process
    count. A last batch too small to give every process and micro-step an item is dropped."""
    if lengths is not None:  # lengths within BUCKET tokens keep their random order (and mix their labels)
        mega, key = size * MEGA, lambda i: tuple(n // BUCKET for n in lengths[i])  # a pair: by one side, then the other
        order = [i for s in range(0, len(order), mega) for i in sorted(order[s:s + mega], key=key)]
    batches = [order[i:i + size] for i in range(0, len(order), size)]
    if lengths is not None:
        batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
    return [b for b in batches if len(b) >= chunks]


def pad_share(lengths, batches, parts):
    """The share of padding tokens in an epoch's micro-batches (each global batch cut into
    `parts`, as train_step cuts it; each side padded to its longest item). lengths: item_length's."""
    real = padded = 0
    for batch in batches:
        for chunk in np.array_split(np.array(batch), parts):
            for side in zip(*(lengths[i] for i in chunk)):
                real, padded = real + sum(side), padded + len(side) * max(side)
    return 1 - real / max(padded, 1)


def train_step(model, items, batch, args, step, rank, world, device, collate):
    """One optimiser step's gradients. The global batch is cut into world x grad_accum chunks;
    chunk c goes to process c % world and seeds its own dropout, so any split of the same
    global batch over processes and micro-steps computes the same gradient."""
    chunks = np.array_split(np.array(batch), world * args.grad_accum)
    mine = sum(len(chunks[a * world + rank]) for a in range(args.grad_accum))
    logs = {}
    for a in range(args.grad_accum):
        c = a * world + rank
        torch.manual_seed(args.seed * 1_000_003 + step * 1009 + c)
        sync = a == args.grad_accum - 1 or not isinstance(model, DDP)
        with (nullcontext() if sync else model.no_sync()), autocast(device):
            loss, chunk_logs = model(collate([items[i] for i in chunks[c]], chunks[c].tolist()).to(device))
        (loss * len(chunks[c]) * world / len(batch)).backward()
        for k, v in chunk_logs.items():  # this process's micro-batches, weighted by their size
            logs[k] = logs.get(k, 0.0) + v * len(chunks[c]) / mine
    return logs


def save(path, obj, rank):
    if rank == 0:
        os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
        layers.atomic_write(path, obj)


START = time.time()  # when main() began, for the total time a run reports


def main(argv=None):
    global START
    START = time.time()
    args = parse_args(argv)
    if args.dry_run:  # under torchrun: every process checks, the first prints
        world = int(os.environ.get('WORLD_SIZE', 1))
        try:
            files = check(args, world)
        except (data.DataError, FileNotFoundError) as e:
            fail(str(e))
        if os.environ.get('RANK', '0') == '0':
            show(f'dry run of {args.method} on {args.task} into {args.out}: nothing is trained or written',
                 plan(args, world, files))
        return
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 matmuls outside autocast
    rank, world, device = setup_distributed()
    data.VERBOSE = rank == 0  # warnings about skipped data, once
    made = (first_missing(args.out) or first_missing(os.path.join(args.out, 'demo-data'))) if rank == 0 else None
    try:
        run(args, rank, world, device)
    except (data.DataError, ev.EvalError, layers.CheckpointError, OSError) as e:
        discard_if_unbegun(args.out, made)
        fail(f'{e.filename}: {e.strerror}' if isinstance(e, OSError) and e.strerror else str(e))
    except SystemExit:
        discard_if_unbegun(args.out, made)
        raise
    except KeyboardInterrupt:
        discard_if_unbegun(args.out, made)
        fail(interrupted(args))
    if dist.is_initialized():
        dist.destroy_process_group()


def first_missing(path):
    """The outermost folder of path that does not exist yet (None if path does)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


def began(folder):
    """Did a run begin in folder, or in a stage below it (its config.json is written by begin())?"""
    return any('config.json' in names for _, _, names in os.walk(folder))


def discard_if_unbegun(out, made):
    """A run that stops before it began (no config.json in its folder or below) leaves nothing
    behind: what this process made goes (the run folder and the parents it made, or the demo
    data in a folder that was there), and nothing else."""
    if not made or not os.path.isdir(made) or began(out):
        return
    path = made if made == os.path.join(os.path.abspath(out), 'demo-data') else os.path.abspath(out)
    shutil.rmtree(path)
    while path != made and not os.listdir(os.path.dirname(path)):  # parents made for it, if nothing else is in them
        path = os.path.dirname(path)
        os.rmdir(path)


def interrupted(args):
    """Ctrl-C's line: the last checkpoint this run wrote, and how to go on from it."""
    if args.eval_only:
        return 'interrupted while evaluating: nothing was changed; run the same command again'
    if not os.path.isdir(args.out):
        return 'interrupted before the run began: nothing was written'
    found = [os.path.join(d, 'last.pt') for d, _, names in os.walk(args.out) if 'last.pt' in names]
    found = [p for p in found if os.path.getmtime(p) >= START]  # not an earlier run's
    if not found:
        return f'interrupted before the first checkpoint in {args.out}: run the same command again'
    last = max(found, key=os.path.getmtime)
    try:
        step = torch.load(last, mmap=True, weights_only=True)['state']['step']  # mapped: the weights are not read
    except Exception:
        return f'interrupted: the last checkpoint is {last}; run the same command with --resume to go on from it'
    return f'interrupted: the last checkpoint is step {step} ({last}); run the same command with --resume to go on from it'


def build_method(args, encoder, device):
    try:
        return xlt.METHODS[args.method][0](encoder, args.task, args).to(device)
    except ValueError as e:
        fail(str(e))


def check_batches(args, world):
    for option in ('batch_size', 'xla_batch_size') if args.method == 'xla' else ('batch_size',):
        if getattr(args, option) < world * args.grad_accum:
            fail(f'--{option} {getattr(args, option)} cannot be cut into {world} processes x --grad_accum {args.grad_accum}: '
                 f'raise --{option} or lower --grad_accum')


def check_init(args):
    """Real data needs pre-trained weights, unless --from_scratch says otherwise."""
    if not (args.init or args.demo or args.from_scratch):
        fail(f'no --init: this would train XLM-R {args.model} from random weights for hours. Get xlm-roberta-'
             f'{args.model} (Hugging Face) or fairseq\'s XLM-R, convert it with python layers.py convert SRC '
             f'xlmr-{args.model}.pt and pass --init xlmr-{args.model}.pt (or --from_scratch to mean it)')


def run(args, rank, world, device):
    files = check(args, world)
    if rank == 0:
        status = 'evaluating' if args.eval_only else 'resuming' if args.resume else 'a new run'
        show(f'{args.method} on {args.task}{f" ({args.stage})" if args.stage else ""} in {args.out}: {status}',
             plan(args, world, files))
    os.makedirs(args.out, exist_ok=True)
    tok = prepare_data(args, rank)
    if args.demo and args.init == demo_start(args.out) and not os.path.exists(args.init):
        demo_pretrained(args, rank, world, device)
    if args.task == 'pretrain':
        return pretrain(args, tok, rank, world, device)
    if args.task == 'translate':
        return translate(args, tok, rank, world, device)
    if args.method == 'xla':
        return xla(args, tok, rank, world, device)
    encoder = build_encoder(args, tok)[0]
    if data.TASKS[args.task].family == 'retrieval':
        begin(args, rank)
        preds = retrieval(args, encoder.to(device), tok, device) if rank == 0 else {}
        return finish(args, {}, test_results(args, preds, rank), rank)
    torch.manual_seed(args.seed)  # the head's initialisation follows --seed, with --init too
    method = build_method(args, encoder, device)
    sets = eval_sets(args, method)
    best_path, last_path = os.path.join(args.out, 'best.pt'), os.path.join(args.out, 'last.pt')
    if not args.eval_only:
        items = training_items(args, tok, method, rank)
        if not items:
            fail(f'no training examples for {args.task} in {args.data_dir}')
        begin(args, rank)
        if args.self_teach or args.teacher:
            method.p_teacher = teacher_probabilities(args, tok, rank, world, device, method, items)
        dev_cache = {}
        validate = lambda: evaluate(method, args, tok, 'dev', device, rank, world, sets, dev_cache)[0]
        train(method, items, args, device, rank, world, best_path, last_path, validate)
    if os.path.exists(best_path):
        method.load_state_dict(load_checkpoint(best_path, args, device)['method'])
    dev, _ = evaluate(method, args, tok, 'dev', device, rank, world, sets)
    test, test_preds = evaluate(method, args, tok, 'test', device, rank, world, sets)
    scored = test_results(args, test_preds, rank)
    if args.translate_test and method.family == 'qa':  # English answers: scored on the translations' answers
        scored = {**scored, **{lang: s for lang, s in test.items() if lang != 'en'}}
    finish(args, dev, scored, rank, selection(method, dev)[1])


def begin(args, rank):
    """All input read: the run begins, and results of an earlier run in --out are no longer its. A
    new run (not --resume) also drops the earlier run's checkpoints and stored teacher labels."""
    if rank == 0:
        for name in ('results.json', 'results.txt') + ('last.pt', 'best.pt', 'p_teacher.pt') * (not args.resume):
            if os.path.exists(os.path.join(args.out, name)):
                os.remove(os.path.join(args.out, name))
        layers.atomic_write(os.path.join(args.out, 'config.json'), json.dumps(vars(args), indent=2))


def pretrain(args, tok, rank, world, device):
    """VECO's pre-training (--task pretrain) on the text of --data_dir/pretrain: the held-out
    losses every --eval_every steps; best.pt holds the encoder with its cross-attention and the
    MLM head, which --init accepts (fine-tuning leaves the cross-attention out)."""
    encoder, mlm = build_encoder(args, tok, cross=True)
    if args.init and mlm is None:
        fail(f'--init {args.init} has no MLM head: pre-training continues XLM-R with its MLM head (a converted '
             'XLM-R checkpoint, python layers.py convert)')
    torch.manual_seed(args.seed)
    method = xlt.VecoPretrain(encoder, tok.mask, mlm, args.cross_only_steps).to(device)
    items, groups = data.read_pretraining(tok, args.data_dir, args.max_len)
    groups, held = data.split_held_out(groups)
    if not groups:
        fail(f'no pre-training pairs in {args.data_dir}/pretrain: the files hold no text')
    begin(args, rank)
    best_path, last_path = os.path.join(args.out, 'best.pt'), os.path.join(args.out, 'last.pt')
    batches_of = lambda epoch: data.pretrain_batches(groups, args.batch_size, min(args.eval_every, args.steps - epoch * args.eval_every),
                                                     args.seed * 1000 + epoch)
    validate = lambda: held_out_losses(method, [items[i] for i in held], args, device)
    if not args.eval_only:
        train(method, items, args, device, rank, world, best_path, last_path, validate, batches_of)
    if os.path.exists(best_path):
        method.load_state_dict(load_checkpoint(best_path, args, device)['method'])
    losses = validate()
    if rank == 0:
        names = sorted({k for row in losses.values() for k in row} - {'score'})
        table = '\n'.join([f'{"held out":<10}' + ''.join(f'{n:>13}' for n in names)] + [
            f'{kind:<10}' + ''.join(f'{row[n]:13.3f}' if n in row else ' ' * 13 for n in names) for kind, row in losses.items()])
        layers.atomic_write(os.path.join(args.out, 'results.json'), json.dumps(
            {'task': 'pretrain', 'method': 'veco', 'selected_by': selection(method, losses)[1], 'held_out': losses}, indent=2))
        layers.atomic_write(os.path.join(args.out, 'results.txt'), table + '\n')
        print(table)
        print(f'pre-trained model in {best_path}: fine-tune it with --init {best_path}; {clock(time.time() - START)} in all')


@torch.no_grad()
def held_out_losses(method, items, args, device):
    """The MLM losses of the held-out pairs with masks fixed by --seed, per kind (mono, para),
    and CS-MLM once more with each row reading another row's X^N (cs_shuffled): far above
    cs_xy, the cross-attention uses its memory. score: minus the summed loss, higher is better."""
    method.eval()
    sums, counts = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: defaultdict(int))
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        for kind in ('mono', 'para'):
            part = [item for item in items if item[0].label == (kind == 'para')]
            for index in data.length_batches([x for x, _ in part], args.eval_batch_size):
                pair = data.collate_pairs([part[i][0] for i in index], [part[i][1] for i in index]).to(device)
                parallel = pair.src.labels.bool()
                (x, x_bar), (y, y_bar) = method.masked(pair.src, parallel), method.masked(pair.tgt, parallel)
                with autocast(device):
                    terms = method.terms(x, pair.src.mask, x_bar, y, pair.tgt.mask, y_bar, parallel)
                    if len(index) > 1:
                        X, xm = method.inner(x, pair.src.mask), pair.src.mask
                        terms['cs_shuffled'] = xlt.mlm_loss(method.mlm, method.crossed(y, pair.tgt.mask, X.roll(1, 0), xm.roll(1, 0)), y_bar)
                for name, t in terms.items():  # a mean over the kind's pairs
                    sums[kind][name] += t.item() * len(index)
                    counts[kind][name] += len(index)
    out = {kind: {n: v / counts[kind][n] for n, v in row.items()} for kind, row in sums.items()}
    for row in out.values():
        row['score'] = -sum(v for n, v in row.items() if n != 'cs_shuffled')
    return out


def translate(args, tok, rank, world, device):
    """VECO's encoder-decoder (--task translate) fine-tuned on --src -> --tgt for --steps steps;
    every --eval_every steps the valid loss (best.pt: the lowest) and a checkpoint kept for
    averaging; then the test set decoded by beam search with the mean of the last
    --average_last checkpoints, written one line per source and scored with BLEU."""
    pre = build_encoder(args, tok, cross=True)[0]  # --init's cross-attention kept, or new for XLM-R
    lang_ids = (tok.vocab_size, tok.vocab_size + 1)  # [src] and [tgt]: new rows of the token embedding
    torch.manual_seed(args.seed)
    try:
        encoder, decoder = xlt.assemble(pre, args.dec_layers, args.dec_init, 2, args.dropout, args.attn_dropout)
    except ValueError as e:
        fail(str(e))
    encoder.grad_checkpoint = decoder.grad_checkpoint = args.grad_checkpoint
    if args.compile:
        layers.compile_blocks(encoder)
        layers.compile_blocks(decoder)
    method = xlt.VecoTranslate(encoder, decoder, lang_ids[1], args.label_smoothing).to(device)
    read = lambda split: data.translation_items(tok, args.data_dir, args.src, args.tgt, split, lang_ids, args.max_len)
    items, valid, test = read('train'), read('valid'), read('test')
    refs = data.lines_of(data.parallel_files(args.data_dir, args.src, args.tgt, 'test')[1])
    for name, part in (('training', items), ('valid', valid)):
        if not part:
            fail(f'no {name} pairs for {args.src}-{args.tgt} in {args.data_dir}/translation: the files hold no text')
    best_path, last_path = os.path.join(args.out, 'best.pt'), os.path.join(args.out, 'last.pt')
    lengths = [item_length(item) for item in items]
    passes = {0: global_batches(len(items), args, 0, world * args.grad_accum, lengths)}  # shuffled passes over the pairs
    per_pass = len(passes[0])

    def batch_at(step):  # the global batch of an optimiser step: pass after pass
        p = step // per_pass
        if p not in passes:
            passes.clear()
            passes[p] = global_batches(len(items), args, p, world * args.grad_accum, lengths)
        return passes[p][step % per_pass]

    def validate():
        save_snapshot(method, args, rank)
        return {'valid': translation_losses(method, valid, args, device)}
    batches_of = lambda epoch: [batch_at(s) for s in range(epoch * args.eval_every, min((epoch + 1) * args.eval_every, args.steps))]
    if not args.eval_only:
        if not per_pass:
            fail(f'--batch_size {args.batch_size} is larger than the {len(items)} training pairs: lower it')
        begin(args, rank)
        if rank == 0 and not args.resume:  # an earlier run's checkpoints are not to be averaged with this one's
            shutil.rmtree(os.path.join(args.out, 'checkpoints'), ignore_errors=True)
        train(method, items, args, device, rank, world, best_path, last_path, validate, batches_of)
    decoded_with = final_weights(method, args, device, best_path)
    hyps = [tok.decode(ids) for ids in decode_all(method, test, args, device, rank, world)]
    if rank == 0:
        report_translations(args, hyps, refs, decoded_with, translation_losses(method, valid, args, device))


def report_translations(args, hyps, refs, decoded_with, valid):
    """The test translations, one line per source, their BLEU in results.json and the table."""
    folder = os.path.join(args.out, 'predictions')
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f'test.{args.src}-{args.tgt}.{args.tgt}')
    layers.atomic_write(path, ''.join(h + '\n' for h in hyps))
    bleu = ev.bleu(hyps, refs)
    tokenized = ev.tokenized_bleu([ev.tokenize_13a(h) for h in hyps], [ev.tokenize_13a(r) for r in refs])
    results = {'task': 'translate', 'method': 'veco', 'pair': f'{args.src}-{args.tgt}', 'decoded_with': decoded_with,
               'valid': valid, 'test': {'bleu': bleu, 'tokenized_bleu': tokenized}}
    layers.atomic_write(os.path.join(args.out, 'results.json'), json.dumps(results, indent=2))
    table = (f'test {args.src}-{args.tgt} ({len(hyps)} sentences, beam {args.beam}, {decoded_with})\n'
             f'  sacreBLEU       {bleu["bleu"]:6.2f}  {bleu["signature"]}\n'
             f'  tokenized BLEU  {tokenized["bleu"]:6.2f}  (13a tokens, lower case, no smoothing: multi-bleu.perl -lc)')
    layers.atomic_write(os.path.join(args.out, 'results.txt'), table + '\n')
    print(table)
    print(f'translations in {path}; {clock(time.time() - START)} in all')


def save_snapshot(method, args, rank):
    """The weights at this step, kept for averaging: --out/checkpoints/step<N>.pt, the last
    --average_last of them (fairseq: --save-interval-updates, --keep-interval-updates)."""
    if rank != 0 or not args.average_last:
        return
    folder = os.path.join(args.out, 'checkpoints')
    os.makedirs(folder, exist_ok=True)
    layers.atomic_write(os.path.join(folder, f'step{method.step + 1:07d}.pt'),
                        {'method': method.state_dict(), 'identity': identity(args)})
    for old in snapshots_in(folder)[:-args.average_last]:
        os.remove(os.path.join(folder, old))


def snapshots_in(folder):
    """The kept checkpoints' names, oldest first (a half-written .tmp file is not one)."""
    return sorted(f for f in os.listdir(folder) if f.startswith('step') and f.endswith('.pt')) if os.path.isdir(folder) else []


def final_weights(method, args, device, best_path):
    """Load the weights that decode the test set: the mean of the last --average_last
    checkpoints, as the paper decodes, or best.pt with --average_last 0. -> what they are."""
    folder = os.path.join(args.out, 'checkpoints')
    kept = snapshots_in(folder)[-args.average_last:] if args.average_last else []
    if kept:
        total = None
        for name in kept:  # a running sum: one checkpoint in memory at a time
            state = load_checkpoint(os.path.join(folder, name), args, device)['method']
            total = state if total is None else {k: total[k] + v for k, v in state.items()}
        method.load_state_dict({k: v / len(kept) for k, v in total.items()})
        return f'the mean of the last {len(kept)} checkpoints ({kept[0][4:-3].lstrip("0")} to {kept[-1][4:-3].lstrip("0")} steps)'
    if not os.path.exists(best_path):
        fail(f'{best_path} not found: --eval_only decodes a finished run in --out')
    method.load_state_dict(load_checkpoint(best_path, args, device)['method'])
    return 'best.pt: the lowest valid loss'


@torch.no_grad()
def translation_losses(method, items, args, device):
    """The label-smoothed loss and the nll per target token of items (the valid set); score: -loss."""
    method.eval()
    loss = nll = tokens = 0.0
    for index in data.length_batches([x for x, _ in items], args.eval_batch_size):
        pair = data.collate_pairs([items[i][0] for i in index], [items[i][1] for i in index]).to(device)
        with autocast(device):
            smoothed, plain = method.token_losses(pair)
        loss, nll = loss + smoothed.sum().item(), nll + plain.sum().item()
        tokens += pair.tgt.labels.ne(data.IGNORE).sum().item()
    return {'loss': loss / tokens, 'nll': nll / tokens, 'ppl': math.exp(nll / tokens), 'score': -loss / tokens}


@torch.no_grad()
def decode_all(method, items, args, device, rank, world):
    """The best beam's token ids for every item's source, in length-sorted batches shared out over processes."""
    method.eval()
    out = {}
    for index in data.bar(data.length_batches([x for x, _ in items], args.eval_batch_size)[rank::world], desc='decode',
                          leave=False):
        src = data.collate([items[i][0] for i in index]).to(device)
        with autocast(device):
            out.update(zip(index, method.generate(src, args.beam, args.lenpen)))
    return gathered(out, len(items), world)


def demo_pretrained(args, rank, world, device):
    """Make the demo's pre-trained tiny model (demo_start). X-Mixup starts from a
    trained encoder, as from XLM-R: from random weights Eq. 7's MSE collapses the last LayerNorm
    (equal representations) before the task loss takes hold."""
    folder = os.path.dirname(demo_start(args.out))
    if rank == 0:
        print(f'{args.method} starts from a pre-trained model: pre-training the demo model into {folder} first')
    run(parse_args(['--method', 'veco', '--task', 'pretrain', '--demo', '--out', folder] + ['--resume'] * args.resume),
        rank, world, device)


def eval_sets(args, method):
    """Every file evaluation will read, read and checked before any training (labels, columns,
    JSON shape, translations, test labels): {split: {lang: (examples scored against, model
    inputs, (English translation, input) pairs for paired methods)}}."""
    sets = {'dev': {}, 'test': {}}
    for split in sets:
        for lang in data.languages(args.task, data.is_demo(args.data_dir)):
            path = data.split_path(args.data_dir, args.task, split, lang)
            if split == 'dev' and not (path and os.path.exists(path)):
                continue  # no dev set in this language (XQuAD, TyDiQA); check() found every other file
            gold, inputs = eval_examples(args, split, lang)
            sets[split][lang] = gold, inputs, with_translations(args, split, lang, inputs) if method.paired else None
            if split == 'test':
                check_test_labels(args.task, os.path.join(args.data_dir, 'labels', args.task, f'test-{lang}.{ev.suffix(args.task)}'), inputs)
    return sets


def check_test_labels(task, path, examples):
    """A test label file, where there is one, must be scorable against the test set: one label (or
    tag sentence) per example, from the label set, or every question's answers."""
    if not os.path.exists(path):
        return
    family = data.TASKS[task].family
    if family == 'qa':
        found = {qa['id'] for article in ev.read_qa_file(path) for p in article.get('paragraphs', []) for qa in p.get('qas', [])}
        lost = [ex['id'] for ex in examples if ex['id'] not in found]
        if lost:
            fail(f'{path} has no answers for {len(lost)} test questions (the first: {lost[0]}): use the labels of this test set')
        return
    labels = ev.read_tag_file(path) if family == 'tagging' else ev.read_lines(path)
    if len(labels) != len(examples):
        fail(f'{path} has {len(labels)} labelled examples for {len(examples)} in the test set: use the labels of this test set')
    allowed = set(data.TASKS[task].labels)
    bad = next((n for n, row in enumerate(labels, 1) for label in (row if family == 'tagging' else [row]) if label not in allowed), None)
    if bad:
        fail(f'{path}: example {bad} has a label outside {", ".join(data.TASKS[task].labels)}; fix the file')


def identity(args):
    """What a checkpoint must match to be loaded into this run."""
    task = f'{args.task} {args.src}-{args.tgt}' if args.task == 'translate' else args.task
    return {'method': args.method, 'task': task, 'model': args.model}


def load_checkpoint(path, args, device):
    ckpt = torch.load(path, map_location=device, weights_only=True)
    found = ckpt.get('identity', {})
    if found != identity(args):
        fail(f'{path} holds {found.get("method")} on {found.get("task")} with the {found.get("model")} preset, '
             f'not {args.method} on {args.task} with {args.model}: use another --out')
    return ckpt


def teacher_probabilities(args, tok, rank, world, device, method, items):
    """Soft labels for the target side of every training item, predicted once by a teacher and
    written to --out/p_teacher.pt, then read back. FILTER's self-teaching (Algorithm 1): a FILTER
    teacher; X-Mixup on tagging: a source-language (zero-shot) model. The teacher is trained
    first into --out/teacher with --self_teach, or is the finished run --teacher."""
    predicted = [item[1] for item in items]
    path = os.path.join(args.out, 'p_teacher.pt')
    stored = torch.load(path, weights_only=True) if os.path.exists(path) else None
    aligned = lambda probs: len(probs) == len(items) and all(
        method.family == 'classification' or len(p) == len(f.ids) for p, f in zip(probs, predicted))
    if stored is not None and aligned(stored):
        return stored
    folder = args.teacher or os.path.join(args.out, 'teacher')  # check() found a --teacher finished
    own = argparse.Namespace(**{**vars(args), 'method': method.teacher_method, 'out': folder, 'self_teach': False,
                                'teacher': None, 'demo': False, 'from_scratch': args.from_scratch or args.demo,
                                'stage': 'teacher', 'overwrite': True})  # the same data and settings
    if not args.teacher and (not os.path.exists(os.path.join(folder, 'results.json'))
                             or differences(read_config(os.path.join(folder, 'config.json')), own)):
        run(own, rank, world, device)  # a teacher of other settings is trained again
    config = read_config(os.path.join(folder, 'config.json'))
    t_args = argparse.Namespace(**{**vars(args), **{k: config.get(k) for k in ('method', 'task', 'model', 'm', 'k', 'mixup_layer')}})
    ckpt = load_checkpoint(os.path.join(folder, 'best.pt'), t_args, device)
    teacher = build_method(t_args, layers.Encoder(layers.Config(**ckpt['config'])), device)
    teacher.load_state_dict(ckpt['method'])
    items = items if teacher.paired else predicted  # a single-text teacher reads T alone
    outputs = outputs_of(teacher, items, collate_items(teacher), args, device, rank, world)
    save(path, [xlt.probabilities(teacher.family, o) for o in outputs], rank)
    if dist.is_initialized():
        dist.barrier()
    return torch.load(path, weights_only=True)


def train(method, items, args, device, rank, world, best_path, last_path, validate, batches_of=None):
    """The training loop of every method and stage. validate() -> the dev scores after each
    epoch; batches_of(epoch) -> the epoch's global batches (default: a shuffle of items; VECO's
    pre-training samples them, an 'epoch' being --eval_every steps)."""
    collate = collate_items(method)
    chunks = world * args.grad_accum
    lengths = [item_length(item) for item in items]
    batches_of = batches_of or (lambda epoch: global_batches(len(items), args, epoch, chunks, lengths))
    per_epoch = len(batches_of(0))
    opt, sched = optimizer_and_schedule(method, args, args.steps or per_epoch * args.epochs)
    model = DDP(method, device_ids=[device.index] if device.type == 'cuda' else None) if world > 1 else method
    state = {'step': 0, 'epoch': 0, 'best': float('-inf')}
    if args.resume and not os.path.exists(last_path) and rank == 0:
        print(f'note: {last_path} not found: starting from the beginning')
    if args.resume and os.path.exists(last_path):
        ckpt = load_checkpoint(last_path, args, device)
        method.load_state_dict(ckpt['method'])
        opt.load_state_dict(ckpt['optimizer'])
        for group in opt.param_groups:
            group['fused'] = True  # a checkpoint of an older run restores its per-tensor AdamW otherwise
        sched.load_state_dict(ckpt['schedule'])
        state = ckpt['state']
        torch.set_rng_state(ckpt['rng'])
    log = open_log(os.path.join(args.out, 'log.jsonl'), state['step']) if rank == 0 else None
    started, since = time.time(), []  # the logs of the steps since the last line: tensors, read only when written
    epoch_loss = []  # (mean loss, steps) of each log line of this epoch, for its printed line
    while state['epoch'] < args.epochs:
        batches = batches_of(state['epoch'])
        bar = data.bar(total=len(batches), initial=state['step'] % per_epoch, desc=f'epoch {state["epoch"] + 1}/{args.epochs}')
        for batch in batches[state['step'] % per_epoch:]:
            method.train()
            method.step = state['step']  # methods with schedules (X-Mixup's p*) read it
            logs = train_step(model, items, batch, args, state['step'], rank, world, device, collate)
            for p in method.frozen() if hasattr(method, 'frozen') else []:
                p.grad = None  # AdamW leaves a parameter without a gradient as it is
            torch.nn.utils.clip_grad_norm_(method.parameters(), args.clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            state['step'] += 1
            bar.update()
            since.append(logs)
            if state['step'] % args.log_every == 0 or batch is batches[-1]:  # the one host sync (and each epoch's end)
                logs = {k: float(sum(s[k] for s in since if k in s)) / sum(k in s for s in since)  # each one's mean
                        for k in dict.fromkeys(k for s in since for k in s)}  # over the steps since the last line
                epoch_loss.append((logs['loss'], len(since)))
                since = []
                bar.set_postfix(loss=f'{logs["loss"]:.3f}')
                if log:
                    log.write(json.dumps({'step': state['step'], 'epoch': state['epoch'], 'lr': sched.get_last_lr()[0],
                                          'time': round(time.time() - started, 2), **logs}) + '\n')
                    log.flush()
            if state['step'] % args.save_every == 0 and state['step'] % per_epoch:
                save(last_path, checkpoint(method, opt, sched, state, args), rank)
            if args.halt_after and state['step'] == args.halt_after:
                os._exit(3)  # as if killed
        bar.close()
        state['epoch'] += 1
        padding = pad_share(lengths, batches, chunks)
        dev = validate()
        score = selection(method, dev)[0]
        score = state['epoch'] if score is None else score  # no dev set: keep the last
        if score > state['best']:
            state['best'] = float(score)
            save(best_path, weights(method, args), rank)
        if rank == 0:
            print(epoch_line(state, args, epoch_loss, dev, method.select, time.time() - started), flush=True)
        epoch_loss = []
        if log:
            log.write(json.dumps({'step': state['step'], 'epoch': state['epoch'], 'dev': {k: v if method.select == 'loss' else v['score'] for k, v in dev.items()},
                                  'dev_avg': float(score), 'pad_share': round(padding, 4)}) + '\n')
            log.flush()
        save(last_path, checkpoint(method, opt, sched, state, args), rank)
    if dist.is_initialized():
        dist.barrier()  # every process reads best.pt (and the kept checkpoints) only once they are written


# ----------------------------------------------------------------------------------------
# XLA (Algorithm 1): three warm-ups, then per XLA epoch vicinal samples, every model's labels,
# and each model trained on what the other two keep and agree on.

XLA_SETS = {1: ('source', 'target'), 2: ('target vicinal',),  # Algorithm 1, line 22: the sets of each epoch
            3: ('source', 'target', 'source vicinal', 'target vicinal')}


def xla(args, tok, rank, world, device):
    """XLA on --train_lang (Algorithm 1): three models warmed up on English with the confidence
    penalty (warmup-1..3), then --xla_epochs epochs, each in epoch<e>/: vicinal samples of the
    target text (and from epoch 3 of English), each model's labels and kept samples, and each
    model trained one epoch on what the other two keep and label alike. Every stage's result is
    kept, so --resume goes on from the stage a crash stopped. Reports each model, their mean and
    the ensemble that averages their probabilities; the ensemble's predictions are the run's."""
    final = os.path.join(args.out, 'final-models.json')  # the three models the run ends with
    warm = [warm_up_run(args, m) for m in range(3)]  # before anything is removed: a kept warm-up may not fit
    if not args.resume and not args.eval_only and rank == 0:  # a new run: an earlier run's stages are not its
        for name in os.listdir(args.out):
            if os.path.isdir(os.path.join(args.out, name)) and (name.startswith(('epoch', 'model')) or
                                                               (name.startswith('warmup-') and not args.warmup_dir)):
                shutil.rmtree(os.path.join(args.out, name))
        if os.path.exists(final):
            os.remove(final)
    if dist.is_initialized():
        dist.barrier()  # no process may see a stage of the earlier run as done
    if args.eval_only:
        if not os.path.exists(final):
            fail(f'{final} not found: --eval_only evaluates a finished XLA run in --out')
        with open(final) as f:
            return xla_report(args, tok, [os.path.join(args.out, p) for p in json.load(f)], rank, world, device)
    english, target = xla_data(args, tok)
    vicinity = vicinity_model(args, tok)  # read now: a missing masked LM must not wait until epoch 2
    begin(args, rank)
    paths = [warm_up(settings, m, rank, world, device) for m, settings in enumerate(warm)]
    sets, dev_cache = eval_sets(args, xlt.XLA), {}
    for e in range(1, args.xla_epochs + 1):
        folder = os.path.join(args.out, f'epoch{e}')
        names = XLA_SETS[min(e, 3)]
        unlabelled = {'target': target} if 'target' in names else {}  # the sets the models label this epoch
        for name, feats in (('target vicinal', target), ('source vicinal', english)):
            if name in names:
                vicinity = [part.to(device) for part in vicinity]
                unlabelled[name] = vicinal(args, tok, feats, vicinity, os.path.join(folder, name.replace(' ', '-') + '.pt'),
                                           e, rank, world, device)
                if rank == 0:
                    print(f'XLA epoch {e}: {len(unlabelled[name])} {name} samples of {len(feats)} sentences')
        eta = args.eta[min(e, len(args.eta)) - 1] / 100
        labels = [labelled(args, paths[m], unlabelled, eta, os.path.join(folder, f'labels-{m + 1}.pt'), rank, world, device)
                  for m in range(3)]
        for m, sets_of in enumerate(labels if rank == 0 else []):
            print(f'XLA epoch {e}, model {m + 1} keeps ' + ', '.join(f'{int(s["keep"].sum())} of {len(s["keep"])} {name}'
                                                                     for name, s in sets_of.items()))
        paths = [xla_train(args, tok, e, l, taught_by_peers(l, labels, unlabelled, english if 'source' in names else None),
                           paths[l], sets, dev_cache, rank, world, device) for l in range(3)]
    save(final, json.dumps([os.path.relpath(p, args.out) for p in paths]), rank)
    xla_report(args, tok, paths, rank, world, device, sets, dev_cache)


def taught_by_peers(l, labels, unlabelled, english=None):
    """Model l's training sets of an epoch: English (when given) and, of every unlabelled set, the
    samples its two peers j and k both keep and label alike, with that label (AGREEMENT): model l
    never learns from its own labels. labels[m][set]: model m's {'labels', 'keep'}."""
    j, k = [m for m in range(3) if m != l]
    parts = {} if english is None else {'source': english}
    for name, feats in unlabelled.items():
        a, b = labels[j][name], labels[k][name]
        agreed = xlt.agreement(a['keep'], a['labels'], b['keep'], b['labels']).nonzero().squeeze(1).tolist()
        parts[name] = [replace(feats[i], label=a['labels'][i]) for i in agreed]
    return parts


WARM_UP_SETTINGS = ('task', 'model', 'init', 'seed', 'conf_penalty', 'train_share', 'lr', 'epochs', 'batch_size', 'max_len',
                    'warmup', 'weight_decay', 'dropout')  # what a reused warm-up must share with the run


def warm_up_run(args, m):
    """Model m's warm-up (Section 3.1): the zero-shot baseline on English with the confidence
    penalty (weight 1, or --conf_penalty), seed --seed + m, in warmup-<m+1> of --warmup_dir
    (default --out). A finished warm-up kept there must have the run's settings."""
    folder = os.path.join(args.warmup_dir or args.out, f'warmup-{m + 1}')
    settings = argparse.Namespace(**{**vars(args), 'method': 'zeroshot', 'out': folder, 'seed': args.seed + m, 'demo': False,
                                     'conf_penalty': 1.0 if args.conf_penalty is None else args.conf_penalty,
                                     'from_scratch': args.from_scratch or args.demo, 'stage': f'warm-up {m + 1} of 3'})
    if (args.warmup_dir or args.resume) and os.path.exists(os.path.join(folder, 'results.json')):
        found = read_config(os.path.join(folder, 'config.json'))
        differ = differences({k: found.get(k) for k in WARM_UP_SETTINGS}, settings, WARM_UP_SETTINGS)
        if differ:
            fail(f'{folder} holds a warm-up with another {differ[0]} ({found.get(differ[0])}, not {getattr(settings, differ[0])}): '
                 'pass another --warmup_dir, or remove that folder')
    return settings


def warm_up(settings, m, rank, world, device):
    """Run a warm-up unless it has finished -> its best.pt."""
    if not os.path.exists(os.path.join(settings.out, 'results.json')):
        if rank == 0:
            print(f'XLA warm-up of model {m + 1}/3 (seed {settings.seed}) in {settings.out}')
        run(settings, rank, world, device)
    return os.path.join(settings.out, 'best.pt')


def xla_data(args, tok):
    """(D_s: the English training features, D_t: --train_lang's unlabelled training features).
    D_t is the target language's own training split without its labels (tagging: XTREME ships
    train-<lang>.tsv for PAN-X), or the target side of translate-train (XNLI, PAWS-X). With
    --train_share below 1 the two are disjoint random draws, so they are not translations of
    each other (the paper's 5% setting)."""
    english, tagging = data.read_split(args.data_dir, args.task, 'train'), data.TASKS[args.task].family == 'tagging'
    if tagging:
        target = [dict(ex, tags=None) for ex in data.read_split(args.data_dir, args.task, 'train', args.train_lang)]
    else:  # drawn from the pairs, so that the draw is disjoint from English's where translations are missing
        pairs = data.share_of(data.read_translations(args.data_dir, args.task, 'train', args.train_lang, english), args.train_share, part=1)
        target = [dict(t, label=None) for _, t in pairs if t is not None]
    english = data.share_of(english, args.train_share, part=0)
    if tagging:  # the two languages' own training sets: each its own draw
        target = data.share_of(target, args.train_share, part=1)
    return [data.make_features(tok, args.task, exs, args.max_len, train=True) for exs in (english, target)]


def xla_model(args, path, device):
    """An XLA model with the weights of a warm-up's or an XLA epoch's best.pt (of this task and preset)."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    found = ckpt.get('identity', {})
    if (found.get('task'), found.get('model')) != (args.task, args.model):
        fail(f'{path} holds {found.get("method")} on {found.get("task")} with the {found.get("model")} preset, not '
             f'{args.task} with {args.model}: use another --out or --warmup_dir')
    method = xlt.XLA(layers.Encoder(layers.Config(**ckpt['config'])), args.task).to(device)
    method.load_state_dict(ckpt['method'])
    return method


def vicinity_model(args, tok):
    """The frozen masked LM of GEN-LM (on the CPU until used): --mlm, or the --init checkpoint's MLM head."""
    path = args.mlm or args.init
    if not path:
        fail('XLA\'s vicinal samples need a masked LM: pass --mlm (a converted XLM-R checkpoint, python layers.py convert)')
    encoder, mlm = build_encoder(argparse.Namespace(**{**vars(args), 'init': path}), tok)
    if mlm is None:
        fail(f'{path} has no MLM head: pass --mlm a converted XLM-R checkpoint (python layers.py convert keeps it)')
    return encoder.eval(), mlm.eval()


def vicinal(args, tok, feats, vicinity, path, epoch, rank, world, device):
    """GEN-LM (Section 3.2): the vicinal samples of every feature, unlabelled, kept in `path`: --delta
    samples of a sentence by successive max, or the delta1 x delta2 successive cross of a pair's two
    parts; each sample replaces ceil(--aug_share x T) pieces of each part. The draws follow (--seed,
    epoch, feature), so any number of processes makes the same samples."""
    if args.resume and os.path.exists(path):
        stored = torch.load(path, weights_only=True)
        rows = stored['ids'].split(stored['lengths'].tolist())
        return [replace(feats[i], ids=r.tolist(), label=None) for i, r in zip(stored['source'].tolist(), rows)]
    family, (encoder, mlm) = data.TASKS[args.task].family, vicinity
    fillable = torch.arange(encoder.cfg.vocab_size, device=device)
    fillable = (fillable >= 4) & (fillable < tok.mask)  # not <s>, <pad>, </s>, <unk> nor <mask>
    word_start = torch.tensor(tok.word_starts() + [False] * (encoder.cfg.vocab_size - tok.vocab_size), device=device)
    out = {}
    for index in data.bar(data.length_batches(feats, args.eval_batch_size)[rank::world], desc='vicinal samples',
                          leave=False):
        rows, orders, made = [], [], []
        for i in index:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch * 10_007 + i)
            spans = xlt.parts_of(feats[i].ids, family)
            made.append((i, spans, len(rows)))
            for span, delta in zip(spans, args.delta):
                for order in xlt.masking_orders(span, delta, args.aug_share, g):
                    rows.append(feats[i].ids)
                    orders.append(order)
        batch = data.collate([data.Feature(r) for r in rows])
        order = torch.nn.utils.rnn.pad_sequence([torch.tensor(o, dtype=torch.long) for o in orders], True, -1)
        with autocast(device):
            filled = xlt.fill_successively(encoder, mlm, batch.ids.to(device), batch.mask.to(device), order.to(device),
                                           fillable, word_start, tok.mask).cpu()
        for i, spans, start in made:
            n = len(feats[i].ids)
            samples = filled[start:start + args.delta[0], :n]
            if len(spans) == 2:
                samples = xlt.crossed(samples, filled[start + args.delta[0]:start + sum(args.delta), :n], spans[0])
            out[i] = samples
    out = gathered(out, len(feats), world)
    source = [i for i, samples in enumerate(out) for _ in samples]
    flat = [row for samples in out for row in samples]
    if flat:
        save(path, {'ids': torch.cat(flat).int(), 'lengths': torch.tensor([len(r) for r in flat]),
                    'source': torch.tensor(source)}, rank)
    return [replace(feats[i], ids=r.tolist(), label=None) for i, r in zip(source, flat)]


def labelled(args, path, unlabelled, eta, store, rank, world, device):
    """One model's labels of each unlabelled set and DISTIL's choice, kept in `store`: {set: {'labels':
    [label per sample], 'keep': bool per sample}}, keep the top eta by confidence, or the samples
    whose posterior of the low-loss GMM component is at least --posterior."""
    if args.resume and os.path.exists(store):
        return torch.load(store, weights_only=True)
    method, out = xla_model(args, path, device), {}
    for name, feats in unlabelled.items():
        outputs = outputs_of(method, feats, data.collate, args, device, rank, world)
        scored = [xlt.pseudo_labels(method.family, o, f.words) for o, f in zip(outputs, feats)]
        labels, confidence, loss = (list(column) for column in zip(*scored)) if scored else ([], [], [])
        keep = (xlt.top_confident(torch.tensor(confidence), eta) if args.distil == 'confidence' else
                xlt.gmm_good(torch.tensor(loss)) >= args.posterior) if feats else torch.zeros(0, dtype=torch.bool)
        out[name] = {'labels': labels, 'keep': keep}
    save(store, out, rank)
    return out


def xla_train(args, tok, epoch, l, parts, start, sets, dev_cache, rank, world, device):
    """Model l's XLA epoch: one pass of Eq. 2's draws over the sets in `parts`, from its weights
    `start`, with a new optimiser (Table 8: --xla_lr, 10% warm-up) -> the epoch's weights if the
    --train_lang dev score did not fall, else `start` (the model goes on as it was)."""
    sub = argparse.Namespace(**{**vars(args), 'out': os.path.join(args.out, f'epoch{epoch}', f'model{l + 1}'), 'epochs': 1,
                                'lr': args.xla_lr, 'batch_size': args.xla_batch_size, 'warmup': 0.1, 'seed': args.seed + l})
    best_path, last_path = os.path.join(sub.out, 'best.pt'), os.path.join(sub.out, 'last.pt')
    done = os.path.join(sub.out, 'results.json')
    if args.resume and os.path.exists(done):
        with open(done) as f:
            return best_path if json.load(f)['better'] else start
    os.makedirs(sub.out, exist_ok=True)
    method = xla_model(args, start, device)
    validate = lambda: evaluate(method, sub, tok, 'dev', device, rank, world, sets, dev_cache)[0]
    before = target_dev(validate(), args)
    items = [f for feats in parts.values() for f in feats]
    sizes = [len(feats) for feats in parts.values()]
    lengths = [item_length(f) for f in items] if args.group_by_length else None
    batches = mixture_batches(sizes, args.alpha, sub.batch_size, sub.seed * 1000 + epoch, world * args.grad_accum, lengths)
    if batches:  # none when the peers agree on nothing: the model stays as it was
        train(method, items, sub, device, rank, world, best_path, last_path, validate, lambda _: batches)
    after = target_dev(validate(), args)
    better = bool(batches) and (after is None or before is None or after >= before)  # as the released code: kept if better
    if rank == 0:
        layers.atomic_write(done, json.dumps({'kept': dict(zip(parts, sizes)), 'dev_before': before, 'dev_after': after,
                                              'better': better}, indent=2))
        dev = '' if after is None else f'; {args.train_lang} dev {before:.1f} -> {after:.1f}' + ('' if better else ', not better: kept the model as it was')
        print(f'XLA epoch {epoch}, model {l + 1}: trained on ' + ', '.join(f'{n} {name}' for name, n in zip(parts, sizes)) + f' samples{dev}')
    if dist.is_initialized():
        dist.barrier()
    return best_path if better else start


def target_dev(dev, args):
    """The --train_lang dev score XLA selects by (the paper's protocol; None without a dev set)."""
    return dev[args.train_lang]['score'] if args.train_lang in dev else None


def mixture_batches(sizes, alpha, batch_size, seed, chunks, lengths=None):
    """An XLA epoch's global batches over the concatenated sets: sum(n_i) draws, round(q_i x sum(n_i))
    of them from set i (Eq. 2), each set read in shuffled passes, the draws shuffled together
    (then grouped by length when lengths are given, as every run's batches)."""
    g, picks, offset = torch.Generator().manual_seed(seed), [], 0
    for n, q in zip(sizes, xlt.mixing_probabilities(sizes, alpha) if sum(sizes) else sizes):
        count = round(q * sum(sizes))
        if n and count:
            picks.append(torch.cat([torch.randperm(n, generator=g) for _ in range(math.ceil(count / n))])[:count] + offset)
        offset += n
    if not picks:
        return []
    order = torch.cat(picks)
    return cut_batches(order[torch.randperm(len(order), generator=g)].tolist(), batch_size, chunks, g, lengths)


def xla_report(args, tok, paths, rank, world, device, sets=None, dev_cache=None):
    """Dev and test of each final model, their mean and their ensemble (the run's predictions), beside
    the warm-ups' (the zero-shot baseline with the confidence penalty). sets, dev_cache: the run's,
    read once (eval_sets) and tokenised once (evaluate's cache), when it has them."""
    models = [xla_model(args, p, device) for p in paths]
    sets, runs = sets or eval_sets(args, xlt.XLA), {}
    caches = {'dev': {} if dev_cache is None else dev_cache, 'test': {}}  # one per split: evaluate keys them by language
    scored = lambda method, split: evaluate(method, args, tok, split, device, rank, world, sets, caches[split])
    for m, (method, path) in enumerate(zip(models, paths)):
        sub = argparse.Namespace(**{**vars(args), 'out': os.path.join(args.out, f'model{m + 1}')})  # its predictions
        runs[f'XLA model {m + 1}'] = {'dev': scored(method, 'dev')[0], 'test': test_results(sub, scored(method, 'test')[1], rank),
                                      'checkpoint': os.path.relpath(path, args.out)}
    ensemble = xlt.Ensemble(models)
    dev = scored(ensemble, 'dev')[0]
    test = test_results(args, scored(ensemble, 'test')[1], rank)
    warm = [os.path.join(args.warmup_dir or args.out, f'warmup-{m + 1}', 'results.json') for m in range(3)]
    rows = {}
    if all(os.path.exists(w) for w in warm):
        rows['warm-up (zero-shot + penalty), mean'] = mean_summary([json.load(open(w)) for w in warm])
    summaries = {name: {split: ev.summarize({lang: s['score'] for lang, s in r[split].items()}) if r[split] else {}
                        for split in ('dev', 'test')} for name, r in runs.items()}
    rows.update({name: dict(s, checkpoint=runs[name]['checkpoint']) for name, s in summaries.items()})
    rows['XLA mean of the models'] = mean_summary(list(summaries.values()))
    finish(args, dev, test, rank, 'each model\'s last XLA epoch that kept the --train_lang dev score (or its warm-up: '
           'the best English dev); the ensemble averages the models\' probabilities', rows)


def mean_summary(results):
    """The per-language mean of several runs' {'dev': summary, 'test': summary}."""
    return {split: {k: float(np.mean([r[split][k] for r in results])) for k in results[0][split]} if results[0][split] else {}
            for split in ('dev', 'test')}


def epoch_line(state, args, epoch_loss, dev, select, seconds):
    """The line printed at an epoch's end: where the run is, its training loss, the dev average
    and the best score so far by the run's selection rule."""
    loss = sum(l * n for l, n in epoch_loss) / max(1, sum(n for _, n in epoch_loss))
    line = f'epoch {state["epoch"]}/{args.epochs}  step {state["step"]}  train loss {loss:.4f}'
    if dev and select == 'loss':
        line += f'  held-out loss {-np.mean([s["score"] for s in dev.values()]):.4f}  best {-state["best"]:.4f}'
    elif dev:
        average = np.mean([s['score'] for s in dev.values()])
        line += f'  dev avg {average:.1f}' + (f'  dev en {dev["en"]["score"]:.1f}' if select == 'en' and 'en' in dev else '')
        line += f'  best {state["best"]:.1f} ({"en" if select == "en" and "en" in dev else "avg"})'
    return line + f'  {clock(seconds)}'


def clock(seconds):
    s = int(seconds)
    return f'{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}'


def open_log(path, step):
    """log.jsonl for appending from `step`: a resumed run drops the lines written after its
    checkpoint, which it trains again, so the log reads as one run."""
    kept = []
    if step and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)['step'] <= step]
    layers.atomic_write(path, ''.join(kept))
    return open(path, 'a')


def weights(method, args):
    """best.pt: the encoder in the converted checkpoint's layout (so --init reads it; VECO's with
    its cross-attention and MLM head), and the whole method for --eval_only."""
    mlm = getattr(method, 'mlm', None)
    return {'config': method.encoder.cfg.__dict__, 'encoder': method.encoder.state_dict(), 'method': method.state_dict(),
            'mlm': None if mlm is None else {k: v for k, v in mlm.state_dict().items() if k != 'weight'},
            'identity': identity(args)}


def checkpoint(method, opt, sched, state, args):
    return {'method': method.state_dict(), 'optimizer': opt.state_dict(), 'schedule': sched.state_dict(),
            'state': dict(state), 'rng': torch.get_rng_state(), 'identity': identity(args)}


def selection(method, dev):
    """-> (the dev score a checkpoint is chosen by, the rule in words): the baselines' English dev
    score (XTREME's zero-shot protocol has no target-language labels), FILTER's and X-Mixup's
    average over the dev languages (as their papers select)."""
    if not dev:
        return None, 'last epoch (no dev set)'
    if method.select == 'en' and 'en' in dev:
        return dev['en']['score'], SELECTED_BY['en']
    return float(np.mean([s['score'] for s in dev.values()])), SELECTED_BY['loss' if method.select == 'loss' else 'average']


def finish(args, dev, test, rank, selected_by=None, runs=None):
    """results.json (dev and test per language with average and transfer gap, the checkpoint's
    selection rule) and the table; runs: other rows {name: {'dev': summary, 'test': summary}}
    (XLA's models), listed first."""
    if rank != 0:
        return
    summary = lambda scores: ev.summarize({lang: s['score'] for lang, s in scores.items()}) if scores else {}
    results = {'task': args.task, 'method': args.method, 'selected_by': selected_by, 'dev': summary(dev),
               'test': summary(test), 'test_metrics': test, 'dev_metrics': dev, **({'runs': runs} if runs else {})}
    layers.atomic_write(os.path.join(args.out, 'results.json'), json.dumps(results, indent=2))
    rows = {f'{split} {name}': r[split] for split in ('dev', 'test') for name, r in (runs or {}).items() if r[split]}
    label = f'{args.task}{f", {args.stage}" if args.stage else ""}{", ensemble" if runs else ""}'
    rows.update({f'{split} ({label})': results[split] for split in ('dev', 'test') if results[split]})
    qa = args.task in data.TASKS and data.TASKS[args.task].family == 'qa'
    for split, scores in (('dev', dev), ('test', test)) if qa else ():  # the score's two halves
        rows.update({f'{split} {name}': ev.summarize({lang: s[metric] for lang, s in scores.items()})
                     for metric, name in (('exact_match', 'EM'), ('f1', 'F1')) if scores})
    table = ev.format_table(rows) if rows else 'no labels to score against: predictions written only'
    table += '\nQA: each score is the mean of exact match (EM) and F1' if qa and rows else ''
    layers.atomic_write(os.path.join(args.out, 'results.txt'), table + '\n')
    print(table)
    print(f'results in {args.out}/results.json and results.txt, predictions in {args.out}/predictions/'
          f'{", the kept model in best.pt" if os.path.exists(os.path.join(args.out, "best.pt")) else ""}; '
          f'{clock(time.time() - START)} in all')


if __name__ == '__main__':
    main()
