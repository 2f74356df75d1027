"""What only a GPU can show, ready for the day there is one. NOT RUN YET: the machines this project is built and tested
on have no GPU, so no figure of this script has been seen; the first run on a GPU is its first test.

    python tests/gpu_check.py                    # base and large, every method; then 1 GPU against 2 (needs 2)
    python tests/gpu_check.py --models base --skip_nccl

For each method at XLM-R base and large, one training step after a first (AdamW's moments made), in the precision a
run picks on this GPU, on the longest micro-batch (--max_len on every side) of the most rows the plan estimates to
fit in 80% of the GPU, it prints:
  - the peak memory measured (torch.cuda.max_memory_allocated) against the plan's estimate (layers.peak_bytes of the
    method's passes), and their ratio: the CPU's profiler holds it within 10% (tests/test_speed.py); here it is new;
  - tokens a second, and the share of the dense matmul rate measured on this GPU (bench.matmul_flops) that the
    step's FLOPs (torch's FlopCounterMode) reach;
  - the SDPA kernels that ran (flash, memory-efficient, cuDNN or the math path, from the profiler's kernel names);
  - with --compile, the graphs compiled over six lengths (dynamic shapes: a few, not one a length).
Then the demo trains on one GPU and on two (torchrun, NCCL): their first logged losses and their final weights agree
within bf16's tolerance. Without CUDA it says so and exits 0."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import layers  # noqa: E402
import train  # noqa: E402
import xlt  # noqa: E402
from bench import matmul_flops  # noqa: E402
from test_speed import ESTIMATED, micro_batch  # noqa: E402

KERNELS = {'flash': 'flash', 'efficient': 'memory-efficient', 'fmha': 'memory-efficient', 'cudnn': 'cuDNN'}


def built(method, task, more, model):
    """-> (args, the method's model on the GPU as a run builds it, its micro-batch lengths)."""
    args = train.parse_args(['--method', method, '--task', task, '--model', model, '--from_scratch', *more])
    cls = xlt.method_class(args)
    with torch.device('cuda'):
        torch.manual_seed(0)
        model = cls.sketch(args, train.planned_config(args)).train()
    model.step = 10 ** 6  # VECO past its cross-attention-only phase
    return args, model, cls.micro_batches(args, 1)[0][1]


def most_rows(model, lengths, precision, room):
    """The most rows (up to 256) whose estimated peak fits in `room` bytes."""
    params = sum(p.numel() for p in model.parameters())
    fits = lambda rows: layers.peak_bytes(model.encoder.cfg, *model.passes(rows, lengths), params, 'cuda',
                                          precision) <= room
    rows = 1
    while rows < 256 and fits(rows * 2):
        rows *= 2
    return rows


def stepper(model, batch, precision):
    opt = torch.optim.AdamW(model.parameters(), fused=True)

    def step():
        with precision.autocast():
            loss = model.loss(batch)[0]
        precision.backward(loss)
        precision.step(opt, model.parameters(), 1.0)
        opt.zero_grad(set_to_none=True)
    return step


def kernels(step):
    """The SDPA kernels a step ran, by the names of its CUDA kernels."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events()]
    found = {kind for key, kind in KERNELS.items() for name in names if key in name}
    return ', '.join(sorted(found)) or 'math (no fused attention kernel ran)'


def check(method, task, more, model_name, rate):
    args, model, lengths = built(method, task, more, model_name)
    precision = layers.Precision(args.precision, torch.device('cuda'))
    rows = most_rows(model, lengths, args.precision, 0.8 * torch.cuda.get_device_properties(0).total_memory)
    batch = micro_batch(xlt.method_class(args), task, rows, lengths).to(torch.device('cuda'))
    step = stepper(model, batch, precision)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured, params = torch.cuda.max_memory_allocated(), sum(p.numel() for p in model.parameters())
    estimate = layers.peak_bytes(model.encoder.cfg, *model.passes(rows, lengths), params, 'cuda', args.precision)
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step()
    start = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 5
    print(f'{method} {task} {" ".join(more)} {model_name} {args.precision}, {rows} x {"+".join(map(str, lengths))}: '
          f'peak {measured / 2 ** 30:.2f} GiB, estimate {estimate / 2 ** 30:.2f} ({estimate / measured:.2f}); '
          f'{rows * sum(lengths) / seconds:,.0f} tokens/s, {counter.get_total_flops() / seconds / rate:.0%} of the '
          f'matmul rate; SDPA: {kernels(step)}', flush=True)


def recompiles(model_name):
    """Graphs torch.compile makes for a block over six lengths (--compile: dynamic shapes)."""
    from torch._dynamo.utils import counters
    encoder = layers.compile_blocks(layers.Encoder(layers.CONFIGS[model_name])).cuda().train()
    before = counters['stats']['unique_graphs']
    for length in (64, 96, 128, 160, 256, 384):
        with torch.autocast('cuda', dtype=torch.bfloat16):
            encoder(torch.randint(5, 1000, (4, length), device='cuda')).sum().backward()
    print(f'--compile, {model_name}: {counters["stats"]["unique_graphs"] - before} graphs over 6 lengths', flush=True)


def nccl_agreement():
    """The demo on 1 GPU and on 2: the first logged loss and the final weights agree within bf16's tolerance."""
    folder = tempfile.mkdtemp()
    argv = ['train.py', '--demo', '--task', 'xnli', '--epochs', '1', '--precision', 'bf16', '--log_every', '1']
    subprocess.run([sys.executable, *argv, '--out', f'{folder}/one'], cwd=ROOT, check=True)
    subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', *argv, '--out',
                    f'{folder}/two'], cwd=ROOT, check=True)
    first = [json.loads(open(f'{folder}/{n}/log.jsonl').readline())['loss'] for n in ('one', 'two')]
    one, two = [torch.load(f'{folder}/{n}/best.pt', weights_only=True)['method'] for n in ('one', 'two')]
    relative = lambda a, b: float((a.float() - b.float()).norm() / a.float().norm().clamp(min=1e-12))
    drift = max(relative(one[k], two[k]) for k in one if one[k].is_floating_point())
    ok = abs(first[0] - first[1]) <= 1e-2 * abs(first[0]) and drift <= 2e-2
    print(f'1 GPU against 2: first loss {first[0]:.4f} / {first[1]:.4f}, largest relative weight difference '
          f'{drift:.1e}: {"agree" if ok else "DIFFER"} (bf16: 1% of the loss, 2% of a weight)', flush=True)
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=['base', 'large'])
    p.add_argument('--skip_nccl', action='store_true', help='leave out the 1-GPU against 2-GPU run')
    args = p.parse_args()
    if not torch.cuda.is_available():
        print('no CUDA device here: nothing checked (this script is for a machine with a GPU)')
        return 0
    rate = matmul_flops(torch.device('cuda'))
    print(f'{torch.cuda.get_device_name(0)}: dense bf16 matmul at {rate / 1e12:.0f} TFLOP/s', flush=True)
    for model_name in args.models:
        for method, task, more in ESTIMATED:
            check(method, task, more, model_name, rate)
            torch.cuda.empty_cache()
        recompiles(model_name)
    if not args.skip_nccl and torch.cuda.device_count() >= 2:
        return 0 if nccl_agreement() else 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
