"""The transformer, written out by hand: XLM-R (RoBERTa), BERT (mBERT, English BERT) and the pieces the methods reuse.

Both are post-LayerNorm encoders with GELU and learned absolute positions. XLM-R numbers positions the fairseq way
and has LayerNorm eps 1e-5. BERT counts positions from 0, adds a token-type (segment) embedding, and has eps 1e-12
and a pre-trained pooler. `load_pretrained` reads the public weights (Hugging Face or fairseq layout) and this
project's own converted checkpoint, which `python layers.py convert SRC OUT` writes.
"""
import argparse
import json
import math
import mmap
import os
import re
import shutil
import struct
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import sentencepiece
import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 250002
    n_layer: int = 12
    n_head: int = 12
    dim: int = 768
    ffn_dim: int = 3072
    max_positions: int = 514  # 512 tokens, because positions start at pad_id + 1
    pad_id: int = 1
    dropout: float = 0.1
    attn_dropout: float = 0.1
    ln_eps: float = 1e-5
    embed_scale: float = 1.0  # the token embeddings are multiplied by this (sqrt(dim) in fairseq's translation models)
    backbone: str = 'xlmr'  # 'bert': positions from 0, token types, a pooler
    type_vocab_size: int = 0  # BERT's token types (2: segment B is the second text of a pair)
    sep_id: int = 2  # the separator; BERT's segment B starts after the first one


BERT = Config(backbone='bert', vocab_size=119547, max_positions=512, pad_id=0, ln_eps=1e-12, type_vocab_size=2,
              sep_id=102)  # bert-base-multilingual-cased (mBERT)
CONFIGS = {
    'tiny': Config(vocab_size=1000, n_layer=2, n_head=2, dim=64, ffn_dim=128),
    'small': Config(n_layer=4, n_head=4, dim=256, ffn_dim=1024),
    'base': Config(),  # XLM-R base
    'large': Config(n_layer=24, n_head=16, dim=1024, ffn_dim=4096),  # XLM-R large
    'veco_small': Config(n_layer=6),  # VECO small and XLM small (VECO's Table 5): 6 x 768, 12 heads
    'mbert': BERT,
    'bert-large': replace(BERT, vocab_size=28996, n_layer=24, n_head=16, dim=1024, ffn_dim=4096),  # bert-large-cased
    'tiny-bert': replace(BERT, vocab_size=1000, n_layer=2, n_head=2, dim=64, ffn_dim=128),
}


def attention_mask(mask, causal, T, S, device):
    """The boolean mask for scaled_dot_product_attention (True = may attend), or None. mask is the (B, S) key
    padding mask, True on real tokens. causal forbids the keys after the query."""
    allowed = None if mask is None else mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    if causal:  # the T queries are the last T of the S positions (T < S when decoding step by step)
        tril = torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)
        allowed = tril if allowed is None else allowed & tril
    return allowed


class Attention(nn.Module):
    """Multi-head attention. Queries come from x, keys and values from `memory` (x itself
    when None), so the same weights serve self-attention and cross-attention. With a `cache`
    dict (decoding step by step) x holds only the newest positions: self-attention appends
    their keys and values to the cached ones, cross-attention computes memory's once."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.dim, self.p = cfg.n_head, cfg.dim, cfg.attn_dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)  # one matmul for q, k and v
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, mask=None, memory=None, causal=False, return_scores=False, cache=None):
        B, T, D = x.shape
        if memory is None:
            q, k, v = self.qkv(x).split(D, dim=2)
            if cache is not None and 'k' in cache:
                k, v = torch.cat([cache['k'], k], 1), torch.cat([cache['v'], v], 1)
        else:
            w, b = self.qkv.weight, self.qkv.bias
            q = F.linear(x, w[:D], b[:D])
            if cache and 'k' in cache:  # the memory's keys and values, computed at the first step
                k, v = cache['k'], cache['v']
            else:
                k, v = F.linear(memory, w[D:], b[D:]).split(D, dim=2)
        if cache is not None:
            cache['k'], cache['v'] = k, v
        q, k, v = (t.view(B, -1, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        causal_only = causal and mask is None and T == k.size(2) and not return_scores  # SDPA's causal kernel, no mask
        allowed = None if causal_only else attention_mask(mask, causal, T, k.size(2), x.device)
        p = self.p if self.training else 0.0
        if return_scores:  # the slow path, for a method that needs the attention itself (X-Mixup's entropy)
            scores = (q / math.sqrt(q.size(-1))) @ k.transpose(-2, -1)  # (B, heads, T, S); scaled first: fp16's range
            masked = scores if allowed is None else scores.masked_fill(~allowed, float('-inf'))
            y = F.dropout(masked.softmax(dim=-1), p, self.training) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p, is_causal=causal_only)
        y = self.out(y.transpose(1, 2).reshape(B, T, D))
        return (y, scores) if return_scores else y


class FFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # the exact (erf) GELU, as in XLM-R


class Block(nn.Module):
    """A post-LN transformer block: self-attention -> AddNorm -> [cross-attention on `memory` -> AddNorm] -> FFN ->
    AddNorm. The cross-attention exists only when the block is built with cross=True. This is VECO's variable block
    (Eq. 2-3): the self-attention and the FFN serve a stream with memory and one without, and the cross-attention
    has weights of its own."""

    def __init__(self, cfg, cross=False):
        super().__init__()
        self.attn, self.ln1 = Attention(cfg), nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        if cross:
            self.cross, self.ln_cross = Attention(cfg), nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.ffn, self.ln2 = FFN(cfg), nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def attend(self, x, mask=None, causal=False, cache=None):
        """The self-attention sub-layer's residual sum, before its LayerNorm ln1."""
        return x + self.drop(self.attn(x, mask, causal=causal, cache=cache))

    def feed_forward(self, h):
        return self.ln2(h + self.drop(self.ffn(h)))

    def forward(self, x, mask=None, memory=None, memory_mask=None, causal=False, cache=None):
        """memory (B, S, H) holds the states the cross-attention reads; None skips the cross-attention. cache holds
        this block's {'self': {...}, 'cross': {...}} keys and values when decoding step by step."""
        part = lambda name: None if cache is None else cache.setdefault(name, {})
        x = self.ln1(self.attend(x, mask, causal, part('self')))
        if memory is not None:
            x = self.ln_cross(x + self.drop(self.cross(x, memory_mask, memory=memory, cache=part('cross'))))
        return self.feed_forward(x)


def position_ids(ids, pad_id):
    """fairseq/RoBERTa numbering: real tokens count from pad_id + 1, padding sits at pad_id."""
    real = ids.ne(pad_id).int()
    return (torch.cumsum(real, dim=1) * real).long() + pad_id


def token_types(ids, sep_id):
    """BERT's segments: 0 up to and including the first [SEP], 1 after it (the second text of a pair and its [SEP])."""
    sep = ids.eq(sep_id).int()
    return (sep.cumsum(1) - sep).clamp(max=1)


class Encoder(nn.Module):
    """Embeddings and blocks. cross=True gives every block a cross-attention (VECO), used only when run() is given a
    memory. load_pretrained(path) leaves out a checkpoint's cross-attention (VECO's NLU assembly). task_head is the
    head of a transformers task model that came with the weights (load_pretrained); the method's head starts from it
    (xlt.Head)."""

    def __init__(self, cfg, cross=False, task_head=None):
        super().__init__()
        self.cfg, self.task_head = cfg, task_head
        bert = cfg.backbone == 'bert'
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_id)
        self.pos = nn.Embedding(cfg.max_positions, cfg.dim, padding_idx=None if bert else cfg.pad_id)
        if cfg.type_vocab_size:
            self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        # BERT's pre-trained pooler, tanh(dense(h of [CLS])), is kept but not trained: the classification head starts
        # from it (xlt.Head), and a trainable parameter that no loss reaches would stop DDP
        self.pooler = nn.Linear(cfg.dim, cfg.dim).requires_grad_(False) if bert else None
        self.ln = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg, cross) for _ in range(cfg.n_layer)])
        self.grad_checkpoint = False  # True: keep only each block's input in training, recompute the rest in backward
        self.apply(init_weights)

    @property
    def longest(self):
        """The most tokens a sequence can have, set by the positions (XLM-R's start at pad_id + 1)."""
        return self.cfg.max_positions - (0 if self.cfg.backbone == 'bert' else self.cfg.pad_id + 1)

    def embed(self, ids, offset=0):
        """Token + position (+ token type) embeddings of a batch of sequences, with positions counted from each row's
        start. offset is how many positions came before (when decoding step by step)."""
        if ids.size(1) + offset > self.longest:
            raise ValueError(f'sequence of {ids.size(1) + offset} tokens is longer than the model\'s {self.longest}: '
                             'lower --max_len')
        if self.cfg.backbone == 'bert':  # 0, 1, ... regardless of the padding
            positions = torch.arange(offset, offset + ids.size(1), device=ids.device)
        else:
            positions = position_ids(ids, self.cfg.pad_id) + offset * ids.ne(self.cfg.pad_id)
        x = self.tok(ids) * self.cfg.embed_scale + self.pos(positions)
        if self.cfg.type_vocab_size:
            x = x + self.token_type(token_types(ids, self.cfg.sep_id))
        return self.drop(self.ln(x))

    def run(self, x, mask=None, start=0, end=None, memory=None, memory_mask=None, causal=False, cache=None):
        """Run blocks [start, end) on hidden states x (B, T, H), each cross-attending to memory when one is given.
        With causal, each position sees only itself and those before it. cache is a dict that keeps each block's keys
        and values between decoding steps."""
        for i, block in enumerate(self.blocks[start:end], start):
            if self.grad_checkpoint and torch.is_grad_enabled() and cache is None:  # activation checkpointing:
                # the block runs again in backward, with the same dropout masks (the RNG state is replayed)
                x = torch.utils.checkpoint.checkpoint(block, x, mask, memory, memory_mask, causal, use_reentrant=False)
            else:
                x = block(x, mask, memory, memory_mask, causal, None if cache is None else cache.setdefault(i, {}))
        return x

    @property
    def has_cross(self):
        return hasattr(self.blocks[0], 'cross')

    def forward(self, ids, mask=None):
        """The last hidden states (B, T, H). mask defaults to the non-padding tokens."""
        if mask is None:
            mask = ids.ne(self.cfg.pad_id)
        return self.run(self.embed(ids), mask)


def mean_pool(h, mask):
    """Mean of the hidden states h (B, T, H) over the real tokens of mask (B, T)."""
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)  # a row with no token pools to zeros


class MLMHead(nn.Module):
    """The MLM head: dense -> GELU -> LayerNorm -> a decoder tied to the word embeddings, plus a bias."""

    def __init__(self, cfg, word_embeddings):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.ln = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.weight = word_embeddings  # the same Parameter as Encoder.tok.weight
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        init_weights(self.dense)

    def forward(self, h):
        return F.linear(self.ln(F.gelu(self.dense(h))), self.weight, self.bias)


def init_weights(module):
    """BERT/XLM-R initialisation: N(0, 0.02) weights, zero biases and zero padding rows. On the meta device it does
    nothing: train.memory_plan builds a model there only to count it."""
    if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        with torch.no_grad():
            module.weight[module.padding_idx].zero_()


# Translation: beam search over a decoder that cross-attends to the encoder's states (VECO's generation).

def next_log_probs(decoder, tokens, memory, memory_mask, cache=None):
    """log p(next token | prefix, source) (N, V) for the prefixes tokens (N, t). The decoder is an Encoder with
    cross-attention on memory, and its output layer is its token embedding, tied as in fairseq's
    share_all_embeddings. With a cache only the newest token runs through the decoder; without one, the whole
    prefix runs again."""
    new = tokens if cache is None else tokens[:, -1:]
    x = decoder.embed(new, offset=tokens.size(1) - new.size(1))
    h = decoder.run(x, None, memory=memory, memory_mask=memory_mask, causal=True, cache=cache)
    return F.linear(h[:, -1], decoder.tok.weight).float().log_softmax(-1)


@torch.no_grad()
def beam_search(decoder, memory, memory_mask, bos, beam=5, lenpen=1.0, max_new=200, min_len=1, cache=True,
                eos=2, pad=1):
    """Beam search as in fairseq's SequenceGenerator, batched over sentences and beams. The decoder reads memory
    (B, S, H), the encoder's states of B sources. Each step takes the 2K best extensions of a sentence's K hypotheses.
    Those among the first K that end in </s> are finished with the score log p / length ** lenpen (the length counts
    </s>), and the K best others go on. A sentence stops at K finished hypotheses or at max_new tokens. With cache,
    each step runs only the newest token and keeps the earlier keys and values. -> the best hypothesis of each
    source, as token ids after bos without </s>."""
    K, V, B, device = beam, decoder.cfg.vocab_size, memory.size(0), memory.device
    memory, memory_mask = memory.repeat_interleave(K, 0), memory_mask.repeat_interleave(K, 0)
    max_len = min(max_new, decoder.longest - 1)
    tokens = torch.full((B * K, 1), bos, dtype=torch.long, device=device)
    scores = torch.zeros(B * K, device=device)  # log p of each hypothesis so far
    alive, finished, state = list(range(B)), [[] for _ in range(B)], {} if cache else None
    rank = torch.arange(2 * K, device=device)
    for step in range(max_len + 1):
        logp = next_log_probs(decoder, tokens, memory, memory_mask, state)
        logp[:, pad] = -math.inf
        if step >= max_len:  # the last step may only end the hypothesis
            logp[:, torch.arange(V, device=device) != eos] = -math.inf
        elif step < min_len:
            logp[:, eos] = -math.inf
        n = len(alive)
        total = (scores[:, None] + logp).view(n, K, V)
        top, index = (total[:, :1] if step == 0 else total).reshape(n, -1).topk(2 * K)  # step 0: the K beams are equal
        beams, words = index // V, index % V
        ends = words.eq(eos) & top.ne(-math.inf)
        for i, j in ends[:, :K].nonzero().tolist():  # at most K per sentence
            if len(finished[alive[i]]) < K:
                hyp = tokens[i * K + beams[i, j], 1:].tolist()
                finished[alive[i]].append((top[i, j].item() / (step + 1) ** lenpen, hyp))
        live = [i for i in range(n) if len(finished[alive[i]]) < K] if step < max_len else []
        if not live:
            break
        live_rows = torch.tensor(live, device=device)
        going = torch.where(ends, rank + 2 * K, rank)[live_rows].topk(K, largest=False).indices  # the K best that go on
        rows = (live_rows[:, None] * K + beams[live_rows].gather(1, going)).view(-1)
        tokens = torch.cat([tokens[rows], words[live_rows].gather(1, going).view(-1, 1)], 1)
        scores = top[live_rows].gather(1, going).view(-1)
        memory, memory_mask = memory[rows], memory_mask[rows]
        for block in (state or {}).values():  # the cached keys and values follow their hypotheses
            for part in block.values():
                part['k'], part['v'] = part['k'][rows], part['v'][rows]
        alive = [alive[i] for i in live]
    return [max(hyps, key=lambda h: h[0])[1] for hyps in finished]


# === Machinery: checkpoints, precision, the writer, the memory estimate, export, the command line ===


# ---------------------------------------------------------------------------
# Checkpoints. Each source is renamed into one flat dict of our names ('enc.…', 'mlm.…'), then checked against
# the model key by key.

class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line that says why."""


def per_layer(prefix, names, ours_prefix='enc'):
    """A checkpoint's names of a block's modules {theirs: ours} for every layer ({} is its index)."""
    return {f'{prefix}.{{}}.{theirs}': f'{ours_prefix}.blocks.{{}}.{ours}' for theirs, ours in names.items()}


HF_NAMES = {  # Hugging Face module -> ours ({} is the layer index)
    'embeddings.word_embeddings': 'enc.tok', 'embeddings.position_embeddings': 'enc.pos',
    'embeddings.LayerNorm': 'enc.ln',
    **per_layer('encoder.layer', {'attention.self.query': 'attn.q', 'attention.self.key': 'attn.k',
                                  'attention.self.value': 'attn.v', 'attention.output.dense': 'attn.out',
                                  'attention.output.LayerNorm': 'ln1', 'intermediate.dense': 'ffn.fc1',
                                  'output.dense': 'ffn.fc2', 'output.LayerNorm': 'ln2'}),
    'lm_head.dense': 'mlm.dense', 'lm_head.layer_norm': 'mlm.ln', 'lm_head': 'mlm',
    'lm_head.decoder': 'tied',  # copies of the word embeddings and lm_head.bias, when present
    'embeddings.token_type_embeddings': 'type',  # one row added to every token: folded into positions
}
BERT_NAMES = {  # Hugging Face's BERT -> ours: the encoder's names, its token types and pooler, the MLM head
    **{k: v for k, v in HF_NAMES.items() if not k.startswith(('lm_head', 'embeddings.token_type'))},
    'embeddings.token_type_embeddings': 'enc.token_type', 'pooler.dense': 'enc.pooler',
    'cls.predictions.transform.dense': 'mlm.dense', 'cls.predictions.transform.LayerNorm': 'mlm.ln',
    'cls.predictions': 'mlm', 'cls.predictions.decoder': 'tied',
}
FAIRSEQ_LAYER = {'self_attn.q_proj': 'attn.q', 'self_attn.k_proj': 'attn.k', 'self_attn.v_proj': 'attn.v',
                 'self_attn.out_proj': 'attn.out', 'self_attn_layer_norm': 'ln1', 'fc1': 'ffn.fc1', 'fc2': 'ffn.fc2',
                 'final_layer_norm': 'ln2'}
FAIRSEQ_NAMES = {  # fairseq's RoBERTa module (after 'decoder.' or 'encoder.') -> ours
    'sentence_encoder.embed_tokens': 'enc.tok', 'sentence_encoder.embed_positions': 'enc.pos',
    'sentence_encoder.emb_layer_norm': 'enc.ln', 'sentence_encoder.layernorm_embedding': 'enc.ln',
    **per_layer('sentence_encoder.layers', FAIRSEQ_LAYER),
    'lm_head.dense': 'mlm.dense', 'lm_head.layer_norm': 'mlm.ln', 'lm_head': 'mlm',
}
FAIRSEQ_CROSS = {'encoder_attn.q_proj': 'cross.q', 'encoder_attn.k_proj': 'cross.k', 'encoder_attn.v_proj': 'cross.v',
                 'encoder_attn.out_proj': 'cross.out', 'encoder_attn_layer_norm': 'ln_cross'}
TRANSLATION_NAMES = {  # fairseq's translation model (VECO's released NLG model): an encoder, a decoder ('dec')
    'encoder.embed_tokens': 'enc.tok', 'encoder.embed_positions': 'enc.pos', 'encoder.layernorm_embedding': 'enc.ln',
    **per_layer('encoder.layers', FAIRSEQ_LAYER),
    'decoder.embed_tokens': 'dec_tok', 'decoder.output_projection': 'dec_out',  # share_all_embeddings: copies
    'decoder.embed_positions': 'dec.pos', 'decoder.layernorm_embedding': 'dec.ln',
    **per_layer('decoder.layers', {**FAIRSEQ_LAYER, **FAIRSEQ_CROSS}, 'dec'),
}


# Tensors real files hold that no part here uses: HF's position_ids, XLM-R's pooler, BERT's NSP head, fairseq's version.
UNUSED = {'embeddings.position_ids', 'pooler.dense.weight', 'pooler.dense.bias', 'sentence_encoder.version',
          'encoder.version', 'decoder.version', 'cls.seq_relationship.weight', 'cls.seq_relationship.bias'}


def rename(sd, names, prefixes):
    """Map checkpoint keys to ours by a {module: our module} table, fusing q, k, v into qkv -> (renamed, unmapped)."""
    out, unknown = {}, []
    for key, t in sd.items():
        stem = next((key[len(p):] for p in prefixes if key.startswith(p)), key)
        module, _, param = stem.rpartition('.')
        param = {'gamma': 'weight', 'beta': 'bias'}.get(param, param)  # BERT's first files' LayerNorm names
        layer = re.search(r'\.(\d+)\.', module)
        ours = names.get(re.sub(r'\.\d+\.', '.{}.', module, count=1))
        if ours is not None:
            out[ours.format(layer.group(1) if layer else '') + '.' + param] = t.float()
        elif stem not in UNUSED:
            unknown.append(key)
    fold_tied(out)
    for key in [k for k in out if re.search(r'\.(attn|cross)\.q\.', k)]:
        stem, attn, param = re.split(r'\.(attn|cross)\.q\.', key)
        parts = [out.pop(f'{stem}.{attn}.{x}.{param}', None) for x in 'qkv']
        if all(p is not None for p in parts):
            out[f'{stem}.{attn}.qkv.{param}'] = torch.cat(parts)
    return out, unknown


def fold_tied(sd):
    """Check and drop the tied copies; fold HF's single token-type row into the positions."""
    if 'type.weight' in sd and 'enc.pos.weight' in sd:
        t = sd.pop('type.weight')
        if t.size(0) != 1:
            raise CheckpointError(f'token_type_embeddings has {t.size(0)} rows; XLM-R has 1 and this model '
                                  'adds no segment ids')
        sd['enc.pos.weight'] = sd['enc.pos.weight'] + t[0]
    tied = {'tied.weight': 'enc.tok.weight', 'tied.bias': 'mlm.bias', 'mlm.weight': 'enc.tok.weight',  # fairseq's
            'dec_tok.weight': 'enc.tok.weight', 'dec_out.weight': 'enc.tok.weight'}
    decoder_copies = {'dec_tok.weight': 'the decoder\'s token embeddings',
                      'dec_out.weight': 'the decoder\'s output projection'}
    for copy, original in tied.items():
        if copy in sd:
            t = sd.pop(copy)
            if original not in sd:
                sd[original] = t
            elif not torch.equal(t, sd[original]):
                what = decoder_copies.get(copy, 'the MLM decoder ' + copy.split('.')[1])
                why = ' (the file was trained without share_all_embeddings)' if copy in decoder_copies else ''
                raise CheckpointError(f'{what} differs from {original}; this model ties them{why}')
    if any(k.startswith('mlm.') for k in sd) and 'enc.tok.weight' in sd:
        sd['mlm.weight'] = sd['enc.tok.weight']


def read_safetensors(path):
    """A .safetensors file read by hand: 8-byte header size, JSON header, raw little-endian data."""
    dtypes = {'F64': torch.float64, 'F32': torch.float32, 'F16': torch.float16, 'BF16': torch.bfloat16,
              'I64': torch.int64, 'I32': torch.int32, 'I16': torch.int16, 'I8': torch.int8,
              'U8': torch.uint8, 'BOOL': torch.bool}
    size = os.path.getsize(path)
    with open(path, 'rb') as f:
        try:
            (n,) = struct.unpack('<Q', f.read(8))
            header = json.loads(f.read(n))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f'{path} is not a safetensors file (bad header: {e})')
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header.pop('__metadata__', None)
    sd = {}
    for name, info in header.items():
        if info['dtype'] not in dtypes or 8 + n + info['data_offsets'][1] > size:
            raise CheckpointError(f'{path}: tensor {name} has dtype {info["dtype"]} or ends past the file '
                                  f'(truncated?): re-download or re-save it')
        (begin, end), dtype = info['data_offsets'], dtypes[info['dtype']]
        count = (end - begin) // dtype.itemsize
        t = (torch.frombuffer(buf, dtype=dtype, count=count, offset=8 + n + begin) if count
             else torch.empty(0, dtype=dtype))  # frombuffer takes no empty tensor
        sd[name] = t.reshape(info['shape']).clone()
    return sd


CHECKPOINTS = ('a checkpoint is a file python layers.py convert wrote, a run\'s best.pt, a Hugging Face XLM-R or BERT '
               'folder (config.json with model.safetensors or pytorch_model.bin) or fairseq\'s model.pt')


def check_format(path):
    """Raise CheckpointError unless path's first bytes allow a checkpoint: a folder, safetensors, a zip or a pickle."""
    if not os.path.exists(path):
        raise CheckpointError(f'checkpoint {path} not found: {CHECKPOINTS}')
    if os.path.isfile(path) and not path.endswith('.safetensors'):
        with open(path, 'rb') as f:
            head = f.read(2)
        if head[:2] != b'PK' and head[:1] != b'\x80':
            raise CheckpointError(f'{path} is {"empty" if not head else "not a PyTorch file"}: {CHECKPOINTS}')


def torch_load(path, mmap=False):
    """torch.load that never runs pickled code: it reads tensors, containers and argparse.Namespace (fairseq's) only."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location='cpu', weights_only=True, mmap=mmap)
    except Exception as e:  # torch reports refused globals as UnpicklingError, with a long explanation
        found = re.search(r'(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)', str(e))
        if found:
            why = (f'{path} holds a pickled {found.group(1)} object, which is not allowed (loading it could run code): '
                   'on a machine you trust, save its tensors alone with torch.save')
            raise CheckpointError(why) from None
        raise CheckpointError(f'{path} is not a PyTorch file (torch.load cannot read it): {CHECKPOINTS}') from None


def config_from(sd, meta, scaled=False, sep_id=2):
    """Shapes give every size but the head count, which comes from the checkpoint's metadata; scaled: a translation
    model's token embeddings times sqrt(dim), unless its args say not; a token-type embedding makes it BERT."""
    heads = meta.get('num_attention_heads') or meta.get('encoder_attention_heads')
    if not heads:
        raise CheckpointError('the checkpoint does not say its number of attention heads (config.json or args)')
    if scaled and meta.get('decoder_attention_heads', heads) != heads:  # the decoder is built with the encoder's Config
        raise CheckpointError(f'the checkpoint\'s decoder has {meta["decoder_attention_heads"]} attention heads and '
                              f'its encoder {heads}: this model gives its decoder the encoder\'s heads, '
                              'so it cannot read it')
    if meta.get('hidden_act', 'gelu') != 'gelu' or meta.get('activation_fn', 'gelu') != 'gelu':
        raise CheckpointError('this model uses exact GELU; the checkpoint asks for another activation')
    n_layer = 1 + max(int(k.split('.')[2]) for k in sd if k.startswith('enc.blocks.'))
    vocab, dim = sd['enc.tok.weight'].shape
    bert = 'enc.token_type.weight' in sd
    pad = meta.get('pad_token_id')  # null in some configs transformers 2.x wrote (FILTER's released models)
    return Config(vocab_size=vocab, n_layer=n_layer, n_head=heads, dim=dim,
                  ffn_dim=sd['enc.blocks.0.ffn.fc1.weight'].size(0), max_positions=sd['enc.pos.weight'].size(0),
                  pad_id=(0 if bert else 1) if pad is None else pad,
                  ln_eps=meta.get('layer_norm_eps', 1e-12 if bert else 1e-5),
                  embed_scale=math.sqrt(dim) if scaled and not meta.get('no_scale_embedding') else 1.0, sep_id=sep_id,
                  backbone='bert' if bert else 'xlmr', type_vocab_size=len(sd['enc.token_type.weight']) if bert else 0)


def read_checkpoint(path):
    """-> (config, flat state dict in our names, keys nothing maps, TaskHead or None) from any supported layout."""
    if os.path.isdir(path):
        names = ('model.safetensors', 'pytorch_model.bin', 'model.pt', 'checkpoint.pt')
        files = [f for f in names if os.path.exists(os.path.join(path, f))]
        if not files:
            raise CheckpointError(f'{path} holds no model.safetensors, pytorch_model.bin or model.pt: {CHECKPOINTS}')
        path = os.path.join(path, files[0])
    check_format(path)
    obj = read_safetensors(path) if path.endswith('.safetensors') else torch_load(path)
    if not isinstance(obj, dict):
        raise CheckpointError(f'{path} holds a {type(obj).__name__}, not XLM-R weights: {CHECKPOINTS}')
    hf = any('word_embeddings' in k for k in obj)
    ours = obj.get('format') == FORMAT or {'config', 'encoder'} <= set(obj)  # (the second: ours before its format)
    if not (hf or ours or 'model' in obj):
        keys = f'{", ".join(map(str, list(obj)[:4]))}{" ..." if len(obj) > 4 else ""}'
        raise CheckpointError(f'{path} holds a dict with the keys {keys}, not XLM-R weights: {CHECKPOINTS}')
    translation = not hf and any(k.startswith('decoder.layers.') for k in obj.get('model') or {})  # fairseq's
    if not hf and ours:
        if 'encoder' not in obj:
            raise CheckpointError(f'{path} holds {", ".join(obj["meta"]["holds"])}, no encoder: give a converted '
                                  'checkpoint or a run\'s best.pt')
        sd = {f'enc.{k}': v for k, v in obj['encoder'].items()}
        sd.update({f'mlm.{k}': v for k, v in (obj.get('mlm') or {}).items()})
        fold_tied(sd)
        return stored_config(obj['config']), sd, [], None
    head = None  # a transformers task model's head
    if not hf:  # fairseq: {'model': state dict, 'args': Namespace or 'cfg': {'model': ...}}
        args = obj.get('args') or (obj.get('cfg') or {}).get('model') or {}
        meta = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
        names, prefixes = (TRANSLATION_NAMES, ()) if translation else (FAIRSEQ_NAMES, ('decoder.', 'encoder.'))
        sd, unknown = rename(obj['model'], names, prefixes)
    else:  # Hugging Face: a flat state dict, its config.json beside it
        cfg_file = os.path.join(os.path.dirname(path), 'config.json')
        if not os.path.exists(cfg_file):
            raise CheckpointError(f'{cfg_file} not found: a Hugging Face checkpoint needs its config.json beside it')
        with open(cfg_file) as f:
            meta = json.load(f)
        bert = meta.get('model_type') == 'bert' or any(k.startswith(('bert.', 'cls.predictions.')) for k in obj)
        obj, fusion = unfused(obj, meta, path)  # FILTER's released models: their layers back in XLM-R's order
        sd, unknown = rename(obj, *((BERT_NAMES, ('bert.',)) if bert else (HF_NAMES, ('roberta.',))))
        head, unknown = task_head(meta, 'bert' if bert else 'filter' if fusion else 'xlmr', obj, unknown, fusion)
        if bert:
            return config_from(sd, meta, sep_id=vocab_index(os.path.dirname(path), '[SEP]', 102)), sd, unknown, head
    if 'enc.tok.weight' not in sd:
        raise CheckpointError(f'{path} has no word embeddings: not an XLM-R checkpoint')
    return config_from(sd, meta, translation), sd, unknown, head


class TaskHead(NamedTuple):
    """A transformers task model's head: its kind (a key of HF_CLASSES' backbones), its labels in the order of its
    rows, its tensors in Head's names, and for FILTER's released models their (m, k)."""
    kind: str
    labels: list
    tensors: dict
    fusion: tuple = None


# FILTER's classification runs (run_xcls.py) leave config.json's id2label at LABEL_0, ...: the rows are in the order
# of its processors' get_labels() (xglue.py, yuwfan/FILTER 6dac390)
FILTER_LABELS = {'xnli': ['contradiction', 'entailment', 'neutral'], 'pawsx': ['0', '1']}


def unfused(sd, meta, path):
    """FILTER's released models (transformers 2.5.1's FilterFor* classes, yuwfan/FILTER modeling_xlm_roberta.py): one
    XLM-R whose m local layers are filter.encoder.layer.i, its k fusion layers filter.fusion.j and the rest
    filter.domain.j -> (XLM-R's names, its layers in order; (m, k)). Any other checkpoint -> (sd, None)."""
    if not any(key.startswith('filter.') for key in sd):
        return sd, None
    if meta.get('filter_m') is None or meta.get('filter_k') is None:
        raise CheckpointError(f'{path}: a FILTER model whose config.json has no filter_m and filter_k: give the '
                              'released folder with its config.json')
    m, k = meta['filter_m'], meta['filter_k']
    first = {'encoder.layer': 0, 'fusion': m, 'domain': m + k}  # each group's first layer in XLM-R's order
    parts = [re.match(r'filter\.(encoder\.layer|fusion|domain)\.(\d+)\.', key) for key in sd]
    for group, n in (('encoder.layer', m), ('fusion', k)):
        found = len({p[2] for p in parts if p and p[1] == group})
        if found != n:
            raise CheckpointError(f'{path} holds {found} filter.{group} layers where its config.json says {n}')
    return {(f'encoder.layer.{first[p[1]] + int(p[2])}.{key[p.end():]}' if p else key.removeprefix('filter.')): t
            for p, (key, t) in zip(parts, sd.items())}, (m, k)


def task_head(meta, backbone, obj, unknown, fusion=None):
    """A task model's head, found by its config's architectures in HF_CLASSES -> (TaskHead or None, keys unknown)."""
    arch = (meta.get('architectures') or [None])[0]
    kind = next((k for k, (name, _) in HF_CLASSES[backbone].items() if name == arch and k in TASK_HEADS), None)
    if kind is None:
        return None, unknown
    ours = {theirs: mine.removeprefix('head.') for mine, theirs in HF_CLASSES[backbone][kind][1].items()}
    module = lambda key: key.rpartition('.')[0]
    tensors = {f'{ours[module(k)]}.{k.rpartition(".")[2]}': obj[k].float() for k in unknown if module(k) in ours}
    ids = meta.get('id2label') or {}
    if not all(str(i).isdigit() for i in ids):
        raise CheckpointError(f'config.json\'s id2label has keys that are not class numbers ({", ".join(ids)})')
    labels = [name for _, name in sorted((int(i), name) for i, name in ids.items())]
    if fusion and kind == 'classification':
        labels = FILTER_LABELS.get(meta.get('finetuning_task'), labels)
    return TaskHead(kind, labels, tensors, fusion), [k for k in unknown if module(k) not in ours]


def vocab_index(folder, token, default):
    """The id of token in the vocab.txt of a BERT folder (its line number), or default without one."""
    path = os.path.join(folder, 'vocab.txt')
    if not os.path.exists(path):
        return default
    with open(path, encoding='utf-8') as f:
        return next((n for n, line in enumerate(f) if line.rstrip('\n') == token), default)


def is_cross(key):
    """Is key a tensor of a block's cross-attention (VECO's), in our names?"""
    return key.startswith('enc.blocks.') and ('.cross.' in key or '.ln_cross.' in key)


class Pretrained(NamedTuple):
    """A pre-trained model as load_pretrained reads it: the encoder, its MLM head (or None), a translation checkpoint's
    decoder (None unless asked for and there) and whether the cross-attention is new (not the checkpoint's)."""
    encoder: Encoder
    mlm: MLMHead = None
    decoder: Encoder = None
    new_cross: bool = False


def load_pretrained(path, cross=False, decoder=False):
    """-> Pretrained, every tensor checked; a transformers task model's head goes to the encoder (its task_head).
    cross=True: VECO's encoder with a cross-attention in every block, read from the checkpoint or newly initialised
    when it has none (XLM-R); cross=False leaves a checkpoint's cross-attention out (VECO's NLU assembly).
    decoder=True: a translation checkpoint's decoder too (VECO's released NLG model), the token embedding shared."""
    cfg, sd, unknown, head = read_checkpoint(path)
    dec_sd = {k.removeprefix('dec.'): sd.pop(k) for k in [k for k in sd if k.startswith('dec.')]}
    found = any(is_cross(k) for k in sd)
    if not cross:
        sd = {k: v for k, v in sd.items() if not is_cross(k)}
    enc = Encoder(cfg, cross, task_head=head)
    mlm = MLMHead(cfg, enc.tok.weight) if any(k.startswith('mlm.') for k in sd) else None
    model = nn.ModuleDict({'enc': enc} if mlm is None else {'enc': enc, 'mlm': mlm})  # keys in our names
    if enc.pooler is not None and 'enc.pooler.weight' not in sd:  # BertForMaskedLM's files have none: a new one, as
        with torch.random.fork_rng():  # transformers starts, the same at every load
            torch.manual_seed(0)
            init_weights(enc.pooler)
        sd.update({f'enc.pooler.{k}': v for k, v in enc.pooler.state_dict().items()})
    check_keys(path, {k: v for k, v in model.state_dict().items() if found or not is_cross(k)}, sd, unknown)
    model.load_state_dict(sd, strict=found or not cross)  # not strict: a new cross-attention keeps its initialisation
    if not decoder or not dec_sd:
        return Pretrained(enc, mlm, None, cross and not found)
    n_layer = 1 + max(int(k.split('.')[1]) for k in dec_sd if k.startswith('blocks.'))
    dec = Encoder(replace(cfg, n_layer=n_layer), cross=True)
    dec_sd['tok.weight'] = sd['enc.tok.weight']
    check_keys(path, dec.state_dict(), dec_sd, [])
    dec.load_state_dict(dec_sd)
    return Pretrained(enc, mlm, dec, cross and not found)


def check_keys(path, expected, sd, unknown):
    """Raise CheckpointError, naming what is missing, unexpected or of the wrong shape, unless sd fits expected."""
    missing = sorted(set(expected) - set(sd))
    unknown = unknown + sorted(set(sd) - set(expected))
    shapes = [f'{k} {list(sd[k].shape)} (model {list(v.shape)})' for k, v in expected.items()
              if k in sd and sd[k].shape != v.shape]
    problems = [f'{what}: {", ".join(keys[:5])}{" ..." if len(keys) > 5 else ""}'
                for what, keys in (('missing', missing), ('unexpected', unknown), ('wrong shape', shapes)) if keys]
    if problems:
        raise CheckpointError(f'{path} does not match the model: ' + '; '.join(problems))


def atomic_write(path, obj):
    """Write text, bytes or (by torch.save) anything else atomically: to a temporary file beside it, then renamed."""
    tmp = f'{path}.tmp{os.getpid()}'
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(folder):  # made when missing; a file in its place fails below, naming itself
        os.makedirs(folder, exist_ok=True)
    try:
        with open(tmp, 'wb') as f:
            if isinstance(obj, (str, bytes)):
                f.write(obj.encode() if isinstance(obj, str) else obj)
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


FORMAT = 'xlt-checkpoint-1'


def stored_config(config):
    """The Config of a checkpoint's config dict (an older one names the backbone 'family')."""
    return Config(**{'backbone' if k == 'family' else k: v for k, v in config.items()})


def save_checkpoint(path, meta, **parts):
    """The project's one checkpoint format, written atomically: {'format', 'meta', and the parts}. meta: what it is
    ('method', 'task', 'model' (the preset), 'settings': the run's options); 'holds' lists the parts. config + encoder
    (+ mlm): the weights --init reads (a converted XLM-R, a run's best.pt); method: the whole method's state;
    optimizer, schedule, state, rng: a resume point (last.pt)."""
    atomic_write(path, {'format': FORMAT, 'meta': dict(meta, holds=sorted(parts)), **parts})


def load_checkpoint(path, expect=None, mmap=False):
    """Read a checkpoint of the project's format (never unpickling an object) whose meta matches expect, if given."""
    check_format(path)
    ckpt = torch_load(path, mmap)
    if not isinstance(ckpt, dict) or ckpt.get('format') != FORMAT:
        raise CheckpointError(f'{path} is not a checkpoint of this project (a run\'s best.pt or last.pt): '
                              'use another --out')
    meta = ckpt['meta']
    if expect and any(meta.get(k) != v for k, v in expect.items()):
        raise CheckpointError(f'{path} holds {meta.get("method")} on {meta.get("task")} with the {meta.get("model")} '
                              f'preset, not {expect.get("method", "a run")} on {expect.get("task")}'
                              f'{" with " + expect["model"] if "model" in expect else ""}: use another --out')
    return ckpt


def kept_checkpoints(folder):
    """The checkpoints of a folder, in the order of their names (none without the folder)."""
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith('.pt')]


def keep_last(folder, n):
    """Only the last n checkpoints of a folder are kept (0: all)."""
    for path in kept_checkpoints(folder)[:-n] if n else []:
        os.remove(path)


def average_checkpoints(paths, expect=None):
    """The mean of the methods' weights in several checkpoints (fairseq's average_checkpoints), summed one at a time."""
    total = None
    for path in paths:
        state = load_checkpoint(path, expect)['method']
        total = state if total is None else {k: total[k] + v for k, v in state.items()}
    return {k: v / len(paths) for k, v in total.items()}


def encoder_parts(encoder, mlm=None):
    """The parts of a checkpoint that --init reads: the config, the encoder, the MLM head."""
    return {'config': asdict(encoder.cfg), 'encoder': encoder.state_dict(),
            'mlm': None if mlm is None else {k: v for k, v in mlm.state_dict().items() if k != 'weight'}}


# ---------------------------------------------------------------------------
# Precision, dropout and compilation: how a run computes with the model.

def set_dropout(encoder, dropout=None, attn_dropout=None):
    """Override a model's dropout and attention dropout (None: keep the checkpoint's)."""
    for m in encoder.modules():
        if isinstance(m, nn.Dropout) and dropout is not None:
            m.p = encoder.cfg.dropout = dropout
        if isinstance(m, Attention) and attn_dropout is not None:
            m.p = encoder.cfg.attn_dropout = attn_dropout


def compile_blocks(encoder):
    """torch.compile each block in place for any length (each shape's first batches compile), parameter names kept."""
    for block in encoder.blocks:
        block.compile(dynamic=True)
    return encoder


def default_precision(device_type):
    """bf16 on a GPU that computes it natively (Ampere on), else fp16 with a loss scaler (V100, T4); fp32 on the CPU."""
    if device_type != 'cuda':
        return 'fp32'
    return 'bf16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'fp16'


def autocast(device, precision):
    """Autocast to bf16 or fp16 (torch's list of operations that run in it; the CPU has both), or none for fp32."""
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()


@contextmanager
def exact_fp32(device):
    """fp32 arithmetic on any device: autocast off, and TF32 off (train.py allows it for fp32 matmuls otherwise)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


class Precision:
    """A run's arithmetic in training: autocast, and for fp16 a dynamic loss scaler (torch.amp.GradScaler) that scales
    the loss up before backward so that small gradients do not vanish, and halves the scale after an overflow."""

    def __init__(self, precision, device):
        self.precision, self.device = precision, device
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == 'fp16')

    def autocast(self):
        return autocast(self.device, self.precision)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self, opt, params, clip, by='norm'):
        """Clip the unscaled gradients to norm `clip` (by 'value': each element to [-clip, clip], as X-Mixup's
        tf.clip_by_value), then the optimiser's step unless they overflowed. -> {} or,
        scaling, {'skipped': 1.0 or 0.0, a tensor on the device} for the log: the scale is compared where it lives
        (GradScaler's _scale; get_scale() would wait for the GPU), and the fused AdamW reads the overflow there too."""
        self.scaler.unscale_(opt)
        (torch.nn.utils.clip_grad_value_ if by == 'value' else torch.nn.utils.clip_grad_norm_)(params, clip)
        if not self.scaler.is_enabled():
            opt.step()
            return {}
        scale = self.scaler._scale.clone()  # the scale as unscale_ left it; update() halves it after an overflow
        self.scaler.step(opt)
        self.scaler.update()
        return {'skipped': (self.scaler._scale < scale).float().squeeze()}


# ---------------------------------------------------------------------------
# The writer: checkpoints written by a thread while training goes on.

class Writer:
    """Checkpoints written one at a time by a thread, from a copy in host memory made without waiting for the GPU
    (pinned, queued on the stream before the next step's kernels): the training goes on (and changes the weights)
    while the copy and the disk write. One write in flight: a second waits for the first. after: run once written."""

    def __init__(self):
        self.written, self.rate = None, None  # rate: the last write's bytes a second (SIGTERM's grace reads it)
        self.failed = None  # the error of a write that failed, raised in the training's thread at the next wait

    def save(self, path, meta, after=None, **parts):
        self.wait()
        copies = []  # (a device storage, its pinned host copy), copied while the thread waits
        parts = host_copy(parts, copies)
        done = torch.cuda.Event() if copies else None
        if done is not None:
            done.record()
        self.written = threading.Event()
        threading.Thread(target=self.write, args=(path, meta, parts, done, after, self.written)).start()

    def write(self, path, meta, parts, done, after, written):
        try:
            if done is not None:
                done.synchronize()  # this thread waits for the copies, the training does not
            start = time.perf_counter()
            save_checkpoint(path, meta, **parts)
            self.rate = os.path.getsize(path) / max(time.perf_counter() - start, 1e-6)
            if after:
                after()
        except Exception as e:  # a full disk, a quota, a network filesystem's error: the run must not go on as if saved
            why = e.strerror if isinstance(e, OSError) and e.strerror else repr(e)
            self.failed = CheckpointError(f'{path} could not be written ({why}): the run stops here, its last resume '
                                          'point kept; free the space or fix the error, then run the same command '
                                          'with --resume')
        finally:
            written.set()

    def wait(self):
        """Wait for the write in flight; a write that failed stops the run here (a CheckpointError naming it)."""
        # an event, not Thread.join: Python 3.11's join, stopped by Ctrl-C while the thread runs, marks the thread as
        # ended, so the interpreter's exit no longer waits for it and tears it down mid-write (SIGABRT)
        if self.written:
            self.written.wait()
        failed, self.failed = self.failed, None
        if failed:
            raise failed


def host_copy(value, copies, storages=None):
    """A host copy of a checkpoint's tensors, nested in dicts and lists (a GPU tensor's pinned, its pair in copies);
    tensors that share a storage (tied weights, or best.pt's encoder and method) share one copy, saved once."""
    storages = {} if storages is None else storages  # (device, address, bytes) -> its copy
    if isinstance(value, torch.Tensor):
        value = value.detach()
        key = (value.device, value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        if key not in storages:  # the whole storage under value, as bytes
            source = torch.empty(0, dtype=torch.uint8, device=value.device).set_(value.untyped_storage())
            if value.device.type == 'cuda':  # pinned, the copy queued without waiting for the GPU
                host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(source, non_blocking=True)
                copies.append((source, host))
            else:
                host = source.to('cpu', copy=True)
            storages[key] = host.untyped_storage()
        view = torch.empty(0, dtype=value.dtype)
        return view.set_(storages[key], value.storage_offset(), value.size(), value.stride())
    if isinstance(value, dict):
        return {k: host_copy(v, copies, storages) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v, copies, storages) for v in value)
    return value


# ---------------------------------------------------------------------------
# Memory: a training step's peak on one process, counted from the shapes before a run spends a GPU (train.py's plan);
# tests/test_speed.py holds it to the CPU profiler's peak, tests/gpu_check.py to a GPU's.

@dataclass
class Pass:
    """`blocks` blocks run in training on rows x length tokens, with a memory cross-attending to its `memory`
    positions; embedded: the tokens come from Encoder.embed."""
    rows: int
    length: int
    blocks: int
    memory: int = 0
    embedded: bool = True


def attention_bytes(cfg, queries, keys, s, math):
    """What one attention keeps per row: q, k and v; SDPA's fused kernels, the output (also `out`'s input: heads
    side by side, no copy) and a log-sum-exp per head; its math path (the CPU's with dropout), `out`'s input and the
    softmax, the dropout mask and the dropped weights, (heads, queries, keys) each."""
    D, H = cfg.dim, cfg.n_head
    if math:
        return s * D * (queries + 2 * keys) + 3 * s * H * queries * keys + s * D * queries
    return s * D * (queries + 2 * keys) + (s * D + 4 * H) * queries


def pass_bytes(cfg, p, s, device_type, checkpointed=False):
    """What a Pass keeps for backward, in bytes (s: an activation's, 2 under autocast, 4 in fp32). Each block: the
    inputs of qkv, fc1 and fc2 and fc1's output (s each), two (three) dropout masks (bool on CUDA, the activation's
    dtype on the CPU) and residual sums (fp32) with their LayerNorm's mean and 1/std, and each attention's bytes."""
    D, F, T = cfg.dim, cfg.ffn_dim, p.length
    mask = 1 if device_type == 'cuda' else s
    math = device_type == 'cpu' and cfg.attn_dropout > 0
    block = (s * D + s * (D + 2 * F) + (3 if p.memory else 2) * ((mask + 4) * D + 8)) * T  # 2 sub-layers, or 3
    block += attention_bytes(cfg, T, T, s, math)
    if p.memory:  # the query's input and, under autocast, the memory's cast for k and v
        block += s * D * T + (s < 4) * s * D * p.memory + attention_bytes(cfg, T, p.memory, s, math)
    embedded = p.embedded * (16 + 4 * D + 8 + mask * D) * T  # ids and positions, LayerNorm's input, dropout's mask
    if checkpointed:  # each block's input alone; the largest block runs again in backward (peak_bytes)
        return p.rows * (p.blocks * 4 * D * T + embedded), p.rows * block
    return p.rows * (p.blocks * block + embedded), 0


def peak_bytes(cfg, passes, head, params, device_type, precision, ddp=False, checkpointed=False):
    """A training step's peak on one process, the larger of two moments. The forward's end: fp32 weights and AdamW's
    moments (12 bytes a parameter); DDP's gradient buckets (4 more, made with it); autocast's 16-bit copies of the
    blocks' weights; every Pass's saved tensors and `head` bytes (the head's and the loss's); then backward's first
    gradients, the last block's. The backward's end, where it is larger at a few rows: the activations gone, every
    gradient there (4 bytes a parameter), and under DDP the word embeddings' gradient twice, the one backward made
    whole beside its bucket until it is added in (the last and largest)."""
    s = 2 if precision in ('bf16', 'fp16') else 4
    block = 4 * cfg.dim ** 2 + 2 * cfg.dim * cfg.ffn_dim + cfg.ffn_dim + 9 * cfg.dim  # its parameters, biases, LNs
    kept = [pass_bytes(cfg, p, s, device_type, checkpointed) for p in passes]
    static = (16 if ddp else 12) * params + (s < 4) * 2 * cfg.n_layer * block
    forward = static + sum(k for k, _ in kept) + max(r for _, r in kept) + head + (not ddp) * 4 * block
    return max(forward, 16 * params + ddp * 4 * cfg.vocab_size * cfg.dim)


# ---------------------------------------------------------------------------
# Export: a model of this project as a Hugging Face folder, which transformers' Auto classes load.

TASK_HEADS = ('classification', 'tagging', 'qa')  # the exports with a task head, which --init reads back
HF_CLASSES = {  # a backbone's export, by what a checkpoint exports as -> (Hugging Face's class, {our module: theirs})
    'xlmr': {'classification': ('XLMRobertaForSequenceClassification',
                                {'head.dense': 'classifier.dense', 'head.out': 'classifier.out_proj'}),
             'tagging': ('XLMRobertaForTokenClassification', {'head.out': 'classifier'}),
             'qa': ('XLMRobertaForQuestionAnswering', {'head.out': 'qa_outputs'}),
             'mlm': ('XLMRobertaForMaskedLM', {'mlm.dense': 'lm_head.dense', 'mlm.ln': 'lm_head.layer_norm',
                                               'mlm': 'lm_head'}),
             'encoder': ('XLMRobertaModel', {})},
    'bert': {'classification': ('BertForSequenceClassification',
                                {'head.dense': 'bert.pooler.dense', 'head.out': 'classifier'}),  # the pooler, tuned
             'tagging': ('BertForTokenClassification', {'head.out': 'classifier'}),
             'qa': ('BertForQuestionAnswering', {'head.out': 'qa_outputs'}),
             'encoder': ('BertModel', {})},
    # read, not written: FILTER's released models (--init); its head dropout, dense, ReLU, dropout, dense
    'filter': {'classification': ('FilterForSequenceClassification',
                                  {'head.dense': 'output.1', 'head.out': 'output.4'}),
               'tagging': ('FilterForTokenClassification', {'head.out': 'classifier'}),
               'qa': ('FilterForQuestionAnswering', {'head.out': 'qa_outputs'})},
}
SPECIAL_TOKENS = {'xlmr': {'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>', 'sep_token': '</s>',
                           'cls_token': '<s>', 'pad_token': '<pad>', 'mask_token': '<mask>'},
                  'bert': {'unk_token': '[UNK]', 'sep_token': '[SEP]', 'pad_token': '[PAD]', 'cls_token': '[CLS]',
                           'mask_token': '[MASK]'}}


def write_safetensors(tensors, path):
    """A .safetensors file written by hand, as read_safetensors reads it (float32 tensors)."""
    header, offset = {'__metadata__': {'format': 'pt'}}, 0
    for name, t in tensors.items():
        header[name] = {'dtype': 'F32', 'shape': list(t.shape), 'data_offsets': [offset, offset + 4 * t.numel()]}
        offset += 4 * t.numel()
    head = json.dumps(header).encode()
    head += b' ' * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(head)) + head)
        for t in tensors.values():
            f.write(t.detach().float().contiguous().numpy().data)


def hf_encoder(encoder, prefix, backbone, pooler):
    """An encoder's tensors in Hugging Face's names (HF_NAMES or BERT_NAMES reversed, qkv cut in three) under prefix,
    without VECO's cross-attention (as its NLU assembly); XLM-R's one token type is zeros; BERT's pooler if pooler."""
    names = BERT_NAMES if backbone == 'bert' else HF_NAMES
    theirs, out = {ours: hf for hf, ours in names.items() if ours.startswith('enc.')}, {}
    for key, t in encoder.items():
        module, _, param = f'enc.{key}'.rpartition('.')
        if is_cross(f'enc.{key}') or module == 'enc.pooler' and not pooler:
            continue
        layer = re.search(r'\.(\d+)\.', module)
        stem = re.sub(r'\.\d+\.', '.{}.', module, count=1)
        for ours, part in zip([stem[:-3] + x for x in 'qkv'], t.chunk(3)) if stem.endswith('.qkv') else [(stem, t)]:
            out[prefix + theirs[ours].format(layer.group(1) if layer else '') + '.' + param] = part
    if backbone != 'bert':
        out[prefix + 'embeddings.token_type_embeddings.weight'] = torch.zeros(1, encoder['tok.weight'].size(1))
    return out


def hf_config(cfg, arch, labels):
    """config.json of XLMRobertaConfig or BertConfig for our Config; labels: the classes or tags, for id2label."""
    bert = cfg.backbone == 'bert'
    ids = {'pad_token_id': cfg.pad_id} if bert else {'pad_token_id': cfg.pad_id, 'bos_token_id': 0, 'eos_token_id': 2}
    return {'architectures': [arch], 'model_type': 'bert' if bert else 'xlm-roberta', 'vocab_size': cfg.vocab_size,
            'hidden_size': cfg.dim, 'num_hidden_layers': cfg.n_layer, 'num_attention_heads': cfg.n_head,
            'intermediate_size': cfg.ffn_dim, 'hidden_act': 'gelu', 'hidden_dropout_prob': cfg.dropout,
            'attention_probs_dropout_prob': cfg.attn_dropout, 'max_position_embeddings': cfg.max_positions,
            'type_vocab_size': cfg.type_vocab_size or 1, 'initializer_range': 0.02, 'layer_norm_eps': cfg.ln_eps,
            **ids, 'position_embedding_type': 'absolute', 'tie_word_embeddings': True,
            **({'id2label': dict(enumerate(labels)), 'label2id': {x: i for i, x in enumerate(labels)}}
               if labels else {})}


def export_checkpoint(src, encoder_only=False):
    """-> (checkpoint, path, what it exports as: a key of HF_CLASSES, backbone), or a CheckpointError saying why not."""
    path = os.path.join(src, 'best.pt') if os.path.isdir(src) else src
    if not os.path.exists(path):  # an XLA run keeps its models below it
        below = sorted(os.path.relpath(os.path.join(d, 'best.pt'), src) for d, _, files in os.walk(src)
                       if 'best.pt' in files)
        more = ' ...' if len(below) > 3 else ''
        hint = (f'its prediction comes from the models below it ({", ".join(below[:3])}{more}): export one of them'
                if below else 'give a run\'s folder or its best.pt')
        raise CheckpointError(f'{src} keeps no best.pt: {hint}')
    ckpt = load_checkpoint(path)
    kind = 'encoder' if encoder_only else ckpt['meta'].get('export')
    backbone = stored_config(ckpt['config']).backbone
    if kind not in HF_CLASSES['xlmr']:
        why = kind or 'the checkpoint does not say how its method predicts'
        raise CheckpointError(f'{path}: {why}, which no Hugging Face {"BERT" if backbone == "bert" else "XLM-R"} class '
                              'computes: export its encoder alone with --encoder')
    scaled = ckpt['config']['embed_scale'] != 1
    if scaled or kind == 'mlm' and not ckpt.get('mlm'):
        why = 'its token embeddings are scaled, which XLM-R\'s are not' if scaled else 'no MLM head'
        raise CheckpointError(f'{path}: {why}: export its encoder alone with --encoder')
    return ckpt, path, kind, backbone


def model_card(ckpt, path, arch, out):
    """The folder's README.md: what the model is, the run's settings and scores, how to load it."""
    meta, s, cfg = ckpt['meta'], ckpt['meta'].get('settings', {}), ckpt['config']
    table = os.path.join(os.path.dirname(path), 'results.txt')
    scores = f'```\n{open(table).read().rstrip()}\n```' if os.path.exists(table) else 'The run has no results.txt.'
    auto = 'AutoModel' + arch[arch.index('For'):] if 'For' in arch else 'AutoModel'
    tag = 'bert' if arch.startswith('Bert') else 'xlm-roberta'
    length = f'{s["steps"]} steps' if s.get('steps') else f'{s.get("epochs")} epochs'
    lower = (' It read QA text lowercased (`--qa_case lower`): lowercase yours too.' if s.get('qa_case') == 'lower'
             else '')
    return (f'---\nlibrary_name: transformers\ntags: [{tag}, cross-lingual-transfer]\n---\n\n'
            f'# {meta.get("method")} on {meta.get("task")}\n\n{arch}, exported from `{path}` by '
            f'`python layers.py export`: method `{meta.get("method")}`, task `{meta.get("task")}`, preset '
            f'`{meta.get("model")}` ({cfg["n_layer"]} layers x {cfg["dim"]}) from '
            f'`{s.get("init") or "random weights"}`; learning rate {s.get("lr")}, batch {s.get("batch_size")}, '
            f'{length}, up to {s.get("max_len")} tokens, seed {s.get("seed")}.{lower}\n\n## Scores\n\n{scores}\n\n'
            f'## Use\n\n```python\nfrom transformers import AutoTokenizer, {auto}\n'
            f'tokenizer = AutoTokenizer.from_pretrained({out!r})\nmodel = {auto}.from_pretrained({out!r})\n```\n')


def unigram(path):
    """Is the sentencepiece model a unigram one, as transformers reads them all? BPE has no n-best segmentations."""
    try:
        return bool(sentencepiece.SentencePieceProcessor(model_file=path).nbest_encode('a', nbest_size=1))
    except RuntimeError:
        return False


def export(src, out, encoder_only=False, spm=None, vocab=None):
    """A run's model (its folder or a checkpoint) written into the new folder `out` as Hugging Face's XLM-R or BERT
    (the files EXPORT_HELP lists), made beside it and moved into place whole. -> the class written."""
    ckpt, path, kind, backbone = export_checkpoint(src, encoder_only)
    tokenizer = (vocab if backbone == 'bert' else spm) or (ckpt['meta'].get('tokenizer') or [''])[0]
    if not os.path.isfile(tokenizer):
        raise CheckpointError(f'{path}: the tokenizer\'s file {tokenizer} not found: pass '
                              f'{"--vocab" if backbone == "bert" else "--spm"}')
    if backbone == 'xlmr' and len(ckpt['meta'].get('tokenizer', [])) > 1:  # a dict.txt sets the ids, not --spm
        raise CheckpointError(f'{path}: its ids follow a fairseq dict.txt, which XLMRobertaTokenizer does not read')
    if backbone == 'xlmr' and not unigram(tokenizer):
        raise CheckpointError(f'{tokenizer} is a BPE sentencepiece model, which transformers\' XLMRobertaTokenizer '
                              'would read as a unigram one (XLM-R\'s is): its ids would not be the run\'s; train with '
                              'a unigram model (--spm) to export')
    if kind not in HF_CLASSES[backbone]:  # BERT's MLM: VECO's pre-training alone makes one, on XLM-R
        raise CheckpointError(f'{path}: {kind}, which no Hugging Face BERT class computes here: export its encoder '
                              'alone with --encoder')
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f'{out} exists and is not an empty folder: give a new folder')
    head = HF_CLASSES[backbone][kind][1]
    parts = {**{k: v for k, v in (ckpt.get('method') or {}).items() if k.startswith('head.')},
             **{f'mlm.{k}': v for k, v in (ckpt.get('mlm') or {}).items()}}  # the MLM's weight: the embeddings (tied)
    found = {f'{head[m]}.{p}': t for key, t in parts.items() for m, _, p in [key.rpartition('.')] if m in head}
    if len(found) != 2 * len(head) - (kind == 'mlm'):  # a weight and a bias a module; the MLM's weight: the embeddings
        raise CheckpointError(f'{path} holds no {kind} head: export its encoder alone with --encoder')
    tmp = f'{os.path.abspath(out)}.tmp{os.getpid()}'
    try:
        write_folder(tmp, out, ckpt, path, kind, found, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a write that failed or was interrupted leaves nothing
        raise
    return HF_CLASSES[backbone][kind][0]


def write_folder(tmp, out, ckpt, path, kind, found, tokenizer):
    """export's folder, written in tmp and then moved to out."""
    cfg = stored_config(ckpt['config'])
    bert, (arch, _) = cfg.backbone == 'bert', HF_CLASSES[cfg.backbone][kind]
    os.makedirs(tmp)
    prefix = '' if kind == 'encoder' else 'bert.' if bert else 'roberta.'
    encoder = hf_encoder(ckpt['encoder'], prefix, cfg.backbone, pooler=kind == 'encoder')
    write_safetensors({**encoder, **found}, os.path.join(tmp, 'model.safetensors'))
    shutil.copyfile(tokenizer, os.path.join(tmp, 'vocab.txt' if bert else 'sentencepiece.bpe.model'))
    labels = ckpt['meta'].get('labels') if kind in ('classification', 'tagging') else None
    settings = ({'tokenizer_class': 'BertTokenizer', 'do_lower_case': ckpt['meta'].get('lower', False)} if bert else
                {'tokenizer_class': 'XLMRobertaTokenizer'})  # BERT's lowercasing strips accents too, as our WordPiece
    files = {'config.json': hf_config(cfg, arch, labels), 'special_tokens_map.json': SPECIAL_TOKENS[cfg.backbone],
             'tokenizer_config.json': {**settings, 'model_max_length': 512, **SPECIAL_TOKENS[cfg.backbone]},
             'README.md': model_card(ckpt, path, arch, out)}
    for name, text in files.items():
        with open(os.path.join(tmp, name), 'w') as f:
            f.write(text if isinstance(text, str) else json.dumps(text, indent=2))
    if os.path.isdir(out):
        os.rmdir(out)  # an empty folder, given to be filled
    os.replace(tmp, out)


# ---------------------------------------------------------------------------
# The command line: python layers.py convert | export.

class Parser(argparse.ArgumentParser):
    """argparse whose usage mistakes are one line, as every other mistake here; options whole, never abbreviated (a
    sweep rewrites its command line for its runs by the options' names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise SystemExit(f'error: {message} ({self.prog} --help lists the options)')


CONVERT_HELP = """Convert XLM-R or BERT weights into this project's checkpoint (a config and plain tensors), which
train.py --init reads. SRC is one of:
  a Hugging Face folder: config.json with model.safetensors or pytorch_model.bin
      (e.g. git clone https://huggingface.co/FacebookAI/xlm-roberta-large, or
      https://huggingface.co/google-bert/bert-base-multilingual-cased: keep its vocab.txt for --vocab);
  fairseq's model.pt (e.g. from xlmr.large.tar.gz), old or new style;
  a file this command wrote, or a run's best.pt (checked and written again).
Every tensor is checked against the model; files are read without running pickled code.

example:
  python layers.py convert xlm-roberta-large/ xlmr-large.pt"""

EXPORT_HELP = """Write a run's model as a Hugging Face folder that transformers loads with its Auto classes, without
this project: config.json, model.safetensors, the tokenizer's files and a model card (README.md). A method whose
prediction is XLM-R and a head on one text exports as XLMRobertaFor{SequenceClassification, TokenClassification,
QuestionAnswering}; VECO's pre-training as XLMRobertaForMaskedLM; --encoder: any run's encoder as XLMRobertaModel.
On BERT (mBERT, BERT-large) the same as BertFor{...} and BertModel, with BertTokenizer's vocab.txt.

example:
  python layers.py export runs/xnli-zeroshot xnli-zeroshot-hf/"""


def main(argv=None):
    parser = Parser(description='XLM-R and BERT checkpoints for this project: in (convert) and out (export).')
    sub = parser.add_subparsers(dest='cmd', required=True, metavar='{convert,export}')
    conv = sub.add_parser('convert', help='XLM-R or BERT weights (Hugging Face; fairseq) -> this project\'s checkpoint',
                          description=CONVERT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    conv.add_argument('src', help='a Hugging Face folder or weights file, or fairseq\'s model.pt')
    conv.add_argument('out', help='the checkpoint to write, e.g. xlmr-large.pt')
    exp = sub.add_parser('export', help='a run\'s model -> a Hugging Face folder (transformers\' Auto classes load it)',
                         description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    exp.add_argument('src', help='a finished run\'s folder, or a checkpoint (its best.pt)')
    exp.add_argument('out', help='the folder to write (new, or empty)')
    exp.add_argument('--encoder', action='store_true', help='the encoder alone, as XLMRobertaModel (BertModel)')
    exp.add_argument('--spm', help='XLM-R\'s sentencepiece model (default: the one the run read)')
    exp.add_argument('--vocab', help='BERT\'s vocab.txt (default: the one the run read)')
    args = parser.parse_args(argv)
    try:
        if args.cmd == 'export':
            return print(f'wrote {args.out}: {export(args.src, args.out, args.encoder, args.spm, args.vocab)}')
        enc, mlm = load_pretrained(args.src)[:2]
        meta = {'method': None, 'task': None, 'model': None, 'source': args.src}
        save_checkpoint(args.out, meta, **encoder_parts(enc, mlm))
    except (CheckpointError, OSError) as e:
        sys.exit(f'error: {e}')
    n = sum(p.numel() for p in enc.parameters())
    print(f'wrote {args.out}: {enc.cfg.n_layer} layers x {enc.cfg.dim}, {n / 1e6:.1f}M parameters'
          f'{", with MLM head" if mlm is not None else ""}')


if __name__ == '__main__':
    main()
