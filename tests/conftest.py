"""Shared fixtures: XLM-R and BERT checkpoints in the real key layouts, a sentencepiece model and a
WordPiece vocabulary, all made on the spot (nothing is downloaded)."""
import argparse
import io
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: runs the trainer end to end; python -m pytest -m "not slow" leaves them out')

# The same sentence in eight scripts, used to train the test tokenizer and to test it.
SCRIPTS = {
    'latin': 'Café crème brûlée à São Paulo, naïve façade déjà vu.',
    'cyrillic': 'Привет, как дела? Москва — столица России.',
    'greek': 'Καλημέρα κόσμε, τι κάνεις σήμερα;',
    'arabic': 'مرحبا بالعالم، كيف حالك اليوم؟',
    'devanagari': 'नमस्ते दुनिया, आप कैसे हैं?',
    'thai': 'สวัสดีชาวโลก คุณสบายดีไหม',
    'chinese': '你好，世界。今天天气很好。',
    'japanese': 'こんにちは、世界。東京は晴れです。',
}


@pytest.fixture(scope='session')
def spm_path(tmp_path_factory):
    """A tiny unigram sentencepiece model with XLM-R's special-piece layout (<unk>=0, <s>=1, </s>=2)."""
    import sentencepiece as spm
    words = ' '.join(SCRIPTS.values()).split()
    lines = list(SCRIPTS.values()) + [' '.join(words[i::7]) for i in range(7)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines * 20), model_writer=model, vocab_size=400,
                                   hard_vocab_limit=False, model_type='unigram', character_coverage=1.0,
                                   minloglevel=2, num_threads=1)
    path = tmp_path_factory.mktemp('spm') / 'sentencepiece.bpe.model'
    path.write_bytes(model.getvalue())
    return str(path)


# ----------------------------------------------------------------------------------------
# Random XLM-R weights under Hugging Face's names, and writers for every real layout.

def hf_config(layers, dim, heads, ffn, vocab):
    return {'architectures': ['XLMRobertaForMaskedLM'], 'model_type': 'xlm-roberta', 'vocab_size': vocab,
            'hidden_size': dim, 'num_hidden_layers': layers, 'num_attention_heads': heads,
            'intermediate_size': ffn, 'hidden_act': 'gelu', 'max_position_embeddings': 514,
            'type_vocab_size': 1, 'layer_norm_eps': 1e-5, 'pad_token_id': 1, 'bos_token_id': 0,
            'eos_token_id': 2, 'hidden_dropout_prob': 0.1, 'attention_probs_dropout_prob': 0.1}


def random_hf_weights(cfg, seed=0):
    """Every tensor of XLMRobertaForMaskedLM, random (LayerNorms and biases too, so that none is trivial)."""
    g = torch.Generator().manual_seed(seed)
    D, Fd, V = cfg['hidden_size'], cfg['intermediate_size'], cfg['vocab_size']
    r = lambda *shape, s=0.05: torch.randn(*shape, generator=g) * s
    ln = lambda: (1 + r(D, s=0.1), r(D, s=0.1))
    sd = {'roberta.embeddings.word_embeddings.weight': r(V, D, s=0.1),
          'roberta.embeddings.position_embeddings.weight': r(514, D, s=0.5),
          'roberta.embeddings.token_type_embeddings.weight': r(1, D, s=0.5),
          'roberta.embeddings.position_ids': torch.arange(514)[None]}
    sd['roberta.embeddings.LayerNorm.weight'], sd['roberta.embeddings.LayerNorm.bias'] = ln()
    for i in range(cfg['num_hidden_layers']):
        p = f'roberta.encoder.layer.{i}.'
        for name, shape in (('attention.self.query', (D, D)), ('attention.self.key', (D, D)),
                            ('attention.self.value', (D, D)), ('attention.output.dense', (D, D)),
                            ('intermediate.dense', (Fd, D)), ('output.dense', (D, Fd))):
            sd[p + name + '.weight'], sd[p + name + '.bias'] = r(*shape), r(shape[0])
        sd[p + 'attention.output.LayerNorm.weight'], sd[p + 'attention.output.LayerNorm.bias'] = ln()
        sd[p + 'output.LayerNorm.weight'], sd[p + 'output.LayerNorm.bias'] = ln()
    sd['lm_head.dense.weight'], sd['lm_head.dense.bias'] = r(D, D), r(D)
    sd['lm_head.layer_norm.weight'], sd['lm_head.layer_norm.bias'] = ln()
    sd['lm_head.bias'] = r(V)
    sd['lm_head.decoder.weight'] = sd['roberta.embeddings.word_embeddings.weight']  # tied copies
    sd['lm_head.decoder.bias'] = sd['lm_head.bias']
    return sd


def write_safetensors(sd, path):
    """The safetensors format by its specification, written independently of the reader under test."""
    header, blobs, offset = {'__metadata__': {'format': 'pt'}}, [], 0
    names = {torch.float32: 'F32', torch.float16: 'F16', torch.bfloat16: 'BF16', torch.int64: 'I64'}
    for k, t in sd.items():
        data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {'dtype': names[t.dtype], 'shape': list(t.shape), 'data_offsets': [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(raw)) + raw + b''.join(blobs))


def write_hf_dir(sd, cfg, folder, fmt='safetensors'):
    """A Hugging Face model directory. safetensors writers drop tied copies and non-persistent buffers."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    if fmt == 'safetensors':
        drop = ('lm_head.decoder.weight', 'lm_head.decoder.bias', 'roberta.embeddings.position_ids')
        write_safetensors({k: v for k, v in sd.items() if k not in drop}, os.path.join(folder, 'model.safetensors'))
    else:
        torch.save(sd, os.path.join(folder, 'pytorch_model.bin'))
    return str(folder)


FAIRSEQ = [  # Hugging Face name piece -> fairseq name piece
    ('roberta.encoder.layer.', 'sentence_encoder.layers.'), ('attention.self.query', 'self_attn.q_proj'),
    ('attention.self.key', 'self_attn.k_proj'), ('attention.self.value', 'self_attn.v_proj'),
    ('attention.output.dense', 'self_attn.out_proj'), ('attention.output.LayerNorm', 'self_attn_layer_norm'),
    ('intermediate.dense', 'fc1'), ('output.dense', 'fc2'), ('output.LayerNorm', 'final_layer_norm'),
    ('roberta.embeddings.word_embeddings', 'sentence_encoder.embed_tokens'),
    ('roberta.embeddings.position_embeddings', 'sentence_encoder.embed_positions'),
    ('lm_head.layer_norm', 'lm_head.layer_norm'), ('lm_head.dense', 'lm_head.dense'),
]


def write_fairseq(sd, cfg, path, new_style=False):
    """A fairseq model.pt: old files use 'decoder.' + emb_layer_norm + args Namespace, newer ones
    'encoder.' + layernorm_embedding + a cfg dict. fairseq has no token types: the single
    token-type row of the HF weights goes into its position table, which is the same sum."""
    prefix = 'encoder.' if new_style else 'decoder.'
    out = {}
    for k, v in sd.items():
        if k in ('roberta.embeddings.token_type_embeddings.weight', 'roberta.embeddings.position_ids',
                 'lm_head.decoder.weight', 'lm_head.decoder.bias'):
            continue
        name = k.replace('roberta.embeddings.LayerNorm', 'sentence_encoder.' + ('layernorm_embedding' if new_style else 'emb_layer_norm'))
        for hf, fs in FAIRSEQ:
            name = name.replace(hf, fs)
        out[prefix + name] = v
    out[prefix + 'sentence_encoder.embed_positions.weight'] = (
        sd['roberta.embeddings.position_embeddings.weight'] + sd['roberta.embeddings.token_type_embeddings.weight'][0])
    out[prefix + 'lm_head.weight'] = sd['roberta.embeddings.word_embeddings.weight']
    args = dict(encoder_layers=cfg['num_hidden_layers'], encoder_embed_dim=cfg['hidden_size'],
                encoder_ffn_embed_dim=cfg['intermediate_size'], encoder_attention_heads=cfg['num_attention_heads'],
                activation_fn='gelu', max_positions=512, arch='roberta_base')
    if new_style:
        out[prefix + 'sentence_encoder.version'] = torch.tensor([3.0])
        state = {'model': out, 'cfg': {'model': args, 'common': {'fp16': True}}, 'optimizer_history': [], 'extra_state': {}}
    else:
        state = {'model': out, 'args': argparse.Namespace(**args), 'optimizer_history': [{'num_updates': 0}]}
    torch.save(state, path)
    return str(path)


# BERT: a WordPiece vocabulary and random weights in the Hugging Face layout.

def write_bert_vocab(folder, texts):
    """vocab.txt in BERT's layout ([PAD] 0, [UNK] [CLS] [SEP] [MASK] at 100-103): the texts' characters alone and
    after '##', their words whole, and each word's first three characters and the rest after '##' (so that the
    longest match has choices)."""
    words = sorted({w.strip('.,;?!()') for t in texts for w in t.split()} - {''})
    chars = sorted({c for t in texts for c in t if not c.isspace()})
    lines = ['[PAD]'] + [f'[unused{i}]' for i in range(99)] + ['[UNK]', '[CLS]', '[SEP]', '[MASK]']
    lines += chars + ['##' + c for c in chars] + words + [w[:3] for w in words] + ['##' + w[3:] for w in words]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'vocab.txt'), 'w', encoding='utf-8') as f:
        f.write(''.join(line + '\n' for line in dict.fromkeys(lines)))
    return os.path.join(folder, 'vocab.txt')


def bert_config(layers, dim, heads, ffn, vocab):
    return {'architectures': ['BertForPreTraining'], 'model_type': 'bert', 'vocab_size': vocab, 'hidden_size': dim,
            'num_hidden_layers': layers, 'num_attention_heads': heads, 'intermediate_size': ffn, 'hidden_act': 'gelu',
            'max_position_embeddings': 512, 'type_vocab_size': 2, 'layer_norm_eps': 1e-12, 'pad_token_id': 0,
            'hidden_dropout_prob': 0.1, 'attention_probs_dropout_prob': 0.1}


def random_bert_weights(cfg, seed=0):
    """Every tensor of BertForPreTraining, random: XLM-R's under BERT's names, 512 positions, two token types,
    the pooler and the next-sentence head."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1
    renames = [('roberta.', 'bert.'), ('lm_head.dense', 'cls.predictions.transform.dense'),
               ('lm_head.layer_norm', 'cls.predictions.transform.LayerNorm'), ('lm_head.', 'cls.predictions.')]
    sd = {}
    for key, t in random_hf_weights(cfg, seed).items():
        for theirs, ours in renames:
            key = key.replace(theirs, ours)
        sd[key] = t
    D = cfg['hidden_size']
    sd['bert.embeddings.position_embeddings.weight'] = r(512, D)
    sd['bert.embeddings.token_type_embeddings.weight'] = r(2, D)
    del sd['bert.embeddings.position_ids']
    sd['bert.pooler.dense.weight'], sd['bert.pooler.dense.bias'] = r(D, D), r(D)
    sd['cls.seq_relationship.weight'], sd['cls.seq_relationship.bias'] = r(2, D), r(2)
    return sd


# ----------------------------------------------------------------------------------------
# An independent implementation of XLM-R's forward pass, in float64, straight from the
# Hugging Face weights: no code of layers.py is involved.

def _ln(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))


def naive_xlmr(sd, heads, ids, pad=1):
    """-> (last hidden states, MLM logits) for ids (B, T), padding = pad."""
    w = lambda k: sd[k].double()
    real = ids != pad
    pos = torch.cumsum(real.long(), 1) * real + pad
    x = (w('roberta.embeddings.word_embeddings.weight')[ids] + w('roberta.embeddings.position_embeddings.weight')[pos]
         + w('roberta.embeddings.token_type_embeddings.weight')[0])
    x = _ln(x, w('roberta.embeddings.LayerNorm.weight'), w('roberta.embeddings.LayerNorm.bias'))
    B, T, D = x.shape
    i = 0
    while f'roberta.encoder.layer.{i}.output.dense.weight' in sd:
        p = f'roberta.encoder.layer.{i}.'
        lin = lambda h, name: h @ w(p + name + '.weight').T + w(p + name + '.bias')
        split = lambda h: h.reshape(B, T, heads, D // heads).transpose(1, 2)
        q, k, v = (split(lin(x, 'attention.self.' + n)) for n in ('query', 'key', 'value'))
        scores = q @ k.transpose(-1, -2) / (D // heads) ** 0.5
        scores = scores.masked_fill(~real[:, None, None, :], float('-inf'))
        ctx = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, D)
        x = _ln(x + lin(ctx, 'attention.output.dense'), w(p + 'attention.output.LayerNorm.weight'), w(p + 'attention.output.LayerNorm.bias'))
        x = _ln(x + lin(_gelu(lin(x, 'intermediate.dense')), 'output.dense'), w(p + 'output.LayerNorm.weight'), w(p + 'output.LayerNorm.bias'))
        i += 1
    h = _ln(_gelu(x @ w('lm_head.dense.weight').T + w('lm_head.dense.bias')), w('lm_head.layer_norm.weight'), w('lm_head.layer_norm.bias'))
    return x, h @ w('roberta.embeddings.word_embeddings.weight').T + w('lm_head.bias')


def padded_batch(vocab, lengths, seed=0, pad=1):
    """Random ids (B, max(lengths)) with <s> first, </s> last and padding after."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(4, vocab, (n,), generator=g)
        ids[row, 0], ids[row, n - 1] = 0, 2
    return ids


def quick_pretrained(demo_dir, out, steps=60):
    """A briefly pre-trained demo model (VECO on demo_dir's text) -> its best.pt, for runs that
    start from a trained encoder (X-Mixup) without the demo's full pre-training."""
    import train
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(out, 'demo-data')):
        os.symlink(demo_dir, os.path.join(out, 'demo-data'))
    train.main(['--method', 'veco', '--task', 'pretrain', '--demo', '--out', str(out), '--steps', str(steps),
                '--eval_every', str(steps)])
    return os.path.join(out, 'best.pt')


def demo_run(out, demo_data, argv, runner=None):
    """A demo run of train.py in `out` on demo_data (linked, not written again), in this process
    or under `runner` (torchrun) -> the method's weights in its best.pt (None without one: XLA's run of stages)."""
    import train
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(out, 'demo-data')):
        os.symlink(demo_data, os.path.join(out, 'demo-data'))
    argv = ['--demo', '--out', str(out), *argv]
    if runner is None:
        train.main(argv)
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        subprocess.run(runner + ['train.py', *argv], cwd=root, check=True, capture_output=True,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    best = os.path.join(out, 'best.pt')
    return torch.load(best, weights_only=True)['method'] if os.path.exists(best) else None


def one_line(argv, message):
    """train.py stops with one line that starts 'error: ' and says message."""
    import train
    with pytest.raises(SystemExit) as err:
        train.main(argv)
    assert str(err.value).startswith('error: ') and '\n' not in str(err.value) and message in str(err.value)


def doc(path, title=None):
    """A page of the repository (README.md, docs/...), or its section `title` (to the next '## ' heading)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, path), encoding='utf-8').read()
    if title is None:
        return text
    start = text.index(f'\n## {title}\n')
    end = text.find('\n## ', start + 1)
    return text[start:end if end > 0 else None]
