"""What only a GPU can show. NOT YET RUN ON A GPU: the machines this project is built and tested on have none, so no
figure of this script has been seen; the first run on a GPU is its first test. Every case also runs on the CPU at tiny
sizes in the test suite (--cpu), so that none can break unseen.

    python tests/gpu_check.py --out gpu.jsonl          # at most --budget seconds (default 480) on one GPU
    python tests/gpu_check.py --cpu --out cpu.jsonl    # every case at tiny sizes on the CPU

Each measurement is one JSON line (printed, and appended to --out); an out-of-memory error or an exception is a line
too ('oom', 'error') and the check goes on; a case the time left cannot hold is a 'skipped' line. The exit code is 1
when a case raised. The cases, in order:
  - matmul: the dense bf16 matmul rate (8192 x 8192, CUDA events; the CPU: fp32, 512) against the card's
    datasheet rate (SPEC), the ceiling every MFU below is measured against, both ways;
  - step: a training step (AdamW's moments made by a first) of zero-shot, FILTER, X-Mixup (its two encoded sides) and
    VECO's pre-training (a monolingual and a bilingual micro-batch) at base (large after the next three cases): on
    padded batches of rows drawn from a length profile (PROFILE), at the recipe's rows a GPU and at the most the
    estimate fits in 80% of the GPU: step time, real tokens a second, MFU (against the measured rate and the
    datasheet's), the measured peak against the plan's estimate (layers.peak_bytes), and the attention kernel torch
    picked (the profiler's aten::_scaled_dot_product_* op);
  - precision: bf16 against fp32 on the same weights and batch (loss, gradient cosine), then 40 steps of each from the
    same start (the gap of their last losses);
  - loop: train.py's own loop on the demo in bf16 and in fp16 (the probe, the background writer, fp16's scaler);
  - writer: a best.pt written from the device's weights while they change (pinned copies), each storage once;
  - compile: --compile's graphs over six odd lengths of padded batches, aligned as a run's are, if time is left (the
    CPU: three, dynamo's graphs without inductor)."""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import layers  # noqa: E402
import train  # noqa: E402
import xlt  # noqa: E402

# dense bf16 tensor-core rates of the datasheets, FLOP/s (fp16 for cards without bf16), first match of the name
SPEC = [('H100 PCIe', 756e12), ('H100', 989e12), ('H200', 989e12), ('H800', 989e12), ('B200', 2250e12),
        ('A100', 312e12), ('A800', 312e12), ('L40S', 362e12), ('L40', 181e12), ('L4', 121e12), ('A10', 125e12),
        ('V100', 125e12), ('T4', 65e12)]
# a side's length in pieces: log-normal around XNLI's median pair (40, sigma 0.45, tests/bench.py's stand-in), cut
# to --max_len; VECO's monolingual segments are whole (--max_len), its bilingual pairs at most data.PARA_LEN
PROFILE = {'median': 40, 'sigma': 0.45}
STEPS = [('zeroshot', 'xnli', 'one'), ('filter', 'xnli', 'pair'), ('xmixup', 'xnli', 'pair'),
         ('veco', 'pretrain', 'mono'), ('veco', 'pretrain', 'para')]
KERNELS = {'_scaled_dot_product_flash_attention': 'flash', '_scaled_dot_product_efficient_attention': 'efficient',
           '_scaled_dot_product_cudnn_attention': 'cudnn', '_scaled_dot_product_attention_math': 'math',
           '_scaled_dot_product_flash_attention_for_cpu': 'flash (CPU)'}


class Check:
    """The device, sizes and time budget; each case's JSON line (emit), its errors counted."""

    def __init__(self, args):
        self.cpu = args.cpu or not torch.cuda.is_available()
        self.device = torch.device('cpu' if self.cpu else 'cuda')
        self.models = ['tiny'] if self.cpu else args.models
        self.deadline, self.out, self.failed = time.monotonic() + args.budget, args.out, 0
        self.rate = self.spec = None  # the measured matmul rate and the datasheet's, FLOP/s (matmul)

    def emit(self, line):
        text = json.dumps(line)
        print(text, flush=True)
        if self.out:
            with open(self.out, 'a') as f:
                f.write(text + '\n')

    def case(self, name, fn, more, cost):
        """fn(self, *more) -> the case's fields, as one line; an error is a line too, and the check goes on; on a GPU,
        with less than cost seconds of the budget left, a line that says it was skipped."""
        line = {'case': name, **({'args': list(more)} if more else {})}
        if time.monotonic() + (0 if self.cpu else cost) > self.deadline:
            return self.emit({**line, 'skipped': f'less than {cost} s of the budget left'})
        start = time.perf_counter()
        try:
            line.update(fn(self, *more))
        except torch.OutOfMemoryError as e:
            line['oom'] = str(e).splitlines()[0]
        except (Exception, SystemExit) as e:  # train.py's one-line errors are SystemExit
            self.failed += 1
            line['error'] = f'{type(e).__name__}: {e}'.splitlines()[0]
            line['where'] = traceback.format_tb(e.__traceback__)[-1].strip().splitlines()[0]
        if self.device.type == 'cuda':
            torch.cuda.empty_cache()
        self.emit({**line, 'seconds': round(time.perf_counter() - start, 2)})

    def timer(self):
        """-> stop(): seconds since the call, the device's queue drained (CUDA events on a GPU)."""
        if self.device.type != 'cuda':
            start = time.perf_counter()
            return lambda: time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        return lambda: (end.record(), end.synchronize(), begin.elapsed_time(end) / 1000)[-1]


def matmul(check):
    """The dense matmul rate the MFUs are measured against: 20 products after 3, timed together."""
    n, dtype = (512, torch.float32) if check.cpu else (8192, torch.bfloat16)
    a, b = (torch.randn(n, n, device=check.device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    stop = check.timer()
    for _ in range(20):
        a @ b
    check.rate = 2 * n ** 3 * 20 / stop()
    name = 'CPU' if check.cpu else torch.cuda.get_device_name(0)
    check.spec = spec = next((rate for key, rate in SPEC if key in name), None)
    return {'device': name, 'n': n, 'tflops': check.rate / 1e12, 'spec_tflops': spec and spec / 1e12,
            'of_spec': spec and check.rate / spec}


def built(check, method, task, model_name):
    """-> (args, the method's model as a run builds it, at random weights, on the device)."""
    args = train.parse_args(['--method', method, '--task', task, '--model', model_name, '--from_scratch',
                             *(['--max_len', '64'] * check.cpu)])
    with check.device:
        torch.manual_seed(0)
        model = xlt.method_class(args).sketch(args, train.planned_config(args)).train()
    model.step = 10 ** 6  # VECO past its cross-attention-only phase, X-Mixup's sampling decayed
    return args, model


def lengths_drawn(rows, kind, max_len, seed):
    """rows lengths a side (one side, or two for pairs) of the kind's profile (PROFILE)."""
    g = torch.Generator().manual_seed(seed)
    if kind == 'mono':
        return [[max_len] * rows] * 2
    cap = min(max_len, data.PARA_LEN) if kind == 'para' else max_len
    drawn = lambda: (torch.randn(rows, generator=g) * PROFILE['sigma'] + math.log(PROFILE['median'])).exp()
    return [drawn().round().clamp(4, cap).int().tolist() for _ in range(1 if kind == 'one' else 2)]


def batch_of(sides, kind, vocab, seed):
    """A padded micro-batch of the sides' lengths: a Batch of XNLI labels, or a Pair (VECO's: parallel or not)."""
    g = torch.Generator().manual_seed(seed)
    label = lambda: int(kind == 'para') if kind in ('mono', 'para') else int(torch.randint(3, (1,), generator=g))
    make = lambda n: data.Feature([0] + torch.randint(5, vocab, (n - 2,), generator=g).tolist() + [2], label())
    features = [[make(n) for n in side] for side in sides]
    return data.collate(features[0]) if len(sides) == 1 else data.collate_pairs(*features)


def most_rows(model, lengths, precision, room):
    """The most rows (up to 512) whose estimated peak fits in `room` bytes."""
    params = sum(p.numel() for p in model.parameters())
    fits = lambda rows: layers.peak_bytes(model.encoder.cfg, *model.passes(rows, lengths), params,
                                          'cuda', precision) <= room
    rows = 1
    while rows < 512 and fits(rows * 2):
        rows *= 2
    return rows


def sdpa_kernels(check, step):
    """The attention ops a step ran, by the profiler's aten::_scaled_dot_product_* names ('none': no SDPA)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (check.device.type == 'cuda')
    with profile(activities=activities) as prof:
        step()
    names = {e.name.removeprefix('aten::') for e in prof.events()}
    return sorted({kind for op, kind in KERNELS.items() if op in names}) or ['none']


def stepper(model, batch, precision, args):
    """One training step of the model on batch: autocast, backward (fp16's scaled), clip, and train.py's own AdamW
    (fused: a plain AdamW's foreach path keeps 4 more bytes a parameter at the step, so its peak would not be ours)."""
    opt = train.optimizer_and_schedule(model, args, 10)[0]

    def step():
        with precision.autocast():
            loss = model.loss(batch)[0]
        precision.backward(loss)
        precision.step(opt, model.parameters(), 1.0)
        opt.zero_grad(set_to_none=True)
    return step


def step_case(check, method, task, kind, model_name, at):
    """A training step at the recipe's rows on one GPU (at 'recipe'; a step the estimate does not fit, as VECO's
    pre-training, is cut into micro-batches of the most it fits) or at the most the estimate fits ('most')."""
    args, model = built(check, method, task, model_name)
    cls, precision_name = xlt.method_class(args), 'fp32' if check.cpu else layers.default_precision('cuda')
    shapes = cls.micro_batches(args, args.grad_accum)
    rows, lengths = shapes[kind == 'para'] if kind in ('mono', 'para') else shapes[0]
    room = (layers.peak_bytes(model.encoder.cfg, *model.passes(8, lengths), sum(p.numel() for p in model.parameters()),
                              'cuda', precision_name) if check.cpu else 0.8 * torch.cuda.mem_get_info()[1])
    most = most_rows(model, lengths, precision_name, room)
    rows, cut = (most, False) if at == 'most' else (min(rows, most), rows > most)
    sides = lengths_drawn(rows, kind, args.max_len, seed=rows)
    batch = model.host(batch_of(sides, kind, model.encoder.cfg.vocab_size, seed=rows)).to(check.device)
    step = stepper(model, batch, layers.Precision(precision_name, check.device), args)
    step()  # AdamW's moments
    measured = peak_of(check, step)
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step()
    stop = check.timer()
    for _ in range(2 if check.cpu else 5):
        step()
    seconds = stop() / (2 if check.cpu else 5)
    params = sum(p.numel() for p in model.parameters())
    padded = [max(side) for side in sides]
    estimate = layers.peak_bytes(model.encoder.cfg, *model.passes(rows, padded), params, 'cuda', precision_name)
    flops = counter.get_total_flops() / seconds
    return {'precision': precision_name, 'rows': rows, 'recipe_cut': cut, 'padded_lengths': padded, 'step_s': seconds,
            'real_tokens_per_s': sum(map(sum, sides)) / seconds, 'mfu': check.rate and flops / check.rate,
            'mfu_of_spec': check.spec and flops / check.spec,
            'peak_gib': measured and measured / 2 ** 30, 'estimate_gib': estimate / 2 ** 30,
            'estimate_over_peak': measured and estimate / measured, 'sdpa': sdpa_kernels(check, step)}


def peak_of(check, step):
    """The device's peak bytes over a step (None on the CPU: the suite holds the estimate to its profiler)."""
    if check.device.type != 'cuda':
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def precision_case(check, model_name):
    """bf16 against fp32 (on the CPU too: its autocast has bf16) on the same weights: the first batch's loss and
    gradients, then 40 steps of each from the same start on the same batches, the gap of their last 5 losses."""
    args, model = built(check, 'zeroshot', 'xnli', model_name)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [batch_of(lengths_drawn(16 if check.cpu else 32, 'one', args.max_len, seed), 'one',
                        model.encoder.cfg.vocab_size, seed).to(check.device) for seed in range(40)]
    first, losses = {}, {}
    for name in ('fp32', 'bf16'):
        model.load_state_dict(start)
        arithmetic = lambda: layers.exact_fp32(check.device) if name == 'fp32' else layers.autocast(check.device, name)
        torch.manual_seed(1)  # the same dropout masks
        with arithmetic():  # fp32 without TF32
            loss = model.loss(batches[0])[0]
        loss.backward()
        first[name] = (loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        model.zero_grad(set_to_none=True)
        opt, losses[name] = torch.optim.AdamW(model.parameters(), lr=1e-4), []
        torch.manual_seed(2)
        for batch in batches:
            with arithmetic():
                loss = model.loss(batch)[0]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.detach())
    (l32, g32), (l16, g16) = first['fp32'], first['bf16']
    last = {name: torch.stack(v[-5:]).mean().item() for name, v in losses.items()}
    cosine = torch.nn.functional.cosine_similarity(g32, g16, 0).item()
    return {'loss_fp32': l32, 'loss_bf16': l16, 'grad_cosine': cosine,
            'last_loss_fp32': last['fp32'], 'last_loss_bf16': last['bf16'], 'gap': last['bf16'] - last['fp32']}


def loop_case(check, precision):
    """train.py's loop on the demo (zero-shot PAWS-X from scratch) in precision: its log's steps and losses, the
    checkpoints its writer kept, fp16's skipped steps, and its time."""
    out, tf32 = tempfile.mkdtemp(prefix='gpu-check-'), torch.backends.cuda.matmul.allow_tf32
    try:
        start = time.perf_counter()
        data.make_demo(os.path.join(out, 'demo-data'), n_train=128, n_eval=16)  # a fifth of the demo: its loop alone
        train.main(['--demo', '--task', 'pawsx', '--from_scratch', '--precision', precision, '--steps', '8',
                    '--eval_every', '8', '--log_every', '1', '--out', out, *(['--model', 'small'] * (not check.cpu))])
        logged = [json.loads(line) for line in open(os.path.join(out, 'log.jsonl')) if '"loss"' in line]
        return {'precision': precision, 'seconds_in_all': time.perf_counter() - start, 'steps': len(logged),
                'last_loss': logged[-1]['loss'], 'skipped_steps': sum(r.get('skipped', 0) for r in logged),
                'kept': sorted(n for n in os.listdir(out) if n.endswith('.pt')),
                'finished': os.path.exists(os.path.join(out, 'results.json'))}
    finally:
        shutil.rmtree(out, ignore_errors=True)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32  # as train.main found them


def writer_case(check, model_name):
    """A best.pt written by layers.Writer from the device (on a GPU: pinned copies of whole storages, queued without
    waiting), the weights changed at once as the next step would change them: the file holds them as they were, each
    storage once (its size against the state's bytes), and the MLM head still tied to the embeddings."""
    cfg = layers.CONFIGS[model_name]
    with check.device:
        encoder = layers.Encoder(cfg)
        method = torch.nn.ModuleDict({'encoder': encoder, 'mlm': layers.MLMHead(cfg, encoder.tok.weight)})
    before = {k: v.cpu().clone() for k, v in method.state_dict().items()}
    state_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                       for t in method.state_dict().values()}.values())
    folder = tempfile.mkdtemp(prefix='gpu-check-')
    try:
        path, writer = os.path.join(folder, 'best.pt'), layers.Writer()
        writer.save(path, {'task': 'xnli'}, method=method.state_dict(), encoder=encoder.state_dict())
        with torch.no_grad():
            for p in method.parameters():
                p.add_(1.0)  # the next step, while the copies and the write are under way
        writer.wait()
        ckpt, address = layers.load_checkpoint(path), lambda t: t.untyped_storage().data_ptr()
        return {'gib': os.path.getsize(path) / 2 ** 30, 'file_over_state': os.path.getsize(path) / state_bytes,
                'as_it_was': all(torch.equal(ckpt['method'][k], v) for k, v in before.items()),
                'tied': address(ckpt['method']['mlm.weight']) == address(ckpt['encoder']['tok.weight'])}
    finally:
        shutil.rmtree(folder)


def compile_case(check, model_name):
    """--compile (layers.compile_blocks, dynamic shapes): the graphs made over six odd lengths, a few rather than six.
    Each batch has a padded row and goes to the device as a run's do (Batch.to: on a GPU padded on to a multiple of 8
    positions, data.aligned_for): a graph traced at one length and reused at an odd one must not fail the
    memory-efficient kernel's alignment of its mask (pytorch#163083)."""
    from torch._dynamo.utils import counters
    cfg = layers.CONFIGS[model_name]
    encoder = layers.compile_blocks(layers.Encoder(cfg)).to(check.device).train()
    for block in encoder.blocks if check.cpu else []:  # the graphs without inductor's C++ build: dynamo's, the same
        block.compile(dynamic=True, backend='eager')
    before, widths = counters['stats']['unique_graphs'], []
    lengths = (9, 13, 17) if check.cpu else (65, 97, 131, 163, 257, 385)
    for n in lengths:
        rows = [data.Feature(torch.randint(5, cfg.vocab_size, (m,)).tolist()) for m in (n, n - 5)]
        batch = data.collate(rows, pad_id=cfg.pad_id).to(check.device)
        widths.append(batch.ids.size(1))
        with layers.autocast(check.device, 'fp32' if check.cpu else 'bf16'):
            encoder.run(encoder.embed(batch.ids), batch.keys).sum().backward()
    return {'lengths': list(lengths), 'widths': widths, 'graphs': counters['stats']['unique_graphs'] - before}


def cases(check):
    """(name, fn, its arguments, seconds it may take on a GPU) of every case, in the order they run: the first model's
    steps, the precisions and train.py's loop before the larger model's steps, so that a short budget keeps them."""
    steps = lambda model_name: [('step', step_case, (method, task, kind, model_name, at), 20)
                                for method, task, kind in STEPS for at in ('recipe', 'most')]
    first = check.models[0]
    return ([('matmul', matmul, (), 10)] + steps(first) + [('precision', precision_case, (first,), 30)]
            + [('loop', loop_case, (p,), 60) for p in ('bf16', 'fp16')] + [('writer', writer_case, (first,), 30)]
            + [case for model_name in check.models[1:] for case in steps(model_name)]
            + [('compile', compile_case, (first,), 120)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--cpu', action='store_true', help='every case at tiny sizes on the CPU (the test suite\'s run)')
    p.add_argument('--models', nargs='+', default=['base', 'large'])
    p.add_argument('--budget', type=float, default=480, help='seconds; a case that may not fit in what is left is '
                   'skipped (on a GPU)')
    p.add_argument('--out', help='append each JSON line to this file too')
    check = Check(p.parse_args(argv))
    note = 'the CPU at tiny sizes' + ' (no CUDA device here)' * (not torch.cuda.is_available()) if check.cpu else 'GPU'
    check.emit({'case': 'start', 'on': note, 'budget_s': None if check.cpu else check.deadline - time.monotonic()})
    for name, fn, more, cost in cases(check):
        check.case(name, fn, more, cost)
    return 1 if check.failed else 0


if __name__ == '__main__':
    sys.exit(main())
