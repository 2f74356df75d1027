"""Length-grouped batches, the padding they save, activation checkpointing and compiled blocks (speed itself is
measured in tests/bench.py, never in a test); the memory estimate against the profiler, and the GPU check's script."""
import json
import random
import shutil

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import data
import layers
import train
import xlt


def batches_of(n, epoch, chunks, lengths, group=True, batch_size=8, seed=3):
    """An epoch's batches as the trainer cuts them: seed --seed x 1000 + epoch; lengths only when grouping."""
    return data.global_batches(n, batch_size, seed * 1000 + epoch, chunks, lengths if group else None)


def test_grouped_batches_hold_similar_lengths_and_every_item_once():
    rng = random.Random(0)
    lengths = [(rng.randint(5, 120),) for _ in range(1000)]  # item_length's: one length per side
    grouped = batches_of(1000, 0, 1, lengths)
    plain = batches_of(1000, 0, 1, lengths, group=False)
    assert sorted(i for b in grouped for i in b) == list(range(1000)) == sorted(i for b in plain for i in b)
    # without grouping: the permutation of (seed, epoch) cut in order, the papers' random batches
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(3 * 1000)).tolist()
    assert plain == [order[i:i + 8] for i in range(0, 1000, 8)]
    # with it: each mega-batch of 50 batches of that permutation sorted by length in steps of BUCKET, then cut
    first = sorted(order[:400], key=lambda i: lengths[i][0] // data.BUCKET)
    assert {tuple(first[i:i + 8]) for i in range(0, 400, 8)} <= {tuple(b) for b in grouped}
    assert grouped != sorted(grouped, key=lambda b: lengths[b[0]])  # the batches are shuffled, not in length order
    lengths = [n for n, in lengths]
    # the padding by hand: each micro-batch padded to its longest item
    by_hand = lambda batches: 1 - sum(lengths[i] for b in batches for i in b) / sum(len(b) * max(lengths[i] for i in b) for b in batches)
    share = lambda batches, parts: data.pad_share(lambda c: np.array(lengths)[c, None], batches, parts)
    assert abs(share(plain, 1) - by_hand(plain)) < 1e-12 and abs(share(plain, 2) - by_hand([h for b in plain for h in (b[:4], b[4:])])) < 1e-12
    assert share(grouped, 1) < 0.1 < 0.3 < share(plain, 1)  # the bar: below 10%


def test_pairs_pad_each_side_on_its_own():
    lengths = [(10, 30), (30, 10)]  # one batch: each side padded to 30, a third of it padding
    assert abs(data.pad_share(lambda c: np.array(lengths)[c], [[0, 1]], 1) - (1 - 80 / 120)) < 1e-12
    assert data.pad_share(lambda c: np.array(lengths)[c], [[0, 1]], 2) == 0  # two micro-batches of one pair each
    batches = batches_of(4, 0, 1, [(10, 30), (30, 10), (30, 11), (10, 29)], batch_size=2)
    assert sorted(sorted(b) for b in batches) == [[0, 3], [1, 2]]  # grouped by both sides


def test_the_split_is_the_same_for_any_number_of_processes():
    lengths = [(random.Random(i).randint(5, 60),) for i in range(203)]
    one, four = (batches_of(203, 2, chunks, lengths) for chunks in (1, 4))
    assert four == [b for b in one if len(b) >= 4]  # only a last batch too small for 4 processes is dropped


def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes_the_blocks(monkeypatch):
    cfg = layers.Config(vocab_size=50, n_layer=3, n_head=2, dim=32, ffn_dim=64)  # dropout 0.1 on: the masks must replay
    ids = torch.randint(4, 50, (4, 12))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 8:] = False
    grads, runs = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        enc = layers.Encoder(cfg).train()
        enc.grad_checkpoint = checkpointing
        calls, forward = [], layers.Block.forward
        monkeypatch.setattr(layers.Block, 'forward', lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
        torch.manual_seed(1)
        (enc(ids, mask) ** 2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None})
        runs.append(len(calls))
        monkeypatch.undo()
    assert grads[0].keys() == grads[1].keys() and all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])
    # nothing inside a block is kept: backward runs each block again (the peak memory: tests/bench.py --memory)
    assert runs == [3, 6]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which('g++') or shutil.which('c++')), reason='torch.compile on a CPU needs a C++ compiler')
def test_compiled_blocks_compute_what_the_blocks_compute():
    cfg = layers.Config(vocab_size=50, n_layer=2, n_head=2, dim=32, ffn_dim=64, dropout=0.0, attn_dropout=0.0)
    torch.manual_seed(0)
    plain = layers.Encoder(cfg)
    compiled = layers.compile_blocks(layers.Encoder(cfg))
    compiled.load_state_dict(plain.state_dict())  # the parameter names are unchanged
    for lengths in ((7, 5, 7), (11, 3)):  # two shapes
        ids = torch.randint(4, 50, (len(lengths), max(lengths)))
        mask = torch.arange(ids.size(1))[None] < torch.tensor(lengths)[:, None]
        ids = ids.masked_fill(~mask, 1)
        outs, w = [], torch.randn(len(lengths), max(lengths), 32)  # a random readout: no gradient cancels to ~0
        for enc in (plain, compiled):
            enc.zero_grad()
            h = enc(ids, mask)
            (h * w)[mask].sum().backward()
            outs.append((h.detach(), {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}))
        (h0, g0), (h1, g1) = outs
        assert (h0 - h1)[mask].abs().max() <= 1e-5 and all((g0[n] - g1[n]).abs().max() <= 1e-5 * max(1.0, g0[n].abs().max()) for n in g0)


# The memory estimate (layers.peak_bytes of each method's passes) against the peak the CPU profiler measures.

def profiled_peak(step, alive):
    """The most bytes held at once while step() runs: those of the tensors `alive` when it starts (the weights, AdamW's
    moments), plus the running sum of the allocations and frees the profiler records in it, in their order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == '[memory]')
    held = peak = 0
    for _, size in changes:
        held += size
        peak = max(peak, held)
    return sum(t.numel() * t.element_size() for t in alive) + peak


def features(rows, length, family=None, seed=0):
    """rows unpadded features of `length` tokens, labelled as the family's."""
    label = {'tagging': [1] * length, 'qa': (3, 5), 'translation': None}.get(family, 1)
    made = [data.Feature([0] + [5 + (7 * i + j + seed) % 500 for j in range(length - 2)] + [2], label,
                         words=list(range(length)) if family == 'tagging' else None) for i in range(rows)]
    for f in made if family == 'translation' else []:
        f.label = f.ids[1:] + [data.IGNORE]  # the next token
    return made


def micro_batch(cls, task, rows, lengths):
    """A micro-batch of a method's task: rows x lengths (one per side), pairs for a paired method; translation's
    source unlabelled, its target labelled with the next tokens."""
    family = 'translation' if task == 'translate' else data.TASKS[task].family if task in data.TASKS else None
    sides = [features(rows, n, family if side or family != 'translation' else None, side)
             for side, n in enumerate(lengths)]
    if not cls.paired:
        return data.collate(sides[0])
    return data.collate_pairs(*sides[:2], alt=sides[2] if len(sides) > 2 else None)


ESTIMATED = [('zeroshot', 'xquad', ()), ('translate-train-all', 'pawsx', ()), ('in-language', 'udpos', ()),
             ('xla', 'panx', ()), ('filter', 'xnli', ()), ('xmixup', 'xnli', ()), ('veco', 'xnli', ()),
             ('veco', 'pretrain', ()), ('veco', 'pretrain', ('--no_cs_mlm',)), ('veco', 'translate', ())]


@pytest.mark.slow
@pytest.mark.parametrize('preset,rows,length', [('tiny', 16, 40), ('small', 4, 48), ('small', 1, 16)])
def test_the_memory_estimate_is_within_10_percent_of_the_profiled_peak_for_every_method(preset, rows, length):
    """A training step of each method (its second: AdamW's moments there), on its model as a run builds it at the demo's
    settings and a micro-batch of rows x lengths: the peak layers.peak_bytes estimates from the method's passes against
    the one the profiler measures (the issue asks for 20%)."""
    import train
    for method, task, more in ESTIMATED:
        args = train.parse_args(['--method', method, '--task', task, '--demo', '--model', preset, *more])
        cls = xlt.method_class(args)
        lengths = (length, length - 6, length - 3)[:1 + cls.paired + cls.round_trip]
        batch = micro_batch(cls, task, rows, lengths)
        torch.manual_seed(0)
        model = cls.sketch(args, train.planned_config(args)).train()
        model.step = 10 ** 6  # VECO past its cross-attention-only phase, X-Mixup's p* decayed
        batch = model.host(batch)  # VECO's masks
        opt = torch.optim.AdamW(model.parameters(), fused=True)

        def step():
            model.loss(batch)[0].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()
        moments = [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
        measured = profiled_peak(step, [*model.parameters(), *moments])
        params = sum(p.numel() for p in model.parameters())
        estimate = layers.peak_bytes(model.encoder.cfg, *model.passes(rows, lengths), params, 'cpu', 'fp32')
        assert abs(estimate / measured - 1) < 0.10, (method, task, more, estimate, measured)


class HostSyncs(TorchDispatchMode):
    """The operations that make a GPU's host wait for it, counted on the CPU by their aten names: a scalar read
    (.item(), int(), bool(), a tensor in an if), nonzero and the boolean indexing and masked_select built on it, unique
    and repeat_interleave (sizes known only once computed); and, patched, .tolist(), .cpu() and .numpy()."""
    WAITS = {'aten::_local_scalar_dense', 'aten::nonzero', 'aten::masked_select', 'aten::is_nonzero', 'aten::equal',
             'aten::_unique2', 'aten::unique_consecutive', 'aten::unique_dim', 'aten::repeat_interleave'}

    def __init__(self, monkeypatch):
        super().__init__()
        self.found = []
        for name in ('tolist', 'cpu', 'numpy'):
            method = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda t, *a, m=method, n=name, **k: self.found.append(n) or m(
                t, *a, **k))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        boolean = name == 'aten::index' and any(i is not None and i.dtype == torch.bool for i in args[1])
        if name in self.WAITS or boolean:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('method,task,more', [*ESTIMATED, ('xmixup', 'udpos', ('--self_teach',)), ('xmixup', 'xquad', ())])
def test_a_training_step_asks_the_device_nothing(method, task, more, monkeypatch):
    """Forward and backward of every method's step (VECO's pre-training masked on the host first, its host hook; X-Mixup
    on tagging and QA too) run no operation that would make a GPU's host wait."""
    import train
    args = train.parse_args(['--method', method, '--task', task, '--demo', '--model', 'tiny', *more])
    cls = xlt.method_class(args)
    torch.manual_seed(0)
    model = cls.sketch(args, train.planned_config(args)).train()
    model.step = 10 ** 6  # VECO with TLM, X-Mixup past its sampling
    lengths = (20, 14, 17)[:1 + cls.paired + cls.round_trip]
    if '--self_teach' in more:  # X-Mixup on tagging learns T from a teacher's stored tag distributions
        model.p_teacher = [torch.rand(lengths[1], len(data.TASKS[task].labels)).softmax(-1) for _ in range(4)]
    batch = model.host(micro_batch(cls, task, 4, lengths))
    if '--self_teach' in more:
        batch.tgt.index = [0, 1, 2, 3]  # the items' positions, as the trainer's collate gives them
    with HostSyncs(monkeypatch) as syncs:
        model.loss(batch)[0].backward()
    assert syncs.found == []


@pytest.mark.slow
def test_the_gpu_check_walks_every_case_on_the_cpu_and_a_broken_case_fails_it(tmp_path, monkeypatch):
    """python tests/gpu_check.py --cpu: every case to its JSON line in --out, in order, none raising, each with its
    measurements; then X-Mixup's loss broken on purpose: its steps are error lines, the others go on, and it exits 1.
    The steps run train.py's own optimiser (fused AdamW), and the compile case's batches have odd lengths."""
    import gpu_check
    out, made, optimiser = tmp_path / 'cpu.jsonl', [], train.optimizer_and_schedule
    monkeypatch.setattr(train, 'optimizer_and_schedule', lambda *a: made.append(optimiser(*a)) or made[-1])
    assert gpu_check.main(['--cpu', '--out', str(out)]) == 0
    assert len(made) == 12 and all(opt.defaults['fused'] for opt, _ in made)  # ten step cases, two loops
    lines = [json.loads(line) for line in open(out)]
    steps = [[method, task, kind, 'tiny', at] for method, task, kind in gpu_check.STEPS for at in ('recipe', 'most')]
    assert [(line['case'], line.get('args')) for line in lines] == [('start', None), ('matmul', None)] + [
        ('step', args) for args in steps] + [('precision', ['tiny']), ('loop', ['bf16']), ('loop', ['fp16']),
                                             ('writer', ['tiny']), ('compile', ['tiny'])]
    assert not [line for line in lines if {'error', 'oom', 'skipped'} & set(line)]
    for line in lines[2:12]:
        assert line['step_s'] > 0 and line['real_tokens_per_s'] > 0 and 0 < line['mfu'] and line['sdpa']
        assert line['estimate_gib'] > 0 and line['rows'] == 8
    assert lines[12]['grad_cosine'] > 0.99 and abs(lines[12]['gap']) < 0.05
    assert all(line['finished'] and line['steps'] == 8 and line['kept'] == ['best.pt'] for line in lines[13:15])
    assert lines[15]['as_it_was'] and lines[15]['tied'] and 1 <= lines[15]['file_over_state'] < 1.1
    assert 1 <= lines[16]['graphs'] <= 3  # dynamic shapes: not one graph a length
    assert all(n % 2 for n in lines[16]['lengths']) and lines[16]['widths'] == lines[16]['lengths']  # the CPU: as is
    broken = lambda self, batch: (_ for _ in ()).throw(RuntimeError('planted'))
    monkeypatch.setattr(xlt.XMixup, 'loss', broken)
    every = gpu_check.cases
    steps = lambda check: [c for c in every(check) if c[0] == 'matmul' or c[0] == 'step' and c[2][0] != 'veco']
    monkeypatch.setattr(gpu_check, 'cases', steps)  # the step cases but VECO's: those around X-Mixup's
    assert gpu_check.main(['--cpu', '--out', str(tmp_path / 'broken.jsonl')]) == 1
    lines = [json.loads(line) for line in open(tmp_path / 'broken.jsonl')]
    assert [line['args'][0] for line in lines if 'error' in line] == ['xmixup', 'xmixup'] and len(lines) == 8
    assert all(line['error'] == 'RuntimeError: planted' for line in lines if 'error' in line)
