"""Train a cross-lingual transfer method on an XTREME task, then evaluate it in every language.

    python train.py --method filter --task xnli --demo             # built-in data and a tiny model, on a CPU
    python train.py --method translate-train-all --task pawsx --init xlmr-base.pt --data_dir data/
    torchrun --nproc_per_node 8 train.py ...                       # the same run on 8 GPUs (DDP)

Read from the top: main calls execute, which hands a Run to the method's procedure (xlt.Method.procedure) to build,
feed, train, evaluate and report. Then comes train, the one training loop of every method and stage. Below the
divider are the command line, the checks and the plan, the run folder's lock and contract, --predict, resuming and
signals. A run writes to --out: config.json, log.jsonl, last.pt (the resume point), best.pt (the kept model),
results.json and .txt, and the test predictions in the leaderboard layout (predictions/<task>/test-<lang>.<ext>).
"""
import argparse
import functools
import gc
import json
import math
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
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


def main(argv=None):
    """Run the command line (parse_args) in its processes (one per GPU under torchrun). Any error prints one line."""
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision != 'fp32'  # off autocast
    rank, world, device = setup_distributed(start=not args.dry_run)  # a dry run starts no process group
    try:
        action(args)(args, rank, world, device)
    except BAD_INPUT as e:  # every process finds these alike (after the checks, one_process_errors handles them)
        fail(error_line(e))
    except KeyboardInterrupt:
        fail(interrupted(args))
    if dist.is_initialized():
        dist.destroy_process_group()


def execute(args, rank, world, device):
    """Do the run that args describe (the command's, or a stage's) in args.out. Check every option and file, print the
    plan (a dry run stops there), hold the folder, make the demo's data, then run the method's procedure."""
    check(args, world)
    if rank == 0:
        print(banner(args, world))
    if args.dry_run:
        return
    with one_process_errors(), hold(args.out, rank):  # past the checks, an error may be one process's alone
        if args.demo:
            make_demo(args, rank, world, device)
        run = Run(args, rank, world, device, tokenizer_of(args))
        if xlt.task_family(args) == 'retrieval':
            return run.cls.retrieval(run)
        run.cls.procedure(run)


class Run:
    """What a method's procedure is handed: args, tok, rank, world, device, out, its class (cls), and folder, the run
    folder's contract (Folder, below). It covers the model (build, pretrained, ready, restore), training (items, fit),
    evaluation (evaluate, outputs, sharded), the results (report, finish) and stages (stage, results_of, sub)."""

    def __init__(self, args, rank, world, device, tok, sets=None, eval_items=None):
        self.args, self.rank, self.world, self.device, self.tok = args, rank, world, device, tok
        self.out, self.cls, self.chunks = args.out, xlt.method_class(args), world * args.grad_accum
        self.folder = Folder(args, rank)
        self.tokenization = data.Tokenization(tok, args.data_dir, args.task, args.max_len, args.doc_stride,
                                              not args.no_cache, xlt.share_draw(args))
        self.sets = sets or {}  # a sub-run shares the evaluation sets of its run
        if sets is None and args.task in data.TASKS and xlt.task_family(args) != 'retrieval':
            self.sets = data.evaluation_sets(args.data_dir, args.task, args.translate_test, self.cls.paired, args.langs,
                                             self.cls.selects_on(args))
        self.eval_items = {'dev': {}, 'test': {}} if eval_items is None else eval_items  # the sets' features, made once

    def build(self, cls=None, encoder=None, settings=None, **parts):
        """Build the method (the run's class, or cls) on the device. Its encoder comes from --init (random weights for
        the demo and --from_scratch) and its head is seeded by --seed. parts are the other arguments its class takes."""
        encoder = self.pretrained().encoder if encoder is None else encoder
        torch.manual_seed(self.args.seed)  # the head's initial weights follow --seed, with --init too
        try:
            method = (cls or self.cls)(encoder, self.args.task, settings or self.args, **parts).to(self.device)
        except ValueError as e:
            fail(str(e))
        method.select = getattr(settings or self.args, 'select', None) or method.select  # --select, or the release's
        return method

    def pretrained(self, cross=False, init=None, decoder=False):
        """Load layers.Pretrained from init (default --init): the encoder, its MLM head and, with decoder, the decoder
        of a translation checkpoint. The demo and --from_scratch start from random weights. With cross the blocks have
        a cross-attention (the checkpoint's, or a new one); without it a checkpoint's cross-attention is left out."""
        args, init = self.args, init or self.args.init
        if init:
            loaded = layers.load_pretrained(init, cross, decoder)  # a CheckpointError becomes main()'s one line
        else:
            check_init(args)
            torch.manual_seed(args.seed)
            cfg = replace(layers.CONFIGS[args.model], vocab_size=self.tok.vocab_size)
            loaded = layers.Pretrained(layers.Encoder(cfg, cross), new_cross=cross)
        check_encoder(args, init, loaded.encoder.cfg, self.tok)
        attention = args.dropout if args.attn_dropout is None else args.attn_dropout
        layers.set_dropout(loaded.encoder, args.dropout, attention)
        return loaded._replace(encoder=self.ready(loaded.encoder))

    def ready(self, encoder):
        """Apply --grad_checkpoint and --compile to an encoder, and return it."""
        encoder.grad_checkpoint = self.args.grad_checkpoint
        if self.args.compile:
            layers.compile_blocks(encoder)
        return encoder

    def restore(self, weights, cls=None):
        """Load the method of a checkpoint, or of a finished run's folder (its best.pt), with its settings and weights.
        Given cls, the method is built as that class, and the checkpoint must be of this run's preset."""
        path = os.path.join(weights, 'best.pt') if os.path.isdir(weights) else weights
        expect = {'task': checkpoint_identity(self.args)['task'], **({'model': self.args.model} if cls else {})}
        ckpt = layers.load_checkpoint(path, expect)
        settings = argparse.Namespace(**ckpt['meta']['settings'])
        encoder = layers.Encoder(layers.stored_config(ckpt['config']))
        method = self.build(cls or xlt.method_class(settings), encoder, settings)
        method.load_state_dict(ckpt['method'])
        return method

    def items(self, method):
        """The training items of a method or of its class (data.training_set), or None with --eval_only."""
        args = self.args
        if args.eval_only:
            return None
        langs = method.train_langs(args, target_langs(args))
        items = data.training_set(self.tokenization, langs, method.trains_on, method.paired, method.round_trip,
                                  args.train_share, args.few_shot, args.with_squad)
        if not items:
            fail(f'no training examples for {args.task} in {args.data_dir}')
        return items

    def fit(self, method, items, validate=None, batches_of=None, keep_last=0):
        """Train method on items (train), resumable from last.pt. validate(): the scores that keep best.pt (default: the
        dev sets). batches_of(epoch): the global batches (default: shuffled). keep_last: N epochs to average."""
        if self.args.eval_only:
            return
        self.folder.begin()
        if keep_last and not self.args.resume:  # an earlier run's checkpoints must not be averaged with these
            self.folder.drop('checkpoints')
        validate = validate or (lambda: self.evaluate(method, 'dev')[0])
        train(self, method, items, validate, batches_of or self.shuffled(items), keep_last)

    def shuffled(self, items):
        """Return batches_of(epoch): a permutation fixed by (--seed, epoch), grouped by length with --group_by_length or
        cut by tokens with --max_tokens. A run in --steps reads pass after pass; each 'epoch' is --eval_every steps."""
        args = self.args
        lengths = data.item_lengths(items) if args.group_by_length or args.max_tokens else None

        @functools.lru_cache(maxsize=1)  # one pass in memory at a time
        def cut(p):
            return data.global_batches(len(items), args.batch_size, args.seed * 1000 + p, self.chunks, lengths,
                                       args.max_tokens, items.index[:, 0] if args.epoch_draw == 'one' else None)
        return data.stepped(cut, args.steps, args.eval_every, f'--batch_size {args.batch_size}') if args.steps else cut

    def evaluate(self, method, split, langs=None):
        """Score every language of the split (eval_sets), or those in langs. -> ({lang: scores}, {lang: predictions})"""
        scores, preds = {}, {}
        for lang, (gold, inputs, pairs) in ((k, v) for k, v in self.sets[split].items() if langs is None or k in langs):
            key, made = (lang, method.paired), self.eval_items[split]
            if key not in made:  # the features are kept on disk (data.evaluation_items) and stay open for the run
                made[key] = data.evaluation_items(self.tokenization, inputs, pairs if method.paired else None)
            items = made[key]
            feats = (item[1] if method.paired else item for item in items)  # the target side, read as it is scored
            preds[lang] = ev.predictions(self.args.task, feats, self.outputs(method, items), inputs)
            if ev.labelled(gold):
                scores[lang] = ev.scores_of(self.args.task, lang, gold, preds[lang])
        return scores, preds

    def outputs(self, method, items, then=lambda output: output):
        """Run the method on the target side of every item (a single-text method reads only the second text of a pair).
        Each output is cut to its tokens and passed through then. -> a data.Ragged of the outputs."""
        method.eval()
        collate, tuples = data.collate_items(method.paired, self.tok.pad), len(items) and isinstance(items[0], tuple)

        def of(index):
            batch = collate([items[i] if method.paired or not tuples else items[i][1] for i in index], index)
            lengths = (batch.tgt if method.paired else batch).mask.sum(1).tolist()
            result = method.predict(batch.to(self.device)).float().cpu()
            return [(then(r if method.family == 'classification' else r[:n]),) for r, n in zip(result, lengths)]
        return self.sharded(of, data.item_lengths(items)[:, int(tuples)])[0]

    @torch.no_grad()
    def sharded(self, fn, lengths, desc='eval', fields=1, everywhere=True):
        """Run fn over every position in the run's precision. Each process takes its share, and the shares pass
        through the run's folder (data.shared_out)."""
        with layers.autocast(self.device, self.args.precision):
            return data.shared_out(fn, lengths, (self.rank, self.world, self.out), self.args.eval_batch_size, desc,
                                   fields, everywhere)

    def report(self, method):
        """Write the kept model's dev and test scores in every language, and its test predictions, to results.json,
        results.txt and predictions/."""
        self.load_best(method)
        dev, test, scored = self.scored(method)
        if self.args.translate_test and method.family == 'qa':  # English answers, scored on the translations' answers
            scored = {**scored, **{lang: s for lang, s in test.items() if lang != 'en'}}
        self.finish(dev, scored, xlt.selection(method.select, dev).rule)

    def load_best(self, method):
        """Load the weights of best.pt into method if the run kept one. -> True when it did."""
        if self.folder.holds('best.pt'):
            best = layers.load_checkpoint(self.path('best.pt'), checkpoint_identity(self.args))
            method.load_state_dict(best['method'])
            return True

    def scored(self, method):
        """Score method on the dev and test sets, its predictions written -> (dev, test, test_scores' scores)."""
        dev, dev_preds = self.evaluate(method, 'dev')
        test, preds = self.evaluate(method, 'test')
        return dev, test, self.test_scores(preds, dev_preds)

    def test_scores(self, preds, dev_preds=None):
        """Write the test predictions in the leaderboard layout and score them (eval.py) against
        labels/<task>/test-<lang>.* where the data folder has them. Write dev_preds beside them."""
        labels = os.path.join(self.args.data_dir, 'labels')
        write_dev_predictions(self, dev_preds or {})  # beside the test ones, for eval.py --analyse
        return ev.score_predictions(self.path('predictions'), labels, self.args.task, preds) if self.rank == 0 else {}

    def finish(self, dev, test, selected_by=None, runs=None, name=None):
        """Write results.json and the table of the run's scores (eval.results). runs are other rows that come first
        (several models of one run); the run's own row follows, named `name`."""
        results, table = ev.results(vars(self.args), dev, test, selected_by, runs, name)
        kept = ', the kept model in best.pt' if self.folder.holds('best.pt') else ''
        self.folder.write_results(results, table, f'results in {self.out}/results.json and results.txt, predictions '
                                                  f'in {self.out}/predictions/{kept}')

    def stage(self, name):
        """Run the method's stage `name` (one of its stages()) unless it finished with these settings. --resume
        continues a stage that began. -> the stage's folder, relative to this run's folder."""
        self.folder.begin()
        if self.args.gpus > 1:  # at the first stage asked for, run every stage at once
            stages_at_once(self)
        settings = stage_settings(self.args, self.cls, name)
        if finished_alike(settings):
            self.say(f'{name}: reused, the finished run in {settings.out} has these settings')
        else:
            execute(settings, self.rank, self.world, self.device)
        return os.path.relpath(settings.out, self.out)

    def results_of(self, name):
        """The results of the stage `name`, or None when it has not finished."""
        folder = stage_settings(self.args, self.cls, name).out
        return json.load(open(os.path.join(folder, 'results.json'))) if is_finished(folder) else None

    def sub(self, name, **changes):
        """A run in the subfolder `name` of this run, with changed settings and the same evaluation sets."""
        self.folder.keep(name)
        args = argparse.Namespace(**{**vars(self.args), 'out': self.path(name), **changes})
        return Run(args, self.rank, self.world, self.device, self.tok, self.sets, self.eval_items)

    def path(self, name):
        return self.folder.path(name)

    def say(self, message):
        if self.rank == 0:
            print(message)

    def fail(self, message):
        fail(message)


class Training:
    """What the steps of one training share: the run, the method (model is the method, or the method in DDP), its
    items and the way a batch of them is made (collate), AdamW and its schedule, the precision (autocast, fp16's loss
    scaler), validate(), and the state: step, epoch and best dev score (ResumePoints reads it from last.pt)."""

    def __init__(self, run, method, items, validate, total_steps, epochs, keep_last=0):
        self.run, self.method, self.items, self.validate, self.keep_last = run, method, items, validate, keep_last
        self.epochs = epochs  # --epochs, or how many 'epochs' of --eval_every steps (or passes) make up --steps
        self.opt, self.sched = optimizer_and_schedule(method, run.args, total_steps)
        self.model = wrapped(method, run.device, run.args.ddp_bf16_grads) if run.world > 1 else method
        self.precision = layers.Precision(run.args.precision, run.device)
        self.collate = data.collate_items(method.paired, run.tok.pad)
        self.state, self.log = {'step': 0, 'epoch': 0, 'best': -math.inf}, None  # log: process 0's log.jsonl
        self.since, self.epoch_loss = [], []  # the step logs since the last log line, and the epoch's mean losses
        self.started, self.padding, self.bar = time.time(), 0.0, None  # the clock (restarted on resume), begin_epoch's
        self.writer = layers.Writer()  # writes every checkpoint of the training in the background


def train(run, method, items, validate, batches_of, keep_last=0):
    """Train for --epochs epochs of batches_of(epoch), or for --steps steps: a step for each batch, a log line every
    --log_every steps, and after each epoch the dev scores, which choose best.pt. Below the divider are --resume,
    resume points and signals (ResumePoints), and each epoch's progress bar and memory probe (begin_epoch)."""
    per_epoch = len(batches_of(0))  # with --steps, an 'epoch' is --eval_every steps, or a pass
    epochs = run.args.epochs or math.ceil(run.args.steps / per_epoch)
    training = Training(run, method, items, validate, run.args.steps or per_epoch * epochs, epochs, keep_last)
    with ResumePoints(training) as resume_points:
        while training.state['epoch'] < epochs:
            batches = begin_epoch(training, batches_of(training.state['epoch']), per_epoch)  # resumed: the batches left
            for batch in batches:
                training.since.append(train_step(training, batch))
                training.since[-1].update(optimizer_step(training))
                step = training.state['step']
                if step % run.args.log_every == 0 or batch is batches[-1]:
                    log_line(training, resume_points)  # the loop's only host sync
                if run.args.eval_steps and step % run.args.eval_steps == 0 and step % per_epoch:
                    end_epoch(training, within=round(step / per_epoch, 2))  # --eval_steps: also within the epoch
                resume_points.after_step(epoch_end=step % per_epoch == 0)
            training.bar.close()
            training.state['epoch'] += 1
            end_epoch(training)
            resume_points.after_epoch(last=training.state['epoch'] == epochs)
        resume_points.trained()  # writes trained.json, and removes last.pt with the optimiser's state
    del training, resume_points  # the DDP wrapper and the optimiser hold reference cycles; on a GPU, collect them now
    collect(run.device)


def train_step(training, batch, probe=False):
    """Compute the gradients of one optimiser step. The global batch is cut into world x grad_accum chunks. Chunk c
    runs on process c % world with its own dropout seed, so any split over processes and micro-steps computes the same
    gradient. Running out of memory prints one line (probe: this step is the trial of the largest batch)."""
    run, step, accum = training.run, training.state['step'], training.run.args.grad_accum
    chunks = np.array_split(np.array(batch), run.world * accum)
    mine = sum(len(chunks[a * run.world + run.rank]) for a in range(accum))
    logs = {}
    training.model.train()  # validation leaves it in eval mode
    try:
        for a in range(accum):
            c = a * run.world + run.rank
            torch.manual_seed(dropout_seed(run.args.seed, step, c))
            sync = a == accum - 1 or not isinstance(training.model, DDP)
            items = [training.items[i] for i in chunks[c]]
            # the batch keeps its items' positions (Batch.index), so a method can look up what it stored for them
            micro = training.method.host(training.collate(items, chunks[c].tolist())).to(run.device)
            with (nullcontext() if sync else training.model.no_sync()), training.precision.autocast():
                loss, chunk_logs = training.model(micro)
            training.precision.backward(loss * len(chunks[c]) * run.world / len(batch))
            for k, v in chunk_logs.items():  # the mean over this process's micro-batches, weighted by size
                logs[k] = logs.get(k, 0.0) + v * len(chunks[c]) / mine
    except torch.OutOfMemoryError:
        fail(out_of_memory(run.args, training.items, batch, step + 1, run.world, probe), own=True)
    return logs


def optimizer_step(training):
    """Step the optimiser and the schedule, then count the step. -> fp16's log (whether the scaler skipped the step)"""
    method, args = training.method, training.run.args
    method.before_update()  # a method in a frozen phase drops the frozen parameters' gradients here
    logs = training.precision.step(training.opt, method.parameters(), args.clip, args.clip_by)
    training.sched.step()
    training.opt.zero_grad(set_to_none=not isinstance(training.model, DDP))  # under DDP, zero the views (wrapped)
    training.state['step'] += 1
    training.bar.update()
    note_event(training, method.stepped(training.state['step']))  # a phase that ends at this step, if any
    return logs


def log_line(training, resume_points):
    """Write a line of log.jsonl with the mean of each logged value since the last line. The processes agree on their
    mean loss, and on any resume point or stop that one of them asks for (resume_points.agree). A mean loss that is
    not finite stops the run with one line."""
    since, step = training.since, training.state['step']
    logs = {k: float(sum(s[k] for s in since if k in s)) / sum(k in s for s in since)
            for k in dict.fromkeys(k for s in since for k in s)}
    loss = resume_points.agree(logs['loss'])  # summed over the processes
    if not math.isfinite(loss):
        fail(diverged(training.run, loss, step - len(since) + 1, step))
    training.bar.set_postfix(loss=f'{logs["loss"]:.3f}')
    write_log(training, lr=training.sched.get_last_lr()[0], time=round(time.time() - training.started, 2), **logs)
    training.epoch_loss.append((logs['loss'], len(since)))
    training.since = []


def end_epoch(training, within=None):
    """End an epoch, or with --eval_steps a point `within` it (in epochs). Keep the weights for averaging (with
    --average_last), get the dev scores (validate), save best.pt if they are the best so far, and write the line."""
    run, state, seconds = training.run, training.state, time.time() - training.started  # the time before the dev sets
    if training.keep_last and within is None:  # fairseq's --save-interval-updates and --keep-interval-updates
        weights = {'method': training.method.state_dict()}
        save(run, f'checkpoints/step{state["step"]:07d}.pt', weights, training.writer, training.keep_last)
    dev = training.validate()
    score = keep_if_best(training, dev)
    report_epoch(training, dev, score, seconds, within)


def keep_if_best(training, dev):
    """Save best.pt when the selection score of the dev scores (xlt.selection) is the best so far. -> that score."""
    method, state = training.method, training.state
    score = xlt.selection(method.select, dev).score
    score = state['epoch'] if score is None else score  # without a dev set, keep the last
    if score > state['best']:
        state['best'] = float(score)
        kept = {**layers.encoder_parts(method.encoder, method.mlm), 'method': method.state_dict()}
        save(training.run, 'best.pt', kept, training.writer)
    return score


def dropout_seed(seed, step, chunk):
    """The dropout seed of one chunk of a step. It is the same for any split over processes and micro-batches."""
    return seed * 1_000_003 + step * 1009 + chunk


def optimizer_and_schedule(method, args, total_steps):
    """AdamW (no weight decay on biases and LayerNorms unless the method says so) and the method's schedule."""
    decay = [p for n, p in method.named_parameters() if p.dim() >= 2 or method.DECAY_ALL]
    no_decay = [p for n, p in method.named_parameters() if p.dim() < 2 and not method.DECAY_ALL]  # biases, LayerNorms
    # fused runs one kernel over all parameters (CPU and CUDA): the same update up to rounding, several times faster
    opt = torch.optim.AdamW([{'params': decay, 'weight_decay': args.weight_decay},
                             {'params': no_decay, 'weight_decay': 0.0}], lr=args.lr, betas=(0.9, args.adam_beta2),
                            eps=args.adam_eps, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, method.schedule(args, total_steps))


# === Machinery: the command line, checks and plan, the run folder's lock and contract, --predict, resume, signals ===


# ----------------------------------------------------------------------------------------
# The command line: the trainer's options and each method's (xlt), checked, then the defaults.

def fail(message, own=False):
    """One line on stderr from the first process, or with own under DDP from each process that meets it, naming it."""
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    if own and world > 1:
        raise SystemExit(f'error (process {rank} of {world}): {message}')
    raise SystemExit(f'error: {message}' if rank == 0 else 1)


BAD_INPUT = (data.DataError, ev.EvalError, layers.CheckpointError, OSError)  # each one line (error_line)


def error_line(e):
    return f'{e.filename}: {e.strerror}' if isinstance(e, OSError) and e.strerror else str(e)


@contextmanager
def one_process_errors():
    """Past the checks, an error may be one process's own: under DDP its line names the process."""
    try:
        yield
    except BAD_INPUT as e:
        fail(error_line(e), own=True)


# The demo: a tiny model from scratch, no warm-up (a ramp from 0 leaves it on a plateau for some seeds), random batches
# (length tells the demo's labels: grouped batches would each hold one); 8 epochs, QA 15; a method's DEMO changes these.
DEMO = {'model': 'tiny', 'lr': 1e-3, 'warmup': 0.0, 'batch_size': 32, 'group_by_length': False}
OPTIONS = (  # the trainer's options; each method's own are its class's OPTIONS (xlt.py)
    Option('method', str, f'one of {", ".join(xlt.METHODS)}', default='zeroshot', changes='scores'),
    Option('task', str, f'one of {", ".join(data.TASKS)}; with --method veco also pretrain, translate', default='xnli',
           changes='scores'),
    Option('demo', bool, 'generated data and a tiny model: runs in a minute on a CPU'),
    Option('model', str, f'preset: {", ".join(layers.CONFIGS)} (default base; tiny with --demo)', changes='scores'),
    Option('init', str, 'converted XLM-R checkpoint (python layers.py convert) or a run\'s best.pt', path='checkpoint'),
    Option('from_scratch', bool, 'random weights: real data without --init, a demo that would start pre-trained'),
    Option('spm', str, 'XLM-R\'s sentencepiece model (default: the one in --data_dir)', changes='nothing'),
    Option('vocab', str, 'BERT\'s vocab.txt (default: the one beside --init, else in --data_dir)', changes='nothing'),
    Option('dict', str, '--init\'s fairseq dict.txt (default: one beside it, as VECO\'s NLG model)', changes='scores'),
    Option('data_dir', str, 'XTREME data in the layout of docs/data.md', default='data', changes='nothing'),
    Option('translations', str, 'xtreme: --data_dir\'s translations (XTREME\'s); filter: --data_dir/filter, FILTER\'s '
           'data; xmixup: --data_dir/xmixup, X-Mixup\'s (python data.py download --translations NAME); or a data '
           'folder of other translations (default: the method\'s own; XTREME\'s for the demo)', changes='scores'),
    Option('out', str, 'run folder (default runs/<task>-<method>-<choices that change results>)', changes='nothing'),
    Option('lr', help='peak learning rate (default: the release\'s per task, as its docs page says)', valid=POSITIVE),
    Option('epochs', int, 'passes over the training data (default: the release\'s, per task)', AT_LEAST_1),
    Option('steps', int, 'train this many optimiser steps instead, the data read pass after pass (XLA\'s warm-ups '
           '3000, Table 8; pre-training 240000, Table 5; translation 100000)', AT_LEAST_1),
    Option('eval_every', int, 'with --steps: steps between evaluations (default: a pass over the training data; '
           'pre-training 2000; translation 5000, each saving a checkpoint to average)', AT_LEAST_1),
    Option('batch_size', int, 'global batch size, over all processes (default: the release\'s, per task)', AT_LEAST_1),
    Option('epoch_draw', str, 'an epoch trains on every item, or on one of the items of each English example (one: '
           'English with one of its translations, drawn each epoch, as FILTER\'s run_xtag.py)', choices=('all', 'one')),
    Option('group_by_length', bool, 'training batches of similar lengths, little padding (ours: faster, not as the '
           'papers ran)', negated='random training batches, as the papers\' scripts (the default)'),
    Option('grad_accum', int, 'micro-batches per process and step', AT_LEAST_1, default=1, changes='nothing'),
    Option('max_len', int, 'max tokens per input (default 128; QA 384)', (lambda v: 8 <= v <= 512, '8 to 512 tokens'),
           changes='scores'),
    Option('warmup', help='share of steps the learning rate rises in (default: the release\'s, mostly 0)', valid=SHARE),
    Option('warmup_steps', int, 'the warm-up in steps instead (VECO\'s SQuAD script: 500)', NON_NEGATIVE),
    Option('doc_stride', int, 'QA: tokens between window starts (default 128; VECO 64)', AT_LEAST_1, changes='scores'),
    Option('weight_decay', help='AdamW\'s weight decay (default: the release\'s, mostly 0)', valid=NON_NEGATIVE),
    Option('clip', help='gradient clipping at this norm (default 1.0; translation 0.1)', valid=POSITIVE),
    Option('clip_by', str, 'clip the gradients\' norm or each element (X-Mixup\'s release)', choices=('norm', 'value')),
    Option('adam_eps', help='Adam\'s epsilon (default 1e-8; BERT\'s QA and VECO\'s pre-training 1e-6)', valid=POSITIVE),
    Option('adam_beta2', help='Adam\'s beta2 (default 0.999; VECO large\'s pre-training 0.98)', valid=SHARE),
    Option('select', str, 'the checkpoint kept: the best English dev score (en), the best dev average (average) or '
           'the last (default: the method\'s release)', choices=('en', 'average', 'last')),
    Option('dropout', help='override the model\'s dropout', valid=SHARE),
    Option('attn_dropout', help='override the attention dropout (default: --dropout\'s value)', valid=SHARE),
    Option('seed', int, 'seed of the head, the batches and dropout (default: the release\'s, else 1)', NON_NEGATIVE),
    Option('share_seed', int, 'seed of --train_share\'s draw (default: --seed, a new draw for each seed, as XLA\'s '
           'paper; XLA\'s warm-ups read its run\'s)', NON_NEGATIVE),
    Option('seeds', lambda text: [int(seed) for seed in text.split(',') if seed], 'a,b,c: the run once a seed, one '
           'after another, in --out/seed<s>, then the mean and standard deviation over them (--out/seeds.txt)',
           NON_NEGATIVE, changes='nothing'),
    Option('train_langs', lambda text: [lang for lang in text.split(',') if lang], 'a,b,c: with a method of '
           '--train_lang (translate-train, in-language, XLA), the run once a language, in --out/<lang>, then the row '
           'of each language\'s score from its own run (--out/langs.txt)', changes='nothing'),
    Option('gpus', int, 'with --seeds or a method\'s stages (--search, XLA\'s warm-ups): N runs at once, each a '
           'process on a GPU of its own (on a CPU, its share of the cores)', AT_LEAST_1, default=1, changes='nothing'),
    Option('commands', bool, 'with --seeds or stages: print each run\'s command line, one a line (a job array\'s), and '
           'run none; the same command without it then reuses them', changes='nothing'),
    Option('precision', str, 'bf16, fp16 (with a loss scaler) or fp32 (default: the release\'s on a GPU, mostly fp32; '
           'fp32 on the CPU)', choices=('bf16', 'fp16', 'fp32')),
    Option('translate_test', bool, 'evaluate on the test sets translated into English', changes='scores'),
    Option('with_squad', bool, 'tydiqa: SQuAD v1.1\'s English training set too (FILTER\'s leaderboard runs)'),
    Option('langs', lambda text: [lang for lang in text.split(',') if lang], 'the target languages to run, e.g. de,sw '
           '(XTREME\'s --predict_languages): the others\' files are not read; English, the source, runs too'),
    Option('seen_langs', lambda text: [lang for lang in text.split(',') if lang], 'a,b,c: with a method that trains '
           'on every language\'s translations, train on these alone and evaluate on all (X-Mixup\'s Table 6)'),
    Option('layer', lambda text: tuple(int(n) for n in text.split('-')), 'retrieval: layer pooled (default XTREME\'s: '
           'BUCC 20, Tatoeba 14 of 24; 8 of 12), or A-B: layers A to B\'s, side by side (XTREME\'s Table 14)',
           (lambda v: v >= 1, 'a layer, at least 1'), changes='scores'),
    Option('pool', str, 'retrieval: the mean of a text\'s states, or its first token\'s (<s>, [CLS])',
           choices=('mean', 'cls'), default='mean', changes='scores'),
    Option('grad_checkpoint', bool, 'recompute blocks in backward: less memory, a third more time', changes='nothing'),
    Option('gpu_memory', help='GiB of the GPU to plan for (default: the GPU found): the plan estimates a process\'s '
           'peak and says whether it fits, or what would make it fit', valid=POSITIVE, changes='nothing'),
    Option('eval_batch_size', int, 'examples per evaluation batch', AT_LEAST_1, default=64, changes='nothing'),
    Option('save_minutes', help='minutes between resume checkpoints (last.pt; also at each epoch\'s end and when '
           'SIGTERM asks); 0: at every log line', valid=NON_NEGATIVE, default=30.0, changes='nothing'),
    Option('ddp_bf16_grads', bool, 'under DDP, all-reduce the gradients in bf16: half the bytes between GPUs, each '
           'gradient\'s mean rounded to bf16 (a communication hook)'),
    Option('term_grace', help='seconds a SIGTERM\'s (SIGUSR1\'s) last.pt may take, by the writer\'s last measured rate '
           '(default 20 under torchrun or Slurm, whose grace is 30, else 60): beyond it, or with 0, the run stops at '
           'its last resume point', valid=NON_NEGATIVE, changes='nothing'),
    Option('no_cache', bool, 'tokenize into a temporary folder, not once into <data_dir>/.cache', changes='nothing'),
    Option('eval_steps', int, 'also select within an epoch, every N steps (VECO: XNLI 500, SQuAD 200)', AT_LEAST_1),
    Option('log_every', int, 'steps between log.jsonl lines, each their mean (one host sync)', AT_LEAST_1, default=10,
           changes='nothing'),
    Option('compile', bool, 'torch.compile each block (slower first steps; outputs alike to 1e-5)', changes='nothing'),
    Option('resume', bool, 'continue from --out/last.pt', changes='nothing'),
    Option('eval_only', bool, 'evaluate --out/best.pt (or --init) without training', changes='nothing'),
    Option('predict', str, 'FILE [TRANSLATION]: the finished run in --out predicts FILE, a TSV of the task\'s columns '
           'or a QA JSON (docs/runs.md), or a split of its data (train-de), into --out/predicted/', nargs='+',
           changes='nothing'),
    Option('overwrite', bool, 'replace a finished run of other settings in --out (else refused)', changes='nothing'),
    Option('dry_run', bool, 'check the options and files, print the plan, stop (writes nothing)', changes='nothing'),
    Option('halt_after', int, argparse.SUPPRESS, changes='nothing'),  # tests: die abruptly after this many steps
    Option('term_after', int, argparse.SUPPRESS, changes='nothing'),  # tests: a SIGTERM to itself after this many steps
    Option('only_stage', str, argparse.SUPPRESS, changes='nothing'),  # a sweep's process (fan_out): one stage alone
    Option('started', float, argparse.SUPPRESS, changes='nothing'),  # when the command began (parse_args)
    Option('command', str, argparse.SUPPRESS, nargs='*', changes='nothing'))  # its words (a sweep's runs change them)


def parse_args(argv=None):
    p = layers.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for o in OPTIONS:
        add_option(p, o)
    owners = {}  # a method option -> the classes that declare it; --help groups them by the first
    for c in xlt.classes():
        new = [o for o in c.OPTIONS if o.name not in owners]
        group = p.add_argument_group(f'options of {xlt.called([c])}') if new else None
        for o in c.OPTIONS:
            owners.setdefault(o.name, []).append(c)
        for o in new:
            add_option(group, o._replace(default=None))  # a method's defaults once it is the one that runs
    args = p.parse_args(argv)
    args.started, args.command = time.time(), list(sys.argv[1:] if argv is None else argv)
    for o in OPTIONS + tuple(o for c in xlt.classes() for o in c.OPTIONS):  # before the defaults: 0 is not 'not given'
        value = getattr(args, o.name)
        if o.valid and value is not None and not all(math.isfinite(v) and o.valid[0](v) for v in np.atleast_1d(value)):
            fail(f'--{o.name} {" ".join(map(str, value)) if o.nargs else value} is out of range: give {o.valid[1]}')
    return configure(args, owners)


def add_option(parser, o):
    """--name on the parser; a flag with a negated form also --no_name (None when neither is given)."""
    if o.type is bool:
        parser.add_argument(f'--{o.name}', action='store_true', default=None if o.negated else False, help=o.help)
        if o.negated:
            parser.add_argument(f'--no_{o.name}', dest=o.name, action='store_false', default=None, help=o.negated)
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
    if args.layer and (len(args.layer) > 2 or args.layer[0] > args.layer[-1]):
        fail(f'--layer {"-".join(map(str, args.layer))}: give a layer N or a range A-B with A at most B')
    shape = data.TRAINS_ON[cls.trains_on]
    if args.with_squad and (args.task != 'tydiqa' or not (cls.paired or (shape.english and not shape.own))):
        fail(f'--with_squad adds SQuAD to the English of TyDiQA\'s training set, which {args.method} on {args.task} '
             'does not train on: drop it')
    if args.seen_langs and (shape.langs != 'every' or not set(args.seen_langs) <= set(target_langs(args))):
        fail(f'--seen_langs {",".join(args.seen_langs)}: name some of {",".join(target_langs(args))}, with a method '
             'that trains on every language together (translate-train-all, FILTER, X-Mixup), or drop it')
    if args.translate_test and (xlt.task_family(args) not in ('classification', 'qa') or cls.paired):
        fail('--translate_test needs a method that reads one text and a task whose labels survive translation '
             '(tags would need a word alignment): drop --translate_test')
    demo = {**DEMO, **cls.DEMO} if args.demo else None
    args.model = args.model or (demo or {}).get('model', 'base')
    if args.model not in layers.CONFIGS:
        fail(f'unknown model {args.model!r}: choose one of {", ".join(layers.CONFIGS)}')
    args.stage = None  # a stage's own run says which it is; a method may name its run's (xlt)
    if args.train_langs:  # a sweep, checked as its first run; its folder named without a language
        if args.train_lang or args.seeds or 'train_lang' not in {o.name for o in cls.OPTIONS}:
            of_a_language = [c for c in xlt.classes() if 'train_lang' in {o.name for o in c.OPTIONS}]
            fail(f'--train_langs runs {xlt.called(of_a_language)} once a language: drop --train_lang and --seeds')
        args.train_lang = args.train_langs[0]
    if args.translations and args.translations != 'xtreme' and args.demo:
        fail('--translations reads a data folder that python data.py download makes; the demo has XTREME\'s shapes '
             'alone: drop --translations')
    args.translations = args.translations or ('xtreme' if args.demo else cls.TRANSLATIONS)
    seeded = args.seed is not None  # a seed given names the default folder
    try:
        cls.configure(args, demo)
    except ValueError as e:
        fail(str(e))
    if args.qa_case == 'lower' and xlt.task_family(args) != 'qa':
        fail(f'--qa_case lower lowercases the text of QA tasks, not of {args.task}: drop it')
    named = argparse.Namespace(**{**vars(args), 'train_lang': None}) if args.train_langs else args
    args.out = args.out or os.path.join('runs', '-'.join(cls.folder(named) + default_folder(args, cls, seeded)))
    args.data_dir = data_folder(args)
    args.dict = args.dict or data.beside(args.init, 'dict.txt')
    check_spread(args, cls)
    if args.demo and not args.init and not args.from_scratch and cls.pretrained_start and args.model == demo['model']:
        args.init = demo_start(args.out)  # made by the run when missing; recorded alike by every run of the folder
    return args


def check_spread(args, cls):
    """--gpus and --commands spread the runs of a sweep (or a method's stages), --gpus on the GPUs there are."""
    if (args.gpus > 1 or args.commands) and not (args.seeds or args.train_langs or cls.stages(args)):
        fail('--gpus and --commands spread the runs of a sweep: add --seeds a,b,c (--train_langs, --search), or drop '
             'them')
    if args.gpus > 1 and 'RANK' in os.environ:
        fail('--gpus runs a sweep\'s runs side by side, each in processes of its own: not under torchrun')
    if args.gpus > 1 and torch.cuda.is_available() and args.gpus > torch.cuda.device_count():
        fail(f'--gpus {args.gpus} asks for more GPUs than the {torch.cuda.device_count()} this process sees '
             '(CUDA_VISIBLE_DEVICES): give at most that many')


def data_folder(args):
    """The run's data folder: the demo's in the run folder, a release's translations' or others', or --data_dir."""
    if args.demo:
        return os.path.join(args.out, 'demo-data')
    if args.translations in ('filter', 'xmixup'):
        return os.path.join(args.data_dir, args.translations)
    return args.data_dir if args.translations == 'xtreme' else args.translations


def default_folder(args, cls, seeded):
    """The rest of a default folder's name: translate-test, other translations, the languages seen in training,
    another preset, a seed, the demo."""
    other = os.path.basename(os.path.normpath(args.translations))  # xtreme, filter, xmixup, or the folder's name
    own = 'xtreme' if args.demo else cls.TRANSLATIONS
    return (['translate-test'] * args.translate_test + [f'{other}-translations'] * (args.translations != own)
            + ['seen-' + '-'.join(args.seen_langs or [])] * bool(args.seen_langs)
            + [args.model] * (args.model != ('tiny' if args.demo else 'base'))
            + [f'seed{args.seed}'] * seeded + ['demo'] * args.demo)


def demo_start(out):
    """The demo's pre-trained model: VECO pre-trained on the demo's text, beside the run folder."""
    return os.path.join(os.path.dirname(os.path.abspath(out)), 'pretrain-veco-demo', 'best.pt')


def makes_demo_start(args):
    """Does the run start from the demo's pre-trained model, which it makes first?"""
    return args.demo and args.init == demo_start(args.out) and not is_finished(os.path.dirname(args.init))


def setup_distributed(start=True):
    """-> (rank, world size, device); under torchrun (or srun, docs/runs.md) one process per device. start=False
    (--dry_run): the rank and world size the launcher gives, no process group and no device."""
    if not start:
        return int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1)), None
    if 'RANK' not in os.environ:
        return 0, 1, torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    cuda = torch.cuda.is_available()
    local = local_gpu() if cuda else 0
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group('nccl' if cuda else 'gloo', device_id=torch.device('cuda', local) if cuda else None)
    data.WAITS = waits_group()
    return dist.get_rank(), dist.get_world_size(), torch.device(f'cuda:{local}' if cuda else 'cpu')


def local_gpu():
    """This process's GPU: LOCAL_RANK among those it sees (srun with a GPU a task: each sees its own, as GPU 0)."""
    return int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()


def waits_group():
    """The gloo group of data.barrier's waits, which get data.PATIENCE while the training's collectives keep torch's
    timeout; checked within data.CONNECT, so that processes that cannot reach each other stop the run in minutes."""
    try:
        group = dist.new_group(backend='gloo', timeout=data.CONNECT)
        dist.monitored_barrier(group, data.CONNECT, wait_all_ranks=True)
    except RuntimeError as e:
        why = str(e).splitlines()[0]
        fail(f'the processes could not reach each other within {data.CONNECT.total_seconds():g} s ({why}): name the '
             'network interface the nodes share in GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (docs/runs.md)')
    dist.distributed_c10d._set_pg_timeout(data.PATIENCE, group)  # torch's one setter (private) of a group's timeout
    return group


# ----------------------------------------------------------------------------------------
# Checks before anything is made, and the plan.

def check(args, world):
    """Check everything before anything is made: --out and what it holds, the options, and every file the run reads.
    Every process finds the same, a stage's checks too (within its run's one_process_errors): one line, unnamed."""
    try:
        check_all(args, world)
    except BAD_INPUT as e:
        fail(error_line(e))


def check_all(args, world):
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
    check_options(args, cls)
    if args.translations in ('filter', 'xmixup') and not os.path.isdir(args.data_dir):
        fail(f'{args.data_dir} not found: {args.method} reads its release\'s data there (python data.py download '
             f'--task {args.task} --translations {args.translations} --out {os.path.dirname(args.data_dir)}); '
             '--translations xtreme runs it on XTREME\'s translations')
    files = [] if args.demo else planned_files(args, cls)
    data.check_files(args.data_dir, args.task, args.method, files, backbone(args))
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
    check_finished(args)


def check_stages(args, cls):
    """A finished stage kept outside the run's folder (--warmup_dir) serves other runs: other settings are refused."""
    for name, changes in cls.stages(args).items():
        settings = stage_settings(args, cls, name)
        found = read_config(settings.out) if 'out' in changes and is_finished(settings.out) else None
        if found and (differ := differences(found, settings)):
            fail(f'{settings.out} holds a finished {name} with --{differ[0]} {found.get(differ[0])} '
                 f'(this run: {getattr(settings, differ[0])}): give another folder, or remove that one')


def check_options(args, cls):
    """Check translate-train's language, and the method's own layer counts on its model (sketched)."""
    langs = target_langs(args) if args.task in data.TASKS or args.langs else ()  # --langs checked
    if data.TRAINS_ON[cls.trains_on].langs == 'one' and xlt.task_family(args) != 'retrieval':
        langs = ['en'] * data.TRAINS_ON[cls.trains_on].own + langs  # in-language English: XTREME's rows average it
        for lang in args.train_langs or [args.train_lang]:
            if lang not in langs:
                fail(f'{args.method} needs --train_lang, one of {", ".join(langs)}' + f' (not {lang})' * bool(lang))
    sketched(args, cls)


def sketched(args, cls):
    """The method built on the meta device for the plan (None for retrieval); a layer count that does not fit stops."""
    if xlt.task_family(args) != 'retrieval':
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


def check_encoder(args, init, got, tok):
    """The encoder's shape (config got) is the preset's, and its vocabulary the tokenizer's."""
    cfg, shape = layers.CONFIGS[args.model], lambda c: (c.backbone, c.n_layer, c.dim, c.n_head, c.ffn_dim)
    if shape(got) != shape(cfg):
        fail(f'--init {init} is {got.backbone} {got.n_layer} x {got.dim}, not the {args.model} preset '
             f'({cfg.backbone} {cfg.n_layer} x {cfg.dim}): pass the --model it was made for')
    if (got.vocab_size, got.pad_id, got.sep_id) != (tok.vocab_size, tok.pad, tok.eos):
        fail(f'the tokenizer has {tok.vocab_size} ids (padding {tok.pad}, separator {tok.eos}), the model '
             f'{got.vocab_size} ({got.pad_id}, {got.sep_id}): pass its own (--spm, --dict; --vocab)')


def target_langs(args):
    """The task's languages but English: XTREME's, the demo's, or those --langs chose."""
    try:
        langs = data.languages(args.task, args.demo or data.is_demo(args.data_dir), args.langs)
    except data.DataError as e:
        fail(f'--langs: {e}')
    return [lang for lang in langs if lang != 'en']


def planned_files(args, cls):
    """-> [(path, what it is, needed)] of the data a run of the method class cls reads (data.task_files
    and the method's own), the tokenizer's file last; not needed: read where it is there."""
    files = []
    if args.task in data.TASKS:
        langs = cls.train_langs(args, target_langs(args))
        files = data.task_files(args.data_dir, args.task, langs, cls.round_trip, cls.paired or args.translate_test,
                                not args.eval_only, args.method, cls.trains_on, args.langs)
    squad = [(data.split_path(args.data_dir, 'xquad', 'train'), 'SQuAD\'s English training set (--with_squad)', True)]
    files += squad * (args.with_squad and not args.eval_only)
    task, split, langs, _ = cls.selects_on(args) or (args.task, 'dev', None, None)
    why = f'{args.method} keeps its checkpoint by {task}\'s dev sets (python data.py download --task {task})'
    files += [(data.split_path(args.data_dir, task, kind, lang), why, True) for lang in langs or data.languages(
        task, args.demo) for kind in ['dev'] + ['translate-dev'] * (cls.paired and lang != 'en')] * (task != args.task)
    return files + cls.reads(args) + [data.tokenizer_file(backbone(args), args.data_dir, args.spm, args.vocab,
                                                          args.init)]


def check_run(args, name, folder):
    """--name is a finished run of this task: its results.json, and its best.pt's meta says so."""
    if not is_finished(folder):
        fail(f'--{name} {folder} is not a finished run (no results.json): give the folder of a finished run')
    try:
        ckpt = layers.load_checkpoint(os.path.join(folder, 'best.pt'), mmap=True)
    except layers.CheckpointError as e:
        fail(f'--{name} {folder}: {e}')
    task, model = ckpt['meta']['task'], layers.stored_config(ckpt['config']).backbone
    if task != args.task:
        fail(f'--{name} {folder} is a run of {task}, not {args.task}: give a {args.task} run')
    if model != backbone(args):  # its ids would be another tokenizer's
        fail(f'--{name} {folder} is a run of {model}, this one of {backbone(args)}: give a run of the same model')


def banner(args, world):
    """The run in a few named lines: the banner, and all that --dry_run prints."""
    status = ('dry run, nothing is trained or written' if args.dry_run else 'evaluating' if args.eval_only
              else 'resuming' if args.resume else 'a new run')
    title = f'{args.method} on {args.task}{f" ({args.stage})" if args.stage else ""} in {args.out}: {status}'
    return '\n'.join([title] + [f'  {name:<9} {value}' for name, value in plan(args, world).items()])


def plan(args, world):
    """The plan's lines {name: text}: the model, data, training, memory, method, stages and the rule it keeps by."""
    cls = xlt.method_class(args)
    files, model = [] if args.demo else planned_files(args, cls), sketched(args, cls)
    found = [path for path, _, _ in files if os.path.isfile(path)]
    options = [(o.name, getattr(args, o.name, None)) for o in cls.OPTIONS]
    stages = [f'{name} in {stage_settings(args, cls, name).out}' for name in cls.stages(args)]
    made = ' (the demo\'s pre-trained model, made first)' if makes_demo_start(args) else ''
    return {'model': f'{args.model}, from {args.init or "random weights"}{made}',
            'data': 'generated into the run folder (--demo)' if args.demo else
                    f'{args.data_dir}: {len(found)} files found, {len(files) - len(found)} optional ones missing'
                    + (f'; {args.translations}\'s translations' if args.translations != 'xtreme' else ''),
            'training': training_plan(args, world), 'memory': memory_plan(args, world, model),
            'method': ', '.join(f'{o} {" ".join(map(str, v)) if isinstance(v, list) else v}' for o, v in options
                                if v not in (None, False)) or 'its defaults',
            'stages': ', '.join(stages + ['then this run']) if stages else 'one',
            'kept': 'nothing trained' if xlt.task_family(args) == 'retrieval' else
                    'the ' + xlt.SELECTED_BY[args.select or cls.select]}


def training_plan(args, world):
    """The plan's line of the training: its length, batch, learning rate and schedule."""
    if args.eval_only or xlt.task_family(args) == 'retrieval':
        return 'none (--eval_only)' if args.eval_only else 'none (retrieval: mean-pooled states, nearest neighbours)'
    length = f'{args.steps} steps' if args.steps else f'{args.epochs} epoch(s)'
    tokens = args.max_tokens and f'micro-batches of at most {args.max_tokens} tokens'
    split = f' ({world} processes x {args.grad_accum} micro-batches)' if world * args.grad_accum > 1 else ''
    warmup = f'{args.warmup_steps} steps' if args.warmup_steps else f'{args.warmup:g}'
    rows, ddp = args.batch_size // world, world > 1 and not tokens
    warning = (f'; warning: DDP puts {rows} rows on a GPU (fewer than 16), so each step\'s all-reduce of every '
               'gradient (4 bytes a parameter) outweighs its compute: run one configuration a GPU instead (--gpus N '
               'with --seeds or --search, or a job array of --commands)') if ddp and rows < 16 else ''
    return (f'{length}, {tokens or f"global batch {args.batch_size}"}{split}, lr {args.lr:g}, warm-up {warmup}, '
            f'weight decay {args.weight_decay:g}, up to {args.max_len} tokens, seed {args.seed}{warning}')


def memory_plan(args, world, model):
    """The plan's line of memory: a process's peak at its largest micro-batch (layers.peak_bytes, on the meta device),
    and whether it fits the GPU (--gpu_memory, or the one found) with a tenth to spare, or what would make it fit."""
    if args.eval_only or model is None:  # nothing trained, or retrieval
        return 'none trained'
    cls, cuda = xlt.method_class(args), torch.cuda.is_available()
    gpu = (args.gpu_memory or 0) * 2 ** 30 or cuda and torch.cuda.get_device_properties(0).total_memory
    released = cls.settings(args)['precision']  # planned on a CPU for a GPU: the release's, not the CPU's fp32
    precision = args.precision if cuda or not gpu or args.precision != 'fp32' else released
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
    """The model's shape in the run: the preset's with --dropout and --attn_dropout, and the demo's vocabulary."""
    cfg, given = layers.CONFIGS[args.model], lambda *values: next(v for v in values if v is not None)
    return replace(cfg, dropout=given(args.dropout, cfg.dropout),
                   attn_dropout=given(args.attn_dropout, args.dropout, cfg.attn_dropout),  # as Run.pretrained sets them
                   vocab_size=layers.CONFIGS['tiny'].vocab_size if args.demo else cfg.vocab_size)


# ----------------------------------------------------------------------------------------
# The data a run prepares: the tokenizer, the demo's data and its pre-trained start.

def make_demo(args, rank, world, device):
    """Make the demo's data in the run folder and, for a method that starts trained, its pre-trained model first."""
    if rank == 0 and not data.is_demo(args.data_dir, current=True):
        data.make_demo(args.data_dir, seed=0)
    data.barrier()
    if makes_demo_start(args) and not args.eval_only:
        demo_pretrained(args, rank, world, device)


def tokenizer_of(args):
    """The run's tokenizer: --spm or --vocab where given, else the data folder's or --init's."""
    path = data.tokenizer_file(backbone(args), args.data_dir, args.spm, args.vocab, args.init)[0]
    return data.tokenizer(backbone(args), path, args.qa_case == 'lower', args.dict)


def backbone(args):  # the preset's, 'xlmr' or 'bert': it picks the tokenizer
    return layers.CONFIGS[args.model].backbone


def demo_pretrained(args, rank, world, device):
    """The demo's pre-trained model (demo_start): VECO pre-trained on the demo's text, in a run beside this one."""
    folder = os.path.dirname(demo_start(args.out))
    if rank == 0:
        print(f'{args.method} starts from a pre-trained model: pre-training the demo model into {folder} first')
    argv = ['--method', 'veco', '--task', 'pretrain', '--demo', '--out', folder]
    argv += ['--resume'] * (args.resume and began(folder))
    argv += ['--halt_after', str(args.halt_after)] * bool(args.halt_after)
    execute(parse_args(argv), rank, world, device)


# ----------------------------------------------------------------------------------------
# The run folder: held by one run at a time (hold), and its contract with later runs (Folder).

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
    """Under DDP, the holder process 0 found, once every process sees its .lock as process 0 wrote it (--out on a
    filesystem every node mounts): else the others would resume nothing of the run's."""
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
    """Did a run begin in folder, or in a stage below it (its config.json is written by Folder.begin)?"""
    return any('config.json' in names for _, _, names in os.walk(folder))


def is_finished(folder):
    return os.path.exists(os.path.join(folder, 'results.json'))


def discard_if_unbegun(out, made, fresh_lock):
    """A run that stops before it began leaves nothing behind: what this process made goes (the run folder and the
    parents it made, the demo data in a folder that was there, the .lock it made), and nothing else."""
    lock = os.path.join(os.path.abspath(out), '.lock')
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


def finished_alike(settings):
    """Has a run finished in settings.out with these settings (a stage's or a seed's, then reused)?"""
    return is_finished(settings.out) and not differences(read_config(settings.out), settings)


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
    if differ := differences(found, args, changing('scores') if args.eval_only else None):
        now, more = vars(args), f', and {len(differ) - 1} more' if len(differ) > 1 else ''
        fail(f'{args.out} holds a {"stopped" if args.resume else "finished"} run with --{differ[0]} {found[differ[0]]} '
             f'(this run: {now[differ[0]]}{more}): give another --out, or add --overwrite to replace it')


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


def checkpoint_identity(args):
    """What a run's checkpoint says it is and must say to be loaded (a translation's task names its pair)."""
    return {'method': args.method, 'task': xlt.method_class(args).folder(args)[0], 'model': args.model}


class Folder:
    """The run folder's contract with later runs: config.json (begin) says that a run began there and with which
    settings, kept.txt what it computed for itself (keep), results.json (write_results) that it finished."""

    def __init__(self, args, rank):
        self.args, self.rank, self.out, self.begun = args, rank, args.out, False

    def path(self, name):
        return os.path.join(self.out, name)

    def holds(self, name):
        return os.path.exists(self.path(name))

    def begin(self):
        """The run begins: an earlier run's results in its folder go, its checkpoints too unless --resume."""
        if self.rank == 0 and not self.begun:
            new = not self.args.resume
            kept = list(data.read_lines(self.path('kept.txt'))) if new and os.path.exists(self.path('kept.txt')) else []
            self.drop('results.json', 'results.txt', *['last.pt', 'best.pt', 'kept.txt', 'trained.json'] * new, *kept)
            layers.atomic_write(self.path('config.json'), self.config())
        self.begun = True

    def config(self):
        """config.json: the run's settings, and which leave results alike (eval.py --collect groups by the rest)."""
        return json.dumps({**vars(self.args), 'changes_nothing': changing('nothing')}, indent=2)

    def keep(self, name):
        """Record a file or folder the run computed (kept.txt): --resume reads it back, the next new run removes it."""
        if not self.args.eval_only:  # an evaluation changes no run
            self.begin()
            if self.rank == 0:
                with open(self.path('kept.txt'), 'a') as f:
                    f.write(name + '\n')

    def drop(self, *names):
        """Remove the files and folders of the run's folder under names, which nothing reads any more."""
        for path in [self.path(name) for name in names] * (self.rank == 0):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)

    def cached(self, name, compute):
        """compute() once, kept as `name` (JSON for .json, else torch.save, read memory-mapped) for --resume and
        --eval_only to read back. compute() may give None on processes but 0, which then read what process 0 kept."""
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
        data.barrier()
        return read() if value is None else value

    def write_results(self, results, table, where, files=None):
        """results.json, results.txt and files {name: text} by process 0, the table printed; every process waits."""
        if self.rank == 0:
            files = {**(files or {}), 'results.json': json.dumps(results, indent=2), 'results.txt': table + '\n'}
            if self.args.eval_only and not self.holds('config.json'):  # an evaluation of --init writes its own
                files['config.json'] = self.config()
            for name, text in files.items():
                layers.atomic_write(self.path(name), text)
            print(f'{table}\n{where}; {ev.clock(time.time() - self.args.started)} in all')
        data.barrier()


# ----------------------------------------------------------------------------------------
# --predict FILE: a finished run's model on a file of the task's columns.

def predict(args, rank, world, device):
    """--predict FILE [TRANSLATION]: the finished run in --out predicts FILE (data.read_input) with its method's
    predictor -> --out/predicted/<FILE's name>.<tsv|json> and .scores.json (probabilities, scores where labelled)."""
    if not is_finished(args.out):
        fail(f'--predict FILE predicts with a finished run: {args.out} has no results.json; give the run\'s folder')
    found = read_config(args.out)
    settings = argparse.Namespace(**{**{o.name: o.default for o in OPTIONS}, **found,  # an older run's: the defaults
                                     'out': args.out, 'eval_only': True, 'resume': False,
                                     'precision': args.precision, 'eval_batch_size': args.eval_batch_size})
    cls, demo = xlt.method_class(settings), os.path.join(args.out, 'demo-data')
    settings.data_dir = demo if settings.demo else settings.data_dir  # the demo's data is in the run's folder
    if settings.task not in data.TASKS or xlt.task_family(settings) == 'retrieval':
        fail(f'--predict is for the runs of a task with labels to predict, not {settings.task}')
    if len(args.predict) > 1 + (xlt.task_family(settings) == 'qa' and cls.paired):
        fail('--predict takes FILE, and for a paired method on QA its TRANSLATION; a TSV holds its translation')
    if not os.path.exists(os.path.join(args.out, cls.KEEPS)) and not (found.get('eval_only') and settings.init):
        fail(f'{args.out} keeps no {cls.KEEPS}: predict with the run that trained it')  # but an --eval_only of --init
    if settings.demo and not data.is_demo(demo, current=True):
        fail(f'{args.out} is a run of an older demo, whose tokenizer has changed since: run it again')
    tok = tokenizer_of(settings)
    split = re.fullmatch(r'(train|dev|test)-([a-z]+)', args.predict[0])
    if split and not os.path.exists(args.predict[0]) and cls.paired:
        fail(f'--predict {args.predict[0]} reads a split of the data for a method of one text; {settings.method} pairs '
             'each text with its English translation: give FILE (and TRANSLATION)')
    if split and not os.path.exists(args.predict[0]):  # a split of the run's data, as it reads it
        examples, pairs = data.read_split(settings.data_dir, settings.task, *split.groups()), None
    else:
        examples, pairs = data.read_input(args.predict[0], settings.task, cls.paired, (args.predict + [None])[1])
    run = Run(settings, rank, world, device, tok, sets={'dev': {}, 'test': {}})
    model = cls.predictor(run)
    items = data.evaluation_items(replace(run.tokenization, cache=False), examples, pairs if model.paired else None)
    feats, outputs = [item[1] if model.paired else item for item in items], run.outputs(model, items)
    stem = os.path.join(args.out, 'predicted', os.path.splitext(os.path.basename(args.predict[0]))[0])
    scores = ev.write_predicted(stem, settings.task, feats, outputs, examples) if rank == 0 else None
    if rank == 0:
        print(f'{len(examples)} predictions in {stem}.{data.suffix(settings.task)}, each with its probability in '
              f'{stem}.scores.json' + (f'; score {scores["score"]:.1f}' if scores else ''))


# ----------------------------------------------------------------------------------------
# A sweep, --seeds a,b,c or --train_langs a,b,c: the command once a value, then its table.

SWEPT = {'seeds': ('seed', 'seed{}', 'seed'), 'train_langs': ('train_lang', '{}', 'language')}  # option, folder, word


def action(args):
    """The function that does what the command line asks: a prediction, a sweep, a stage, its commands or the run."""
    asked = [(args.predict, predict), (args.seeds or args.train_langs, sweep), (args.only_stage, one_stage),
             (args.commands, stage_commands)]
    return next((function for wanted, function in asked if wanted), execute)


def sweep(args, rank, world, device):
    """--seeds or --train_langs: each value's run in --out/seed<s> (--out/<lang>), a finished one reused, one after
    another or --gpus N at once (fan_out), or with --commands each its command line; then the sweep's table."""
    name = 'seeds' if args.seeds else 'train_langs'
    (option, folder, word), values = SWEPT[name], getattr(args, name)
    say = print if rank == 0 else (lambda message: None)
    if len(set(values)) < len(values):
        fail(f'--{name} {",".join(map(str, values))} repeats a {word}: give each once')
    check_options(args, xlt.method_class(args))  # every language of --train_langs, before any run
    runs = {v: argparse.Namespace(**{**vars(args), 'seeds': None, 'train_langs': None, option: v, 'gpus': 1,
                                     'commands': False, 'out': os.path.join(args.out, folder.format(v))})
            for v in values}
    for settings in runs.values():  # the demo makes each run's data in that run's folder, as the run alone does
        settings.data_dir = data_folder(settings) if args.demo else settings.data_dir
    changes = lambda v: {option: v, 'out': runs[v].out, **({'init': runs[v].init} if runs[v].init else {})}
    if makes_demo_start(args) and args.gpus > 1:  # the runs' start, made once before they run at once (demo_start)
        demo_pretrained(args, rank, world, device)
    if args.commands:  # a job array's lines: nothing runs here
        return say('\n'.join(shlex.join(command(args, **changes(v))) for v in values))
    if args.dry_run:  # the plan of the first run: the others' read the same
        execute(runs[values[0]], rank, world, device)
        return say(f'--{name}: the same run for {word} {", ".join(map(str, values[1:]))} too')
    if args.gpus > 1:  # the stages runs share (XLA's --warmup_dir), made once, N at a time, before the runs
        fan_out([(f'{name} ({word} {v})', out, command(args, **changes(v), only_stage=name))
                 for out, (v, name) in shared_stages(runs).items()
                 if not finished_alike(stage_settings(runs[v], xlt.method_class(args), name))], args.gpus)
    todo = []
    for v, settings in runs.items():
        if finished_alike(settings):
            say(f'{word} {v}: reused, the finished run in {settings.out} has these settings')
        elif args.gpus > 1:
            todo.append((f'{word} {v}', settings.out, command(args, **changes(v))))
        else:
            settings.resume = args.resume and began(settings.out)
            execute(settings, rank, world, device)
    fan_out(todo, args.gpus)
    if rank == 0:
        (seeds_table if name == 'seeds' else langs_table)(args, [settings.out for settings in runs.values()])


def shared_stages(runs):
    """The stages runs of a sweep share (XLA's --warmup_dir): {its folder: (the first run's value, the stage)}."""
    found = {}
    for v, settings in runs.items():
        for name in xlt.method_class(settings).stages(settings):
            found.setdefault(stage_settings(settings, xlt.method_class(settings), name).out, []).append((v, name))
    return {out: users[0] for out, users in found.items() if len(users) > 1}


def seeds_table(args, folders):
    """--out/seeds.json and seeds.txt: each language's mean and standard deviation over the seeds (eval.seed_table)."""
    results = [json.loads(data.read_text(os.path.join(f, 'results.json'))) for f in folders]
    summary = {'seeds': args.seeds, 'runs': folders, 'mean': ev.statistic(results), 'std': ev.statistic(results, 'std')}
    table = f'test, mean ± std over --seeds {",".join(map(str, args.seeds))}:\n{ev.seed_table(folders)}'
    layers.atomic_write(os.path.join(args.out, 'seeds.json'), json.dumps(summary, indent=2))
    layers.atomic_write(os.path.join(args.out, 'seeds.txt'), table + '\n')
    print(f'{table}\nin {args.out}/seeds.json and seeds.txt')


def langs_table(args, folders):
    """--out/langs.json and langs.txt: each language's scores from its own run, and their average (XTREME's rows)."""
    read = lambda folder: json.loads(data.read_text(os.path.join(folder, 'results.json')))
    results = {lang: read(folder) for lang, folder in zip(args.train_langs, folders)}
    own = {split: {lang: r[split][lang] for lang, r in results.items() if lang in r[split]}
           for split in ('dev', 'test')}
    summary = {'train_langs': args.train_langs, 'runs': folders, **{s: ev.summarize(v) for s, v in own.items() if v}}
    rows = {f'{split} (each language\'s own run)': summary[split] for split in ('dev', 'test') if split in summary}
    table = ev.format_table(rows) if rows else 'no labels to score against: predictions written only'
    layers.atomic_write(os.path.join(args.out, 'langs.json'), json.dumps(summary, indent=2))
    layers.atomic_write(os.path.join(args.out, 'langs.txt'), table + '\n')
    print(f'{table}\nin {args.out}/langs.json and langs.txt')


def stage_commands(args, rank, world, device):
    """--commands without --seeds: each stage's command line, one a line (a job array's), and nothing runs."""
    check(args, world)
    print('\n'.join(shlex.join(command(args, only_stage=name)) for name in xlt.method_class(args).stages(args)))


def one_stage(args, rank, world, device):
    """--only_stage NAME, a sweep's process (fan_out): the stage NAME of the run args describe, alone, in its folder."""
    if args.demo:
        make_demo(args, rank, world, device)  # the demo's data folder, which the stage reads: the run's
    execute(stage_settings(args, xlt.method_class(args), args.only_stage), rank, world, device)


def command(args, **changes):
    """train.py's command line for one run of a sweep: this one's (args.command), its --seeds (--train_langs), --gpus
    and --commands dropped, and each option of changes given its value (--seed and --out, or --only_stage)."""
    dropped = ('--seeds', '--train_langs', '--gpus', *(f'--{name}' for name in changes))
    fresh = 'out' in changes and not began(changes['out'])  # a run of a sweep that never began: nothing to resume
    flags, kept, skip = ('--commands',) + ('--resume',) * fresh, [], False
    for word in args.command:
        name = word.split('=', 1)[0]
        if skip or name in flags:
            skip = False
        elif name in dropped:
            skip = '=' not in word  # its value follows
        else:
            kept.append(word)
    given = [word for option, value in changes.items() for word in (f'--{option}', str(value))]
    return [sys.executable, os.path.abspath(__file__), *kept, *given]


def write_dev_predictions(run, preds):
    """The dev predictions (predictions/<task>/dev-<lang>.<ext>) by process 0, where the dev sets are the task's."""
    if run.rank == 0 and run.cls.selects_on(run.args) is None:
        for lang, p in preds.items():
            ev.write_predictions(run.path('predictions'), run.args.task, lang, p, 'dev')


def stages_at_once(run):
    """--gpus N: the method's unfinished stages, N at a time, each a process (fan_out), which Run.stage then reuses."""
    todo = [(name, settings.out, command(run.args, only_stage=name)) for name in run.cls.stages(run.args)
            if not finished_alike(settings := stage_settings(run.args, run.cls, name))]
    fan_out(todo, run.args.gpus)


def fan_out(runs, gpus):
    """The runs [(label, out, command)] as processes, gpus of them at a time, each on a GPU of its own
    (CUDA_VISIBLE_DEVICES) or on a CPU with its share of the cores; each one's output in out/sweep.log."""
    cuda, free, running, failed, ended = torch.cuda.is_available(), list(range(gpus)), 0, [], queue.Queue()
    visible = os.environ.get('CUDA_VISIBLE_DEVICES', ','.join(map(str, range(gpus)))).split(',')  # the parent's GPUs
    threads = str(max(1, data.usable_cores() // gpus))  # the cores this process may use (a Slurm job's), shared out
    if cuda and runs:
        torch.cuda.empty_cache()  # the blocks this process cached (a stage it ran) go back to the first GPU's child
    while runs or running:
        while runs and free:
            (label, out, line), slot = runs.pop(0), free.pop(0)
            env = {**os.environ, 'OMP_NUM_THREADS': threads}
            env.update({'CUDA_VISIBLE_DEVICES': visible[slot]} if cuda else {})
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, 'sweep.log'), 'w') as log:
                process = subprocess.Popen(line, stdout=log, stderr=subprocess.STDOUT, env=env)
            # a thread waits for each process (its own Popen: nothing else in this process reaps it)
            threading.Thread(target=lambda p=process, run=(slot, label, out): ended.put((*run, p.wait())),
                             daemon=True).start()
            running += 1
            print(f'{label}: running in {out} ({f"GPU {visible[slot]}, " if cuda else ""}{threads} CPU threads)')
        slot, label, out, code = ended.get()  # the next run to end
        running -= 1
        free.append(slot)
        failed += [f'{out}/sweep.log'] * bool(code)
        print(f'{label}: {"failed" if code else "finished"} in {out}')
    if failed:
        fail(f'{len(failed)} run(s) of the sweep failed: see {", ".join(failed)}')


# ----------------------------------------------------------------------------------------
# The training's machinery: DDP, the probe, out of memory, divergence, resume points and SIGTERM, checkpoints.

def wrapped(method, device, bf16=False):
    """The method in DDP, its gradients views of DDP's buckets, which the loop zeroes rather than drops (else each is
    made anew and copied in). bf16 (--ddp_bf16_grads): the buckets all-reduced in bf16 (bf16_gradients)."""
    model = DDP(method, device_ids=[device.index] if device.type == 'cuda' else None, gradient_as_bucket_view=True)
    if bf16:
        model.register_comm_hook(None, bf16_gradients)
    return model


def bf16_gradients(state, bucket):
    """A DDP comm hook: the bucket's mean over the processes all-reduced in bf16, half the bytes of fp32 on the wire
    (torch's bf16_compress_hook does the same on NCCL alone), written back into the fp32 gradients."""
    buffer = bucket.buffer()
    half = buffer.to(torch.bfloat16).div_(dist.get_world_size())

    def written_back(future):
        buffer.copy_(future.value()[0])
        return buffer
    return dist.all_reduce(half, async_op=True).get_future().then(written_back)


SCARCE = ('cuda',)  # devices whose memory a run watches (probe, collect); on a CPU neither is worth its time


def begin_epoch(training, batches, per_epoch):
    """An epoch's batches from where the training stands (a resumed epoch: those left), with the epoch's progress bar
    and padding share (its log reads it); before this process's first step, the memory probe on the epoch's."""
    training.since, training.epoch_loss = [], []
    training.padding = data.pad_share(functools.partial(data.item_lengths, training.items), batches,
                                      training.run.chunks)
    if training.bar is None:  # this process's first epoch
        probe(training, batches)
    start, epoch = training.state['step'] % per_epoch, training.state['epoch']
    training.bar = data.bar(total=len(batches), initial=start, desc=f'epoch {epoch + 1}/{training.epochs}')
    return batches[start:]


def report_epoch(training, dev, score, seconds, within=None):
    """The line of an epoch's end (or a point within it), printed and in log.jsonl: its dev scores and padding share."""
    state, select = training.state, training.method.select
    if training.run.rank == 0:
        at = {**state, 'epoch': within or state['epoch']}
        print(ev.epoch_line(at, training.epochs, training.epoch_loss, dev, select, seconds), flush=True)
    scores = {k: v if select == 'loss' else v['score'] for k, v in dev.items()}  # the held-out losses whole
    write_log(training, dev=scores, dev_avg=float(score), pad_share=round(training.padding, 4))


def write_log(training, **fields):
    """A line of log.jsonl (the first process's): the step, the epoch and the fields."""
    if training.log:
        print(json.dumps({'step': training.state['step'], 'epoch': training.state['epoch'], **fields}),
              file=training.log, flush=True)


def note_event(training, event):
    """An event of the training (a method's phase that ends), printed and logged, if there is one."""
    if event and training.log:
        training.bar.write(f'step {training.state["step"]}: {event}')
        write_log(training, event=event)


def probe(training, batches):
    """On a GPU, before the first step: the epoch's largest batch (data.largest_batch) run beside AdamW's moments to
    come, so that a run that cannot fit stops at step 1, in one line, not hours in."""
    if training.run.device.type not in SCARCE:
        return
    moments = 0 if training.state['step'] else 2 * sum(p.numel() for p in training.model.parameters())
    moments_to_come = torch.empty(moments, device=training.run.device)
    largest = data.largest_batch(functools.partial(data.item_lengths, training.items), batches, training.run.chunks)
    train_step(training, largest, probe=True)
    training.model.zero_grad(set_to_none=True)


def collect(device):
    """A finished training's reference cycles (the DDP wrapper's, the optimiser's) collected now, on a GPU."""
    if device.type in SCARCE:
        gc.collect()


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


def diverged(run, loss, first, last):
    """The line of a training loss that is not finite in steps first to last."""
    checkpoint = run.path('last.pt')
    kept = f'the last checkpoint is {checkpoint}' if os.path.exists(checkpoint) else 'no checkpoint was kept'
    return (f'the training loss is {loss} in steps {first}-{last}: {kept}; start again with a lower --lr (now '
            f'{run.args.lr:g}) or a lower --clip (now {run.args.clip:g})')


class ResumePoints(AbstractContextManager):
    """A training's resume points. Entered: --resume's state from last.pt (resumed) and log.jsonl from there. Then
    last.pt every --save_minutes, at each epoch's end but the last and at SIGTERM, as the processes agree (agree)."""

    def __init__(self, training):
        self.training, self.saved, self.signalled = training, time.time(), None
        self.point = None  # the step last.pt holds
        self.agreed = (False, False)  # (a resume point, a stop): what the processes agreed on at the last log line

    def __enter__(self):
        training, run = self.training, self.training.run
        training.state = run.args.resume and resumed(training) or training.state  # nothing to resume: from the start
        step = training.state['step']
        self.point = step if os.path.exists(run.path('last.pt')) and run.args.resume else None
        training.log = open_log(run.path('log.jsonl'), step) if run.rank == 0 else None
        training.method.step = step  # read by schedules (X-Mixup's p*, frozen phases)
        training.started = time.time()  # the clock of the log and the epoch lines starts once last.pt is read
        self.defaults = {s: signal.signal(s, self.on_signal) for s in STOPS}
        return self

    def on_signal(self, number, frame):
        self.signalled = signal.Signals(number)  # acted on at the next log line, where the processes agree

    def agree(self, loss):
        """A log line's mean loss summed over the processes, and in the same collective their wishes: a resume
        point due by a process's clock, a stop asked by a signal (any process's is every process's). -> the loss."""
        run = self.training.run
        wishes = time.time() - self.saved >= 60 * run.args.save_minutes, self.signalled is not None
        sums = torch.tensor([loss, *wishes], dtype=torch.float64, device=run.device)  # large losses stay finite
        if run.world > 1:
            dist.all_reduce(sums)  # every process stops together, and saves together
        self.agreed = tuple(sums[1:].gt(0).tolist())
        return sums[0].item()

    def after_step(self, epoch_end):
        """The resume point or stop agreed on, within an epoch (its last step saves after validation, after_epoch)."""
        if any(self.agreed) and not epoch_end:
            self.save(stop=self.agreed[1])
        planted_stops(self.training.run.args, self.training.state['step'], self)
        self.agreed = self.agreed if epoch_end else (False, False)

    def after_epoch(self, last):
        """last.pt at an epoch's end, but the last's (trained.json holds it) unless a stop was asked."""
        if not last or self.agreed[1]:
            self.save(stop=self.agreed[1])
        self.agreed = (False, False)

    def save(self, stop=False):
        if stop and not self.in_grace():
            self.stop(self.training.state['step'], self.point)
        self.saved, self.point = time.time(), self.training.state['step']
        save(self.training.run, 'last.pt', resume_point(self.training), self.training.writer)
        if stop:
            self.stop(self.training.state['step'])

    def in_grace(self):
        """Would SIGTERM's last.pt (weights and AdamW's moments, 12 bytes a parameter) be written within --term_grace
        seconds, at the rate the writer last measured (unmeasured yet: yes), once the write in flight is done?"""
        grace, rate = term_grace(self.training.run.args), self.training.writer.rate
        size = 12 * sum(p.numel() for p in self.training.method.parameters())
        return grace > 0 and (rate is None or size / rate <= grace)

    def trained(self):
        """The training is over and best.pt holds what it kept: trained.json says so (--resume reads it), and the
        resume point, the optimiser's state too, goes once written; every process waits for both."""
        self.training.writer.wait()
        if self.training.run.rank == 0:
            layers.atomic_write(self.training.run.path('trained.json'), json.dumps(self.training.state))
            self.training.run.folder.drop('last.pt')
        data.barrier()  # every process reads best.pt (and the kept checkpoints) only once they are written

    def __exit__(self, *exception):
        self.training.writer.wait()
        for number, default in self.defaults.items():
            signal.signal(number, default)

    def stop(self, step, kept='it'):
        """A signal's end, once its resume point is saved (or, beyond --term_grace, at the last one, kept): one line,
        and the signal's exit status (another process's signal: SIGTERM's)."""
        run = self.training.run
        self.training.writer.wait()
        last, number = run.path('last.pt'), self.signalled or signal.SIGTERM
        where = (f'{last} holds it' if kept == 'it' else 'a new last.pt would outlast --term_grace, so the run stops '
                 'at its last resume point, ' + (f'step {kept} in {last}' if kept else 'none: --resume starts again'))
        run.say(f'stopped by {number.name} at step {step}: {where}; run the same command with --resume to go on')
        raise SystemExit(128 + number)


STOPS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's stop, and the warning Slurm sends ahead (--signal=USR1@180)


def term_grace(args):
    """--term_grace, or its default: 20 s under torchrun (its agent kills the workers 30 s after its own SIGTERM) and
    under Slurm (its KillWait is 30 s unless the cluster sets more), else 60 s."""
    if args.term_grace is not None:
        return args.term_grace
    return 20.0 if 'TORCHELASTIC_RUN_ID' in os.environ or 'SLURM_JOB_ID' in os.environ else 60.0


def resumed(training):
    """--resume: the loop's state from last.pt (the method, optimiser, schedule, fp16's loss scale and random state as
    they were), or from the start when it is not there."""
    run = training.run
    last, trained = run.path('last.pt'), run.path('trained.json')
    if os.path.exists(trained):  # a finished training: best.pt holds what it kept
        return json.loads(data.read_text(trained))
    if not os.path.exists(last):
        run.say(f'note: {last} not found: starting from the beginning')
        return None  # the loop starts afresh
    ckpt = layers.load_checkpoint(last, checkpoint_identity(run.args))
    for part, name in ((training.method, 'method'), (training.opt, 'optimizer'), (training.sched, 'schedule'),
                       (training.precision.scaler, 'scaler')):
        part.load_state_dict(ckpt.get(name, {}))  # the scaler reads {} unless fp16's
    torch.set_rng_state(ckpt['rng'])
    return ckpt['state']


def resume_point(training):
    return {'method': training.method.state_dict(), 'optimizer': training.opt.state_dict(),
            'schedule': training.sched.state_dict(), 'state': dict(training.state), 'rng': torch.get_rng_state(),
            'scaler': training.precision.scaler.state_dict()}


def planted_stops(args, step, points):
    """The tests' stops at a known step: a SIGTERM to itself, or death as if killed once last.pt is written."""
    if args.term_after and step == args.term_after:
        os.kill(os.getpid(), signal.SIGTERM)
    if args.halt_after and step == args.halt_after:
        points.training.writer.wait()
        os._exit(3)


def save(run, name, parts, writer, keep=0):
    """A checkpoint from the first process by the training's writer (atomic); keep: the last `keep` of its folder."""
    if run.rank == 0:
        exported = xlt.method_class(run.args).exported(run.args, run.tok)  # what python layers.py export reads
        meta = {**checkpoint_identity(run.args), 'settings': json.loads(json.dumps(vars(run.args))), **exported}
        writer.save(run.path(name), meta, lambda: layers.keep_last(os.path.dirname(run.path(name)), keep), **parts)


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
    found = [p for p in found if os.path.getmtime(p) >= args.started]  # not an earlier run's
    if not found:
        return f'interrupted before the first checkpoint in {args.out}: run the same command again'
    last, go_on = max(found, key=os.path.getmtime), 'run the same command with --resume to go on'
    if last.endswith('trained.json'):  # a training ended, its model in best.pt
        return f'interrupted after a training ended ({os.path.dirname(last)}): {go_on}'
    step = layers.load_checkpoint(last, mmap=True)['state']['step']  # mapped: the weights are not read
    return f'interrupted: the last checkpoint is step {step} ({last}); {go_on} from it'


if __name__ == '__main__':
    main()
