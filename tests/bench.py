"""Speed of the transformer: training-step and inference tokens/s, and model FLOPs utilisation
against the dense matmul rate measured on the same device.

    python tests/bench.py                       # base preset, batch 8 x 128, current device
    python tests/bench.py --compare             # side by side with Hugging Face's XLM-R (same weights)
    python tests/bench.py --model tiny --steps 3
    python tests/bench.py --precision fp16          # autocast to fp16 with train.py's loss scaler (V100, T4)
    python tests/bench.py --filter              # a FILTER step (k = m = 1) against encoding S and T apart
    python tests/bench.py --generate            # beam search with cached keys and values against re-running the prefix
    python tests/bench.py --pipeline --compare  # a pass of training steps on XNLI-like lengths: ours against the released way
    python tests/bench.py --memory              # peak memory of a training step (each model in a process of its own)
    python tests/bench.py --data                # the data path: tokenizing XNLI-length pairs, a run's start-up on them
    python tests/bench.py --xla_share 0.2       # XLA's stages on a share of XNLI-length data: memory per process
"""
import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import layers  # noqa: E402
import xlt  # noqa: E402


DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}


def matmul_flops(device, precision, n=2048, reps=10):
    """Measured dense matmul rate in the precision's type, FLOP/s: the ceiling MFU is measured against."""
    dtype = DTYPES[precision]
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def flops_per_token(cfg, T):
    """Forward FLOPs per token: q, k, v, out projections (8 D^2), FFN (4 D F), scores and values (4 T D)."""
    return cfg.n_layer * (8 * cfg.dim ** 2 + 4 * cfg.dim * cfg.ffn_dim + 4 * T * cfg.dim)


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


class Ours(torch.nn.Module):
    def __init__(self, enc):
        super().__init__()
        self.enc = enc

    def forward(self, ids, mask):
        return self.enc(ids, mask)


class Reference(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def reference_model(path, device):
    """Hugging Face's XLMRobertaModel on the same weights (the directory was written by it)."""
    from transformers import XLMRobertaModel
    return Reference(XLMRobertaModel.from_pretrained(path, add_pooling_layer=False, attn_implementation='sdpa')).to(device)


def optimizer(model, head, name):
    """Ours: the engine's fused AdamW (train.py); the reference: torch's AdamW with its defaults."""
    return torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-5, fused=name.startswith('ours'))


def scaled_step(loss, opt, scaler):
    """backward and the optimiser's step, through fp16's loss scaler (a no-op for bf16 and fp32), as train.py."""
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def timed_steps(model, ids, mask, steps, train, device, precision, name='ours'):
    """Seconds per step over `steps` steps after two warm-up steps."""
    head = torch.nn.Linear(model_dim(model), 3).to(device)
    opt = optimizer(model, head, name) if train else None
    scaler = torch.amp.GradScaler(device.type, enabled=precision == 'fp16')
    labels = torch.randint(0, 3, (ids.size(0),), device=device)
    model.train(train)
    times = []
    for i in range(steps + 2):
        sync(device)
        t = time.perf_counter()
        with layers.autocast(device, precision), torch.set_grad_enabled(train):
            h = model(ids, mask)
            if train:
                loss = F.cross_entropy(head(h[:, 0]).float(), labels)
        if train:
            scaled_step(loss, opt, scaler)
        sync(device)
        times.append(time.perf_counter() - t)
    return sum(times[2:]) / steps


def model_dim(model):
    return next(p for n, p in model.named_parameters() if 'word_embeddings' in n or n.endswith('tok.weight')).size(1)


def filter_bench(cfg, args, device):
    """Seconds per training step (forward, backward and AdamW; and without AdamW) of FILTER with
    k = m = 1 against the same encoder run on S and on T apart, on the same pair batch."""
    torch.manual_seed(0)
    encoder = layers.Encoder(cfg).to(device)
    model = xlt.Filter(encoder, 'xnli', argparse.Namespace(m=1, k=1, kl_weight=None)).to(device)
    ids = lambda: torch.randint(4, cfg.vocab_size, (args.batch, args.seq), device=device)
    labels = torch.randint(0, 3, (args.batch,), device=device)
    pair = data.Pair(*(data.Batch(x, torch.ones_like(x, dtype=torch.bool), labels) for x in (ids(), ids())))

    def apart():  # translate-train on both sides: the encoder on S, then on T
        loss = sum(xlt.per_example_loss('classification', model.head(encoder(b.ids, b.mask), b.mask), b.labels).mean()
                   for b in (pair.src, pair.tgt))
        return loss

    steps = {'separate S, T': apart, 'FILTER k=m=1': lambda: model.loss(pair)[0]}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == 'fp16')
    model.train()
    times = {name: {'step': [], 'fwd+bwd': []} for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            for i in range(args.steps + 2):
                sync(device)
                t = time.perf_counter()
                with layers.autocast(device, args.precision):
                    loss = fn()
                scaler.scale(loss).backward()
                sync(device)
                mid = time.perf_counter()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sync(device)
                if i >= 2:
                    times[name]['fwd+bwd'].append(mid - t)
                    times[name]['step'].append(time.perf_counter() - t)
    best = {name: {k: min(v) for k, v in t.items()} for name, t in times.items()}
    print(f'{args.model} preset, {args.batch} pairs of {args.seq} + {args.seq} tokens on {device}')
    for name, b in best.items():
        print(f'{name:<16} step {b["step"]:.3f} s   forward+backward {b["fwd+bwd"]:.3f} s')
    base, fil = best['separate S, T'], best['FILTER k=m=1']
    print(f'FILTER / separate: step {fil["step"] / base["step"]:.3f}, forward+backward {fil["fwd+bwd"] / base["fwd+bwd"]:.3f}')


def generate_bench(cfg, args, device):
    """Target tokens per second of VECO's beam search (beam 5, 6 decoder layers or the model's
    depth) with cached keys and values against re-running the whole prefix every step, each
    hypothesis held to exactly --new tokens; median of --rounds alternating runs."""
    torch.manual_seed(0)
    encoder, decoder = xlt.assemble(layers.Encoder(cfg, cross=True), min(6, cfg.n_layer), new_tokens=2)
    model = xlt.VecoTranslate(encoder, decoder, bos=cfg.vocab_size + 1).to(device).eval()
    ids = torch.randint(4, cfg.vocab_size, (args.batch, args.seq), device=device)
    src = data.Batch(ids, torch.ones_like(ids, dtype=torch.bool))
    times = {'cached': [], 'whole prefix': []}
    for _ in range(args.rounds):
        for name in times:
            sync(device)
            t = time.perf_counter()
            with layers.autocast(device, args.precision):
                out = model.generate(src, beam=5, max_new=args.new, min_len=args.new, cache=name == 'cached')
            sync(device)
            times[name].append(time.perf_counter() - t)
            assert all(len(o) == args.new for o in out)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    print(f'{args.model} preset, {len(decoder.blocks)} decoder layers, {args.batch} sources of {args.seq} tokens, '
          f'beam 5, {args.new} target tokens on {device}, {torch.get_num_threads()} threads')
    for name, t in median.items():
        print(f'{name:<14} {args.batch * args.new / t:>8.1f} target tokens/s ({t:.2f} s)')
    print(f'cached / whole prefix: {median["whole prefix"] / median["cached"]:.2f}x')


def xnli_lengths(n, args):
    """n pair lengths in XLM-R pieces, cut to 128: sampled from a real XNLI training file when
    --data_dir (XTREME's layout) and --spm are given, else the stand-in below."""
    g = torch.Generator().manual_seed(0)
    if args.data_dir:
        tok = data.Tokenizer(args.spm or os.path.join(args.data_dir, 'sentencepiece.bpe.model'))
        rows = data.read_split(args.data_dir, 'xnli', 'train')
        picked = torch.randperm(len(rows), generator=g)[:n].tolist()
        return [len(f.ids) for f in data.make_features(tok, 'xnli', [rows[i] for i in picked], 128)], 'XNLI train-en.tsv'
    # no XNLI text here: a log-normal with median 40 pieces and sigma 0.45 (mean 44, 95% below 84), a
    # stand-in for English premise + hypothesis pairs, to be checked against the real file with --data_dir
    lengths = (torch.randn(n, generator=g) * 0.45 + math.log(40)).exp().round().clamp(8, 128).int().tolist()
    return lengths, 'the log-normal stand-in (median 40, sigma 0.45)'


def pipeline_bench(models, cfg, args, device):
    """Real tokens/s over one pass of training steps (--examples pairs, batch --batch): ours, the
    engine's batches grouped by length and each padded to its longest, against the released
    scripts' way, random batches each padded to 128 (XTREME's run_classify: pad_to_max_length),
    on the same examples; alternating, the median of --rounds."""
    lengths, source = xnli_lengths(args.examples, args)
    ids = [torch.randint(4, cfg.vocab_size, (n,)) for n in lengths]
    sides = [(n,) for n in lengths]
    grouped = data.global_batches(len(ids), args.batch, 0, 1, sides)
    plain = data.global_batches(len(ids), args.batch, 0, 1)
    ways = {'ours': (grouped, None), 'released way': (plain, 128)}
    names = {'ours': 'ours', 'released way': 'reference (HF)' if 'reference (HF)' in models else 'ours'}
    times = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, (batches, pad_to) in ways.items():
            model = models[names[way]]
            head = torch.nn.Linear(model_dim(model), 3).to(device)
            opt, labels = optimizer(model, head, names[way]), torch.zeros(args.batch, dtype=torch.long, device=device)
            scaler = torch.amp.GradScaler(device.type, enabled=args.precision == 'fp16')
            model.train()
            sync(device)
            t = time.perf_counter()
            for batch in batches:
                x = torch.nn.utils.rnn.pad_sequence([ids[i] for i in batch], batch_first=True, padding_value=1)
                if pad_to:
                    x = F.pad(x, (0, pad_to - x.size(1)), value=1)
                x = x.to(device)
                with layers.autocast(device, args.precision):
                    loss = F.cross_entropy(head(model(x, x.ne(1))[:, 0]).float(), labels[:len(batch)])
                scaled_step(loss, opt, scaler)
            sync(device)
            times[way].append(time.perf_counter() - t)
    real = sum(lengths)
    print(f'{args.model} preset, {len(lengths)} pairs in batches of {args.batch} on {device}, {torch.get_num_threads()} threads; '
          f'lengths from {source}: mean {real / len(lengths):.1f} pieces')
    for way, (batches, pad_to) in ways.items():
        median = sorted(times[way])[len(times[way]) // 2]
        padded = sum(len(b) * (pad_to or max(lengths[i] for i in b)) for b in batches)
        label = f'{way} ({names[way]})'
        print(f'{label:<30} {real / median:>9.0f} real tokens/s   padding {1 - real / padded:6.1%}   ({median:.1f} s)')
        times[way] = median
    print(f'ours / released way: {times["released way"] / times["ours"]:.2f}x; random batches each padded to their '
          f'longest would pad {data.pad_share(lambda c: np.array(lengths)[c, None], plain, 1):.1%}')


def optimizer_bench(cfg, args):
    """Seconds per AdamW step over the preset's encoder parameters (random gradients)."""
    torch.manual_seed(0)
    enc = layers.Encoder(cfg)
    for p in enc.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    times = {'default': [], 'fused': []}
    for _ in range(args.rounds):
        for name in times:
            opt = torch.optim.AdamW(enc.parameters(), lr=1e-5, fused=name == 'fused')
            opt.step()  # the moments' first allocation
            t = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[name].append((time.perf_counter() - t) / args.steps)
    n = sum(p.numel() for p in enc.parameters())
    for name, t in times.items():
        print(f'AdamW {name:<8} {sorted(t)[len(t) // 2]:.3f} s a step ({n / 1e6:.0f}M parameters, {torch.get_num_threads()} threads)')


def peak_memory(args):
    """Peak resident memory of one base training step at --batch x --seq for ours and the reference,
    each in a fresh process (CPU: the process's maximum RSS, weights and optimiser included)."""
    import json
    import subprocess
    for name, extra in (('ours', ''), ('ours', '"--grad_checkpoint", '), ('reference (HF)', '')):
        code = (f'import sys, resource, json, torch; sys.argv = ["bench", "--model", "{args.model}", "--batch", "{args.batch}", '
                f'"--seq", "{args.seq}", "--steps", "1", "--rounds", "1", "--compare", {extra}"--only", "{name}"]; '
                'sys.path.insert(0, "tests"); import bench; bench.main(); '
                'print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))')
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, '-c', code], cwd=root, capture_output=True, text=True, check=True).stdout
        name += ' + --grad_checkpoint' if extra else ''
        print(f'{name:<30} peak {json.loads(out.strip().splitlines()[-1]) / 2 ** 20:.2f} GB '
              f'({args.model}, training steps at batch {args.batch} x {args.seq})')


XNLI_LANGS = ['ar', 'bg', 'de', 'el', 'es', 'fr', 'hi', 'ru', 'sw', 'th', 'tr', 'ur', 'vi', 'zh']


def memory_mb():
    """This process's memory in MB: private (RssAnon: beyond the files it maps), file pages mapped
    (RssFile: the page cache, shared between processes), its proportional share (Pss: a page
    mapped by two processes counts half in each) and its peak resident set (VmHWM)."""
    with open('/proc/self/status') as f:
        status = {k: int(v.split()[0]) / 1024 for k, v in (line.split(':', 1) for line in f) if k in ('RssAnon', 'RssFile', 'VmHWM')}
    with open('/proc/self/smaps_rollup') as f:
        status['Pss'] = next(int(line.split()[1]) for line in f if line.startswith('Pss:')) / 1024
    return status


def generated_xnli(folder, n, langs, seed=0):
    """n XNLI-length English pairs (premise 18-40 words, hypothesis 6-15, Zipf-distributed words of
    a 60k-word vocabulary) in XTREME's layout: train-en.tsv, their translations into each of langs
    (each language its own words), and dev and test sets of 50 pairs in each of XNLI's languages."""
    rng = np.random.default_rng(seed)
    letters = np.array(list('bcdfghklmnprstvz')), np.array(list('aeiou'))
    vocab = np.array([''.join(rng.choice(letters[i % 2]) for i in range(rng.integers(2, 9))) for _ in range(60000)])
    p = 1 / np.arange(1, len(vocab) + 1) ** 1.1
    p /= p.sum()

    def sentences(count, low, high, words):
        lengths = rng.integers(low, high + 1, count)
        flat = words[rng.choice(len(words), lengths.sum(), p=p)]
        return [' '.join(s) for s in np.split(flat, np.cumsum(lengths)[:-1])]
    premises, hypotheses = sentences(n, 18, 40, vocab), sentences(n, 6, 15, vocab)
    labels = rng.choice(['entailment', 'neutral', 'contradiction'], n)
    os.makedirs(f'{folder}/xnli/translate-train', exist_ok=True)
    with open(f'{folder}/xnli/train-en.tsv', 'w') as f:
        f.writelines(f'{a}\t{b}\t{c}\n' for a, b, c in zip(premises, hypotheses, labels))
    for lang in langs:  # a 'translation': the same sentence in the language's own words
        words = np.char.add(vocab, lang)
        table = dict(zip(vocab, words))
        with open(f'{folder}/xnli/translate-train/en-{lang}-translated.tsv', 'w') as f:
            for a, b, c in zip(premises, hypotheses, labels):
                ta, tb = (' '.join(table[w] for w in s.split()) for s in (a, b))
                f.write(f'{a}\t{b}\t{ta}\t{tb}\t{c}\n')
    for lang in ['en', *XNLI_LANGS]:
        words = vocab if lang == 'en' else np.char.add(vocab, lang)
        for split in ('dev', 'test'):
            with open(f'{folder}/xnli/{split}-{lang}.tsv', 'w') as f:
                f.writelines(f'{a}\t{b}\tneutral\n' for a, b in zip(sentences(50, 18, 40, words), sentences(50, 6, 15, words)))
    return premises + hypotheses


def first_step(argv):
    """In this process: train.py's run of argv up to its first training step -> (seconds, memory_mb()
    at the start, memory_mb() at the first step)."""
    import train

    class FirstStep(Exception):
        pass
    start, base = time.perf_counter(), memory_mb()

    def stop(*a, **k):
        raise FirstStep(time.perf_counter() - start, memory_mb())
    train.train_step = stop
    try:
        train.main(argv)
    except FirstStep as e:
        return e.args[0], base, e.args[1]
    raise SystemExit('the run ended before its first training step')


def data_bench(args):
    """Tokenizing --examples XNLI-length pairs (read_split + make_features), then the start-up of
    translate-train-all on them and their translations into XNLI's 14 other languages, each start in
    processes of its own: the first (it tokenizes the set into the cache, under torchrun with --ranks
    processes), the second (one process) and the third (--ranks processes): the time to the first
    training step and the memory then."""
    import json
    import shutil
    import subprocess
    import sentencepiece as spm
    folder = args.workdir or tempfile.mkdtemp(prefix='bench-data-')
    langs = XNLI_LANGS  # translate-train-all reads all 14
    if not os.path.exists(f'{folder}/xnli/train-en.tsv'):
        t = time.perf_counter()
        text = generated_xnli(folder, args.examples, langs)
        print(f'generated {args.examples} pairs and {len(langs)} translations in {folder} ({time.perf_counter() - t:.0f} s)')
        if not args.spm:
            spm.SentencePieceTrainer.train(sentence_iterator=iter(text[:200000]), model_prefix=f'{folder}/spm',
                                           vocab_size=32000, hard_vocab_limit=False, model_type='unigram', minloglevel=2)
    tok = data.Tokenizer(args.spm or f'{folder}/spm.model')
    base, t = memory_mb()['RssAnon'], time.perf_counter()
    examples = data.read_split(folder, 'xnli', 'train', 'en')[:args.examples]
    read, held = time.perf_counter() - t, memory_mb()['RssAnon']
    feats = data.make_features(tok, 'xnli', examples, 128)
    took, total = time.perf_counter() - t, memory_mb()['RssAnon']
    pieces = sum(len(f.ids) for f in feats) / len(feats)
    print(f'read_split + make_features in one process: {len(feats)} features, {len(feats) / took:.0f} examples/s ({read:.1f} s '
          f'reading), {pieces:.1f} pieces a feature; memory +{held - base:.0f} MB examples, +{total - held:.0f} MB features '
          f'({(total - held) * 2 ** 20 / len(feats):.0f} bytes a feature)')
    del examples, feats
    argv = ['--method', 'translate-train-all', '--task', 'xnli', '--data_dir', folder, '--spm', args.spm or f'{folder}/spm.model',
            '--model', 'tiny', '--from_scratch', '--out', f'{folder}/run', '--overwrite'] + (['--no_cache'] if args.no_cache else [])
    shutil.rmtree(f'{folder}/.cache', ignore_errors=True)
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(args.ranks)]
    for start, ranks in (('first', args.ranks), ('second', 1), ('third', args.ranks)):
        out = subprocess.run((torchrun if ranks > 1 else [sys.executable]) + [__file__, '--first_step', json.dumps(argv)],
                             capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        builds = out.stdout.count('tokenizing the training data into')
        for line in [line for line in out.stdout.splitlines() if line.startswith('[')]:
            seconds, before, at = json.loads(line)
            print(f'{start} start ({ranks} process{"es" * (ranks > 1)}, {builds} build{"s" * (builds != 1)}): first training step '
                  f'after {seconds:.1f} s; private {at["RssAnon"]:.0f} MB ({at["RssAnon"] - before["RssAnon"]:.0f} MB more than '
                  f'after the imports), page cache mapped {at["RssFile"]:.0f} MB, proportional {at["Pss"]:.0f} MB, peak '
                  f'resident {at["VmHWM"]:.0f} MB')
    cache = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(f'{folder}/.cache') for f in fs)
    print(f'the cache: {cache / 2 ** 30:.2f} GB in {folder}/.cache')


def generated_text(folder, megabytes, seed=0):
    """About `megabytes` MB of pre-training text in the layout of docs/veco.md: monolingual documents
    (5-30 lines of 8-40 Zipf-distributed words) in English and German (German: each word with a
    suffix), a third each, and a third of English-German parallel lines of 40-60 words (at --seq
    64 every batch then has the same shape, so that memory tells the data apart from the
    compute). -> a sample of lines."""
    rng = np.random.default_rng(seed)
    letters = np.array(list('bcdfghklmnprstvz')), np.array(list('aeiou'))
    vocab = np.array([''.join(rng.choice(letters[i % 2]) for i in range(rng.integers(2, 9))) for _ in range(60000)])
    p = 1 / np.arange(1, len(vocab) + 1) ** 1.1
    p /= p.sum()

    def lines(n, low=8, high=40):
        lengths = rng.integers(low, high + 1, n)
        return [' '.join(vocab[w]) for w in np.split(rng.choice(len(vocab), lengths.sum(), p=p), np.cumsum(lengths)[:-1])]
    os.makedirs(f'{folder}/pretrain/mono', exist_ok=True)
    os.makedirs(f'{folder}/pretrain/parallel', exist_ok=True)
    files = {name: open(f'{folder}/pretrain/{name}', 'w') for name in ('mono/en.txt', 'mono/de.txt', 'parallel/en-de.en', 'parallel/en-de.de')}
    sample, budget = [], megabytes * 2 ** 20 / 3
    for name in ('mono/en.txt', 'mono/de.txt'):
        while files[name].tell() < budget:
            doc = lines(int(rng.integers(5, 31)))
            files[name].write('\n'.join(w + 'de' * name.endswith('de.txt') for w in doc) + '\n\n')
            sample += doc[:2] if len(sample) < 100000 else []
    while files['parallel/en-de.en'].tell() + files['parallel/en-de.de'].tell() < budget:
        block = lines(1000, 40, 60)
        files['parallel/en-de.en'].write(''.join(s + '\n' for s in block))
        files['parallel/en-de.de'].write(''.join(' '.join(w + 'de' for w in s.split()) + '\n' for s in block))
    for f in files.values():
        f.close()
    return sample


def run_steps(argv):
    """In this process: train.py's run of argv -> (seconds from its first training step to its
    last, steps, peak resident MB, the most private and mapped MB seen at a step)."""
    import resource
    import train
    times, seen, step = [], [], train.train_step

    def timed(*a, **k):
        times.append(time.perf_counter())
        seen.append(memory_mb())
        return step(*a, **k)
    train.train_step = timed
    train.main(argv)
    return (times[-1] - times[0], len(times), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            max(m['RssAnon'] for m in seen), max(m['RssFile'] for m in seen))


def pretrain_bench(args):
    """VECO's pre-training on --pretrain_text MB of generated text, segments of up to --seq pieces:
    the preparation (tokenizing into the cache), in a process of its own, then a run of --steps
    steps after it: MB/s, steps/s and the peak resident memory of each."""
    import json
    import subprocess
    import sentencepiece as spm
    folder = args.workdir or tempfile.mkdtemp(prefix='bench-pretrain-')
    if not os.path.exists(f'{folder}/pretrain'):
        t = time.perf_counter()
        sample = generated_text(folder, args.pretrain_text)
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sample), model_prefix=f'{folder}/spm', vocab_size=32000,
                                       hard_vocab_limit=False, model_type='unigram', minloglevel=2)
        print(f'generated {args.pretrain_text} MB of text in {folder} ({time.perf_counter() - t:.0f} s)')
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(f'{folder}/pretrain') for f in fs) / 2 ** 20
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prepare = (f'import sys, time, resource, json; sys.path.insert(0, {root!r}); import data; t = time.perf_counter(); '
               f'items, groups, _ = data.pretraining_set(data.Tokenizer({folder!r} + "/spm.model"), {folder!r}, {args.seq}); '
               'print(json.dumps([time.perf_counter() - t, len(items), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))')
    shutil.rmtree(f'{folder}/.cache', ignore_errors=True)
    out = subprocess.run([sys.executable, '-c', prepare], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    seconds, pairs, peak = json.loads(out.stdout.strip().splitlines()[-1])
    print(f'preparation: {size:.0f} MB of text into {pairs} pairs in {seconds:.0f} s, {size / seconds:.1f} MB/s; peak resident {peak:.0f} MB')
    argv = ['--method', 'veco', '--task', 'pretrain', '--data_dir', folder, '--spm', f'{folder}/spm.model', '--model', 'tiny',
            '--from_scratch', '--steps', str(args.steps), '--eval_every', str(args.steps), '--batch_size', '16', '--max_len', str(args.seq),
            '--para_batch_size', '16', '--eval_batch_size', '16', '--out', f'{folder}/run', '--overwrite']
    out = subprocess.run([sys.executable, __file__, '--timed_steps', json.dumps(argv)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    seconds, steps, peak, private, mapped = json.loads(out.stdout.strip().splitlines()[-1])
    print(f'pre-training after it (tiny, batches of 16 pairs of --seq {args.seq}): {(steps - 1) / seconds:.2f} steps/s over {steps} steps; '
          f'peak resident {peak:.0f} MB; at a step, at most {private:.0f} MB private and {mapped:.0f} MB of mapped files')


def xla_stages(argv):
    """In this process: train.py's XLA run of argv, the co-teaching trainings replaced by reading what
    they would train on: every batch of the first training of each epoch (the others pass) ->
    (memory_mb() after the imports, at each of those readings, and the peak resident MB)."""
    import resource
    import train
    start, seen = memory_mb(), []

    def reading_only(run, epoch, l, pair, parts, model):
        if pair == (0, 1):  # the sets of the epoch, their labels and their samples made: what a training reads
            items = xlt.Chosen(parts.values())
            batches = xlt.mixture_batches(np.diff(items.starts).tolist(), run.args.alpha, run.args.xla_batch_size, epoch, 1,
                                          data.item_lengths(items))
            for batch in batches[run.rank::run.world]:
                data.collate([items[i] for i in batch])
            seen.append(dict(memory_mb(), items=len(items)))
        return model
    xlt.co_train = reading_only
    train.main(argv)
    return start, seen, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def xla_prepare(argv):
    """In this process: the sets an XLA run of argv reads (D_s, the warm-ups' English, and D_t, as
    XLA.algorithm_1 asks for them) tokenized into the data folder's cache -> (seconds, peak
    resident MB). The build reads the whole files, whatever the share."""
    import resource
    import train
    args, start = train.parse_args(argv), time.perf_counter()
    tok = data.Tokenizer(args.spm)
    spec = data.Tokenization(tok, args.data_dir, args.task, args.max_len, args.doc_stride)
    data.training_set(spec, [], share=args.train_share)
    data.unlabelled_set(spec, args.train_lang, args.train_share)
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def xla_bench(args):
    """XLA on --xla_share of --examples generated XNLI-length pairs and their German translations,
    tiny random model, under torchrun with --ranks processes: three warm-ups of one epoch, then
    three XLA epochs of GEN-LM (the vicinal samples), DISTIL (three models' labels of every set)
    and the reading of what each epoch's first training trains on (xla_stages) -> each process's
    memory after each epoch and its peak."""
    import json
    import subprocess
    import sentencepiece as spm
    folder = args.workdir or tempfile.mkdtemp(prefix='bench-xla-')
    if not os.path.exists(f'{folder}/xnli/train-en.tsv'):
        text = generated_xnli(folder, args.examples, ['de'])
        spm.SentencePieceTrainer.train(sentence_iterator=iter(text[:200000]), model_prefix=f'{folder}/spm',
                                       vocab_size=32000, hard_vocab_limit=False, model_type='unigram', minloglevel=2)
    tok = data.Tokenizer(f'{folder}/spm.model')
    cfg = layers.Config(**{**layers.CONFIGS['tiny'].__dict__, 'vocab_size': tok.vocab_size})
    encoder = layers.Encoder(cfg)  # a random model with its MLM head, in the layout --init reads
    mlm = layers.MLMHead(cfg, encoder.tok.weight)
    with torch.no_grad():  # that fills in whole words, as a trained one mostly does: the samples keep their number
        mlm.bias += 10.0 * (torch.tensor(tok.word_starts()) & (torch.tensor(tok.piece_chars()) > 0))
    layers.save_checkpoint(f'{folder}/init.pt', {'model': 'tiny'}, config=cfg.__dict__, encoder=encoder.state_dict(),
                           mlm=mlm.state_dict())
    argv = ['--method', 'xla', '--task', 'xnli', '--train_lang', 'de', '--data_dir', folder, '--spm', f'{folder}/spm.model',
            '--model', 'tiny', '--init', f'{folder}/init.pt', '--train_share', str(args.xla_share), '--epochs', '1',
            '--lr', '1e-4', '--out', f'{folder}/run', '--overwrite']
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(args.ranks)] if args.ranks > 1 else [sys.executable]
    run = lambda launch, flag: subprocess.run(launch + [__file__, flag, json.dumps(argv)], capture_output=True, text=True,
                                              env=dict(os.environ, OMP_NUM_THREADS='1'))
    out = run([sys.executable], '--xla_prepare')  # the sets tokenized first, in a process of its own
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    seconds, peak = json.loads(out.stdout.splitlines()[-1])
    print(f'preparation (D_s and D_t into the cache, one process): {seconds:.0f} s, peak resident {peak:.0f} MB')
    t = time.perf_counter()
    out = run(torchrun, '--xla_stages')
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    print('\n'.join(line for line in out.stdout.splitlines() if line.startswith('XLA epoch') and 'keeps' not in line))
    print(f'{args.ranks} process(es), {args.xla_share:.0%} of {args.examples} pairs, {time.perf_counter() - t:.0f} s in all; '
          f'sets tokenized by the stages: {out.stdout.count("tokenizing the training data")}')
    for line in [line for line in out.stdout.splitlines() if line.startswith('[')]:
        start, seen, peak = json.loads(line)
        print(f'after the imports: private {start["RssAnon"]:.0f} MB; ' + '; '.join(
            f'epoch {e + 1} ({m["items"]} items read): private {m["RssAnon"]:.0f} MB, mapped {m["RssFile"]:.0f} MB'
            for e, m in enumerate(seen)) + f'; peak resident {peak:.0f} MB ({peak - start["VmHWM"]:.0f} MB beyond the imports)')


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='base', choices=list(layers.CONFIGS))
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--seq', type=int, default=128)
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--rounds', type=int, default=2, help='alternate the models this many times')
    parser.add_argument('--precision', choices=('bf16', 'fp16', 'fp32'), help='autocast, and fp16\'s loss scaler '
                        '(default: train.py\'s, bf16 on a GPU that has it, fp16 on one that has not, fp32 on a CPU)')
    parser.add_argument('--compare', action='store_true', help='also time Hugging Face XLM-R on the same weights')
    parser.add_argument('--filter', action='store_true', help='FILTER k = m = 1 against encoding S and T apart')
    parser.add_argument('--generate', action='store_true', help='beam search: cached keys and values against the whole prefix')
    parser.add_argument('--new', type=int, default=64, help='--generate: target tokens per hypothesis')
    parser.add_argument('--pipeline', action='store_true', help='a pass of training steps on XNLI-like lengths: grouped '
                        'batches against random batches padded to 128 (with --compare, the reference model for the latter)')
    parser.add_argument('--examples', type=int, default=256, help='--pipeline: training pairs in the pass')
    parser.add_argument('--data_dir', help='--pipeline: XTREME data, to draw the lengths from xnli/train-en.tsv')
    parser.add_argument('--spm', help='--pipeline with --data_dir: the sentencepiece model (default: in --data_dir)')
    parser.add_argument('--memory', action='store_true', help='peak memory of a training step, ours and the reference')
    parser.add_argument('--only', help=argparse.SUPPRESS)  # --memory: time one model alone
    parser.add_argument('--grad_checkpoint', action='store_true', help='ours with activation checkpointing')
    parser.add_argument('--compile', action='store_true', help='ours with compiled blocks (layers.compile_blocks)')
    parser.add_argument('--optimizer', action='store_true', help='an AdamW step on the preset\'s parameters: '
                        'torch\'s default against the fused one (train.py\'s)')
    parser.add_argument('--data', action='store_true', help='the data path: tokenizing --examples XNLI-length pairs '
                        '(default 39270 with --data, a tenth of XNLI), and a translate-train-all run\'s start-up on them '
                        'and their 14 translations')
    parser.add_argument('--workdir', help='--data: the generated data\'s folder, kept and reused (default: a new one)')
    parser.add_argument('--ranks', type=int, default=2, help='--data: processes of the first and third starts (torchrun)')
    parser.add_argument('--no_cache', action='store_true', help='--data: the runs with --no_cache')
    parser.add_argument('--first_step', help=argparse.SUPPRESS)  # --data: one start, in a process of its own
    parser.add_argument('--pretrain_text', type=int, help='VECO\'s pre-training on this many MB of generated text: '
                        'the preparation\'s MB/s, then --steps steps: steps/s and peak memory of each')
    parser.add_argument('--xla_share', type=float, help='XLA\'s warm-ups, GEN-LM, DISTIL and reading on this share of '
                        '--examples XNLI-length pairs (default all 392,702): each process\'s memory (--ranks, --workdir)')
    parser.add_argument('--xla_stages', help=argparse.SUPPRESS)  # --xla_share: the run, in each process
    parser.add_argument('--xla_prepare', help=argparse.SUPPRESS)  # --xla_share: its sets tokenized first
    parser.add_argument('--timed_steps', help=argparse.SUPPRESS)  # --pretrain_text: the run, in a process of its own
    args = parser.parse_args()
    if args.first_step:
        import json
        return print(json.dumps(first_step(json.loads(args.first_step))))
    if args.timed_steps:
        import json
        return print(json.dumps(run_steps(json.loads(args.timed_steps))))
    if args.xla_prepare:
        import json
        return print(json.dumps(xla_prepare(json.loads(args.xla_prepare))))
    if args.xla_stages:
        import json
        line = json.dumps(xla_stages(json.loads(args.xla_stages))) + '\n'
        sys.stdout.flush()  # then the line in one write: the processes' lines do not interleave
        return sys.stdout.write(line) and sys.stdout.flush()
    if args.xla_share:
        args.examples = args.examples if args.examples != 256 else 392702  # XNLI's
        return xla_bench(args)
    if args.pretrain_text:
        return pretrain_bench(args)
    if args.data:
        args.examples = args.examples if args.examples != 256 else 39270  # a tenth of XNLI's 392,702
        return data_bench(args)
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    args.precision = args.precision or layers.default_precision(device.type)
    if args.filter:
        return filter_bench(layers.CONFIGS[args.model], args, device)
    if args.generate:
        return generate_bench(layers.CONFIGS[args.model], args, device)
    if args.memory:
        return peak_memory(args)
    if args.optimizer:
        return optimizer_bench(layers.CONFIGS[args.model], args)
    torch.manual_seed(0)
    cfg = layers.CONFIGS[args.model]
    ids = torch.randint(4, cfg.vocab_size, (args.batch, args.seq), device=device)
    ids[:, 0], ids[:, -1] = 0, 2
    mask = torch.ones_like(ids, dtype=torch.bool)
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare:  # HF writes random weights; ours loads that very file
            from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM
            XLMRobertaForMaskedLM(XLMRobertaConfig(
                vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layer,
                num_attention_heads=cfg.n_head, intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_positions,
                type_vocab_size=1, pad_token_id=cfg.pad_id)).save_pretrained(tmp)
            if args.only in (None, 'ours'):
                models['ours'] = Ours(layers.load_pretrained(tmp)[0]).to(device)
                models['ours'].enc.grad_checkpoint = args.grad_checkpoint
            if args.only in (None, 'reference (HF)'):
                models['reference (HF)'] = reference_model(tmp, device)
        else:
            models['ours'] = Ours(layers.Encoder(cfg)).to(device)
        if args.compile:  # both, compiled and not, side by side
            models['ours, compiled'] = Ours(layers.compile_blocks(layers.Encoder(cfg))).to(device)
            models['ours, compiled'].load_state_dict(models['ours'].state_dict())
    if args.pipeline:
        return pipeline_bench(models, cfg, args, device)
    peak = matmul_flops(device, args.precision)
    fpt = flops_per_token(cfg, args.seq)
    tokens = args.batch * args.seq
    results = {name: {'train': [], 'infer': []} for name in models}
    for _ in range(args.rounds):  # interleaved, so that both see the same machine
        for name, model in models.items():
            results[name]['train'].append(timed_steps(model, ids, mask, args.steps, True, device, args.precision, name))
            results[name]['infer'].append(timed_steps(model, ids, mask, args.steps, False, device, args.precision, name))
    print(f'{args.model} preset, batch {args.batch} x {args.seq} on {device}, {torch.get_num_threads()} threads; '
          f'measured matmul rate {peak / 1e9:.1f} GFLOP/s')
    print(f'{"model":<16} {"train tok/s":>12} {"train MFU":>10} {"infer tok/s":>12} {"infer MFU":>10}')
    for name, r in results.items():  # the median of the alternating rounds
        train, infer = sorted(r['train'])[len(r['train']) // 2], sorted(r['infer'])[len(r['infer']) // 2]
        print(f'{name:<16} {tokens / train:>12.0f} {3 * fpt * tokens / train / peak:>10.1%} '
              f'{tokens / infer:>12.0f} {fpt * tokens / infer / peak:>10.1%}')
        results[name] = train, infer
    first = next(iter(results))
    for name in list(results)[1:]:
        (t0, i0), (t1, i1) = results[first], results[name]
        print(f'{first} / {name}: train {t1 / t0:.2f}x, inference {i1 / i0:.2f}x (medians of {args.rounds} alternating rounds)')


if __name__ == '__main__':
    main()
