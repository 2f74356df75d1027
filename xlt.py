"""The cross-lingual transfer methods: the task heads, the losses, and one class per method. Each class holds
the method's options, its released default settings and, for a method with stages, its procedure.

The `Method` class below is the protocol. Everything that train.py, data.py and eval.py use of a method is an
attribute or a hook of that class, with a default there. A new method is one new class and one entry in
METHODS (see "Adding a method" in the README). Methods read data through data.py and write nothing themselves:
the run object that train.py hands to a procedure keeps whatever must survive a crash.
"""
import argparse
import itertools
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import eval as ev
from data import IGNORE, TASKS, Batch
from layers import (CONFIGS, Encoder, MLMHead, Pass, autocast, average_checkpoints, beam_search, exact_fp32,
                    init_weights, is_cross, kept_checkpoints, load_checkpoint, mean_pool)


# ----------------------------------------------------------------------------------------
# The protocol: a method's options (Option), the base class (Method) and the rule that keeps a checkpoint (selection).

class Option(NamedTuple):
    """A command-line option. train.py builds the command line from the OPTIONS of every class. The fields are:
    name (the --name); type (int, float or str; bool makes a flag); help; valid (a test of a given value, and the
    valid range in words); nargs ('+' takes a list); choices; default (the value when none is given); changes (what
    the option changes: 'results' for training, 'scores' for evaluation too, or 'nothing' when the results stay
    alike); path (for a path, what it names, checked before a run: a 'checkpoint' or a finished 'run' of the task);
    negated (the help of the flag's --no_<name>, so that giving neither flag leaves the default to the method, None)."""
    name: str
    type: object = float
    help: str = ''
    valid: tuple = None
    nargs: str = None
    choices: tuple = None
    default: object = None
    changes: str = 'results'
    path: str = None
    negated: str = None


POSITIVE, AT_LEAST_1, NON_NEGATIVE = (lambda v: v > 0, 'a number above 0'), (lambda v: v >= 1, 'at least 1'), \
    (lambda v: v >= 0, '0 or more')
SHARE, UNIT = (lambda v: 0 <= v < 1, 'at least 0 and below 1'), (lambda v: 0 <= v <= 1, 'from 0 to 1')
PART = (lambda v: 0 < v <= 1, 'above 0 and at most 1')
QA_CASE = Option('qa_case', str, 'QA text as the model reads it: lower (XTREME\'s train_qa.sh and FILTER\'s train.sh '
                 'pass --do_lower_case, which lowercased XLM-R\'s input in their transformers 2.x) or cased (the '
                 'default elsewhere)', choices=('lower', 'cased'), default='cased')
MINING = Option('mining', str, 'BUCC: margin (XTREME\'s ratio margin over 4 neighbours both ways, the default) or '
                'cosine (each source sentence\'s nearest English one)', choices=('margin', 'cosine'), default='margin',
                changes='scores')


class Method(nn.Module):
    """The protocol between a method and the trainer. It lists first what a new method writes, then the hooks that a
    method may override; each has a default here. "Adding a method" in the README shows a whole method in 30 lines.

    What a method writes:
      NAME        its --method name (it also needs an entry in METHODS)
      TASKS       the tasks it runs (default: every task of data.TASKS)
      trains_on   the kind of training data, a key of data.TRAINS_ON. 'en' is English alone; 'train_lang' is English
                  translated into --train_lang; 'every_lang' is English and its translations into every target
                  language; 'own_lang' is --train_lang's own training data; 'every_own' is every language's own data
      paired      True when batches are data.Pair (English and its translation), so that loss and predict read pairs;
                  round_trip: True when a pair also holds English's round trip through the target language (Pair.alt)
      select      the rule that keeps a checkpoint. A language code keeps that language's best dev score ('en' by
                  default; an instance may name another, as in-language names its own); 'average' keeps the best dev
                  average, 'loss' the lowest held-out loss, and 'last' the last checkpoint
      RUN         the settings of its release, {task: {option: value}}, the learning rate among them. RUN_BERT holds
                  those that differ on BERT (the settings table of the method's docs page gives each value's source)
      OPTIONS     its command-line options (Option). An option may belong to several methods.
      __init__(encoder, task, args)  Method.__init__ sets what the trainer reads of every method: encoder, family,
                  options (each option's value, or its default), the task's usual head (HEAD holds its settings; None
                  means no such head), step (the optimiser steps taken) and mlm (an MLM head kept with the encoder,
                  VECO's). A method's own __init__ calls it first, then adds its own parts.
      loss(batch) -> (the mean loss, the logs); forward calls loss, so that DDP can wrap a method as it is
      predict(batch) -> class logits (B, C), tag logits (B, T, C) or span logits (B, T, 2)
    A method with stages (a teacher, warm-ups, a search) also writes:
      stages(args)     {name: option changes}, the runs made first, each in its own folder inside the run's folder
      procedure(run)   the run itself, given a train.Run (default: build, fit and report)

    Hooks a method may override:
      settings    DEMO: its changes to the demo's settings. settings(args, demo): the values a run takes where it
                  gives none. configure(args, demo): fills in the options left unset, and raises ValueError on a
                  setting that cannot run. released(args): RUN and RUN_BERT for this run. TRANSLATIONS: the
                  translations it reads by default (--translations). train_langs(args, targets): the languages
                  besides English that it trains on. selects_on(args): the sets that choose the kept checkpoint,
                  when they are not the task's dev sets. reads(args): [(path, what, needed)], the files it reads
                  beyond the task's. folder(args): the default run folder's name, in parts. resolve(args),
                  variants(): the class that runs (VECO's pre-training, translation, translate-train-all).
      training    before_update(): runs before each optimiser update (VECO drops its frozen phase's gradients).
                  stepped(step): counts the step in `step` -> an event for the log, or None. schedule(args, total):
                  the learning rate's factor per step. DECAY_ALL: weight decay on biases and LayerNorms too (fairseq's).
                  host(batch): the micro-batch as loss() reads it, made on the host before it goes to the device.
      prediction  predictor(run): the model that a finished run predicts with (train.py --predict). KEEPS: the
                  file that --eval_only evaluates in a finished run's folder.
      export      EXPORT: what `python layers.py export` makes of its checkpoints: 'head' (XLM-R and its Head on one
                  text), 'mlm' (its MLM head), or in words why it cannot. exported(args, tok): what the export reads.
      retrieval   retrieval(run): the run of a retrieval task (BUCC, Tatoeba), which trains nothing.
                  retrieval_layer(task, n_layer): the layer whose states it pools.
      memory      sketch(args, cfg): its model as a run builds it (on the meta device, for the plan to count).
                  micro_batches(args, parts, max_tokens): [(rows, lengths)] of its largest micro-batches.
                  passes(rows, lengths): what its training keeps for the backward pass (layers.peak_bytes).
      BERT, demo  NOT_ON_BERT: in words, why it does not run on BERT (None when it does). pretrained_start: the
                  demo starts from the demo's pre-trained model, not from random weights."""
    # what a method writes, with defaults for those it may leave out
    NAME, TASKS, family = None, tuple(TASKS), None  # family: that of its own task (VECO's), else the task's
    trains_on, paired, round_trip, select = 'en', False, False, 'en'
    RUN, RUN_BERT, OPTIONS, HEAD = {}, {}, (), {}

    def __init__(self, encoder, task, args=None):
        super().__init__()
        self.encoder, self.family = encoder, TASKS[task].family if task in TASKS else self.family
        self.options = argparse.Namespace(**given_or(args, option_defaults(type(self))))
        if self.HEAD is not None and task in TASKS:
            self.head = Head(self.family, encoder, TASKS[task].labels, **self.HEAD)
        self.step, self.mlm = 0, None  # mlm: an MLM head saved with the encoder (VECO's)

    def forward(self, batch):
        return self.loss(batch)

    @classmethod
    def stages(cls, args):
        return {}

    @classmethod
    def procedure(cls, run):
        """Fine-tune on the training data, keep the best checkpoint and evaluate every language."""
        method = run.build()
        run.fit(method, run.items(method))
        run.report(method)

    # hooks: settings
    DEMO, TRANSLATIONS = {}, 'xtreme'

    @classmethod
    def configure(cls, args, demo=None):
        """Fill in the options left unset (settings) and, on a CPU, compute in fp32 unless told otherwise. Raise
        ValueError on a setting that cannot run."""
        if cls.NOT_ON_BERT and CONFIGS[args.model].backbone == 'bert':
            raise ValueError(f'{cls.NAME} does not run on BERT (--model {args.model}): {cls.NOT_ON_BERT}')
        if args.steps and args.epochs:
            raise ValueError('--steps counts the training in optimiser steps, --epochs in passes: give one')
        precision = args.precision
        vars(args).update(given_or(args, cls.settings(args, demo)))
        if precision is None and not torch.cuda.is_available():
            args.precision = 'fp32'  # the releases' fp16 is meant for GPUs
        if args.steps:  # in a run counted in steps, train.train makes its own 'epochs' of --eval_every steps or passes
            args.epochs = None
        elif args.eval_every:
            raise ValueError('--eval_every counts the steps between evaluations of a run counted in --steps: add '
                             '--steps, or drop it')

    @classmethod
    def settings(cls, args, demo=None):
        """{option: value}, the values a run takes where it gives none; each source overrides the ones before it.
        First come the defaults of the class's options. Then what every release's runner leaves at its default: no
        warm-up or weight decay, clipping at norm 1, Adam's eps 1e-8, random batches, fp32, up to 128 tokens (384
        for QA), windows 128 apart, and seed 1 where none is set. Then ours where a method gives none: 2e-5, 4 epochs
        (2 for XQuAD and MLQA) and batch 32. Last, the release's settings for the run (released) or the demo's."""
        qa = args.task in TASKS and TASKS[args.task].family == 'qa'
        epochs = (15 if qa else 8) if demo else 2 if args.task in ('xquad', 'mlqa') else 4  # the demo's QA needs longer
        runners = {'lr': 2e-5, 'epochs': epochs, 'batch_size': 32, 'warmup': 0.0, 'weight_decay': 0.0, 'clip': 1.0,
                   'clip_by': 'norm', 'adam_eps': 1e-8, 'adam_beta2': 0.999, 'group_by_length': False, 'seed': 1,
                   'precision': 'fp32', 'doc_stride': 128, 'max_len': 384 if qa else 128, 'epoch_draw': 'all'}
        settings = {**{o.name: o.default for o in cls.OPTIONS}, **runners,
                    **(cls.released(args) if demo is None else demo)}
        if args.epochs:  # counted in passes as asked, even where the scripts count steps
            settings = {k: v for k, v in settings.items() if k not in ('steps', 'eval_every')}
        return settings

    @classmethod
    def released(cls, args):
        bert = cls.RUN_BERT.get(args.task, {}) if CONFIGS[args.model].backbone == 'bert' else {}
        return {**cls.RUN.get(args.task, {}), **bert}

    @classmethod
    def train_langs(cls, args, targets):
        """The languages of targets, besides English, whose translations (or own data, for in-language) it trains on.
        With --seen_langs, a method that trains on every language trains on those alone (X-Mixup's Table 6)."""
        chosen = given_or(args, {'seen_langs': None})['seen_langs'] or targets
        seen = [lang for lang in targets if lang in chosen]
        return {'one': [args.train_lang], 'every': seen}.get(data.TRAINS_ON[cls.trains_on].langs, [])

    @classmethod
    def reads(cls, args):
        return []

    @classmethod
    def selects_on(cls, args):
        """(task, split, languages, first examples) of the sets that keep its checkpoint; None: the task's dev sets."""
        return None

    @classmethod
    def folder(cls, args):
        return [args.task, args.method]

    @classmethod
    def resolve(cls, args):
        return cls

    @classmethod
    def variants(cls):
        return ()

    # hooks: training
    DECAY_ALL = False

    def before_update(self):
        pass

    def stepped(self, step):
        self.step = step

    def host(self, batch):
        return batch

    def schedule(self, args, total):
        return warmup_then_decay(args.warmup_steps or int(args.warmup * total), 0, total)

    # hooks: prediction and export
    KEEPS, EXPORT = 'best.pt', 'its prediction is its own, not XLM-R\'s forward pass and a head'

    @classmethod
    def predictor(cls, run):
        """best.pt; in an --eval_only run of --init (a released model), the --init weights as it evaluated them."""
        return run.restore(run.path('best.pt')) if run.folder.holds('best.pt') else run.build()

    @classmethod
    def exported(cls, args, tok):
        """What the checkpoints tell `python layers.py export`: how the method predicts (EXPORT, where 'head' becomes
        the family of its task), the task's labels, the tokenizer's files and whether the tokenizer lowercases."""
        return {'export': task_family(args) if cls.EXPORT == 'head' else cls.EXPORT, 'tokenizer': tok.files,
                'lower': tok.lower, 'labels': list(TASKS[args.task].labels) if args.task in TASKS else []}

    # hooks: retrieval. XTREME's run_bucc2018.sh and run_tatoeba.sh (d224426 to 838c13b) pool --specific_layer of
    # the last --num_layers hidden states, counting the embeddings as the first. BUCC takes 7 of the last 12;
    # Tatoeba takes 13 of 24 on XLM-R large and 7 of 12 on 12 layers.
    RETRIEVAL_LAYERS = {24: {'bucc2018': 20, 'tatoeba': 14}, 12: {'bucc2018': 8, 'tatoeba': 8}}

    @classmethod
    def retrieval(cls, run):
        """bucc2018 or tatoeba: nothing is trained. The mean-pooled states of the method's layer (retrieval_layer;
        --layer, --pool) are mined as --mining says (eval.retrieve)."""
        args, encoder = run.args, run.pretrained().encoder.to(run.device)
        which = args.layer or (cls.retrieval_layer(args.task, encoder.cfg.n_layer),)
        if which[-1] > encoder.cfg.n_layer:  # checked before the folder is begun, so that an earlier run's results stay
            run.fail(f'--layer {"-".join(map(str, which))}: the model has layers 1 to {encoder.cfg.n_layer}')
        run.folder.begin()
        embed = lambda texts: ev.embed_texts(encoder, run.tok, texts, which, args.eval_batch_size, run.device,
                                             args.pool)
        preds = ev.retrieve(args.data_dir, args.task, embed, args.mining, args.langs) if run.rank == 0 else {}
        run.finish({}, run.test_scores(preds))

    @classmethod
    def retrieval_layer(cls, task, n_layer):
        """XTREME's layer for the preset's depth; at another depth, the same share of layers as on a 12-layer model."""
        return cls.RETRIEVAL_LAYERS.get(n_layer, {}).get(task) or max(1, round(n_layer * 8 / 12))

    # hooks: memory, for the plan that estimates the peak memory of a training step (train.memory_plan)
    @classmethod
    def sketch(cls, args, cfg):
        return cls(Encoder(cfg), args.task, args)

    @classmethod
    def micro_batches(cls, args, parts, max_tokens=None):
        """A step cut into `parts` micro-batches (processes x --grad_accum), or ones of at most max_tokens tokens (a
        pair counts its longer side) -> [(rows, lengths)] of the largest, each side (as item_lengths) at --max_len."""
        rows = max_tokens // args.max_len if max_tokens else math.ceil(max(batch_sizes(args).values()) / parts)
        return [(rows, (args.max_len,) * (1 + cls.paired + cls.round_trip))]

    def passes(self, rows, lengths):
        """A training micro-batch of rows x lengths tokens (a length per side, as in data.item_lengths) -> (the runs
        of blocks that its loss makes, as layers.Pass; the bytes that its head and loss keep beyond them). Those bytes
        are the logits over the vocabulary where a method makes them; a head's few floats per token are left out."""
        return [Pass(rows, lengths[0], self.encoder.cfg.n_layer)], 0

    # hooks: BERT, the demo
    NOT_ON_BERT, pretrained_start = None, False


SELECTED_BY = {'en': 'best English dev score', 'average': 'best average dev score over languages',
               'loss': 'lowest held-out loss', 'train_lang': 'best dev score of --train_lang',
               'last': 'last epoch'}  # each method.select's rule, in words


Selection = NamedTuple('Selection', [('score', float), ('rule', str)])  # the score that chooses a checkpoint (None
# when the last is kept), and the rule in words


def selection(select, dev):
    """-> Selection(the dev score that chooses a checkpoint, the rule in words). The score is a language's dev score:
    English for the baselines (XTREME's zero-shot protocol has no target-language labels), or the language's own for
    in-language (XTREME's run_tag.py --train_langs). X-Mixup takes the average over the dev languages (as its release
    selects) and VECO the lowest held-out loss. 'last' has none (FILTER's runners and XTREME's QA keep the last)."""
    if select == 'last' or not dev:
        return Selection(None, SELECTED_BY['last'] if dev else 'last epoch (no dev set)')
    if select in dev:
        return Selection(dev[select]['score'], SELECTED_BY['en'] if select == 'en' else f'best dev score of {select}')
    if select not in SELECTED_BY:  # a language without a dev set (in-language's Kazakh, say): not the others' average
        return Selection(None, f'last epoch (no {select} dev set)')
    mean = float(np.mean([s['score'] for s in dev.values()]))
    return Selection(mean, SELECTED_BY['loss' if select == 'loss' else 'average'])


def given_or(args, defaults):
    """-> {name: the value in args, or the default where args leaves it unset (None) or lacks it, as a checkpoint's
    settings may} for each option of defaults. This is the one place where an option takes its default."""
    return {name: default if getattr(args, name, None) is None else getattr(args, name)
            for name, default in defaults.items()}


def warmup_then_decay(warm, start, end):
    """The learning rate's factor at a step in [start, end): a linear warm-up over the first `warm`
    steps, then a linear decay to 0 at end."""
    warm = max(1, warm)
    return lambda step: min((step - start + 1) / warm, max(0.0, (end - step) / max(1, end - start - warm)))


def share_draw(args):
    """The seed of the draw that --train_share makes: --share_seed, or else the run's --seed (a new draw per seed)."""
    return args.seed if args.share_seed is None else args.share_seed


def method_class(args):
    """The class that runs --method on --task (with its options)."""
    return METHODS[args.method].resolve(args)


def task_family(args):
    """The family of the run's task: that of an XTREME task, or of a method's own task (VECO's pretrain, translate)."""
    return TASKS[args.task].family if args.task in TASKS else method_class(args).family


# ----------------------------------------------------------------------------------------
# Task heads and losses, shared by the methods.

class Head(nn.Module):
    """The task head. For classification: <s> -> dense -> tanh -> classes (RoBERTa's head; act=torch.relu gives
    FILTER's released one). On BERT, the dense layer starts from the encoder's pre-trained pooler, with no dropout
    before it, unless pooled=False. For tagging: a class per token (labels: the task's). For QA: a start and an end
    score per token. A transformers task model that --init read (the encoder's task_head) is the head's start."""

    def __init__(self, family, encoder, labels, pooled=True, act=torch.tanh):
        super().__init__()
        dim, pooler = encoder.cfg.dim, encoder.pooler if pooled else None
        self.family, self.act = family, act
        self.drop = nn.Dropout(encoder.cfg.dropout)
        self.dense = nn.Linear(dim, dim) if family == 'classification' else None
        self.out = nn.Linear(dim, 2 if family == 'qa' else len(labels))
        self.apply(init_weights)  # N(0, 0.02) weights, zero biases, as the encoder's
        self.pooled = pooler is not None and self.dense is not None and act is torch.tanh
        if self.pooled:  # BertForSequenceClassification: the pooler is part of the model that is fine-tuned
            self.dense.load_state_dict(pooler.state_dict())
        if encoder.task_head:
            start_from_released(self, *encoder.task_head[:3], labels, encoder.task_head.fusion is not None)

    def forward(self, h, mask):
        if self.pooled:
            return self.out(self.drop(torch.tanh(self.dense(h[:, 0]))))
        if self.dense is not None:
            return self.out(self.drop(self.act(self.dense(self.drop(h[:, 0])))))
        if self.family == 'tagging':
            return self.out(self.drop(h))
        # QA: no dropout before the span layer (XTREME, FILTER and X-Mixup have none). Padding
        # must not take part in the softmax over positions.
        return self.out(h).masked_fill(~mask[..., None], float('-inf'))


def to_examples(family, values, real=None):
    """Values per example (B,), per token (B, T) or per answer end (B, 2) -> values per example (B,) whose mean
    is the batch's. Tagging weights its real tokens as per_example_loss says; QA averages its two ends."""
    if family == 'tagging':
        return (values * real).sum(1) * real.size(0) / real.sum().clamp(min=1)
    return values.mean(-1) if family == 'qa' else values


def per_example_loss(family, logits, labels):
    """Cross-entropy per example (B,), such that its mean is the batch's loss. Classification and QA (the mean of
    the start and end losses) are per example. Tagging's loss is the mean over all labelled tokens of the batch
    (XTREME's run_tag), so example i carries B x (the sum over its tokens) / (the batch's labelled tokens), and
    weighting an example weights its tokens."""
    if family == 'classification':
        return F.cross_entropy(logits.float(), labels, reduction='none')
    if family == 'tagging':
        tokens = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE, reduction='none')
        return to_examples(family, tokens, labels.ne(IGNORE))
    start, end = logits.float().unbind(-1)
    return (F.cross_entropy(start, labels[:, 0], reduction='none')
            + F.cross_entropy(end, labels[:, 1], reduction='none')) / 2


def entropy_per_example(family, logits, mask):
    """H(p) of the predictions per example (B,). For tagging, it is the mean over every real token of the batch
    (mask: the attention mask), as the released model.py's NegEntropy over its active logits, weighted per example
    as per_example_loss weights tokens. For QA, it is the mean of the entropies of the start and the end
    distributions (padding has p = 0 and adds nothing)."""
    dim = 1 if family == 'qa' else -1
    logp = logits.float().log_softmax(dim)
    h = -torch.where(logp.isfinite(), logp.exp() * logp, 0.0).sum(dim)
    return to_examples(family, h, mask)


def kl_per_example(family, p_teacher, logits, first=None, temperature=1.0):
    """KL(p_teacher || p_student) per example (B,). Both are softened by the temperature t, and the KL is scaled by
    t^2, as in FILTER's released code (softmax(teacher / t) = p_teacher^(1/t), renormalised). The KL is over classes;
    for tagging, it is per word (first sub-words), averaged over the batch's words as the tagging loss; for QA, it
    is over positions for the start and the end of an answer, averaged."""
    dim = 1 if family == 'qa' else -1
    if temperature != 1.0:
        p_teacher = p_teacher ** (1 / temperature)
        p_teacher = p_teacher / p_teacher.sum(dim, keepdim=True)
    log_q = (logits.float() / temperature).log_softmax(dim)
    kl = torch.where(p_teacher > 0, p_teacher * (p_teacher.clamp_min(1e-30).log() - log_q), 0.0) * temperature ** 2
    return to_examples(family, kl.sum(dim), first)


def teacher_kl(family, p_teacher, tgt, logits, temperature=1.0):
    """KL(p_teacher || p) per example. p_teacher holds the stored probabilities of every training item, and a batch
    knows the positions of its items among them (Batch.index), so that row r reads p_teacher[tgt.index[r]]."""
    stored = torch.nn.utils.rnn.pad_sequence([p_teacher[i] for i in tgt.index], batch_first=True)
    return kl_per_example(family, data.moved(stored, logits.device), logits, tgt.first, temperature)


def probabilities(family, logits):
    """What the teacher stores: class (or tag) distributions, or start and end distributions."""
    return logits.float().softmax(0 if family == 'qa' else -1)


def scale_depth(n, n_layer):
    """A layer count or index that the papers give for XLM-R large (24 layers), scaled to another depth."""
    return min(n_layer, max(1, round(n * n_layer / 24)))


# ----------------------------------------------------------------------------------------
# XTREME's baselines (Hu et al., 2020, Section 4): fine-tuning on English alone (zero-shot transfer), or on
# English translated into the target languages (translate-train, translate-train-all).

class Baseline(Method):
    """Fine-tuning the encoder and a task head on labelled examples of one text each."""
    NAME, EXPORT = 'zeroshot', 'head'
    # XTREME's scripts of the paper's time on XLM-R and mBERT (9522b49) keep the best English dev score, checked every
    # eval_steps, and QA keeps the last. RUN_BERT: mBERT's QA as the paper trained it, with the original BERT codebase.
    RUN = {'xnli': {'lr': 2e-5, 'epochs': 5, 'eval_steps': 100, 'seed': 42},
           'pawsx': {'lr': 2e-5, 'epochs': 5, 'eval_steps': 200, 'seed': 42},
           'udpos': {'lr': 2e-5, 'epochs': 10, 'eval_steps': 500},
           'panx': {'lr': 2e-5, 'epochs': 10, 'eval_steps': 1000},
           **{task: {'lr': 3e-5, 'epochs': 2, 'batch_size': 16, 'warmup_steps': 500, 'weight_decay': 1e-4,
                     'qa_case': 'lower', 'select': 'last', 'seed': 42} for task in ('xquad', 'mlqa', 'tydiqa')}}
    RUN_BERT = {task: {'lr': 2e-5, 'batch_size': 32, 'warmup_steps': 0, 'warmup': 0.1, 'weight_decay': 0.01,
                       'adam_eps': 1e-6, 'qa_case': 'cased', 'seed': 1} for task in ('xquad', 'mlqa', 'tydiqa')}
    OPTIONS = (
        MINING, QA_CASE,
        Option('conf_penalty', help='XLA\'s confidence penalty (Eq. 1): minus this weight times the entropy of the '
               'predictions (XLA warms up with 1)', valid=NON_NEGATIVE),
        Option('train_share', help='share of the English training data used (XLA: of the English and the target '
               'text; XNLI, PAWS-X: 0.05, the paper\'s 5%% setting; 1 for the 100%% setting)', valid=PART))

    def __init__(self, encoder, task, args=None):
        super().__init__(encoder, task, args)
        self.conf_penalty = self.options.conf_penalty or 0.0  # the weight of XLA's Eq. 1 (XLA's warm-up uses 1)

    def predict(self, batch):
        return self.head(self.encoder.run(self.encoder.embed(batch.ids), batch.keys), batch.mask)

    def loss(self, batch):
        logits = self.predict(batch)
        loss, logs = per_example_loss(self.family, logits, batch.labels), {}
        if self.conf_penalty:  # XLA's Eq. 1, the confidence penalty: CE - H(p), penalising confident predictions
            h = entropy_per_example(self.family, logits, batch.mask)
            loss, logs['entropy'] = loss - self.conf_penalty * h, h.mean().detach()
        return loss.mean(), {'loss': loss.mean().detach(), **logs}


# The tasks whose translations carry labels. XTREME publishes no tagging translations, FILTER's have no
# tags, and XTREME, FILTER and VECO give no translation-trained baseline for POS and NER.
LABELLED_TRANSLATIONS = tuple(task for task in TASKS if TASKS[task].family != 'tagging')


class TranslateTrain(Baseline):
    """Fine-tuning on the translation of English into one target language, --train_lang."""
    NAME, trains_on, TASKS = 'translate-train', 'train_lang', LABELLED_TRANSLATIONS
    OPTIONS = Baseline.OPTIONS + (Option('train_lang', str, 'the target language whose translation is trained on '
                                         '(XLA: whose text it adapts to)'),)

    @classmethod
    def folder(cls, args):
        return super().folder(args) + [args.train_lang] * bool(args.train_lang)


class TranslateTrainAll(Baseline):
    """Fine-tuning on English and its translations into every target language."""
    NAME, trains_on, TASKS = 'translate-train-all', 'every_lang', LABELLED_TRANSLATIONS


# XTREME's in-language baselines (Section 4, Table 2): the tasks with training data in the target languages
IN_LANGUAGE = ('udpos', 'panx', 'tydiqa', 'conll')


class InLanguage(Baseline):
    """Fine-tuning on a target language's own training data (--train_lang). That language's dev score keeps the
    checkpoint (XTREME's run_tag.py --train_langs). With --few_shot N, it trains on its first N examples alone."""
    NAME, trains_on, TASKS, select = 'in-language', 'own_lang', IN_LANGUAGE, 'train_lang'
    OPTIONS = (QA_CASE, Option('train_lang', str, 'the language whose own training data is trained on'),
               Option('few_shot', int, 'train on its first N examples alone (XTREME\'s in-language few-shot: 1000)',
                      AT_LEAST_1))

    def __init__(self, encoder, task, args=None):
        super().__init__(encoder, task, args)
        self.select = self.options.train_lang or 'en'

    @classmethod
    def folder(cls, args):
        return super().folder(args) + [args.train_lang] * bool(args.train_lang) + [f'first{args.few_shot}'] * bool(
            args.few_shot)


class InLanguageAll(Baseline):
    """In-language multi-task: one model fine-tuned on every language's own training data, English's too."""
    NAME, trains_on, TASKS, select = 'in-language-all', 'every_own', IN_LANGUAGE, 'average'
    OPTIONS = (QA_CASE,)


# ----------------------------------------------------------------------------------------
# FILTER (Fang et al., 2021): fusion of a text and its translation in the middle layers (Eq. 1-3), and
# self-teaching (Algorithm 1, Eq. 6), in which a teacher labels the target side (Taught). X-Mixup shares
# self-teaching for tagging, whose translations have no labels.

class Taught(Method):
    """A paired method that can learn the target side from a teacher's stored probabilities, p_teacher. Given them,
    it is the student of FILTER's Algorithm 1; without them, it is the teacher, or a method that no one teaches."""
    teacher_method = 'filter'
    OPTIONS = (MINING, QA_CASE,
               Option('self_teach', bool, 'train a teacher into --out/teacher first, then this model taught by it'),
               Option('teacher', str, 'a finished run folder of this task whose predictions teach the target side',
                      path='run'))

    def __init__(self, encoder, task, args=None, p_teacher=None):
        super().__init__(encoder, task, args)
        self.p_teacher = p_teacher  # a data.Ragged: p_teacher[i] holds training item i's probabilities

    @classmethod
    def procedure(cls, run):
        """FILTER's Algorithm 1 in three steps: train a teacher, store its soft labels of the target side, and train
        the student on them. A run without a teacher (no --self_teach or --teacher) trains as any method does."""
        items, p_teacher = run.items(cls), None  # no items with --eval_only, which trains nothing
        if items and (run.args.self_teach or run.args.teacher or cls.soft_labelled(run.args)):
            # lines 1-8, then line 12, kept in the run's folder, so that --resume reads them back and trains no teacher
            p_teacher = run.folder.cached('p_teacher.pt', lambda: cls.soft_labels(run, cls.train_teacher(run), items))
        cls.train_student(run, items, p_teacher)  # lines 9-16

    @classmethod
    def train_teacher(cls, run):
        """Algorithm 1, lines 1-8: the folder of the teacher trained on L^s + L^t: its own run in teacher/ (the
        stage of stages()) or the finished run that --teacher names. None where the data holds labels (X-Mixup's)."""
        return None if cls.soft_labelled(run.args) else run.args.teacher or run.path(run.stage('teacher'))

    @classmethod
    def soft_labels(cls, run, teacher, items):
        """Algorithm 1, line 12: p^t_tea, a data.Ragged of the teacher's probabilities for each training item's target
        side (a single-text teacher reads that side alone). Without a teacher, the release's data gives them."""
        if teacher is None:
            return released_probabilities(run, items)
        teacher = run.restore(teacher)
        return run.outputs(teacher, items, lambda output: probabilities(teacher.family, output))

    @classmethod
    def train_student(cls, run, items, p_teacher):
        """Algorithm 1, lines 9-16: the student, trained with Eq. 6's KL to p_teacher, then kept and evaluated as
        every method is. Without p_teacher, it is a model that no one teaches."""
        student = run.build(p_teacher=p_teacher)
        run.fit(student, items)
        run.report(student)

    @classmethod
    def configure(cls, args, demo=None):
        super().configure(args, demo)
        args.stage = 'student' if args.self_teach or args.teacher else None

    @classmethod
    def stages(cls, args):
        teacher = {'method': cls.teacher_method, 'self_teach': False, 'teacher': None, 'stage': 'teacher'}
        return {'teacher': teacher} if args.self_teach else {}

    @classmethod
    def folder(cls, args):
        return super().folder(args) + ['self-teach'] * bool(args.self_teach or args.teacher)

    @classmethod
    def soft_labelled(cls, args):
        """Does the run learn the target side from released distributions in its data, not from a teacher it trains?"""
        return False

    @classmethod
    def train_langs(cls, args, targets):
        """A release's data leaves some languages untranslated (FILTER's eu, jv, ka, my, tl, yo). Its runners train
        without them, and so does this method."""
        langs = [lang for lang in super().train_langs(args, targets) if lang != 'en']  # English is paired with itself
        return langs if args.translations == 'xtreme' else data.translated(args.data_dir, args.task, langs, cls.NAME)



class Filter(Taught):
    """FILTER. A source text S and its translation T are encoded apart by m local layers, together by k fusion
    layers over [H_l^s; H_l^t] (Eq. 1), and apart again by the L - k - m domain layers (Eq. 2-3). Both sides share
    one set of weights and one head. It trains on English with its translation, and it predicts from the target
    side of (English translation, target text). With stored teacher probabilities p_teacher, it is the
    self-taught student."""
    NAME, trains_on, paired, teacher_method, TRANSLATIONS = 'filter', 'every_lang', True, 'filter', 'filter'
    EXPORT = 'FILTER predicts from a text fused with its English translation in the middle layers'
    select = 'last'  # its runners keep the last epoch (the paper's best dev average chose among learning rates)
    HEAD = {'act': torch.relu}  # the activation of its released head
    # train.sh on 8 GPUs (XNLI in fp16), with its runners' seeds and temperatures. Each run keeps its last epoch.
    QA = {'qa_case': 'lower', 'seed': 42, 'temperature': 6.0}
    RUN = {'xnli': {'lr': 3e-6, 'epochs': 5, 'batch_size': 64, 'max_len': 256, 'precision': 'fp16', 'seed': 52,
                    'temperature': 0.1},
           'pawsx': {'lr': 1e-5, 'epochs': 4, 'max_len': 256, 'seed': 52, 'temperature': 0.1},
           **{task: {'lr': 5e-6, 'epochs': 20, 'batch_size': 64, 'seed': 62, 'epoch_draw': 'one'}
              for task in ('udpos', 'panx')},
           'mlqa': {'lr': 5e-6, 'epochs': 2, 'batch_size': 64, **QA}, 'xquad': {'lr': 5e-6, 'epochs': 2, **QA},
           'tydiqa': {'lr': 1e-5, 'epochs': 4, **QA}}
    # The paper's m, k and KL weight 1 - lambda for XLM-R large (24 layers). Unless --k is given, k is scaled to
    # other depths (QA on XLM-R base: m = 1, k = 10).
    DEFAULTS = {'classification': (1, 1, 0.5), 'tagging': (1, 1, 1.0), 'qa': (1, 20, 0.1)}
    OPTIONS = Taught.OPTIONS + (
        Option('m', int, 'local layers (default 1)', NON_NEGATIVE),
        Option('k', int, 'fusion layers (default 1; 20 for QA)', NON_NEGATIVE),
        Option('kl_weight', help='self-teaching KL weight 1 - lambda (0.5 / 1.0 / 0.1)', valid=UNIT),
        Option('temperature', help='self-teaching KL of distributions softened by t, times t^2 (default 1, as the '
               'paper)', valid=POSITIVE))

    def __init__(self, encoder, task, args, p_teacher=None):
        super().__init__(encoder, task, args, p_teacher)
        given, L = self.options, encoder.cfg.n_layer
        m, k, kl_weight = self.DEFAULTS[self.family]
        self.m = m if given.m is None else given.m
        self.k = min(scale_depth(k, L), L - self.m) if given.k is None else given.k
        self.m, self.k = released_fusion(encoder, given, (self.m, self.k))  # a released FILTER model's own (m, k)
        if self.k + self.m > L or min(self.k, self.m) < 0:
            raise ValueError(f'--k {self.k} + --m {self.m} does not fit the model\'s {L} layers: choose k + m <= {L}')
        self.lam = 1 - (kl_weight if given.kl_weight is None else given.kl_weight)  # Eq. 6's lambda
        self.temperature = given.temperature or 1.0  # softens both sides of the KL (the paper has none)

    @classmethod
    def train_langs(cls, args, targets):  # its run_xqa.py trains QA without Chinese ("the tokenize issue")
        return [lang for lang in super().train_langs(args, targets) if lang != 'zh' or TASKS[args.task].family != 'qa']

    def encode(self, src, tgt, source_side=True):
        enc, m, k = self.encoder, self.m, self.k
        h_s = enc.run(enc.embed(src.ids), src.mask, 0, m)  # local layers; each side numbers its own positions
        h_t = enc.run(enc.embed(tgt.ids), tgt.mask, 0, m)
        fused = enc.run(torch.cat([h_s, h_t], 1), torch.cat([src.mask, tgt.mask], 1), m, m + k)  # Eq. 1
        h_s, h_t = fused.split([h_s.size(1), h_t.size(1)], 1)
        h_t = enc.run(h_t, tgt.mask, m + k)  # Eq. 3
        return (enc.run(h_s, src.mask, m + k) if source_side else None), h_t  # Eq. 2

    def predict(self, pair):  # the source side's domain layers are not needed
        return self.head(self.encode(pair.src, pair.tgt, source_side=False)[1], pair.tgt.mask)

    def loss(self, pair):
        """The teacher's L^s + L^t (Algorithm 1, lines 1-8) or, with p_teacher, the student's Eq. 6. The translations
        for tagging carry no tags, so their L^t is 0, and lambda is 0 unless --kl_weight says otherwise."""
        h_s, h_t = self.encode(pair.src, pair.tgt)
        p_s, p_t = self.head(h_s, pair.src.mask), self.head(h_t, pair.tgt.mask)
        loss_s = per_example_loss(self.family, p_s, pair.src.labels)
        loss_t = 0.0 if self.family == 'tagging' else per_example_loss(self.family, p_t, pair.tgt.labels)
        if self.p_teacher is None:
            loss = loss_s + loss_t
            return loss.mean(), {'loss': loss.mean().detach()}
        kl = teacher_kl(self.family, self.p_teacher, pair.tgt, p_t, self.temperature)
        loss = loss_s + self.lam * loss_t + (1 - self.lam) * kl  # Eq. 6
        return loss.mean(), {'loss': loss.mean().detach(), 'kl': kl.mean().detach()}

    # memory hooks (see Method): what the plan's estimate counts
    def passes(self, rows, lengths):
        (s, t), L, m, k = lengths[:2], self.encoder.cfg.n_layer, self.m, self.k
        apart = lambda start, blocks: [Pass(rows, n, blocks, embedded=start) for n in (s, t)]
        return apart(True, m) + [Pass(rows, s + t, k, embedded=False)] + apart(False, L - m - k), 0


# ----------------------------------------------------------------------------------------
# X-Mixup (Yang et al., 2022): mixing the target's states with the source's in one layer (Eq. 3-5), scheduled
# sampling of the source (Eq. 6), and consistency losses (Eq. 7-8).

def attention_entropy(scores, query_mask, key_mask):
    """Eq. 5: H(A) = -1/I sum_i sum_j A_ij log A_ij per instance, where A is the softmax of scores (B, heads, I, J)
    over the real keys j. It is averaged over the I real query tokens and over the heads."""
    probs = scores.masked_fill(~key_mask[:, None, None, :], float('-inf')).softmax(-1)
    h = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean(1)  # (B, I)
    m = query_mask.float()
    return (h * m).sum(1) / m.sum(1)


SCORES_KEPT = 11  # the (heads, T, S) tensors X-Mixup's mixup layer keeps: scores, softmax and dropout; Eq. 5's twice


class XMixup(Taught):
    """X-Mixup. The source S and the target T are encoded apart. In one layer, the target's self-attention output
    also attends to the source's, with that layer's own weights (Eq. 3). The two are mixed with a per-instance ratio
    lambda (Eq. 4) that grows with the two-way attention entropy (Eq. 5), and the layer's FFN follows. Training feeds
    the real English or its round-trip translation as S (scheduled sampling, Eq. 6) and adds consistency losses
    (Eq. 7-8). Inference mixes the target with its translation into English."""
    NAME, trains_on, paired, round_trip, teacher_method = 'xmixup', 'every_lang', True, True, 'zeroshot'
    TRANSLATIONS = 'xmixup'  # its release's data: round trips, and tagging translations with its model's distributions
    EXPORT = 'X-Mixup predicts from a text\'s states mixed with its English translation\'s'
    pretrained_start = True  # X-Mixup starts from a trained encoder, see train.demo_pretrained
    select = 'average'  # the best average over the dev languages (Section 4.1)
    # X-Mixup's released mBERT code (xmixup/tasks/mbert/sequence_classification.py) classifies with a new
    # RoBERTa-style head, not from BERT's pooler
    HEAD = {'pooled': False}
    # The released scripts (train_classification.sh, train_tagging.sh, train_qa.sh) keep the best dev average, checked
    # every 100 steps, and clip every gradient to [-1, 1] by value (its trainer.py).
    RUN = {**{task: {'lr': 5e-6, 'epochs': 4, 'batch_size': 64, 'eval_steps': 100, 'clip_by': 'value', 'seed': seed}
              for task, seed in (('xnli', 1234), ('pawsx', 1234), ('udpos', 1), ('panx', 1))},
           **{task: {'lr': lr, 'epochs': epochs, 'warmup': 0.1, 'eval_steps': 100, 'clip_by': 'value', 'seed': 42}
              for task, lr, epochs in (('xquad', 5e-6, 2), ('mlqa', 5e-6, 2), ('tydiqa', 3e-5, 4))}}
    DEMO = {'p_k': 50}  # so that p* decays within the demo's short runs
    # The mixup layer, alpha and p_k (Table 10 and the released scripts). Only QA's layer depends on the
    # depth (16 of 24 on XLM-R large, 8 of 12 on base: Section 4.1).
    DEFAULTS = {'classification': (1, 0.4, 1000), 'tagging': (4, 0.8, 1000), 'qa': (16, 0.2, 2000)}
    OPTIONS = Taught.OPTIONS + (
        Option('mixup_layer', int, 'the layer that mixes (default 1 / 4 / 16 of 24, scaled)', AT_LEAST_1),
        Option('mixup_alpha', help='Eq. 8\'s weight alpha of the source\'s task loss (0.4 / 0.8 / 0.2, Table 10; '
               'the paper searched 0.2 to 0.8)', valid=UNIT),
        Option('fixed_lambda', bool, 'ablation: lambda = lambda_0'),
        Option('p_k', help='scheduled sampling decay rate (1000 / 1000 / 2000; demo 50)', valid=POSITIVE),
        Option('no_mixup_inference', bool, 'ablation: predict from the target alone', changes='scores'),
        Option('no_mixup', bool, 'ablation (Table 5): no mixup layer, each side through the plain encoder in training '
               'and inference, the losses kept'),
        Option('no_scheduled_sampling', bool, 'ablation (Table 5): the real English source always (p* = 1)'),
        Option('no_mse', bool, 'ablation (Tables 5, 9): no representation consistency, Eq. 7\'s MSE'),
        Option('no_kl', bool, 'ablation (Tables 5, 9): no prediction consistency, Eq. 7\'s KL (classification)'))

    @classmethod
    def configure(cls, args, demo=None):
        tagging = TASKS[args.task].family == 'tagging'
        if (args.self_teach or args.teacher) and not tagging:
            raise ValueError('--self_teach and --teacher belong to FILTER, and to X-Mixup on tagging (udpos, panx)')
        if tagging and not (args.self_teach or args.teacher or args.translations == 'xmixup'):
            raise ValueError('X-Mixup on tagging learns T from a source-language model\'s labels: its release\'s '
                             '(--translations xmixup), or pass --teacher RUN (a finished zeroshot run) or --self_teach')
        super().configure(args, demo)

    @classmethod
    def selects_on(cls, args):
        """As its release chooses: XQuAD's model by MLQA's dev sets, TyDiQA's by the English TyDiQA-GoldP file that
        XTREME tests on (run_squad.py), and tagging's by each language's first 1000 dev sentences (ner.py)."""
        tagging = TASKS[args.task].family == 'tagging'
        return {'xquad': ('mlqa', 'dev', None, None), 'tydiqa': ('tydiqa', 'test', ('en',), None)}.get(
            args.task, (args.task, 'dev', None, 1000) if tagging else None)

    @classmethod
    def soft_labelled(cls, args):  # its release's tagging data: translations with the English model's distributions
        return TASKS[args.task].family == 'tagging' and args.translations == 'xmixup' and not (
            args.self_teach or args.teacher)

    @classmethod
    def reads(cls, args):
        langs = cls.train_langs(args, data.languages(args.task, False, args.langs)) if cls.soft_labelled(args) else []
        why = 'X-Mixup\'s released tag distributions (python data.py download --translations xmixup)'
        return [(data.soft_path(args.data_dir, args.task, lang), why, True) for lang in langs]

    def __init__(self, encoder, task, args, p_teacher=None):
        super().__init__(encoder, task, args, p_teacher)  # tagging's p_teacher: a source-language model's labels of T
        given, L = self.options, encoder.cfg.n_layer
        layer, alpha, p_k = self.DEFAULTS[self.family]
        self.layer = given.mixup_layer
        if self.layer is None:
            self.layer = scale_depth(layer, L) if self.family == 'qa' else min(layer, L)
        if not 1 <= self.layer <= L:
            raise ValueError(f'--mixup_layer {self.layer} is not a layer of the model (1 to {L})')
        self.p_k, self.lambda_0 = given.p_k or p_k, 0.5  # Eq. 6 decays with self.step, the steps taken
        self.alpha = alpha if given.mixup_alpha is None else given.mixup_alpha
        self.fixed_lambda, self.mixes = bool(given.fixed_lambda), not given.no_mixup
        self.mixup_inference = self.mixes and not given.no_mixup_inference
        self.sampled = not given.no_scheduled_sampling  # Eq. 6 (otherwise the real English alone)
        self.mse, self.kl = not given.no_mse, not given.no_kl
        if self.mixes and not self.fixed_lambda:  # Eq. 5's W and b (none to train with a fixed ratio, or no mixup)
            self.w, self.b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.zeros(1))

    def p_star(self):
        """Eq. 6's probability of feeding the real source: an inverse sigmoid decay in the batch index."""
        return self.p_k / (self.p_k + math.exp(min(self.step / self.p_k, 700.0)))

    def mixup_ratio(self, scores, mask_t, mask_s):
        """lambda = lambda_0 sigmoid((H(A) + H(A^T)) W + b) from the scores of T attending to S."""
        if self.fixed_lambda:
            return torch.full((mask_t.size(0), 1, 1), self.lambda_0, device=mask_t.device)
        entropy = (attention_entropy(scores, mask_t, mask_s)
                   + attention_entropy(scores.transpose(-1, -2), mask_s, mask_t))
        return (self.lambda_0 * torch.sigmoid(entropy * self.w + self.b)).view(-1, 1, 1)

    def mix(self, block, x_s, mask_s, x_t, mask_t):
        """The mixup layer on both sides -> (the source's output, the target's output, lambda)."""
        h_s, h_t = block.ln1(block.attend(x_s, mask_s)), block.ln1(block.attend(x_t, mask_t))  # Eq. 2
        h_ts, scores = block.attn(h_t, mask_s, memory=h_s, return_scores=True)  # Eq. 3: T queries S
        lam = self.mixup_ratio(scores, mask_t, mask_s)
        # Eq. 4 as in the released code: the normalised h_T is mixed with the cross-attention after its dropout,
        # then the sub-layer's LayerNorm runs once more (so lambda = 0 gives LN(h_T), not the plain layer)
        mixed = block.ln1(lam * block.drop(h_ts) + (1 - lam) * h_t)
        return block.feed_forward(h_s), block.feed_forward(mixed), lam

    def encode(self, src, tgt):
        enc, l = self.encoder, self.layer
        if not self.mixes:  # the ablation: each side through the plain encoder
            lam = torch.zeros(src.ids.size(0), 1, 1, device=src.ids.device)
            return enc(src.ids, src.mask), enc(tgt.ids, tgt.mask), lam
        x_s = enc.run(enc.embed(src.ids), src.mask, 0, l - 1)
        x_t = enc.run(enc.embed(tgt.ids), tgt.mask, 0, l - 1)
        x_s, x_t, lam = self.mix(enc.blocks[l - 1], x_s, src.mask, x_t, tgt.mask)
        return enc.run(x_s, src.mask, l), enc.run(x_t, tgt.mask, l), lam

    def scheduled_source(self, pair):
        """Eq. 6: each example's source is the real English with probability p*, or else its round trip
        -> (the source batch, a (B,) mask that is True where the source is real)."""
        if pair.alt is None or not self.sampled:
            return pair.src, torch.ones(pair.src.ids.size(0), dtype=torch.bool, device=pair.src.ids.device)
        real = torch.rand(pair.src.ids.size(0)) < self.p_star()  # drawn on the CPU: the same draws on any device
        real = data.moved(real, pair.src.ids.device)
        longest = max(pair.src.ids.size(1), pair.alt.ids.size(1))

        def pick(a, b, pad=None):  # row by row: a where the source is real, else b (both padded alike)
            if pad is not None:
                a, b = F.pad(a, (0, longest - a.size(1)), value=pad), F.pad(b, (0, longest - b.size(1)), value=pad)
            return torch.where(real.view(-1, *[1] * (a.dim() - 1)), a, b)
        s, r = pair.src, pair.alt
        trip = r.labels if r.labels is not None or s.labels is None else torch.full_like(r.ids, IGNORE)  # untagged
        labels = None if s.labels is None else pick(s.labels, trip, IGNORE if self.family == 'tagging' else None)
        return Batch(pick(s.ids, r.ids, self.encoder.cfg.pad_id), pick(s.mask, r.mask, False), labels, s.index), real

    def predict(self, pair):
        if not self.mixup_inference:  # the ablation: the target alone through the plain encoder
            return self.head(self.encoder(pair.tgt.ids, pair.tgt.mask), pair.tgt.mask)
        h_s, h_t, _ = self.encode(pair.src, pair.tgt)
        p_t = self.head(h_t, pair.tgt.mask)
        if self.family != 'classification':
            return p_t
        return (p_t + self.head(h_s, pair.src.mask)) / 2  # both sides: the mean of the logits, as the released code

    def representation(self, h, mask):
        """r of Eq. 7, as the released code takes it: <s> for classification, otherwise the mean over
        the real tokens between <s> and the last </s>."""
        if self.family == 'classification':
            return h[:, 0]
        inner = mask.clone()
        inner[:, 0] = False
        inner[torch.arange(mask.size(0), device=mask.device), mask.sum(1) - 1] = False  # no host copy, no sync
        return mean_pool(h, inner)

    def loss(self, pair):
        src, real = self.scheduled_source(pair)
        h_s, h_t, lam = self.encode(src, pair.tgt)
        p_s, p_t = self.head(h_s, src.mask), self.head(h_t, pair.tgt.mask)
        loss_s = per_example_loss(self.family, p_s, src.labels)
        if self.family == 'tagging':  # no labels on T: a source-language model's label distribution instead
            loss_t = teacher_kl(self.family, self.p_teacher, pair.tgt, p_t)
        else:
            loss_t = per_example_loss(self.family, p_t, pair.tgt.labels)
        task = self.alpha * loss_s + (1 - self.alpha) * loss_t  # Eq. 8
        if self.family != 'classification':  # a round trip's labels may not fit it, so T's loss alone
            task = torch.where(real, task, loss_t)
        mse = F.mse_loss(self.representation(h_s, src.mask), self.representation(h_t, pair.tgt.mask),
                         reduction='none').float().mean(-1)
        loss = task + mse * self.mse  # Eq. 7's representation consistency
        if self.family == 'classification' and self.kl:  # Eq. 7's prediction consistency, KL(p_S || p_T)
            loss = loss + kl_per_example(self.family, p_s.float().softmax(-1), p_t)
        return loss.mean(), {'loss': loss.mean().detach(), 'lambda': lam.mean().detach(), 'p_star': self.p_star(),
                             'real_source': real.float().mean(), 'mse': mse.mean().detach()}

    # memory hooks (see Method): what the plan's estimate counts
    def passes(self, rows, lengths):
        """The mixup layer counts as a block on each side, plus the inputs and outputs of its cross-attention and the
        scores of T's queries on S, kept with their softmax and dropout for Eq. 3, and twice over for Eq. 5."""
        s, t = max(lengths[0], lengths[-1]), lengths[1]  # scheduled sampling pads the source and its round trip alike
        L, l, cfg = self.encoder.cfg.n_layer, self.layer, self.encoder.cfg
        sides = [Pass(rows, n, l - 1) for n in (s, t)] + [Pass(rows, n, L - l + 1, embedded=False) for n in (s, t)]
        return sides, rows * 4 * (cfg.dim * (4 * t + 2 * s) + SCORES_KEPT * cfg.n_head * t * s)


# ----------------------------------------------------------------------------------------
# VECO (Luo et al., 2020): pre-training of variable blocks (Section 2.2), and the encoder they assemble into
# for understanding (Section 2.3).

def bert_mask(ids, share, mask_id, first_piece=4):
    """BERT's masking. Each piece (ids >= first_piece, so not <s>, <pad>, </s> or <unk>) is chosen with probability
    `share` (a float, or (B, 1) for a share per row). A chosen piece becomes <mask> (80%), a random piece (10%) or
    stays itself (10%). -> (the masked ids, the targets: the original id where chosen, IGNORE elsewhere)."""
    chosen = (torch.rand(ids.shape, device=ids.device) < share) & ids.ge(first_piece)
    action = torch.rand(ids.shape, device=ids.device)
    random_piece = torch.randint(first_piece, mask_id, ids.shape, device=ids.device)
    masked = torch.where(chosen & (action < 0.8), mask_id, ids)
    masked = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_piece, masked)
    return masked, torch.where(chosen, ids, IGNORE)


MLM_KEPT = 4  # (dim,) tensors the MLM head keeps per masked token: its input and the outputs of dense, GELU, LayerNorm


def mlm_loss(mlm, h, predicted):
    """-log P(original | masked) averaged over the chosen tokens (0 when none is). The head runs on the chosen
    positions only (predicted, a Predicted), because the projection onto the vocabulary is the costly part."""
    logits = mlm(h.flatten(0, 1)[predicted.at]).float()
    return F.cross_entropy(logits, predicted.targets, reduction='sum') / max(len(predicted.targets), 1)


@dataclass
class Predicted:
    """The tokens that an MLM term predicts, found on the host: their positions in the flattened (B * T) states (at)
    and the original ids there (targets). The device then indexes with them and never has to count them."""
    at: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, targets):
        flat = targets.flatten()
        at = flat.ne(IGNORE).nonzero().squeeze(1)
        return cls(at, flat[at])

    def to(self, device):
        return Predicted(data.moved(self.at, device), data.moved(self.targets, device))


@dataclass
class Masked:
    """A pre-training micro-batch as VecoPretrain's step reads it, made on the host (VecoPretrain.host). It holds x^
    and y^ with their attention masks (None when no row is padded), the tokens each term predicts, and TLM's rows, the
    parallel pairs joined (None when there is no parallel pair). The step then never asks the device for a size."""
    x: torch.Tensor
    x_keys: torch.Tensor
    x_predicted: Predicted
    y: torch.Tensor
    y_keys: torch.Tensor
    y_predicted: Predicted
    tlm: tuple = None  # (ids, mask, Predicted)

    @classmethod
    def of(cls, x, x_mask, x_bar, y, y_mask, y_bar, parallel):
        """From the masked ids, their masks (None when unpadded), their targets and the parallel rows (bool, (B,))."""
        rows, tlm = parallel.nonzero().squeeze(1), None
        if len(rows):  # TLM (XLM): the pair as one sequence
            real = lambda ids, mask: torch.ones_like(ids, dtype=torch.bool) if mask is None else mask
            ids, mask, order = concat_pairs(x[rows], real(x, x_mask)[rows], y[rows], real(y, y_mask)[rows])
            tlm = ids, mask, Predicted.of(torch.cat([x_bar[rows], y_bar[rows]], 1).gather(1, order))
        return cls(x, x_mask, Predicted.of(x_bar), y, y_mask, Predicted.of(y_bar), tlm)

    def to(self, device):
        move = lambda t: None if t is None else t.to(device) if isinstance(t, Predicted) else data.moved(t, device)
        fields = self.x, self.x_keys, self.x_predicted, self.y, self.y_keys, self.y_predicted
        return Masked(*(move(t) for t in fields), self.tlm and tuple(move(t) for t in self.tlm))


def concat_pairs(a, a_mask, b, b_mask, eos=2):
    """Rows <s> a </s></s> b </s> from the padded rows <s> a </s> and <s> b </s>, in XLM-R's pair format (b's <s>
    becomes </s>), with the real tokens of [a; b] moved left in order -> (ids, mask, the position in [a; b] that
    each column came from, so that targets can be moved alike)."""
    b = torch.cat([torch.full_like(b[:, :1], eos), b[:, 1:]], 1)
    mask = torch.cat([a_mask, b_mask], 1)
    order = torch.argsort((~mask).int(), dim=1, stable=True)[:, :int(mask.sum(1).max())]
    return torch.cat([a, b], 1).gather(1, order), mask.gather(1, order), order


IN_TOKENS = (Option('max_tokens', int, 'pre-training and translation: batches in tokens (fairseq\'s --max-tokens): '
                     'each process\'s micro-batch holds at most this many, padding included (a translation pair counts '
                     'its longer side, a pre-training pair both), processes x --grad_accum of them a step, in place '
                     'of the batch sizes', AT_LEAST_1),)


class VecoPretrain(Method):
    """VECO pre-training (Section 2.2). A pair (x, y) is two adjacent monolingual segments, or a sentence and its
    translation (src.labels 1). BERT's masking turns it into (x^, y^). IS-MLM (Eq. 4-5) runs x^ through
    self-attention and FFN alone, and its last states X^N predict x's masked tokens. CS-MLM (Eq. 6-7) runs y^ with a
    causal mask, each layer's cross-attention reading X^N (detached), and Y^N predicts y's masked tokens. Eq. 8 adds
    both directions. On parallel pairs, TLM adds the masked concatenation x^ y^ (Section 3). One MLM head serves all
    the terms. Without CS-MLM (cs_mlm=False, no cross-attention), it is Table 2's XLM: MLM and TLM."""
    NAME, TASKS, paired, family, select, EXPORT = 'veco', ('pretrain',), True, 'pretrain', 'loss', 'mlm'
    NOT_ON_BERT = 'VECO is a model of its own, pre-trained (and released) in XLM-R\'s layout and vocabulary'
    MASKED_SHARE = {'mono': 0.15, 'para': 0.25}  # the masked share of a monolingual / bilingual pair (Table 5)
    # the demo takes about a minute on a laptop CPU, with segments of a sentence or two
    DEMO = {'steps': 2000, 'eval_every': 500, 'max_len': 32, 'lr': 3e-3}
    OPTIONS = IN_TOKENS + (
        Option('cross_only_steps', int, 'phase 1: the first steps, which train only the cross-attention, the rest '
               'frozen; phase 2 trains everything for the rest of --steps; each phase warms up (default from --init: '
               'the --warmup share of --steps; 0 from scratch)', NON_NEGATIVE),
        Option('para_batch_size', int, 'pairs of a bilingual step; --batch_size is the monolingual one (default 4 x '
               '--batch_size, Table 5\'s 1024 / 4096; the demo: 1 x)', AT_LEAST_1),
        Option('no_cs_mlm', bool, 'CS-MLM off, no cross-attention: MLM and TLM, Table 2\'s XLM'),
        Option('mono_only', bool, 'the monolingual text alone (Table 2\'s first rows)'),
        Option('lang_alpha', float, 'languages drawn with p_i ~ n_i^alpha over their pairs n_i (Section 4: 0.5, as '
               'XLM; XLM-R took 0.3)', POSITIVE, default=0.5))
    # Table 5: 3e-4 and Adam's beta2 0.999 for the small model, 2e-4 and 0.98 for the large one (released)
    RUN = {'pretrain': {'lr': 3e-4, 'steps': 240000, 'eval_every': 2000, 'warmup': 0.05, 'batch_size': 1024,
                        'max_len': 512, 'weight_decay': 0.01, 'adam_eps': 1e-6, 'precision': 'fp16'}}

    @classmethod
    def released(cls, args):
        return {**cls.RUN['pretrain'], **({'lr': 2e-4, 'adam_beta2': 0.98} if args.model == 'large' else {})}

    @classmethod
    def configure(cls, args, demo=None):
        if args.epochs:
            raise ValueError('pre-training is counted in --steps (Table 5: 240000), not --epochs: give --steps')
        super().configure(args, demo)
        if args.cross_only_steps is None:  # phase 1 trains the new cross-attention, which XLM does not have
            args.cross_only_steps = int(args.warmup * args.steps) if args.init and not args.no_cs_mlm else 0
        if args.no_cs_mlm and args.cross_only_steps:
            raise ValueError('--cross_only_steps trains the cross-attention alone, which --no_cs_mlm leaves out: '
                             'drop one')
        args.para_batch_size = args.para_batch_size or (1 if demo else 4) * args.batch_size
        if args.cross_only_steps >= args.steps:
            raise ValueError(f'--cross_only_steps {args.cross_only_steps} leaves no step of phase 2 in --steps '
                             f'{args.steps}: lower it or raise --steps')

    @classmethod
    def reads(cls, args):
        return [(p, 'pre-training text', True) for paths in data.pretrain_files(args.data_dir, args.mono_only).values()
                for p in paths]

    @classmethod
    def procedure(cls, run):
        """Pre-training on --data_dir/pretrain, with the held-out losses every --eval_every steps. Its best.pt holds
        the encoder with its cross-attention and the MLM head. Fine-tuning (Veco) reads it with --init and leaves the
        cross-attention out (Section 2.3)."""
        args = run.args
        encoder, mlm = run.pretrained(cross=not args.no_cs_mlm)[:2]
        if args.init and mlm is None:
            run.fail(f'--init {args.init} has no MLM head: pre-training continues XLM-R with its MLM head (a converted '
                     'XLM-R checkpoint, python layers.py convert)')
        torch.manual_seed(args.seed)
        method = cls(encoder, run.tok.mask, mlm, args.cross_only_steps, cs_mlm=not args.no_cs_mlm).to(run.device)
        items, groups, used = data.pretraining_set(run.tok, args.data_dir, args.max_len, args.mono_only,
                                                   not args.no_cache)
        run.say(data.pretraining_table(used))
        groups, held = data.split_held_out(groups)
        if not groups:
            run.fail(f'no pre-training pairs in {args.data_dir}/pretrain: the files hold no text')
        held = [items[i] for i in held]
        validate = lambda: method.held_out_losses(held, args.eval_batch_size, args.seed, run.device, args.precision)
        steps = lambda epoch: min(args.eval_every, args.steps - epoch * args.eval_every)  # an 'epoch': eval_every steps
        sizes = {g: args.batch_size if g.startswith('mono:') else args.para_batch_size for g in groups}
        if args.max_tokens:
            sizes = data.token_sizes(lambda index: data.item_lengths(items, index), groups, args.max_tokens, run.chunks)
        batches = lambda epoch: data.pretrain_batches(groups, sizes, steps(epoch), args.seed * 1000 + epoch,
                                                      args.lang_alpha)
        run.fit(method, items, validate, batches)
        run.load_best(method)
        losses = validate()
        results = {'task': 'pretrain', 'method': 'veco', 'selected_by': selection(method.select, losses).rule,
                   'held_out': losses, 'data': used}
        run.folder.write_results(results, ev.held_out_table(losses),
                          f'pre-trained model in {run.out}/best.pt: fine-tune it with --init {run.out}/best.pt')

    def __init__(self, encoder, mask_id, mlm=None, cross_only_steps=0, cs_mlm=True):
        super().__init__(encoder, 'pretrain')
        if cs_mlm and not encoder.has_cross:
            raise ValueError('VECO pre-training needs an encoder with cross-attention '
                             '(layers.Encoder(cfg, cross=True))')
        self.mask_id, self.cross_only_steps, self.cs_mlm = mask_id, cross_only_steps, cs_mlm
        self.mlm = mlm if mlm is not None else MLMHead(encoder.cfg, encoder.tok.weight)

    def inner(self, ids, mask):
        """Eq. 4: X^(i) = FFN(SelfAttention(X^(i-1))), bidirectional, no cross-attention -> X^N."""
        return self.encoder.run(self.encoder.embed(ids), mask)

    def crossed(self, ids, mask, memory, memory_mask):
        """Eq. 6: S^(i) = SelfAttention(Y^(i-1)) with a causal mask, Z^(i) = CrossAttention(S^(i),
        X^N), Y^(i) = FFN(Z^(i)) -> Y^N. X^N is detached, so the two objectives train in isolation."""
        return self.encoder.run(self.encoder.embed(ids), mask, memory=memory.detach(), memory_mask=memory_mask,
                                causal=True)

    def cross_only(self):
        return self.step < self.cross_only_steps

    def terms(self, m):
        """The loss terms of a Masked batch m, as {name: the mean over the chosen tokens}: Eq. 8's four terms and, on
        the parallel rows, TLM."""
        with torch.no_grad() if self.cross_only() else nullcontext():  # phase 1 trains CS-MLM alone
            X, Y = self.inner(m.x, m.x_keys), self.inner(m.y, m.y_keys)
        terms = {'is_x': mlm_loss(self.mlm, X, m.x_predicted), 'is_y': mlm_loss(self.mlm, Y, m.y_predicted)}  # Eq. 5
        if self.cs_mlm:
            terms['cs_xy'] = mlm_loss(self.mlm, self.crossed(m.y, m.y_keys, X, m.x_keys), m.y_predicted)  # Eq. 7: y|x
            terms['cs_yx'] = mlm_loss(self.mlm, self.crossed(m.x, m.x_keys, Y, m.y_keys), m.x_predicted)  # and x|y
        if m.tlm and not (self.training and self.cross_only()):  # TLM (XLM): the pair as one sequence
            ids, mask, predicted = m.tlm
            terms['tlm'] = mlm_loss(self.mlm, self.inner(ids, mask), predicted)
        return terms

    def masked(self, batch, parallel):
        share = torch.where(parallel, self.MASKED_SHARE['para'], self.MASKED_SHARE['mono'])
        share = share.view(-1, 1).to(batch.ids.device)
        return bert_mask(batch.ids, share, self.mask_id)

    def host(self, pair):
        """The pair masked on the host (BERT's masking at Table 5's shares), before it goes to the device."""
        parallel = pair.src.labels.bool()
        (x, x_bar), (y, y_bar) = self.masked(pair.src, parallel), self.masked(pair.tgt, parallel)
        return Masked.of(x, pair.src.keys, x_bar, y, pair.tgt.keys, y_bar, parallel)

    def loss(self, masked):
        terms = self.terms(masked)
        counted = ('cs_xy', 'cs_yx') if self.cross_only() else tuple(terms)
        loss = sum(terms[name] for name in counted)
        return loss, {'loss': loss.detach(), **{name: t.detach() for name, t in terms.items()}}

    def before_update(self):
        """In the first phase, the optimiser leaves everything but the new cross-attention alone (the paper freezes
        XLM-R and trains the cross-attention first). Their gradients are dropped, and AdamW skips a parameter without
        one."""
        for name, p in self.named_parameters() if self.cross_only() else ():
            if not is_cross('enc.' + name.removeprefix('encoder.')):
                p.grad = None

    def stepped(self, step):
        """Count the step -> an event for the log when the first phase ends at this step, else None."""
        self.step = step
        return 'every parameter trains from here on' if step == self.cross_only_steps else None

    def schedule(self, args, total):
        """Each phase has its own warm-up and decay (Table 5's shape, --warmup of the phase's steps). In phase 2,
        XLM-R's weights start their Adam moments afresh, so they warm up, while the cross-attention keeps the
        moments of phase 1 (one optimiser all along)."""
        P = self.cross_only_steps
        first = warmup_then_decay(int(args.warmup * P), 0, P)
        second = warmup_then_decay(int(args.warmup * (total - P)), P, total)
        return lambda step: first(step) if step < P else second(step)

    @torch.no_grad()
    def held_out_losses(self, items, batch_size, seed, device, precision):
        """The MLM losses of the held-out pairs per kind (mono, para), with masks fixed by seed. CS-MLM runs once more
        with each row reading another row's X^N (cs_shuffled): when that is far above cs_xy, the cross-attention uses
        its memory. score is minus the summed loss, so higher is better."""
        self.eval()
        sums, counts = {}, {}
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for kind in ('mono', 'para'):
                part = [item for item in items if item[0].label == (kind == 'para')]
                for index in data.length_batches(data.item_lengths(part)[:, 0], batch_size):
                    pair = data.collate_pairs([part[i][0] for i in index], [part[i][1] for i in index])
                    for name, t in self.held_out_terms(self.host(pair).to(device), precision).items():  # t is a mean
                        total, count = sums.setdefault(kind, {}), counts.setdefault(kind, {})
                        total[name] = total.get(name, 0.0) + t.item() * len(index)
                        count[name] = count.get(name, 0) + len(index)
        out = {kind: {n: v / counts[kind][n] for n, v in row.items()} for kind, row in sums.items()}
        for row in out.values():
            row['score'] = -sum(v for n, v in row.items() if n != 'cs_shuffled')
        return out

    def held_out_terms(self, m, precision):
        """The loss terms of a held-out Masked batch, and CS-MLM once more with each row reading another row's X^N."""
        with autocast(m.x.device, precision):
            terms = self.terms(m)
            if len(m.x) > 1 and self.cs_mlm:
                X, x_mask = self.inner(m.x, m.x_keys), m.x_keys
                shuffled = self.crossed(m.y, m.y_keys, X.roll(1, 0), None if x_mask is None else x_mask.roll(1, 0))
                terms['cs_shuffled'] = mlm_loss(self.mlm, shuffled, m.y_predicted)
        return terms

    # memory hooks (see Method): what the plan's estimate counts
    @classmethod
    def sketch(cls, args, cfg):
        return cls(Encoder(cfg, cross=not args.no_cs_mlm), cfg.vocab_size - 1, cs_mlm=not args.no_cs_mlm)

    @classmethod
    def micro_batches(cls, args, parts, max_tokens=None):
        """A monolingual micro-batch of pairs of --max_len, and a bilingual one of data.PARA_LEN. With max_tokens, as
        many pairs as fit in it, counting both sides (data.token_sizes)."""
        mono, para = args.max_len, min(args.max_len, data.PARA_LEN)
        rows = lambda size, n: max_tokens // (2 * n) if max_tokens else math.ceil(size / parts)
        shapes = [(rows(args.batch_size, mono), (mono, mono)), (rows(args.para_batch_size, para), (para, para))]
        return shapes[:1] if args.mono_only else shapes

    def passes(self, rows, lengths):
        """Pairs short enough to be bilingual count as bilingual, TLM's pass too (the most they keep). The MLM head runs
        on the masked share of each term's tokens: its hidden layer and the log-softmax over the vocabulary."""
        (x, y), cfg = lengths[:2], self.encoder.cfg
        passes = [Pass(rows, n, cfg.n_layer) for n in (x, y, x + y)[:2 + (max(x, y) <= data.PARA_LEN)]]
        if self.cs_mlm:
            passes += [Pass(rows, y, cfg.n_layer, memory=x), Pass(rows, x, cfg.n_layer, memory=y)]
        masked = self.MASKED_SHARE['para'] * rows * (x + y) * (3 if self.cs_mlm else 2)
        return passes, int(masked * 4 * (MLM_KEPT * cfg.dim + cfg.vocab_size))


class Veco(Baseline):
    """VECO for understanding (Section 2.3). The pre-trained self-attention and FFN modules make the encoder, and the
    cross-attention is thrown away (Run.pretrained loads --init without it). The encoder is fine-tuned as XLM-R is:
    on English (cross-lingual transfer) or, with --translate_train_all, on English and its translations (VecoAll)."""
    NAME, NOT_ON_BERT = 'veco', VecoPretrain.NOT_ON_BERT
    select = 'en'  # the released run_classify.py keeps the best English dev checkpoint
    # train_xnli.sh keeps the best English dev score, checked every 500 steps. The tasks it did not script take
    # XTREME's scripts, whose codebase the paper fine-tuned on (Section 4.1). train_squad.sh (XQuAD's; MLQA and
    # TyDiQA train on SQuAD's English too) checks SQuAD's dev score every 200 steps.
    RUN = {'xnli': {'lr': 2e-5, 'epochs': 2, 'batch_size': 64, 'eval_steps': 500, 'seed': 42},
           **{task: Baseline.RUN[task] for task in ('pawsx', 'udpos', 'panx')},
           **{task: {'lr': 2e-5, 'epochs': 2, 'batch_size': 16, 'weight_decay': 1e-4, 'warmup_steps': 500,
                     'doc_stride': 64, 'eval_steps': 200, 'seed': 42} for task in ('xquad', 'mlqa', 'tydiqa')}}
    GRID = {'lr': (1e-5, 2e-5, 3e-5), 'epochs': (3, 5, 10), 'batch_size': (16, 32, 64)}  # Table 6's search
    OPTIONS = Baseline.OPTIONS + (
        Option('translate_train_all', bool, 'fine-tune on English and its translations into every target language '
               '(default: English alone)'),
        Option('search', str, 'Table 6\'s search: a run per point of a grid, the best average dev score kept; '
               'NAME=V,V,... replaces a row of the default grid (lr 1e-5,2e-5,3e-5 epochs 3,5,10 batch_size 16,32,64; '
               'translate-train-all lr 3e-6,5e-6,1e-5)', nargs='*'))

    @classmethod
    def retrieval_layer(cls, task, n_layer):  # its run_tatoeba.sh: after layer 19 of 24, the mean over every token
        return max(1, round(n_layer * 19 / 24))

    @classmethod
    def variants(cls):
        return VecoAll, VecoPretrain, VecoTranslate

    @classmethod
    def configure(cls, args, demo=None):
        super().configure(args, demo)
        if args.search is not None and TASKS[args.task].family == 'retrieval':
            raise ValueError(f'--search fine-tunes, and {args.task} trains nothing: drop --search')
        search_grid(cls.GRID, args.search)  # reports a bad --search before anything runs

    @classmethod
    def stages(cls, args):
        """With --search, a run per point of the grid, each in --out/<point>."""
        grid = search_grid(cls.GRID, args.search) if args.search is not None else {}
        points = list(itertools.product(*grid.values())) if grid else []
        return {'-'.join(f'{k}{v:g}' for k, v in zip(grid, p)): {**dict(zip(grid, p)), 'search': None,
                                                                  'stage': f'grid point {i + 1} of {len(points)}'}
                for i, p in enumerate(points)}

    @classmethod
    def procedure(cls, run):
        """The baseline's fine-tuning. With --search, Table 6's search: a run per point of the grid (stages). The
        point with the best average dev score (the paper's rule, Appendix A) is this run's result. It is evaluated
        again here, and the table lists every point."""
        if run.args.search is None:
            return super().procedure(run)
        found = {}
        for name in cls.stages(run.args):
            run.stage(name)
            found[name] = run.results_of(name)
        best = max(found, key=lambda name: found[name]['dev']['avg'])
        method = run.restore(run.path(best))
        dev, _, test = run.scored(method)
        run.finish(dev, test,
                   f'the best average dev score of the grid: {best}',
                   {name: {'dev': r['dev'], 'test': r['test']} for name, r in found.items()})

    @classmethod
    def resolve(cls, args):
        own_tasks = {'pretrain': VecoPretrain, 'translate': VecoTranslate}
        return own_tasks.get(args.task, VecoAll if args.translate_train_all else cls)


class VecoAll(Veco):
    """VECO fine-tuned on English and its translations (Table 2's translate-train-all)."""
    TASKS, trains_on = LABELLED_TRANSLATIONS, 'every_lang'  # POS and NER: English alone (VECO, Section 4.1)
    RUN = {task: {**Veco.RUN.get(task, {}), 'lr': 5e-6} for task in TASKS}  # the middle of Table 6's [3e-6, 1e-5]
    GRID = {'lr': (3e-6, 5e-6, 1e-5)}  # Table 6: the learning rate alone

    @classmethod
    def folder(cls, args):
        return super().folder(args) + ['translate-train-all']


# ----------------------------------------------------------------------------------------
# VECO for generation (Section 2.3, Tables 3-4): the same blocks assembled into an
# encoder-decoder, fine-tuned on translation as the released fairseq scripts do.

def assemble(pre, n, init='last', new_tokens=0, dropout=0.1, attn_dropout=0.0, embed_scale=None, released=None):
    """-> (encoder, decoder) from a pre-trained encoder with cross-attention. The encoder is every layer's
    self-attention and FFN. The decoder's n layers (causal self-attention, cross-attention on the encoder's output,
    FFN) copy the last n pre-trained layers ('last', the paper's choice), the first n ('first'), or none ('random',
    a new decoder); these are Table 4's rows. When a released decoder is given, they copy its layers (VECO's NLG
    model: its --keep-decoder-layers, the last n). One token embedding, grown by `new_tokens` new rows (the language
    tokens), serves both sides and the output layer. Token embeddings are scaled by embed_scale, by default the
    scale that the pre-trained model was trained with (XLM-R and the pre-training here: 1; VECO's released NLG
    model: sqrt(dim))."""
    source = pre if released is None else released  # where the decoder's layers come from
    L = source.cfg.n_layer
    if not 1 <= n <= L:
        raise ValueError(f'--dec_layers {n} is not a layer count of the {L}-layer model: choose 1 to {L}')
    cfg = replace(pre.cfg, vocab_size=pre.cfg.vocab_size + new_tokens, dropout=dropout, attn_dropout=attn_dropout,
                  embed_scale=pre.cfg.embed_scale if embed_scale is None else embed_scale)
    encoder, decoder = Encoder(cfg), Encoder(replace(cfg, n_layer=n), cross=True)
    weights = {k: v for k, v in pre.state_dict().items() if not is_cross('enc.' + k)}
    with torch.no_grad():
        encoder.tok.weight[:pre.cfg.vocab_size] = weights.pop('tok.weight')  # the new rows keep their N(0, 0.02)
    encoder.load_state_dict(weights, strict=False)
    decoder.tok = encoder.tok  # share_all_embeddings
    if init != 'random':
        decoder.pos.load_state_dict(source.pos.state_dict())
        decoder.ln.load_state_dict(source.ln.state_dict())
        for i, j in enumerate(range(L - n, L) if init == 'last' else range(n)):
            decoder.blocks[i].load_state_dict(source.blocks[j].state_dict())
    return encoder, decoder


def label_smoothed_loss(logits, targets, eps):
    """fairseq's label-smoothed cross-entropy per target token (B, T), 0 where the target is IGNORE:
    (1 - eps) (-log p(y)) + eps / V sum_v (-log p(v)). It also returns -log p(y) alone."""
    logp = logits.float().log_softmax(-1)
    real = targets.ne(IGNORE)
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return ((1 - eps) * nll - eps * logp.mean(-1)) * real, nll * real


# The valid loss makes at most this many logits over the vocabulary at a time (1 GiB in fp32). A batch of 64
# pairs of 251 tokens would make 64 x 251 x 250k of them, 16 GiB, and as much again for their log-softmax.
VALID_LOGITS = 2 ** 28


class VecoTranslate(Method):
    """A VECO encoder-decoder (assemble) fine-tuned on translation with label-smoothed cross-entropy. As in the
    released code, the source is `x </s> [src]`, and the decoder reads `[tgt] y` to predict `y </s>`. The released
    code also appends [tgt] after </s> and stops at it; we stop at </s>. The output layer is the token embedding,
    without a bias. generate() is fairseq's beam search with its length penalty."""
    NAME, TASKS, paired, family, select, pretrained_start = 'veco', ('translate',), True, 'translation', 'loss', True
    EXPORT, NOT_ON_BERT = 'VECO\'s translation model is an encoder-decoder', VecoPretrain.NOT_ON_BERT
    # finetune-wmt14en2{de,fr}.sh: 1e-4 (the paper: 1e-4 / 2e-4) for 100k updates, 16k of them warm-up, then a
    # linear decay, in fp16, with weight decay on every parameter (DECAY_ALL). A checkpoint every 5k updates, the last
    # 10 averaged (inference-wmt14en2{de,fr}.sh). Training pairs of at most 250 pieces a side
    # (prepare-wmt14en2{de,fr}.sh). Dropout 0.1 and attention dropout 0 (veco_large).
    RUN = {'translate': {'lr': 1e-4, 'steps': 100000, 'eval_every': 5000, 'warmup': 0.16, 'weight_decay': 0.01,
                         'clip': 0.1, 'label_smoothing': 0.2, 'average_last': 10, 'max_len': 250, 'batch_size': 2048,
                         'dropout': 0.1, 'attn_dropout': 0.0, 'precision': 'fp16', 'seed': 222}}
    DECAY_ALL = True
    # A batch holds 64k tokens for en-de (4096 tokens x 2 accumulations x 8 GPUs) and 256k for en-fr: in
    # sentences of about 32 pieces, 2048 and 8192.
    PAIRS = {'en-de': {'dropout': 0.3, 'attn_dropout': 0.1}, 'en-fr': {'batch_size': 8192, 'length_ratio': 1.5}}
    # the demo: the tiny model's 2 layers make the decoder
    DEMO = {'steps': 500, 'eval_every': 125, 'lr': 1e-3, 'batch_size': 32, 'warmup': 0.1, 'dropout': 0.1,
            'attn_dropout': 0.0, 'label_smoothing': 0.1, 'average_last': 2, 'max_len': 64}
    OPTIONS = IN_TOKENS + (
        Option('src', str, 'source language (default en; the layout of docs/veco.md)', changes='scores'),
        Option('tgt', str, 'target language (default de)', changes='scores'),
        Option('dec_layers', int, 'decoder layers (default 6, at most the model\'s depth)', AT_LEAST_1),
        Option('length_ratio', help='skip training and valid pairs of which one side has more than this many times '
               'the other\'s pieces (en-fr\'s prepare-wmt14en2fr.sh: 1.5; en-de: none)', valid=POSITIVE),
        Option('dec_init', str, 'the decoder copies the last (default) or the first pre-trained layers, or is new '
               '(Table 4)', choices=('last', 'first', 'random'), default='last'),
        Option('label_smoothing', help='label smoothing (default 0.2)', valid=SHARE),
        Option('beam', int, 'beam size (default 5)', AT_LEAST_1, default=5, changes='scores'),
        Option('decode_bf16', bool, 'decode in bf16 autocast (default fp32, as the released inference script)',
               changes='scores'),
        Option('lenpen', help='length penalty, score / length ** lenpen (default 1)', valid=NON_NEGATIVE, default=1.0,
               changes='scores'),
        Option('average_last', int, 'decode with the mean of the last N checkpoints (one every --eval_every steps; '
               'default 10; 0: best.pt, the lowest valid loss)', NON_NEGATIVE, changes='scores'),
        Option('curve', bool, 'keep every checkpoint and decode the test set with each: BLEU by step in results.json '
               '(VECO\'s Figure 4, eval.py --analyse bleu-curve)'))

    @classmethod
    def configure(cls, args, demo=None):
        args.src, args.tgt = args.src or 'en', args.tgt or 'de'  # set first, as the pair chooses some defaults (PAIRS)
        if args.src == args.tgt:
            raise ValueError(f'--src and --tgt are both {args.src}: translation needs two languages')
        if args.epochs:
            raise ValueError('translation is counted in --steps (the scripts\' 100000), not --epochs: give --steps')
        super().configure(args, demo)
        args.dec_layers = args.dec_layers or min(6, CONFIGS[args.model].n_layer)

    @classmethod
    def released(cls, args):
        return {**cls.RUN['translate'], **cls.PAIRS.get(f'{args.src}-{args.tgt}', {})}

    @classmethod
    def reads(cls, args):
        return [(p, 'parallel text', True) for split in ('train', 'valid', 'test')
                for p in data.parallel_files(args.data_dir, args.src, args.tgt, split)]

    @classmethod
    def folder(cls, args):
        return [f'translate-{args.src}-{args.tgt}', 'veco']

    @classmethod
    def procedure(cls, run):
        """Tables 3-4: the pre-trained blocks are assembled into an encoder-decoder and fine-tuned on --src -> --tgt.
        Every --eval_every steps, the run computes the valid loss (best.pt has the lowest) and keeps a checkpoint.
        Then beam search decodes the test set, one line per source, with the mean of the last --average_last
        checkpoints (fairseq's average_checkpoints), and BLEU scores the translations."""
        args, tok = run.args, run.tok
        method, lang_ids, scale = cls.assembled(run)
        read = lambda split: data.translation_items(tok, args.data_dir, args.src, args.tgt, split, lang_ids,
                                                    args.max_len, args.length_ratio)
        items, valid, test = read('train'), read('valid'), read('test')
        for name, part in (('training', items), ('valid', valid)):
            if not part:
                run.fail(f'no {name} pairs for {args.src}-{args.tgt} in {args.data_dir}/translation: '
                         'the files hold no text')
        validate = lambda: {'valid': method.valid_losses(valid, args.eval_batch_size, run.device, args.precision)}
        run.fit(method, items, validate, keep_last=KEEP_ALL if args.curve else args.average_last)
        refs = list(data.read_lines(data.parallel_files(args.data_dir, args.src, args.tgt, 'test')[1]))
        curve = learning_curve(run, cls, method, test, refs) if args.curve else None
        decoded_with = average_last(run, cls, method, args.average_last)
        hyps = cls.decoded(run, method, test)
        scores = ev.translation_scores(hyps, refs)
        decoded_in = 'bf16' if args.decode_bf16 else 'fp32'
        results = {'task': 'translate', 'method': 'veco', 'pair': f'{args.src}-{args.tgt}',
                   'decoded_with': decoded_with, 'decoded_in': decoded_in, 'embed_scale': scale,
                   'valid': validate()['valid'], 'test': scores, **({'curve': curve} if curve else {})}
        path = f'predictions/test.{args.src}-{args.tgt}.{args.tgt}'
        table = ev.translation_table(f'test {args.src}-{args.tgt} ({len(hyps)} sentences, beam {args.beam}, '
                                     f'{decoded_with})', scores)
        run.folder.write_results(results, table, f'translations in {run.out}/{path}',
                                 {path: ''.join(h + '\n' for h in hyps)})

    @classmethod
    def assembled(cls, run):
        """The encoder-decoder (assemble) from --init, or a new one -> (the method, the ids of [src] and [tgt], the
        scale of the token embeddings)."""
        args, tok = run.args, run.tok
        loaded = run.pretrained(cross=True, decoder=True)  # --init's cross-attention, or new
        pre, released = loaded.encoder, loaded.decoder
        if args.init and released is None and loaded.new_cross:
            run.say(f'note: --init {args.init} is an encoder alone, without cross-attention or decoder (XLM-R, or '
                    'VECO\'s released NLU model): the cross-attention starts from random weights')
        lang_ids = tok.language_ids(args.src, args.tgt)  # [src], [tgt]: the --dict's lines, or new embedding rows
        new_rows = sum(i >= tok.vocab_size for i in lang_ids)
        scale = pre.cfg.embed_scale if args.init else math.sqrt(pre.cfg.dim)  # a new model: fairseq's default
        why = 'the scale --init was trained with' if args.init else 'a new model, fairseq\'s sqrt(dim)'
        run.say(f'token embeddings scaled by {scale:g}: {why}')
        torch.manual_seed(args.seed)
        try:
            encoder, decoder = assemble(pre, args.dec_layers, args.dec_init, new_rows, args.dropout, args.attn_dropout,
                                        scale, released)
        except ValueError as e:
            run.fail(str(e))
        method = cls(run.ready(encoder), run.ready(decoder), lang_ids[1], args.label_smoothing).to(run.device)
        return method, lang_ids, scale

    @classmethod
    def decoded(cls, run, method, test):
        """The translations of the test sources, shared out over the processes (run.sharded)."""
        args = run.args
        method.eval()

        def decode(index):  # in fp32 as in the released inference script (TF32 off), unless --decode_bf16
            with autocast(run.device, 'bf16') if args.decode_bf16 else exact_fp32(run.device):
                batch = data.collate([test[i][0] for i in index]).to(run.device)
                return [(torch.tensor(h, dtype=torch.long),) for h in method.generate(batch, args.beam, args.lenpen)]
        decoded = run.sharded(decode, data.item_lengths(test)[:, 0], 'decode')[0]
        return [run.tok.decode(ids.tolist()) for ids in decoded]

    def __init__(self, encoder, decoder, bos, eps=0.2):
        super().__init__(encoder, 'translate')
        self.decoder, self.bos, self.eps = decoder, bos, eps  # bos: the [tgt] token

    def logits(self, h):
        return F.linear(h, self.encoder.tok.weight)  # the output layer is the token embedding

    def decode(self, ids, memory, memory_mask):
        """The decoder states of the target prefixes ids (B, T). Right padding needs no mask, because
        the causal mask keeps every real position off the padding after it."""
        return self.decoder.run(self.decoder.embed(ids), None, memory=memory, memory_mask=memory_mask, causal=True)

    def token_losses(self, pair, rows=None):
        """-> (the label-smoothed loss, the nll) per target token (B, T), 0 on padding. The logits over the vocabulary
        are made for `rows` rows of the batch at a time (default: all)."""
        memory = self.encoder.run(self.encoder.embed(pair.src.ids), pair.src.keys)
        h, labels = self.decode(pair.tgt.ids, memory, pair.src.keys), pair.tgt.labels
        parts = [label_smoothed_loss(self.logits(h_), y, self.eps) for h_, y in zip(h.split(rows or len(h)),
                                                                                      labels.split(rows or len(h)))]
        return torch.cat([loss for loss, _ in parts]), torch.cat([nll for _, nll in parts])

    def loss(self, pair):
        """The mean over the batch's target tokens (fairseq normalises by the token count)."""
        loss, nll = self.token_losses(pair)
        n = pair.tgt.labels.ne(IGNORE).sum().clamp(min=1)
        per_example = loss.sum(1) * loss.size(0) / n  # its mean is the token mean
        return per_example.mean(), {'loss': per_example.mean().detach(), 'nll': (nll.sum() / n).detach()}

    @torch.no_grad()
    def valid_losses(self, items, batch_size, device, precision):
        """The label-smoothed loss and the nll per target token of items (the valid set), with score = -loss."""
        self.eval()
        loss = nll = tokens = 0.0
        for index in data.length_batches(data.item_lengths(items)[:, 0], batch_size):
            pair = data.collate_pairs([items[i][0] for i in index], [items[i][1] for i in index]).to(device)
            rows = max(1, VALID_LOGITS // (pair.tgt.ids.size(1) * self.encoder.tok.weight.size(0)))
            with autocast(device, precision):
                smoothed, plain = self.token_losses(pair, rows)
            loss, nll = loss + smoothed.sum().item(), nll + plain.sum().item()
            tokens += pair.tgt.labels.ne(IGNORE).sum().item()
        return {'loss': loss / tokens, 'nll': nll / tokens, 'ppl': math.exp(nll / tokens), 'score': -loss / tokens}

    @torch.no_grad()
    def generate(self, src, beam=5, lenpen=1.0, max_new=200, min_len=1, cache=True):
        """The best translation of each source row (a Batch): beam search from [tgt] (layers.beam_search)."""
        memory = self.encoder(src.ids, src.mask)
        return beam_search(self.decoder, memory, src.mask, self.bos, beam, lenpen, max_new, min_len, cache)

    # memory hooks (see Method): what the plan's estimate counts
    @classmethod
    def sketch(cls, args, cfg):
        return cls(*assemble(Encoder(cfg, cross=True), args.dec_layers, 'random', dropout=cfg.dropout,
                             attn_dropout=cfg.attn_dropout), bos=0)

    def passes(self, rows, lengths):
        """The encoder on the source and the decoder on the target. Per target token, over the vocabulary: the
        log-softmax that the label-smoothed loss keeps and, in backward, its gradient and the logits' gradient."""
        (s, t), cfg = lengths[:2], self.encoder.cfg
        logits = rows * t * 12 * cfg.vocab_size
        return [Pass(rows, s, cfg.n_layer), Pass(rows, t, self.decoder.cfg.n_layer, memory=s)], logits


# ----------------------------------------------------------------------------------------
# XLA (Bari et al., 2021; Algorithm 1): self-training on unlabelled target-language text. Three models warm up on
# English with Eq. 1's confidence penalty (Baseline.conf_penalty). In every XLA epoch, a frozen masked LM makes
# vicinal samples (Section 3.2), and each model labels the data and keeps what it is sure of (DISTIL, Section 3.3).
# Each model then trains on the samples that the other two keep with the same labels (AGREEMENT), drawn by Eq. 2.
# See XLA.stages and XLA.algorithm_1.

class XLA(Baseline):
    """One XLA model, fine-tuned as the zero-shot baseline is, and on pseudo-labelled samples too. Its
    procedure is Algorithm 1."""
    NAME, TASKS = 'xla', ('xnli', 'pawsx', 'panx', 'udpos', 'conll')  # the paper's: a pair's or a sentence's words kept
    pretrained_start = True  # the demo starts from its pre-trained model, whose MLM makes the vicinal samples
    select = 'en'  # the warm-up keeps the best English dev checkpoint; an XLA epoch is kept if the target dev rises
    NOT_ON_BERT = ('its vicinity model is XLM-R\'s masked LM, not mBERT\'s (the paper\'s Appendix E.2); its mBERT '
                   'rows are the warm-up alone: --method zeroshot --conf_penalty 1')
    KEEPS = 'final-models.json'
    # Table 8 (XNER: CoNLL NER, also for panx and udpos) gives the warm-up (--lr, --batch_size, --epochs) and the XLA
    # epochs (--xla_lr, --xla_batch_size). eta is the share kept per epoch, in percent; aug_share is P; delta is the
    # samples per sentence (one number) or per part of a pair (successive cross).
    TAGGING = {'lr': 3e-5, 'batch_size': 20, 'steps': 3000, 'warmup_steps': 200, 'max_len': 280, 'eval_steps': 50,
               'xla_lr': 5e-6, 'xla_batch_size': 16, 'xla_weight_decay': 0.01, 'xla_eval_steps': 50,
               'eta': [80, 100, 100], 'aug_share': 0.3, 'delta': [3], 'train_share': 1.0, 'seed': 1000}
    PAIR = {'lr': 1e-6, 'batch_size': 32, 'warmup': 0.1, 'eval_steps': 50, 'xla_lr': 1e-6, 'xla_batch_size': 32,
            'xla_weight_decay': 0.0, 'xla_eval_steps': 25, 'aug_share': 0.3, 'delta': [2, 2], 'train_share': 0.05,
            'seed': 1000}
    RUN = {'conll': TAGGING, 'panx': TAGGING, 'udpos': TAGGING, 'xnli': {**PAIR, 'epochs': 6, 'eta': [50, 80, 100]},
           'pawsx': {**PAIR, 'epochs': 10, 'xla_epochs': 6, 'eta': [80, 90, 80], 'aug_share': 0.4}}
    # the demo: the warm-up as in every demo, and the XLA epochs at a lower rate, selecting at their end, on all data
    DEMO = {'xla_lr': 1e-4, 'xla_batch_size': 32, 'xla_eval_steps': None, 'train_share': 1.0, 'train_lang': 'de',
            'seed': 1000}
    SETS = {1: ('source', 'target'), 2: ('target vicinal',),  # Algorithm 1, line 22: the sets of each epoch
            3: ('source', 'target', 'source vicinal', 'target vicinal')}
    OPTIONS = TranslateTrain.OPTIONS + (
        Option('xla_lr', help='learning rate of the XLA epochs (--lr: the warm-up\'s; Table 8)', valid=POSITIVE),
        Option('xla_batch_size', int, 'batch size of the XLA epochs (Table 8: 16, 32)', AT_LEAST_1),
        Option('xla_epochs', int, 'epochs of co-teaching after the warm-up (Algorithm 1: 3; Table 8: PAWS-X 6); 0: the '
               'three warm-ups alone, their mean and ensemble (the papers\' zero-shot rows)', NON_NEGATIVE, default=3),
        Option('xla_weight_decay', help='weight decay of the XLA epochs (Table 8: 0.01; XNLI, PAWS-X none)',
               valid=NON_NEGATIVE),
        Option('xla_eval_steps', int, 'select on the --train_lang dev score every N steps of an XLA epoch (Table 8: '
               '50; XNLI, PAWS-X 25)', AT_LEAST_1),
        Option('eta', float, 'percent of the labelled samples each model keeps, per XLA epoch, by confidence (the last '
               'repeats; Table 8: 80 100 100 / 50 80 100 / 80 90 80)', (lambda v: 0 < v <= 100, 'percents above 0 and '
               'at most 100'), nargs='+'),
        Option('distil', str, 'keep the top --eta percent by confidence (default), or the samples a 2-component GMM of '
               'the losses puts in the low-loss cluster', choices=('confidence', 'gmm'), default='confidence'),
        Option('posterior', help='with --distil gmm: the least posterior of the low-loss component a kept sample has '
               '(default 0.5)', valid=UNIT),
        Option('aug_share', help='share P of a sentence\'s words the masked LM replaces (0.3; PAWS-X 0.4)',
               valid=PART),
        Option('delta', int, 'vicinal samples per sentence (3), or per part of a pair (2 2: successive cross, 4 '
               'samples)', (lambda v: v >= 1, 'samples per sentence, at least 1'), nargs='+'),
        Option('alpha', help='Eq. 2\'s sampling factor over the training sets (default 0.7, Table 8)', valid=UNIT,
               default=0.7),
        Option('union', bool, 'ablation: a model learns what either peer keeps (both: if they agree), not what both '
               'agree on'),
        Option('no_vicinal', bool, 'ablation: no vicinal samples, each epoch\'s English and target sets alone'),
        Option('single', bool, 'ablation: each model learns what it keeps itself, no co-teaching (Table 5\'s φ)'),
        Option('mlm', str, 'the checkpoint whose masked LM makes the vicinal samples (default --init)',
               path='checkpoint'),
        Option('warmup_dir', str, 'folder of the three warm-up runs warmup-1..3, reused when finished (default --out; '
               'share one folder between target languages)', changes='nothing'))

    def __init__(self, encoder, task, args=None):
        super().__init__(encoder, task)  # every option's default: the XLA epochs train without the warm-up's penalty

    @classmethod
    def released(cls, args):
        """Table 8's settings. Table 8 gives XNLI's and PAWS-X's for 5% of the data alone, so at 100% the warm-up
        is the zero-shot baseline's (XTREME's scripts), and the XLA epochs take Table 8's."""
        run = cls.RUN.get(args.task, {})
        if not (args.train_share == 1 and run.get('train_share') == 0.05):
            return run
        warm_up = ('lr', 'batch_size', 'epochs', 'warmup', 'weight_decay', 'eval_steps')
        return {**{k: v for k, v in run.items() if k not in warm_up},
                **{k: v for k, v in Baseline.RUN[args.task].items() if k != 'seed'}}

    @classmethod
    def configure(cls, args, demo=None):
        if demo is not None:  # Table 8's augmentation and distillation, with the warm-up of every demo
            demo = {**{k: v for k, v in cls.released(args).items() if k in {o.name for o in cls.OPTIONS}}, **demo}
        if args.posterior is not None and args.distil != 'gmm':
            raise ValueError('--posterior is the threshold of --distil gmm: add --distil gmm or drop --posterior')
        super().configure(args, demo)
        args.posterior = 0.5 if args.posterior is None and args.distil == 'gmm' else args.posterior
        pair = TASKS[args.task].family == 'classification'
        if len(args.delta) not in ((1, 2) if pair else (1,)):
            takes = 'one or two numbers (samples per part of a pair)' if pair else 'one number (samples per sentence)'
            raise ValueError(f'--delta takes {takes} for {args.task}, not {len(args.delta)}')
        args.delta = args.delta * 2 if pair and len(args.delta) == 1 else args.delta
        if not args.train_lang:
            raise ValueError('XLA adapts to one target language: '
                             'pass --train_lang (its unlabelled training text is read)')

    @classmethod
    def folder(cls, args):
        return super().folder(args) + [args.train_lang] * bool(args.train_lang)  # none: a --train_langs sweep's

    @classmethod
    def reads(cls, args):
        lang, task = args.train_lang, args.task
        if args.eval_only or not args.xla_epochs:  # --xla_epochs 0: the warm-ups read English alone
            return []
        if TASKS[task].family == 'tagging':
            return [(data.split_path(args.data_dir, task, 'train', lang), f'XLA reads the unlabelled {lang} training '
                     f'text (XTREME\'s train-{lang}.tsv)', True)]
        return [(data.split_path(args.data_dir, task, 'translate-train', lang), f'{task} needs translate-train files '
                 f'for {lang}; {data.get_translations(task)}', True)]

    @classmethod
    def stages(cls, args):
        """The warm-up (Section 3.1, lines 1-3): three zero-shot runs on English with the confidence penalty
        (weight 1, or --conf_penalty), seeded --seed + 0, 2000 and 3000 (UXLA's 1000, 3000, 4000)."""
        seed = '' if args.seed == cls.RUN['conll']['seed'] else f'seed{args.seed}/'  # --seeds: each seed's apart
        shared = lambda m: {'out': f'{args.warmup_dir}/{seed}warmup-{m + 1}'} if args.warmup_dir else {}  # other runs'
        penalty = 1.0 if args.conf_penalty is None else args.conf_penalty
        return {f'warmup-{m + 1}': {'method': 'zeroshot', 'seed': args.seed + offset, 'stage': f'warm-up {m + 1} of 3',
                                    'conf_penalty': penalty, 'share_seed': share_draw(args), **shared(m)}
                for m, offset in enumerate((0, 2000, 3000))}

    @classmethod
    def procedure(cls, run):
        """Algorithm 1, then the report: each final model, their mean, and the ensemble that
        averages their probabilities (the run's predictions), beside the same for the warm-ups."""
        models = run.folder.cached('final-models.json', lambda: cls.algorithm_1(run))
        report_models(run, cls, models)

    @classmethod
    def algorithm_1(cls, run):
        """Three warm-up models, then in each XLA epoch: vicinal samples of the target text (and from epoch 3
        of English too; GEN-LM, lines 6-7), each model's labels and DISTIL's choice (lines 8-10), and
        co-teaching (lines 3-22). -> the checkpoints of the three final models."""
        args = run.args
        if not args.xla_epochs:  # the warm-ups alone: the zero-shot rows (with --conf_penalty 0) and their ensemble
            return [f'{run.stage(name)}/best.pt' for name in cls.stages(args)]
        english = data.training_set(run.tokenization, [], share=args.train_share)  # D_s: the warm-ups' set
        target = data.unlabelled_set(run.tokenization, args.train_lang, args.train_share)  # D_t
        if not (args.mlm or args.init):
            run.fail('XLA\'s vicinal samples need a masked LM: '
                     'pass --mlm (a converted XLM-R checkpoint, python layers.py convert)')
        encoder, mlm = run.pretrained(init=args.mlm or args.init)[:2]  # here: a missing MLM must not wait for epoch 2
        if mlm is None:
            run.fail(f'{args.mlm or args.init} has no MLM head: pass --mlm a converted XLM-R checkpoint '
                     '(python layers.py convert keeps it)')
        models = [f'{run.stage(name)}/best.pt' for name in cls.stages(args)]
        vicinity = encoder.eval(), mlm.eval()  # frozen, on the CPU until GEN-LM runs
        for e in range(1, args.xla_epochs + 1):
            names = cls.SETS[min(e, 3)]
            names = tuple(dict.fromkeys(n.removesuffix(' vicinal') for n in names)) if args.no_vicinal else names
            unlabelled = {'target': target} if 'target' in names else {}  # the sets the models label this epoch
            for name, feats in (('target vicinal', target), ('source vicinal', english)):
                if name in names:
                    unlabelled[name] = vicinal_samples(run, feats, vicinity, e, f'epoch{e}/{name.replace(" ", "-")}')
            models = cls.co_teaching(run, e, models, unlabelled, english if 'source' in names else None)
        return models

    @classmethod
    def co_teaching(cls, run, e, models, unlabelled, english):
        """Lines 3-22 of epoch e. For every ordered pair of peers (k, j), the third model l trains on what k and j
        keep and agree on (AGREEMENT). So each model trains twice an epoch, and later pairs label with peers that
        have already trained in it. A checkpoint labels only once an epoch (DISTIL). models: each model's newest
        checkpoint -> the epoch's last checkpoints."""
        args, models, labelled = run.args, list(models), {}
        eta = args.eta[min(e, len(args.eta)) - 1] / 100

        def labels_of(m):  # the newest checkpoint of model m labels (named after its folder)
            path = models[m]
            if path not in labelled:
                name = '-'.join(path.split('/')[-3:-1])
                labels = lambda: distil(run, path, unlabelled, eta)
                labelled[path] = run.folder.cached(f'epoch{e}/labels-{name}.pt', labels)
                run.say(f'XLA epoch {e}, {name} keeps ' + ', '.join(f'{int(s["keep"].sum())} of {len(s["keep"])} {n}'
                                                                    for n, s in labelled[path].items()))
            return labelled[path]
        peers = [(k, j) for k in range(3) for j in range(3) if j != k]
        for k, j in [(m, m) for m in range(3)] if args.single else peers:
            l = 3 - k - j if k != j else k  # the third model; --single: each model by itself
            parts = taught_by_peers(labels_of(k), labels_of(j), unlabelled, english, args.union)
            models[l] = co_train(run, e, l, (k, j), parts, models[l])
        return models

    @classmethod
    def predictor(cls, run):
        """The ensemble of the three final models, which makes the run's predictions."""
        return Ensemble([run.restore(run.path(m), cls) for m in json.loads(data.read_text(run.path(cls.KEEPS)))])


def vicinal_samples(run, feats, vicinity, epoch, name):
    """GEN-LM (Section 3.2) as in the released code: the unlabelled vicinal samples of every feature, made once and
    kept as a set on disk (data.Items) in the run's folder `name`. Each sentence (each one of a pair) gets --delta
    samples. Each sample masks words chosen by masked_words, and the frozen masked LM fills them one at a time
    (fill_successively). A pair's δ1 and δ2 samples are crossed into δ1 x δ2 (successive cross). A sample whose
    word count changed (a filled piece that does not start a word) is dropped, as the released code drops it. The
    draws follow (--seed, epoch, feature), so any number of processes makes the same samples. vicinity is
    (encoder, MLM head)."""
    args, tok, device, family, source = run.args, run.tok, run.device, TASKS[run.args.task].family, 'source' in name
    if not (args.resume and data.is_whole(run.path(name))):  # a resumed run reads the set it made, if it is whole
        word_start, chars = torch.tensor(tok.word_starts()), torch.tensor(tok.piece_chars())
        whole_word = word_start & (chars > 0)  # a fill that keeps the word count: not a continuation, not a lone '▁'
        encoder, mlm = (part.to(device) for part in vicinity)
        fillable = torch.arange(encoder.cfg.vocab_size, device=device)
        fillable = (fillable >= 4) & (fillable < tok.mask)  # not <s>, <pad>, </s>, <unk> nor <mask>

        def samples_of(index):  # a batch of features -> each one's samples as sample_arrays
            batch_feats = [feats[i] for i in index]
            seed = lambda i: ((args.seed * 10 + epoch) * 2 + source) * 10 ** 10 + i
            plans = [masked_words(f, family, args.delta, args.aug_share, word_start, chars,
                                  torch.Generator().manual_seed(seed(i))) for i, f in zip(index, batch_feats)]
            rows = [(f, words) for f, (parts, _) in zip(batch_feats, plans) for sets in parts for words in sets]
            filled = torch.zeros(0, max(len(f.ids) for f in batch_feats), dtype=torch.long)
            ok = torch.zeros(0, dtype=torch.bool)
            if rows:
                batch = data.collate([data.Feature(f.ids) for f, _ in rows])
                words = torch.nn.utils.rnn.pad_sequence([torch.tensor(w).view(-1, 2) for _, w in rows], True, -1)
                filled = fill_successively(encoder, mlm, batch.ids.to(device), batch.mask.to(device), words.to(device),
                                           fillable, tok.mask, tok.pad).cpu()
                firsts = words[..., 0]
                ok = (whole_word[filled.gather(1, firsts.clamp(min=0))] | (firsts < 0)).all(1)
            return samples_per_feature(batch_feats, plans, filled, ok, family, tok.pad)
        fields = ('ids', 'length', 'example', 'removed') + ('words', 'word_count') * (family == 'tagging')
        made = run.sharded(samples_of, data.item_lengths(feats)[:, 0], name, len(fields), everywhere=False)
        for part in vicinity:
            part.cpu()  # .to() moved the module itself: off the GPU until the next GEN-LM (2.1 GiB at large)
        keep_samples(run, name, dict(zip(fields, made)) if made is not None else None, family)
    samples = data.Items(run.path(name))
    what = name.split('/')[-1].replace('-', ' ')
    run.say(f'XLA epoch {epoch}: {len(samples)} {what} samples of {len(feats)} sentences; removed: '
            + ', '.join(f'{n} {why}' for why, n in samples.meta['removed'].items()))
    return samples


def samples_per_feature(feats, plans, filled, ok, family, pad):
    """A batch's filled rows (the samples of its features, one after another) and whether each row kept its word
    count (ok) -> each feature's sample_arrays, its rows cut to its length. A pair's samples of part a and part b
    are crossed (successive cross), and a crossed sample is kept where both of its parts are."""
    out, at = [], 0
    for f, (parts, removed) in zip(feats, plans):
        counts = [len(sets) for sets in parts]
        made, good = filled[at:at + sum(counts), :len(f.ids)], ok[at:at + sum(counts)]
        at += sum(counts)
        if family != 'tagging' and parts:  # a pair: every sample of part a with every one of part b
            made = successive_cross(made[:counts[0]], made[counts[0]:], parts_of(f.ids, family)[0])
            good = good[:counts[0]].repeat_interleave(counts[1]) & good[counts[0]:].repeat(counts[0])
        removed = [removed.get(why, 0) for why in REMOVED[:-1]] + [int((~good).sum())]
        out.append(sample_arrays(f, made[good], removed, pad))
    return out


def parts_of(ids, family, eos=2):
    """The (start, end) spans masked as one part: the sentence of <s> words </s> (tagging), or a and b
    of <s> a </s></s> b </s> (for a pair, successive cross generates each part apart)."""
    if family == 'tagging':
        return [(1, len(ids) - 1)]
    cut = ids.index(eos)
    return [(1, cut), (cut + 2, len(ids) - 1)]


def masked_words(feat, family, delta, share, word_start, chars, generator):
    """What a feature's vicinal samples mask, as the released code chooses it. A part (parts_of) of under 5 or over
    150 words, or without a word of 3 or more characters, gives the feature no sample. Each of a part's δ samples
    masks k = max(int(P x n), 1) of its n words (for tagging, the data's words; for a pair, a piece that starts a
    word begins one). Only words of 3 or more characters are masked, taken as successive windows of one random
    order of them (cycling). A set of words drawn before is dropped. -> the sets per part, each word as its
    (first, end) positions in masking order, and {filter: count removed}."""
    parts = []
    for (start, end), d in zip(parts_of(feat.ids, family), delta):
        part = torch.tensor(feat.ids[start:end], dtype=torch.long)
        first = word_start[part] | (torch.arange(len(part)) == 0)
        if feat.words is not None:  # the data's words: a word without pieces is an <unk>, which starts no word
            first = torch.zeros(len(part), dtype=torch.bool).index_fill_(0, torch.tensor(feat.words) - start, True)
        starts = first.nonzero().squeeze(1)
        ends = torch.cat([starts[1:], torch.tensor([len(part)])])
        n_chars = torch.zeros(len(starts), dtype=torch.long).index_add_(0, first.cumsum(0) - 1, chars[part])
        eligible = (n_chars >= 3).nonzero().squeeze(1)
        if not 5 <= len(starts) <= 150:
            return [], {'sentences under 5 or over 150 words': 1}
        if not len(eligible):
            return [], {'sentences without a word of 3 or more characters': 1}
        k = min(max(int(share * len(starts)), 1), len(eligible))
        cycle = eligible[torch.randperm(len(eligible), generator=generator)].repeat(d)
        sets = {}  # first come: a repeated set of words is dropped
        for s in range(d):
            window = cycle[s * k:(s + 1) * k].tolist()
            sets.setdefault(frozenset(window), [[start + starts[w].item(), start + ends[w].item()] for w in window])
        parts.append(list(sets.values()))
    return parts, {'repeated sets of masked words': sum(delta) - sum(len(p) for p in parts)}


@torch.no_grad()
def fill_successively(encoder, mlm, ids, mask, words, fillable, mask_id, pad_id):
    """Successive max (Section 3.2) on the rows ids (B, T), a word at a time as in the released code. words
    (B, K, 2) holds each row's masked words in masking order, as (first, end) positions padded with -1. Step s puts
    one <mask> in place of the word words[:, s]: its first piece becomes <mask> and the others <pad>, which the
    attention mask and the position numbers skip as if removed. The frozen MLM reads the row with the earlier
    steps' fills in place, and its most probable piece that `fillable` allows (no special token) fills the mask;
    the replaced word may win. -> the rows, with a filled word as one piece followed by <pad> for its other pieces."""
    ids, mask = ids.clone(), mask.clone()
    rows, columns = torch.arange(len(ids), device=ids.device), torch.arange(ids.size(1), device=ids.device)
    for s in range(words.size(1)):
        first, end = words[:, s, 0], words[:, s, 1]
        rest = (columns > first[:, None]) & (columns < end[:, None])  # none in a row without step s (-1, -1)
        ids[rest], mask[rest] = pad_id, False
        live = first >= 0
        r, pos = rows[live], first[live]
        ids[r, pos] = mask_id
        logits = mlm(encoder(ids[r], mask[r])[torch.arange(len(r)), pos]).float()
        ids[r, pos] = logits.masked_fill(~fillable, float('-inf')).argmax(-1)
    return ids


def successive_cross(a_samples, b_samples, a_span):
    """Successive cross: every sample of part a joined with every sample of part b, δ1 x δ2 rows (all
    rows hold the same pair, so part a's positions are the same in each)."""
    start, end = a_span
    out = b_samples.repeat(len(a_samples), 1)
    out[:, start:end] = a_samples[:, start:end].repeat_interleave(len(b_samples), 0)
    return out


def distil(run, model, unlabelled, eta):
    """One model's labels of each unlabelled set and DISTIL's choice (Section 3.3), as {set: {'label': the samples'
    labels one after another (a class, or a tag per word), 'ends': where each sample's labels end (after a first 0),
    'confidence', 'keep': a bool per sample}}. It keeps the top eta by confidence, or the samples whose posterior of
    the low-loss GMM component is at least --posterior. Every process computes it (run.sharded), and process 0
    returns it (None elsewhere)."""
    args, method, out = run.args, run.restore(run.path(model), XLA).eval(), {}

    def scored(items, index):  # a batch -> each sample's labels and scores
        batch = data.collate([items[i] for i in index]).to(run.device)
        scores = pseudo_labels(method.family, method.predict(batch), batch.first)
        labels, count, confidence, loss = (t.cpu() for t in scores)
        return list(zip(labels.split(count.tolist()), confidence[:, None], loss[:, None]))
    for name, items in unlabelled.items():
        made = run.sharded(lambda index: scored(items, index), data.item_lengths(items)[:, 0], name, 3,
                           everywhere=False)
        if made is None:
            continue
        (label, ends), confidence, loss = (made[0].values, made[0].ends), made[1].values, made[2].values
        keep = torch.zeros(0, dtype=torch.bool)  # no sample: nothing to keep
        if len(loss):
            keep = top_confident(confidence, eta) if args.distil == 'confidence' else gmm_good(loss) >= args.posterior
        out[name] = {'label': label.long(), 'ends': ends, 'confidence': confidence, 'keep': keep}
    return out if run.rank == 0 else None


def pseudo_labels(family, logits, first=None):
    """A model's labels of a batch of unlabelled samples and DISTIL's scores, from logits (B, C) or (B, T, C).
    -> (labels, counts, confidence, loss). labels: the argmax class of each sample, or the argmax tag of each word
    on its first piece (first: (B, T)), the batch's one after another. counts: each sample's number of labels.
    confidence: max_c p_c, or its mean over the words (Section 3.3). loss: the cross-entropy against that label,
    the same mean of -log max_c p_c."""
    top, label = logits.float().softmax(-1).max(-1)
    if family == 'classification':
        return label, torch.ones_like(label), top, -top.log()
    count = first.sum(1)
    return label[first], count, (top * first).sum(1) / count, -(top.log() * first).sum(1) / count


def top_confident(confidence, eta):
    """DISTIL by model confidence: the floor(eta * N) samples with the highest confidence, as in the
    released unsup_utils.py (len * top_k // 100)."""
    keep = torch.zeros(len(confidence), dtype=torch.bool)  # (why the round: 0.29 x 100 is 28.999999999999996)
    keep[torch.argsort(confidence, descending=True, stable=True)[:math.floor(round(eta * len(confidence), 6))]] = True
    return keep


def em_step(x, mu, var, pi):
    """One EM step of a 1-D two-component Gaussian mixture (Appendix B). E: r_ik proportional to
    pi_k N(x_i | mu_k, var_k); M: pi_k = mean_i r_ik, mu_k = sum_i r_ik x_i / sum_i r_ik,
    var_k = sum_i r_ik (x_i - mu_k)^2 / sum_i r_ik. -> (mu, var, pi) and the E-step's r."""
    r = responsibilities(x, mu, var, pi)
    n = r.sum(0)
    mu = (r * x[:, None]).sum(0) / n
    var = (r * (x[:, None] - mu) ** 2).sum(0) / n + 1e-5  # the released GMM's reg_covar: no collapse to a point
    return mu, var, n / len(x), r


def responsibilities(x, mu, var, pi):
    log_n = -0.5 * ((x[:, None] - mu) ** 2 / var + torch.log(2 * math.pi * var))
    return (log_n + pi.log()).softmax(1)


def gmm_good(losses, iters=100, init=None):
    """DISTIL by clustering: p(z = g | loss) of each sample under a 2-component GMM of the
    per-sample losses fitted by EM, where g is the component with the smaller mean (the clean samples).
    init: the two starting means (default: the smallest and the largest loss)."""
    x = losses.double()
    mu = torch.tensor(init if init is not None else [x.min().item(), x.max().item()], dtype=torch.float64)
    var = torch.full((2,), max(x.var().item() if len(x) > 1 else 0.0, 1e-5), dtype=torch.float64)
    pi = torch.full((2,), 0.5, dtype=torch.float64)
    for _ in range(iters):
        mu, var, pi, _ = em_step(x, mu, var, pi)
    return responsibilities(x, mu, var, pi)[:, mu.argmin()].float()


def agreement(a, b):
    """AGREEMENT (Section 3.3): the samples that both peers keep and label alike (every word's tag, for
    tagging). a and b are the distil outputs of two peers for one set ({'label', 'ends', 'keep'})."""
    differ = torch.cat([torch.zeros(1, dtype=torch.long), a['label'].ne(b['label']).long().cumsum(0)])[a['ends']]
    return a['keep'] & b['keep'] & (differ[1:] == differ[:-1])  # no label of the sample differs


def taught_by_peers(by_k, by_j, unlabelled, english=None, union=False):
    """The training sets that a pair of peers k and j give the third model: English (when given) and, of every
    unlabelled set, the samples that both keep and label alike, with that label (AGREEMENT). A model never learns
    from its own labels. With union (the ablation, the released --agreement_param 2), it also gets the samples that
    either peer keeps, with that peer's label. by_k and by_j are distil's {set: {'label', 'ends', 'keep'}}.
    -> {set: a part of Chosen (items, positions, labels, ends)}."""
    parts = {} if english is None else {'source': (english, None, None, None)}
    for name, items in unlabelled.items():
        a, b = by_k[name], by_j[name]
        chosen = agreement(a, b) | (a['keep'] ^ b['keep'] if union else False)
        count = a['ends'].diff()  # a sample's labels: one, or one per word
        labels = torch.where(a['keep'].repeat_interleave(count), a['label'], b['label'])  # where both keep, alike
        parts[name] = (items, chosen.nonzero().squeeze(1), labels[chosen.repeat_interleave(count)],
                       torch.cat([torch.zeros(1, dtype=torch.long), count[chosen].cumsum(0)]))
    return parts


def co_train(run, epoch, l, pair, parts, start):
    """Train model l, taught by its peers pair = (k, j) (with --single, (l, l)), in an XLA epoch: one pass of Eq. 2's
    draws over the sets in `parts`, from its weights `start`, with a new optimiser (Table 8: --xla_lr, 10% warm-up).
    The --train_lang dev score selects every --xla_eval_steps (Table 8). -> the best weights if their score beats
    that of `start` (strictly, as in the released code), or else `start` (the model goes on as it was)."""
    (k, j), args = pair, run.args
    folder = f'epoch{epoch}/model{l + 1}-by{k + 1}{j + 1}'
    sub = run.sub(folder, epochs=1, steps=None, eval_every=None, lr=args.xla_lr, batch_size=args.xla_batch_size,
                  warmup=0.1, warmup_steps=None, seed=args.seed, eval_steps=args.xla_eval_steps,
                  weight_decay=args.xla_weight_decay)  # one pass of Eq. 2's draws, whatever the warm-ups counted
    target_dev = lambda method: sub.evaluate(method, 'dev', [args.train_lang])[0]  # the paper's selection: the target
    score = lambda dev: dev[args.train_lang]['score'] if args.train_lang in dev else None

    def train():
        method = run.restore(run.path(start), XLA)
        before = score(target_dev(method))
        items = Chosen(parts.values())
        sizes = np.diff(items.starts).tolist()
        lengths = data.item_lengths(items) if args.group_by_length else None
        seed = sub.args.seed * 1000 + epoch * 10 + k  # the two trainings of a model in an epoch draw apart
        batches = mixture_batches(sizes, args.alpha, sub.args.batch_size, seed, run.chunks, lengths)
        if batches:  # none when the peers agree on nothing: the model stays as it was
            sub.fit(method, items, lambda: target_dev(method), lambda _: batches)  # none: the last weights
            sub.load_best(method)
        after = score(target_dev(method))
        better = bool(batches) and (after is None or before is None or after > before)  # as in the released code
        dev = '' if after is None else f'; {args.train_lang} dev {before:.1f} -> {after:.1f}'
        dev += '' if better or after is None else ', not better: kept the model as it was'
        run.say(f'XLA epoch {epoch}, model {l + 1} by {k + 1} and {j + 1}: trained on '
                + ', '.join(f'{n} {name}' for name, n in zip(parts, sizes)) + f' samples{dev}')
        return {'kept': dict(zip(parts, sizes)), 'dev_before': before, 'dev_after': after, 'better': better}
    if not run.folder.cached(f'{folder}/results.json', train)['better']:
        sub.folder.drop('best.pt')  # the model goes on from start: nothing reads this training's (once that is kept)
        return start
    return f'{folder}/best.pt'


def mixture_batches(sizes, alpha, batch_size, seed, chunks, lengths=None):
    """The global batches of an XLA epoch over the concatenated sets. There are sum(n_i) draws, round(q_i x sum(n_i))
    of them from set i (Eq. 2). Each set is read in shuffled passes, and the draws are shuffled together (then
    grouped by length when lengths are given, as every run's batches are)."""
    g, picks, offset = torch.Generator().manual_seed(seed), [], 0
    for n, q in zip(sizes, data.sampling_weights(sizes, alpha) if sum(sizes) else sizes):
        count = round(q * sum(sizes))
        if n and count:
            passes = torch.cat([torch.randperm(n, generator=g) for _ in range(math.ceil(count / n))])
            picks.append(passes[:count] + offset)
        offset += n
    if not picks:
        return []
    order = torch.cat(picks)
    return data.cut_batches(order[torch.randperm(len(order), generator=g)].tolist(), batch_size, chunks, g, lengths)


class Ensemble(nn.Module):
    """XLA's ensemble of the three models: the mean of their probabilities. It returns the log of that mean,
    which evaluation reads as logits (the argmax is the same)."""
    paired = False

    def __init__(self, models):
        super().__init__()
        self.models, self.family = nn.ModuleList(models), models[0].family

    def predict(self, batch):
        return torch.stack([m.predict(batch).float().softmax(-1) for m in self.models]).mean(0).log()


# ----------------------------------------------------------------------------------------
# The methods, by their --method names.

METHODS = {cls.NAME: cls for cls in (Baseline, TranslateTrain, TranslateTrainAll, InLanguage, InLanguageAll, Filter,
                                     XMixup, Veco, XLA)}


# === Machinery: XLA's samples and sets on disk, released heads and tag distributions, the classes, the checks ===


# ----------------------------------------------------------------------------------------
# XLA's vicinal samples as a set on disk (data.save_items), and what a model trains on in an XLA epoch (Chosen).

REMOVED = ('sentences under 5 or over 150 words', 'sentences without a word of 3 or more characters',
           'repeated sets of masked words', 'samples whose word count changed')  # what GEN-LM drops, counted


def sample_arrays(feat, rows, removed, pad):
    """A feature's vicinal samples, rows of its ids with <pad> where pieces were removed, as
    data.feature_arrays' fields (unlabelled): the pieces left, a tagging sample's words moved to
    where their first pieces are now; and the counts of what was removed (REMOVED)."""
    real = rows.ne(pad)
    arrays = rows[real], real.sum(1), torch.full((len(rows),), feat.example), torch.tensor(removed)
    if feat.words is None:
        return arrays
    return arrays + ((real.cumsum(1) - 1)[:, feat.words].flatten(), torch.full((len(rows),), len(feat.words)))


def keep_samples(run, name, made, family):
    """Process 0's vicinal samples (made: {field: data.Ragged}; None on the other processes) written as a set in the
    run's folder `name` (data.save_items), what GEN-LM removed counted in its meta; every process waits for it."""
    if made is not None:
        arrays = {field: ragged.values.numpy().astype(np.int32) for field, ragged in made.items()}
        removed = dict(zip(REMOVED, arrays.pop('removed').reshape(-1, len(REMOVED)).sum(0).tolist()))
        data.save_items(run.path(name), arrays, {'family': family, 'removed': removed})
    run.folder.keep(name)
    data.barrier()


class Chosen:
    """What a model trains on in an XLA epoch (co_train): of each set, the samples its peers chose,
    with their labels (taught_by_peers), or all of English with its own; the sets one after
    another, each sample read from its set when it is used. parts: [(items, positions or None for
    all, labels or None for their own, ends: where each sample's labels end)]."""

    def __init__(self, parts):
        self.parts = [(items, torch.arange(len(items)) if at is None else at, labels, ends)
                      for items, at, labels, ends in parts]
        self.starts = np.cumsum([0] + [len(at) for _, at, _, _ in self.parts])
        self.length = np.concatenate([np.zeros((0, 1), np.int64)] + [data.item_lengths(items, at.numpy())
                                                                    for items, at, _, _ in self.parts])

    def __len__(self):
        return int(self.starts[-1])

    def lengths(self, index=None):
        return self.length if index is None else self.length[index]

    def __getitem__(self, n):
        part = int(np.searchsorted(self.starts, n, 'right')) - 1
        items, at, labels, ends = self.parts[part]
        k = n - self.starts[part]
        feat = items[int(at[k])]
        if labels is None:
            return feat
        label = labels[ends[k]:ends[k + 1]].tolist()  # a class, or the words' tags on their first pieces
        if feat.words is None:
            return replace(feat, label=label[0])
        tags = [IGNORE] * len(feat.ids)
        for w, tag in zip(feat.words, label):
            tags[w] = tag
        return replace(feat, label=tags)


# ----------------------------------------------------------------------------------------
# VECO's translation decodes with the mean of its last checkpoints.

def average_last(run, cls, method, n):
    """Load the weights that decode: the mean of the last n kept checkpoints (fairseq's
    average_checkpoints), or best.pt with n = 0. -> what they are."""
    kept = kept_checkpoints(run.path('checkpoints'))[-n:] if n else []
    if not kept:
        if not run.load_best(method):
            run.fail(f'{run.path("best.pt")} not found: --eval_only decodes a finished run in --out')
        return 'best.pt: the lowest valid loss'
    method.load_state_dict(average_checkpoints(kept, kept_identity(run, cls)))
    return f'the mean of the last {len(kept)} checkpoints ({step_of(kept[0])} to {step_of(kept[-1])} steps)'


def kept_identity(run, cls):
    """What a kept checkpoint of the run must say it is (layers.load_checkpoint's expect)."""
    return {'method': run.args.method, 'task': cls.folder(run.args)[0]}


def step_of(path):
    """The step of a kept checkpoint, checkpoints/step<7 digits>.pt."""
    return int(path[-10:-3])


KEEP_ALL = 10 ** 9  # --curve keeps every checkpoint: more than a run makes


def learning_curve(run, cls, method, test, refs):
    """VECO's Figure 4 (right): the test set's BLEU with each kept checkpoint -> {step: BLEU}."""
    curve = {}
    for path in kept_checkpoints(run.path('checkpoints')):
        method.load_state_dict(load_checkpoint(path, kept_identity(run, cls))['method'])
        curve[step_of(path)] = ev.bleu(cls.decoded(run, method, test), refs)['bleu']
        run.say(f'learning curve: step {step_of(path)}, BLEU {curve[step_of(path)]:.2f}')
    return curve


# ----------------------------------------------------------------------------------------
# XLA's results: each model, their mean and std, the ensemble.

def report_models(run, cls, models):
    """XLA's run's table: each final model's dev and test scores (its test predictions in model<m>/), their mean and
    std (the paper's mean of the three models, ± std), the warm-ups' mean beside them; the ensemble that averages the
    models' probabilities is the run's own result."""
    ensemble, trained = cls.predictor(run), run.args.xla_epochs > 0  # the models in final-models.json
    warm = [run.results_of(name) for name in cls.stages(run.args)]
    rows = {'warm-up (zero-shot + penalty), mean': ev.statistic(warm)} if all(warm) and trained else {}
    kind = 'XLA' if trained else 'warm-up'  # --xla_epochs 0: the warm-ups are the models
    for m, (method, path) in enumerate(zip(ensemble.models, models)):  # each model's test predictions in model<m>/
        dev, _, test = run.sub(f'model{m + 1}').scored(method)
        rows[f'{kind} model {m + 1}'] = {'dev': ev.summary(dev), 'test': ev.summary(test), 'checkpoint': path}
    each = [rows[f'{kind} model {m + 1}'] for m in range(len(models))]
    for stat in ('mean', 'std'):
        rows[f'{kind} {stat} of the models'] = ev.statistic(each, stat)
    kept = ('each model\'s last XLA epoch that kept the --train_lang dev score (or its warm-up: the best English '
            'dev)' if trained else 'each warm-up\'s best English dev')
    dev, _, test = run.scored(ensemble)
    run.finish(dev, test,
               f'{kept}; the ensemble averages the models\' probabilities', rows, 'ensemble')


# ----------------------------------------------------------------------------------------
# VECO's search grid as --search gives it.

def search_grid(grid, terms):
    """--search's grid {option: values}: grid (Veco.GRID), each term NAME=V,V,... replacing (or adding) a row."""
    grid, kinds = dict(grid), {'lr': float, 'epochs': int, 'batch_size': int}
    for term in terms or []:
        name, _, values = term.partition('=')
        try:
            grid[name] = tuple(map(kinds[name], values.split(',')))
            assert all(v > 0 for v in grid[name])
        except (KeyError, ValueError, AssertionError):
            raise ValueError(f'--search {term}: give NAME=V,V,... with NAME one of lr, epochs, batch_size and '
                             'positive numbers') from None
    return grid


# ----------------------------------------------------------------------------------------
# A released task model's head, the start of a Head (Head.__init__), and a released FILTER model's layers (Filter).

def released_fusion(encoder, given, planned):
    """FILTER's (m, k): a released FILTER model's, its config's, unless --m or --k is given (planned: those given, or
    the paper's); a released model's own, given otherwise, cannot run."""
    released = encoder.task_head and encoder.task_head.fusion
    if not released:
        return planned
    if given.m is None and given.k is None:
        return released
    if released != planned:
        raise ValueError(f'--init is FILTER fine-tuned with m = {released[0]}, k = {released[1]}: drop --m and --k')
    return planned


def start_from_released(head, kind, theirs, tensors, labels, fused=False):
    """A Head started from a transformers task model's head (layers.TaskHead) that --init read: the head's kind is
    the task's family, and its classes (its id2label) are the task's, its rows put in the task's order. BERT's pooler
    came with the encoder. fused: FILTER's released model, whose layers were fine-tuned fused."""
    if kind != head.family:
        raise ValueError(f'--init is a {kind} model and the task a {head.family} one: give a model of the task')
    if fused and head.act is not torch.relu:  # its layers were fine-tuned fused
        raise ValueError('--init is FILTER\'s released model: run it with --method filter')
    if kind == 'classification' and not fused and head.act is torch.relu:
        raise ValueError('--init\'s classification head is RoBERTa\'s, and FILTER\'s is its released one: start '
                         'it from the encoder alone (python layers.py convert)')
    if head.family != 'qa' and sorted(theirs) != sorted(labels):
        raise ValueError(f'--init predicts {", ".join(theirs)} (its id2label), not the task\'s '
                         f'{", ".join(labels)}: give a model fine-tuned on the task')
    needed = {k for k in head.state_dict() if not (head.pooled and k.startswith('dense.'))}
    if set(tensors) != needed:
        raise ValueError(f'--init\'s head holds {", ".join(sorted(tensors))}, this method\'s '
                         f'{", ".join(sorted(needed))}: start it from the encoder alone (python layers.py convert)')
    rows = [theirs.index(label) for label in labels] if head.family != 'qa' else slice(None)
    head.load_state_dict({**head.state_dict(), **{k: t[rows] if k.startswith('out.') else t
                                                 for k, t in tensors.items()}})


# ----------------------------------------------------------------------------------------
# A release's tag distributions as stored teacher probabilities (X-Mixup's tagging, Taught.procedure).

def released_probabilities(run, items):
    """The released tag distributions (data.soft_labels) of the target side of every training item, found by its
    tokens; English paired with itself learns its own tags, on their first pieces. -> a data.Ragged of them"""
    langs = run.cls.train_langs(run.args, data.languages(run.args.task, run.args.demo, run.args.langs))
    found, tags, p = data.soft_labels(run.tokenization, langs), len(TASKS[run.args.task].labels), []
    for i in range(len(items)):
        feat = items[i][1]
        if feat.label is not None:  # English paired with itself
            label = torch.tensor(feat.label)
            p.append(F.one_hot(label.clamp(min=0), tags).float() * label.ne(IGNORE)[:, None])
        elif tuple(feat.ids) in found:
            p.append(torch.from_numpy(found[tuple(feat.ids)]))
        else:
            raise data.DataError(f'{run.args.data_dir}: a translated {run.args.task} training sentence has no '
                                 'released tag distributions: convert X-Mixup\'s data again (python data.py download '
                                 '--translations xmixup)')
    return data.Ragged(torch.cat(p), torch.tensor(np.cumsum([0] + [len(x) for x in p])))


# ----------------------------------------------------------------------------------------
# The classes a run may be, and how a user names them; the batch sizes the trainer checks.

def classes():
    """Every class a run may be: each method's, and the variants its resolve() picks."""
    return [c for method in METHODS.values() for c in (method, *method.variants())]


def option_defaults(cls):
    """{name: default} of the options of a method class and of the classes it extends, whose __init__ may read an
    option that the class leaves out (Baseline's --conf_penalty, read by in-language)."""
    return {o.name: o.default for c in cls.__mro__[::-1] if issubclass(c, Method) for o in c.OPTIONS}


def called(classes):
    """How a user names method classes: --method NAME, or NAME --task TASK for a class of its own task."""
    names = list(dict.fromkeys(c.NAME + ('' if set(c.TASKS) & set(TASKS) else f' --task {"/".join(c.TASKS)}')
                               for c in classes))
    return '--method ' + (f'{", ".join(names[:-1])} or {names[-1]}' if len(names) > 1 else names[0])


def batch_sizes(args):
    """A run's global batch sizes {option: size}: --batch_size and a method's own stages' (XLA's --xla_batch_size)."""
    return {name: size for name, size in vars(args).items()
            if name.endswith('batch_size') and name != 'eval_batch_size' and size is not None}
