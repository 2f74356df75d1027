"""From text to tensors: the XTREME tasks, the XLM-R and BERT tokenizers, the data files, features and batches."""
import argparse
import contextvars
import csv
import datetime
import errno
import fcntl
import functools
import hashlib
import io
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import unicodedata
import urllib.parse
import urllib.request
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, replace
from itertools import accumulate, chain, islice, zip_longest
from typing import NamedTuple

import numpy as np
import sentencepiece as spm
import torch
from tqdm import tqdm

from layers import Parser, atomic_write


# ----------------------------------------------------------------------------------------
# The tasks: the nine XTREME tasks and XLA's CoNLL NER, each in one family (classification, tagging, QA, retrieval).

@dataclass(frozen=True)
class Task:
    name: str
    family: str  # classification, tagging, qa or retrieval, which is also the task's group on the leaderboard
    metric: str  # accuracy, f1 or em_f1 (for QA, the mean of exact match and F1)
    langs: tuple  # the task's XTREME languages in leaderboard order (the averages are summed in this order)
    labels: tuple = ()
    xtreme: bool = True  # whether the task is one of the nine XTREME tasks (CoNLL NER from XLA's Table 1 is not)


UPOS = tuple('ADJ ADP ADV AUX CCONJ DET INTJ NOUN NUM PART PRON PROPN PUNCT SCONJ SYM VERB X'.split())
TASKS = {t.name: t for t in [  # in the leaderboard's task order
    Task('pawsx', 'classification', 'accuracy', tuple('de en es fr ja ko zh'.split()), ('0', '1')),
    Task('xnli', 'classification', 'accuracy', tuple('ar bg de el en es fr hi ru sw th tr ur vi zh'.split()),
         ('contradiction', 'entailment', 'neutral')),
    Task('panx', 'tagging', 'f1', tuple('ar he vi id jv ms tl eu ml ta te af nl en de el bn hi mr ur fa fr it pt es '
                                        'bg ru ja ka ko th sw yo my zh kk tr et fi hu'.split()),
         ('O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC')),
    Task('udpos', 'tagging', 'f1', tuple('af ar bg de el en es et eu fa fi fr he hi hu id it ja kk ko mr nl pt ru ta '
                                         'te th tl tr ur vi yo zh'.split()), UPOS),
    Task('bucc2018', 'retrieval', 'f1', tuple('de fr ru zh'.split())),
    Task('tatoeba', 'retrieval', 'accuracy', tuple('ar he vi id jv tl eu ml ta te af nl de el bn hi mr ur fa fr it '
                                                   'pt es bg ru ja ka ko th sw zh kk tr et fi hu'.split())),
    Task('xquad', 'qa', 'em_f1', tuple('en es de el ru tr ar vi th zh hi'.split())),
    Task('mlqa', 'qa', 'em_f1', tuple('en es de ar hi vi zh'.split())),
    Task('tydiqa', 'qa', 'em_f1', tuple('en ar bn fi id ko ru sw te'.split())),
    # XLA's Table 1 NER: CoNLL-2002 (es, nl), CoNLL-2003 (en, de), Bari et al.'s ar and fi, labels in UXLA's order
    Task('conll', 'tagging', 'f1', tuple('en es nl de ar fi'.split()), ('O', 'B-MISC', 'I-MISC', 'B-PER', 'I-PER',
                                                                        'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC'), False),
]}
XTREME = tuple(task for task in TASKS if TASKS[task].xtreme)  # the nine tasks on the leaderboard
GROUPS = {'classification': ('pawsx', 'xnli'), 'tagging': ('udpos', 'panx'),
          'qa': ('xquad', 'mlqa', 'tydiqa'), 'retrieval': ('bucc2018', 'tatoeba')}


# ----------------------------------------------------------------------------------------
# Tokenizers with one interface: XLM-R's sentencepiece with fairseq's ids, and BERT's WordPiece written out here.

class Tokenizer:
    """Ids over a sentencepiece model, as fairseq's dictionary assigns them. Ids 0-3 are <s>, <pad>, </s> and
    <unk>, line i of dict.txt gets id 4 + i, and <mask> comes last. XLM-R's dict.txt lists the sentencepiece pieces
    in order, so by default a piece's id is its sentencepiece id + 1 (sentencepiece's own <unk>, id 0, becomes 3).
    For a model trained with another dict.txt (VECO's NLG model), pass that file as `dictionary`. Its pieces then
    get ids in its order, and a piece missing from it reads as <unk> (as fairseq reads it). Its lines that are not
    pieces (language tokens such as [en]) go into `symbols`."""
    bos, pad, eos, unk = 0, 1, 2, 3
    between = [eos, eos]  # the ids that separate the two texts of a pair

    def __init__(self, path, lower=False, dictionary=None):
        if not os.path.isfile(path):
            raise FileNotFoundError(f'sentencepiece model {path} not found: pass --spm with XLM-R\'s '
                                    'sentencepiece.bpe.model')
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError):
            raise DataError(f'{path} is not a sentencepiece model: pass --spm with XLM-R\'s '
                            'sentencepiece.bpe.model') from None
        lines = read_dictionary(dictionary) if dictionary else None
        pieces = np.arange(3, self.sp.get_piece_size())  # the sentencepiece ids of XLM-R's dict.txt lines, in order
        spm_ids = np.array([self.sp.piece_to_id(w) for w in lines], int) if lines else pieces
        same = np.array_equal(spm_ids, pieces)  # XLM-R's own dict.txt changes no id
        self.path, self.lower = path, lower
        self.files = [os.path.abspath(p) for p in [path] + [dictionary] * (not same)]  # keys the caches and the export
        self.symbols = {w: 4 + i for i, w in enumerate(lines or []) if spm_ids[i] < 3}  # ids 0-2: the line is no piece
        self.to_spm = np.concatenate([[-1, -1, -1, 0], np.where(spm_ids < 3, -1, spm_ids), [-1]])  # -1 decodes to ''
        self.to_id = np.full(self.sp.get_piece_size(), self.unk)
        self.to_id[self.to_spm[self.to_spm > 0]] = np.flatnonzero(self.to_spm > 0)  # a repeated line: the later wins
        self.mask = 4 + len(spm_ids)
        self.vocab_size = self.mask + 1

    def _ids(self, spm_ids):
        return self.to_id[spm_ids].tolist()

    def language_ids(self, *langs):
        """The ids of the language tokens [xx]. With a dictionary, they are its lines. Without one, they are new
        ids after the vocabulary, and the model grows a row for each."""
        missing = [f'[{lang}]' for lang in langs if f'[{lang}]' not in self.symbols]
        if self.symbols and missing:  # fairseq would read a missing token as <unk>
            raise DataError(f'{self.files[-1]} has no line {missing[0]}: '
                            'give the dict.txt that came with the checkpoint (--dict)')
        return tuple(self.symbols[f'[{lang}]'] if self.symbols else self.vocab_size + k for k, lang in enumerate(langs))

    def model_text(self, text):
        """The text as the model reads it. Where the run asks, each character is lowercased on its own, as the
        tokenize of transformers 2.x did for do_lower_case (XTREME's and FILTER's QA scripts on XLM-R). So a
        word-final Σ becomes σ, not ς. A character whose lower case is longer stays as it is, so that character
        positions stay."""
        if not self.lower:
            return text
        low = text.lower()
        if len(low) == len(text) and 'Σ' not in text:  # the final sigma is the only context rule of str.lower
            return low
        return ''.join(c if len(c.lower()) > 1 else c.lower() for c in text)

    def encode(self, text):
        """The ids of `text`, without special tokens."""
        return self._ids(self.sp.encode(self.model_text(text)))

    def encode_lines(self, lines):
        """The ids of each line, without special tokens (an empty line has no ids)."""
        return [self._ids(ids) for ids in self.sp.encode([self.model_text(line) for line in lines])]

    def encode_words(self, words):
        """The ids of each word on its own, for tagging. A word with no piece becomes <unk>."""
        return [self._ids(ids) or [self.unk] for ids in self.sp.encode([self.model_text(word) for word in words])]

    def encode_with_spans(self, text, cuts=()):
        """-> (ids, spans). spans[i] = (start, end) are the characters of `text` that token i stands for, without
        leading whitespace (so a lone '▁' has an empty span). Every position in `cuts` (QA answer boundaries)
        becomes a token boundary, and a token that straddles one is split in two."""
        text = self.model_text(text)  # as long as the text, so its spans are the text's spans
        out = self.sp.encode_as_offset_mapping(text)
        ids, spans = out['ids'], [(s + len(text[s:e]) - len(text[s:e].lstrip()), e) for s, e in out['offsets']]
        for cut in cuts:
            k = next((k for k, (s, e) in enumerate(spans) if s < cut < e), None)
            if k is not None:
                s, e = spans[k]
                left = self._piece_ids(text, s, cut, self.sp.id_to_piece(ids[k]).startswith('▁'))
                right = self._piece_ids(text, cut, e, False)
                ids[k:k + 1], spans[k:k + 1] = left[0] + right[0], left[1] + right[1]
        return self._ids(ids), spans

    def _piece_ids(self, text, start, end, word_start):
        """The sentencepiece ids and spans of text[start:end] encoded alone. Unless the part starts a word, the
        word-start marker '▁' that sentencepiece puts in front is taken off again."""
        out = self.sp.encode_as_offset_mapping(text[start:end])
        ids, spans = out['ids'], [(start + s, start + e) for s, e in out['offsets']]
        piece = self.sp.id_to_piece(ids[0]) if ids else ''
        if not word_start and piece == '▁':
            ids, spans = ids[1:], spans[1:]
        elif not word_start and piece.startswith('▁'):
            ids[0] = self.sp.piece_to_id(piece[1:])  # 0 (<unk>) when the bare piece does not exist
        return ids, spans

    def encode_pair(self, a, b=None):
        """The ids of <s> a </s>, or of <s> a </s></s> b </s> for a pair. a and b are texts or lists of ids."""
        a = self.encode(a) if isinstance(a, str) else list(a)
        ids = [self.bos] + a + [self.eos]
        if b is not None:
            ids += [self.eos] + (self.encode(b) if isinstance(b, str) else list(b)) + [self.eos]
        return ids

    def decode(self, ids):
        """The text of ids, without the special tokens."""
        spm_ids = self.to_spm[[i for i in ids if 0 <= i < self.vocab_size]]
        return self.sp.decode(spm_ids[spm_ids >= 0].tolist())

    @functools.cache  # built once, because the pre-training build asks for it once per slice
    def word_starts(self):
        """For every id, whether its piece begins a word ('▁...'). The special tokens do not."""
        return [bool(s > 0 and self.sp.id_to_piece(int(s)).startswith('▁')) for s in self.to_spm]

    def piece_chars(self):
        """For every id, how many characters its piece adds to the text of a word, not counting '▁'. The special
        tokens add 0."""
        return [len(self.sp.id_to_piece(int(s)).removeprefix('▁')) if s > 0 else 0 for s in self.to_spm]


# BERT's BasicTokenizer sorts every character into one of these kinds.
DROP, SPACE, CJK, PUNCTUATION, IN_WORD = range(5)  # dropped, between words, a word each (CJK, PUNCTUATION), in a word
CJK_BLOCKS = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))  # BERT's "Chinese characters": CJK ideographs


@functools.cache
def char_kind(c):
    """The kind of c: DROP for NUL, U+FFFD and control characters (Unicode C* except tab and newlines), SPACE for
    whitespace, CJK for an ideograph, PUNCTUATION for non-alphanumeric ASCII symbols and Unicode P*, else IN_WORD."""
    cp, cat = ord(c), unicodedata.category(c)
    if cp in (0, 0xFFFD) or cat.startswith('C') and c not in '\t\n\r':
        return DROP
    if c.isspace():  # BERT turns whitespace into ' ' and then splits as str.split() does
        return SPACE
    if any(a <= cp <= b for a, b in CJK_BLOCKS):
        return CJK
    ascii_symbol = 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126
    return PUNCTUATION if ascii_symbol or cat.startswith('P') else IN_WORD


class WordPiece:
    """BERT's tokenizer, as the Python BertTokenizer of XTREME's transformers computes it (docs/weights.md). The text
    is cleaned and split into words at whitespace, punctuation and CJK ideographs, after lowercasing and stripping
    accents for an uncased vocabulary or with `lower`. Each word is cut greedily, from its start, into the longest
    pieces of vocab.txt, and a piece inside a word gets '##'. A word of over 100 characters, or one that no pieces
    make up, becomes [UNK]. The interface is Tokenizer's, with [CLS] a [SEP] b [SEP] for pairs."""
    LONGEST = 100  # a longer word, in characters, becomes [UNK]

    def __init__(self, path, lower=False):
        if not os.path.isfile(path):
            raise FileNotFoundError(f'WordPiece vocabulary {path} not found: pass --vocab with the model\'s vocab.txt')
        with open(path, encoding='utf-8') as f:
            self.pieces = [line.rstrip('\n') for line in f]
        self.vocab = {piece: i for i, piece in enumerate(self.pieces)}  # a repeated line: the later wins, as in BERT's
        specials = [self.vocab.get(s) for s in ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')]
        if None in specials:
            raise DataError(f'{path} has no [PAD], [UNK], [CLS], [SEP] or [MASK] line: not a BERT vocab.txt; pass '
                            '--vocab with the model\'s')
        self.pad, self.unk, self.bos, self.eos, self.mask = self.specials = specials
        self.path, self.files, self.vocab_size = path, [os.path.abspath(path)], len(self.pieces)
        self.between = [self.eos]  # the ids that separate the two texts of a pair
        self.lower, self.cache = lower or self.uncased(path), {}  # the cache maps a word to its pieces

    def uncased(self, path):
        """Whether the vocabulary is uncased. Its tokenizer_config.json says so (do_lower_case) where there is one.
        Otherwise it is uncased when no piece has a capital (bert-base-uncased's has none, the cased ones many)."""
        config = os.path.join(os.path.dirname(path), 'tokenizer_config.json')
        if os.path.isfile(config):
            with open(config, encoding='utf-8') as f:
                return bool(json.load(f).get('do_lower_case', False))
        return all(p == p.lower() for p in self.pieces if not p.startswith('['))

    def words(self, text):
        """-> [(word, at)], the words of text as the vocabulary reads them. at[k] is the index in text of the
        character that the word's k-th character comes from."""
        words, chars, at = [], [], []
        for i, c in enumerate(text + ' '):
            kind = char_kind(c)
            if kind in (SPACE, CJK):  # a whitespace token ends here (an ideograph is a word by itself)
                words += self.split(chars, at) + (self.split([c], [i]) if kind == CJK else [])
                chars, at = [], []
            elif kind != DROP:
                chars.append(c)
                at.append(i)
        return words

    def split(self, chars, at):
        """Split a whitespace token into its words. Where the tokenizer lowers, each character is lowercased on its
        own and loses its accents (Unicode Mn after NFD), as the tokenize of transformers 2.x and 4.x did before
        BERT's own lowering (so a final Σ becomes σ, not ς). The token is then cut around each punctuation mark."""
        if self.lower and chars:
            kept = [(x, a) for c, a in zip(chars, at) for x in unicodedata.normalize('NFD', c.lower())
                    if unicodedata.category(x) != 'Mn']
            chars, at = [x for x, _ in kept], [a for _, a in kept]
        words, start = [], 0
        for k, c in enumerate(chars):
            if char_kind(c) == PUNCTUATION:
                words += [(''.join(chars[start:k]), at[start:k])] * (k > start) + [(c, at[k:k + 1])]
                start = k + 1
        return words + [(''.join(chars[start:]), at[start:])] * (len(chars) > start)

    def word_pieces(self, word, inside=False):
        """-> [(id, number of characters of word it stands for)], taking the longest piece of vocab.txt first. A
        piece inside a word gets '##'. With `inside`, every piece does (word is then the rest of a word cut at a QA
        answer boundary). A word that no pieces make up gives [UNK]."""
        if (word, inside) not in self.cache:
            out, start = [], 0
            while start < len(word):
                mark = '##' if start or inside else ''
                end = next((e for e in range(len(word), start, -1) if mark + word[start:e] in self.vocab), None)
                if end is None:
                    out = [(self.unk, len(word))]
                    break
                out.append((self.vocab[mark + word[start:end]], end - start))
                start = end
            if len(self.cache) > 1 << 20:
                self.cache.clear()
            self.cache[word, inside] = out
        return self.cache[word, inside]

    def encode_with_spans(self, text, cuts=()):
        """-> (ids, spans). spans[i] = (start, end) are the characters of text that token i stands for. A position
        in cuts (QA answer boundaries) inside a word cuts it there, and the rest is read as the inside of a word."""
        ids, spans = [], []
        for word, at in self.words(text):
            if len(word) > self.LONGEST:
                ids.append(self.unk)
                spans.append((at[0], at[-1] + 1))
                continue
            bounds = [0] + [k for k in range(1, len(at)) if any(at[k - 1] < cut <= at[k] for cut in cuts)]
            for s, e in zip(bounds, bounds[1:] + [len(at)]):
                start = s  # the first character of the piece
                for i, n in self.word_pieces(word[s:e], s > 0):
                    ids.append(i)
                    spans.append((at[start], at[start + n - 1] + 1))
                    start += n
        return ids, spans

    def encode(self, text):
        return self.encode_with_spans(text)[0]

    def encode_lines(self, lines):
        return [self.encode(line) for line in lines]

    def encode_words(self, words):
        """The ids of each word on its own, for tagging. A word with no piece becomes [UNK]."""
        return [self.encode(word) or [self.unk] for word in words]

    def encode_pair(self, a, b=None):
        """The ids of [CLS] a [SEP], or of [CLS] a [SEP] b [SEP] for a pair. a and b are texts or lists of ids."""
        ids = [self.bos] + (self.encode(a) if isinstance(a, str) else list(a)) + [self.eos]
        return ids if b is None else ids + (self.encode(b) if isinstance(b, str) else list(b)) + [self.eos]

    def decode(self, ids):
        """The text of ids, with each '##' piece joined to the one before it. Special tokens are dropped."""
        kept = [self.pieces[i] for i in ids if 0 <= i < self.vocab_size and i not in self.specials]
        return ' '.join(kept).replace(' ##', '')


def tokenizer(backbone, path, lower=False, dictionary=None):
    """The tokenizer of a backbone: BERT's WordPiece over its vocab.txt, or XLM-R's over its sentencepiece model."""
    return WordPiece(path, lower) if backbone == 'bert' else Tokenizer(path, lower, dictionary)


class DataError(ValueError):
    """Data that cannot be read. The message is one line that names the file, the line and the fix."""


# ----------------------------------------------------------------------------------------
# Features: the token ids and whatever the head needs. One type serves every family.

IGNORE = -100  # the label of tokens that the loss skips (cross_entropy's ignore_index)


@dataclass
class Feature:
    ids: list
    label: object = None  # a class index, a tag id per token (IGNORE except on first sub-words), or (start, end) tokens
    example: int = 0  # the index of the example it came from
    words: list = None  # for tagging, the position of each word's first sub-word
    spans: list = None  # for QA windows, each token's character span in the example's context (None outside it)
    max_context: list = None  # for QA windows, whether this window gives each token its most context


def truncate_pair(a, b, budget):
    """Truncate two id lists, the longer one first, to at most `budget` ids together."""
    la, lb = len(a), len(b)
    while la + lb > budget:
        la, lb = (la - 1, lb) if la > lb else (la, lb - 1)
    return a[:la], b[:lb]


def classification_features(tok, task, examples, max_len=128):
    labels, specials = TASKS[task].labels, len(tok.encode_pair([], []))  # <s> </s></s> </s>, or [CLS] [SEP] [SEP]
    feats = []
    for n, ex in enumerate(progress(examples, 'features')):
        a, b = truncate_pair(tok.encode(ex['a']), tok.encode(ex['b']), max_len - specials)
        feats.append(Feature(tok.encode_pair(a, b), None if ex['label'] is None else labels.index(ex['label']), n))
    return feats


def tagging_features(tok, task, examples, max_len=128):
    """Features <s> words </s>, with each word's label on its first sub-word. A sentence longer than max_len is
    cut between words into several features."""
    labels, feats = TASKS[task].labels, []
    for n, ex in enumerate(progress(examples, 'features')):
        pieces = [p[:max_len - 2] for p in tok.encode_words(ex['words'])]
        start = 0
        while start == 0 or start < len(pieces):
            ids, words, tags, end = [tok.bos], [], [IGNORE], start
            while end < len(pieces) and len(ids) + len(pieces[end]) < max_len:
                words.append(len(ids))
                tags += [labels.index(ex['tags'][end]) if ex['tags'] else IGNORE] + [IGNORE] * (len(pieces[end]) - 1)
                ids += pieces[end]
                end += 1
            feats.append(Feature(ids + [tok.eos], tags + [IGNORE] if ex['tags'] else None, n, words))
            start = end
    return feats


def word_predictions(features, token_preds, n_examples):
    """Turn the per-token predictions of tagging features into one prediction per word of each example (the one at
    the word's first sub-word). The chunks of a cut sentence are joined back in order."""
    out = [[] for _ in range(n_examples)]
    for f, pred in zip(features, token_preds):
        out[f.example] += [pred[i] for i in f.words]
    return out


def qa_features(tok, examples, max_len=384, stride=128, max_query=64, train=False):
    """Sliding windows <s> question </s></s> context part </s> over each context (for BERT, [CLS] question [SEP]
    context part [SEP]), which start `stride` tokens apart. A training label is the answer's first and last token,
    or (0, 0) when the answer is not inside the window. In training, the answer's boundaries become token
    boundaries, so that its tokens give back exactly its characters, also in scripts without spaces. Evaluation
    tokenizes without looking at any answer."""
    feats, specials = [], len(tok.encode_pair([], []))
    for n, ex in enumerate(progress(examples, 'QA windows')):
        if train and unusable_answer(ex):
            continue  # the readers already skip and count these, and features never learn from them
        a0 = ex['answers'][0]['answer_start'] if train else None  # evaluation does not look at the answer
        a1 = a0 + len(ex['answers'][0]['text']) if train else None
        query = tok.encode(ex['question'])[:min(max_query, max_len - specials - 1)]  # leaves room for a context token
        ctx, spans = tok.encode_with_spans(ex['context'], (a0, a1) if train else ())
        if train:  # the first and last tokens that hold answer characters
            inside = [p for p, (s, e) in enumerate(spans) if s < e and s < a1 and e > a0]
            first, last = (inside[0], inside[-1]) if inside else (-1, -1)
        budget = max_len - len(query) - specials
        step = min(stride, budget)
        # Windows start step tokens apart, up to the first window that reaches the end of the context.
        windows = [(start, min(len(ctx) - start, budget)) for start in range(0, max(len(ctx) - budget, 0) + step, step)]
        # Each token belongs to the window where it has the most context on both sides (SQuAD's max-context rule).
        # On a tie, the first such window wins.
        score = np.full((len(windows), len(ctx)), -1.0)  # -1 outside the window
        for w, (start, length) in enumerate(windows):
            p = np.arange(start, start + length)
            score[w, p] = np.minimum(p - start, start + length - 1 - p) + 0.01 * length
        owner = score.argmax(0)
        head = [tok.bos] + query + tok.between
        for w, (start, length) in enumerate(windows):
            label = None
            if train:
                within = start <= first and last < start + length
                label = (first - start + len(head), last - start + len(head)) if within else (0, 0)
            fullest = (owner[start:start + length] == w).tolist()
            feats.append(Feature(head + ctx[start:start + length] + [tok.eos], label, n,
                                 spans=[None] * len(head) + spans[start:start + length] + [None],
                                 max_context=[False] * len(head) + fullest + [False]))
    return feats


def make_features(tok, task, examples, max_len=None, train=False, stride=128):
    family = TASKS[task].family
    if family == 'classification':
        return classification_features(tok, task, examples, max_len or 128)
    if family == 'tagging':
        return tagging_features(tok, task, examples, max_len or 128)
    return qa_features(tok, examples, max_len or 384, stride, train=train)


# ----------------------------------------------------------------------------------------
# What a run reads: the examples that a method trains and is evaluated on, as features tokenized once (Items).

@dataclass(frozen=True)
class Tokenization:
    """How a run turns a task's examples into features: the tokenizer, the data folder (whose .cache keeps every set
    tokenized once, or a temporary folder with cache False), the task, the tokens per input, the QA stride between
    windows, and the seed that draws a share of the examples (the share of training_set and unlabelled_set)."""
    tok: object
    data_dir: str
    task: str
    max_len: int = None
    stride: int = 128
    cache: bool = True
    draw: int = 0


class Shape(NamedTuple):
    """A shape of training data. A method names its shape with its trains_on, which is a key of TRAINS_ON."""
    langs: str  # the languages besides English: None, 'one' (--train_lang) or 'every' target language
    own: bool  # their own training data (in-language), not translations of English into them
    english: bool  # English examples as well (with own, English's own data)


TRAINS_ON = {'en': Shape(None, False, True), 'train_lang': Shape('one', False, False),
             'every_lang': Shape('every', False, True), 'own_lang': Shape('one', True, False),
             'every_own': Shape('every', True, True)}


def training_set(spec, langs, trains_on='en', paired=False, round_trip=False, share=None, first=None, squad=False):
    """The training items (Items) of a method, made as spec (a Tokenization) says, in the shape
    TRAINS_ON[trains_on] and in langs. With `first`, each language gives only its first examples. With `share`,
    only a share of English's examples is used. A paired method gets tuples (English, translation[, round trip]),
    and English is also paired with itself, as both released codes do. With squad, SQuAD v1.1's English training
    set follows TyDiQA's (FILTER's --use_squad_for_tydiqa). The items are tokenized once into <data_dir>/.cache
    (build_once), or into a temporary folder with cache False."""
    tok, data_dir, task, shape = spec.tok, spec.data_dir, spec.task, TRAINS_ON[trains_on]
    if shape.own and shape.english:  # English and the languages with training data of their own
        langs = ['en'] + [lang for lang in langs if has_training_data(data_dir, task, lang)]
    if shape.own:
        files = tok.files + [split_path(data_dir, task, 'train', lang) for lang in langs]
    else:
        kinds = ('translate-train', 'round-trip')[:1 + round_trip]
        files = tok.files + [split_path(data_dir, task, 'train')] + [
            split_path(data_dir, task, kind, lang) for lang in langs for kind in kinds]
        files += [split_path(data_dir, 'xquad', 'train')] * squad
    key = [task, langs, trains_on, paired, round_trip, spec.max_len, share, spec.stride] + [first] * bool(first)
    key += ['with squad'] * squad + [f'draw {spec.draw}'] * bool(spec.draw and share and share < 1)
    sources = lambda: training_sources(data_dir, task, langs, trains_on, paired, round_trip, share, first, squad,
                                       spec.draw)
    items = feature_set(spec, files, key, sources, (2 + round_trip) if paired else 1)
    if not paired and not items.labelled.all():  # a single-text method learns each feature's own label
        unlabelled = len(items) - int(items.labelled.sum())
        raise DataError(f'{task}: {unlabelled} of {len(items)} training examples have no label: translations without '
                        'tags (XTREME publishes none for POS and NER, FILTER\'s have none) teach a single-text method '
                        'nothing; train on English, or pair them with it')
    return items


def training_sources(data_dir, task, langs, trains_on, paired, round_trip, share, first=None, squad=False, draw=0):
    """Yields (name, examples, positions of their English examples), one source at a time. In-language, the sources
    are each language's own first examples. Otherwise English comes first (except for a single-text method on
    'train_lang'), then each language's translations and their round trips, where they exist (where they do not,
    write_items pairs the English with itself)."""
    if TRAINS_ON[trains_on].own:
        for lang in langs:
            yield lang, read_split(data_dir, task, 'train', lang)[:first], None
        return
    english = read_split(data_dir, task, 'train')
    if share:  # XLA's warm-up in the 5% setting uses a share of English
        english = share_of(english, share, part=0, seed=draw)
    if paired or TRAINS_ON[trains_on].english:  # SQuAD goes last, so the translations keep the task's positions
        yield 'en', english + (read_split(data_dir, 'xquad', 'train') if squad else []), None
    missing = []
    for lang in langs:
        pairs = read_translations(data_dir, task, 'train', lang, english)
        kept = [n for n, (_, t) in enumerate(pairs) if t is not None]
        yield lang, [pairs[n][1] for n in kept], kept
        trip = read_round_trip(data_dir, task, lang, pairs) if round_trip else None
        if trip is not None:
            yield f'{lang} round trip', [trip[n] for n in kept], kept
        missing += [lang] * (round_trip and trip is None)
    if missing:
        warn(f'no round-trip data for {task} in {", ".join(missing)} (docs/data.md): scheduled sampling feeds the '
             'real English text there')


def share_of(examples, share, part=0, seed=0):
    """A random share of the examples, kept in order. Every run with the same seed gets the same draw. Part 0 and
    part 1 are disjoint draws while two shares fit in the list (XLA's 5% setting needs English and target text that
    are not translations of each other). Share 1 keeps all the examples."""
    if share >= 1:
        return examples
    n = math.ceil(share * len(examples))
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    start = min(part * n, len(examples) - n)
    return [examples[i] for i in sorted(order[start:start + n])]


def has_training_data(data_dir, task, lang):
    """Whether lang has training data of its own. UD v2.5 has none for some languages (Thai, Tagalog, Yoruba)."""
    path = split_path(data_dir, task, 'train', lang)
    if path and os.path.exists(path):
        return True
    warn(f'{task} has no training data in {lang} ({path}): in-language multi-task trains without it')
    return False


def unlabelled_set(spec, lang, share):
    """XLA's D_t: the unlabelled training features (Items) of lang. For tagging, they are the target language's own
    training split without its labels (XTREME ships train-<lang>.tsv for PAN-X). Otherwise they are the target side
    of translate-train (XNLI, PAWS-X). With share below 1, the draw is disjoint from English's (the share in
    training_set), so the two are not translations of each other (the paper's 5% setting)."""
    tok, data_dir, task = spec.tok, spec.data_dir, spec.task
    tagging = TASKS[task].family == 'tagging'
    text = split_path(data_dir, task, 'train' if tagging else 'translate-train', lang)
    files = tok.files + [split_path(data_dir, task, 'train'), text]

    def sources():
        if tagging:  # the two languages' own training sets, each with its own draw
            own = [dict(ex, tags=None) for ex in read_split(data_dir, task, 'train', lang)]
            yield lang, share_of(own, share, part=1, seed=spec.draw), None
        else:  # drawn from the pairs, so that the draw is disjoint from English's where translations are missing
            english = read_split(data_dir, task, 'train')
            pairs = share_of(read_translations(data_dir, task, 'train', lang, english), share, part=1, seed=spec.draw)
            yield lang, [dict(t, label=None) for _, t in pairs if t is not None], None
    drawn = bool(spec.draw and share < 1)  # True when a share is drawn (at 100%, nothing is)
    key = ['unlabelled', task, lang, share, spec.max_len, spec.stride] + [f'draw {spec.draw}'] * drawn
    return feature_set(spec, files, key, sources, 1)


def evaluation_sets(data_dir, task, translate_test=False, paired=False, chosen=None, dev=None):
    """Read and check every file that evaluation will read, in the chosen languages, before any training (labels,
    columns, JSON shape, translations, test labels). -> {split: {lang: (examples scored against, model inputs,
    (English translation, input) pairs for paired methods)}} (data.evaluation_set). dev gives (task, split,
    languages, first examples) of the sets that pick the kept checkpoint, where they are not the task's dev sets."""
    sets = {'dev': {}, 'test': {}}
    for lang in languages(task, is_demo(data_dir), chosen):
        sets['test'][lang] = evaluation_set(data_dir, task, 'test', lang, translate_test, paired)
        check_labels(task, os.path.join(data_dir, 'labels', task, f'test-{lang}.{suffix(task)}'), sets['test'][lang][1])
    of, split, langs, first = dev or (task, 'dev', None, None)
    for lang in langs or languages(of, is_demo(data_dir), chosen if of == task else None):
        path = split_path(data_dir, of, split, lang)
        if path and os.path.exists(path):  # some languages have no dev set (XQuAD, TyDiQA). The run checked the rest.
            gold, inputs, pairs = evaluation_set(data_dir, of, split, lang, translate_test, paired)
            sets['dev'][lang] = gold[:first], inputs[:first], pairs and pairs[:first]
    return sets


def evaluation_set(data_dir, task, split, lang, translate_test=False, paired=False):
    """-> (examples scored against, model inputs, [(English translation, input)] for paired methods or None).
    translate-test reads the English translations, and QA is then scored on the translations' own answers, as
    XTREME does. English examples are paired with themselves, and so is an example whose translation is missing."""
    if translate_test and lang != 'en':
        pairs = read_translations(data_dir, task, split, lang)
        english = [t or o for o, t in pairs]  # an example without a translation is read as it is
        gold, inputs = (english if TASKS[task].family == 'qa' else [o for o, _ in pairs]), english
    else:
        gold = inputs = read_split(data_dir, task, split, lang)
    if not paired:
        return gold, inputs, None
    if lang == 'en':
        return gold, inputs, [(ex, ex) for ex in inputs]
    return gold, inputs, [(t or ex, ex) for ex, t in read_translations(data_dir, task, split, lang, inputs)]


def evaluation_items(spec, inputs, pairs):
    """The evaluation features (Items) of inputs, or of pairs (English translation, input) for paired methods, with
    each target feature once, next to its English. They are stored as the training sets are, keyed by the examples
    themselves (those of evaluation_set: a split, or its translations)."""
    english = None if pairs is None else [en for en, _ in pairs]  # the second side of each pair is the input
    digest = hashlib.sha1(json.dumps([inputs, english]).encode()).hexdigest()
    # The inputs come first, so that a feature's example is its input's number.
    sources = lambda: [('input', inputs, None)] + ([] if english is None else [('en', english, None)])
    key = ['evaluation', spec.task, spec.max_len, spec.stride, digest]
    return feature_set(spec, spec.tok.files, key, sources, 1 if pairs is None else 2, train=False)


# ----------------------------------------------------------------------------------------
# Batches, each padded to its own longest sequence.

@dataclass
class Batch:
    ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T), True on real tokens
    labels: torch.Tensor = None  # (B,) classes, (B, T) tags, or (B, 2) answer start and end
    index: list = None  # the positions of the features in their list
    first: torch.Tensor = None  # for tagging, (B, T), True on each word's first sub-word
    padded: bool = True  # True when a row is shorter than another (collate knows this without asking the device)

    @property
    def keys(self):
        """The mask for attention. It is None when no row is padded, so that SDPA may pick its fastest kernel."""
        return self.mask if self.padded else None

    def to(self, device):
        move = lambda t: None if t is None else moved(t, device)
        batch = aligned_for(self, device)  # on a GPU, padded up to a multiple of 8 positions (below the divider)
        return Batch(move(batch.ids), move(batch.mask), move(batch.labels), self.index, move(batch.first), self.padded)


@dataclass
class Pair:
    """A source example and its translation, the one input shape of FILTER, X-Mixup and the consistency-style
    methods. alt is the source's round trip through the target language."""
    src: Batch
    tgt: Batch
    alt: Batch = None

    def to(self, device):
        return Pair(self.src.to(device), self.tgt.to(device), self.alt and self.alt.to(device))


def moved(t, device):
    """t on device. A copy to a GPU starts from page-locked memory, so that it runs while the device computes
    (no host sync)."""
    pin = torch.device(device).type == 'cuda' and t.device.type == 'cpu'
    return (t.pin_memory() if pin else t).to(device, non_blocking=True)


def collate(features, index=None, pad_id=1):
    """A Batch of features, padded with pad_id, the tokenizer's padding id (1 for XLM-R, 0 for BERT)."""
    pad = lambda rows, value: torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], True, value)
    ids = pad([f.ids for f in features], pad_id)
    labels = first = None
    if all(f.label is not None for f in features):  # tag lists pad with IGNORE, others are a class or (start, end)
        labels = [f.label for f in features]
        labels = pad(labels, IGNORE) if isinstance(labels[0], list) else torch.tensor(labels)
    if features[0].words is not None:
        first = torch.zeros_like(ids, dtype=torch.bool)
        for row, f in enumerate(features):
            first[row, f.words] = True
    return Batch(ids, ids.ne(pad_id), labels, index, first, len({len(f.ids) for f in features}) > 1)


def collate_pairs(src, tgt, index=None, alt=None, pad_id=1):
    return Pair(collate(src, index, pad_id), collate(tgt, index, pad_id), alt and collate(alt, index, pad_id))


def collate_items(paired, pad_id=1):
    """A collate function that makes Batches of features, or Pairs of (English, target) features for paired methods."""
    if not paired:
        return lambda items, index=None: collate(items, index, pad_id)
    return lambda items, index=None: collate_pairs([i[0] for i in items], [i[1] for i in items], index,
                                                   [i[2] for i in items] if len(items[0]) > 2 else None, pad_id)


MEGA = 50  # length grouping sorts mega-batches of this many batches
BUCKET = 4  # sort by length in steps of this many tokens, not token by token. Where the length tells the label
# (the demo's XNLI has 19, 20 and 22 tokens, one label each), batches of one length would hold one label each.


def item_lengths(items, index=None):
    """An (items, sides) array with the token count of each side of items[index] (all items by default). A feature
    has one column, and a paired method's tuple has one per side (each side of a batch is padded on its own)."""
    if hasattr(items, 'lengths'):  # a set on disk (Items), or XLA's choice of samples
        return items.lengths(index)
    rows = [[len(f.ids) for f in (items[i] if isinstance(items[i], tuple) else (items[i],))]
            for i in (range(len(items)) if index is None else index)]
    return np.array(rows, np.int64).reshape(len(rows), -1) if rows else np.zeros((0, 1), np.int64)


def global_batches(n, batch_size, seed, chunks, lengths=None, max_tokens=None, sources=None):
    """The global batches of an epoch over n items, from a permutation fixed by seed. With lengths, items of similar
    length are grouped (otherwise batches are random, as in the papers' scripts). max_tokens sizes batches in tokens
    (token_batches). sources holds each item's English feature, and the epoch draws one item per feature."""
    if max_tokens:
        return token_batches(lengths, max_tokens, chunks, seed)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g).numpy()
    if sources is not None:  # keep the first item of each English feature in the permutation (FILTER's tagging epochs)
        order = order[np.sort(np.unique(np.asarray(sources)[order], return_index=True)[1])]
    return cut_batches(order.tolist(), batch_size, chunks, g, lengths)


def cut_batches(order, size, chunks, g, lengths=None):
    """Batches of `size` items in `order`. With lengths, each mega-batch of MEGA batches is sorted by length (in
    BUCKET steps) before it is cut, and g then shuffles the batches. So a batch holds items of similar length and
    pads little, and the split does not depend on the process count. A last batch too small to give every process
    and micro-step (chunks) an item is dropped."""
    if lengths is not None:  # a stable sort, so lengths in one BUCKET step keep their random order (and mix labels)
        key, mega = np.asarray(lengths) // BUCKET, size * MEGA  # a pair sorts by one side, then the other
        parts = np.split(np.asarray(order), range(mega, len(order), mega))
        order = np.concatenate([part[np.lexsort(key[part].T[::-1])] for part in parts]).tolist()
    batches = [order[i:i + size] for i in range(0, len(order), size)]
    if lengths is not None:
        batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
    return [b for b in batches if len(b) >= chunks]


def length_batches(lengths, batch_size):
    """Evaluation batches of positions sorted by length (one side of item_lengths), so that each batch pads little."""
    order = np.argsort(lengths, kind='stable').tolist()
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# ----------------------------------------------------------------------------------------
# Pre-training text (VECO), with one sentence or paragraph per line:
#   pretrain/mono/{lang}.txt        monolingual documents, separated by blank lines (CC-100's layout)
#   pretrain/parallel/{a}-{b}.{a}   parallel sentences, where line n of {a}-{b}.{a} and line n of
#   pretrain/parallel/{a}-{b}.{b}   {a}-{b}.{b} are translations of each other (OPUS's Moses layout)

PARA_LEN = 128  # the longest parallel sentence, in tokens (the bilingual length of Table 5)


def pretraining_set(tok, data_dir, max_len, mono_only=False, cache=True):
    """-> (items, {group: positions of its items}, counts). The items are (x, y) Feature pairs <s> x </s> and
    <s> y </s>, labelled 1 for parallel pairs and 0 for adjacent monolingual segments. counts says what each rule
    used and what was left out, as {rule: [documents or lines, segments, pieces]}. The text is read one slice at a
    time and tokenized once into <data_dir>/.cache, as in training_set."""
    groups = pretrain_files(data_dir, mono_only)
    text = lambda group, paths: documents(paths[0]) if group.startswith('mono:') else line_pairs(*paths)
    jobs = ((group, (group.startswith('para:'), part, max_len)) for group, paths in groups.items()
            for part in slices(text(group, paths), TEXT_SLICE))
    build = lambda path: write_items(path, tok, jobs, pair_arrays, pretraining_index, {'family': 'pretrain'})
    files = tok.files + [p for paths in groups.values() for p in paths]
    items = stored(build, files, ['pretrain', max_len, mono_only], data_dir, cache)
    return items, {g: range(*ends) for g, ends in items.meta['groups'].items()}, items.meta['counts']


def segment_pairs(tok, documents, max_len, counts):
    """The "two adjacent segments" of Section 2.2 in each document, as (x, y) id lists. Consecutive lines are packed
    into segments of at most max_len - 2 pieces (a longer line is cut), paired in order as (1, 2), (3, 4) and so
    on. An odd last segment pairs with the one before it. A document of one segment is cut in two (cut_in_two).
    counts, {rule: [documents, segments, pieces]}, adds up what each rule used and what was left out (the segment
    before an odd last one is used twice)."""
    pairs, budget, word_start = [], max_len - 2, tok.word_starts()
    tally = lambda rule, segments: count(counts, rule, 1, len(segments), sum(map(len, segments)))
    for doc in documents:
        lines, segments = tok.encode_words(doc), [[]]  # one id list per line (at least one id each)
        for ids in lines:
            for start in range(0, len(ids), budget):
                piece = ids[start:start + budget]
                if len(segments[-1]) + len(piece) > budget:
                    segments.append([])
                segments[-1] += piece
        if len(segments) == 1:  # it holds every line whole, so lines end at the running sums of their lengths
            rule, made = cut_in_two(segments[0], list(accumulate(map(len, lines)))[:-1], word_start)
            tally(rule, segments)
            pairs += made
            continue
        even = segments[:len(segments) // 2 * 2]
        tally('adjacent segments', even)
        pairs += [(even[i], even[i + 1]) for i in range(0, len(even), 2)]
        if len(segments) % 2:
            count(counts, 'odd last segment, with the one before', 0, 1, len(segments[-1]))  # its document counted once
            pairs.append((segments[-2], segments[-1]))
    return pairs


def count(counts, rule, documents, segments, pieces):
    """Add to what one rule of the pre-training data used: counts[rule] = [documents, segments, pieces]."""
    counts[rule] = [a + b for a, b in zip(counts.get(rule, (0, 0, 0)), (documents, segments, pieces))]


def cut_in_two(segment, line_ends, word_start):
    """-> (rule, pairs). A document of one segment is cut at the line boundary nearest its middle. A single line is
    cut at the word start nearest its middle, or at the nearest piece boundary when the line has no word start past
    its first piece (text written without spaces, as CC-100's zh, ja and th, or a single long word). A single piece
    is left out."""
    cuts, rule = line_ends, 'one segment, cut at a line'
    if not cuts:
        cuts, rule = [i for i in range(1, len(segment)) if word_start[segment[i]]], 'one line, cut at a word'
    if not cuts:
        cuts, rule = list(range(1, len(segment))), 'one line of one word (no spaces), cut at a piece'
    if not cuts:
        return 'left out: a single piece', []
    cut = min(cuts, key=lambda c: abs(2 * c - len(segment)))
    return rule, [(segment[:cut], segment[cut:])]


def split_held_out(groups, share=0.02, most=500):
    """-> (training groups, held-out positions). The last `share` of each group is held out to measure the MLM
    losses: at most `most` pairs, and at least 1 when the group has 20 pairs or more."""
    train, held = {}, []
    for g, positions in groups.items():
        n = min(most, round(len(positions) * share), len(positions) - 1)
        n = max(n, 1 if len(positions) >= 20 else 0)
        train[g], held = positions[:len(positions) - n], held + list(positions[len(positions) - n:])
    return train, held


def sampling_weights(sizes, alpha=0.5):
    """Smoothed sampling (XLM's for VECO's languages, XLA's Eq. 2 for its sets). Set i is drawn with probability
    q_i = f_i^alpha / sum_j f_j^alpha, where f_i = n_i / sum_j n_j. Alpha 1 draws in proportion to the sizes, and
    alpha 0 draws uniformly. An empty set is never drawn."""
    n = np.array(sizes, dtype=float)
    q = np.where(n > 0, (n / n.sum()) ** alpha, 0.0)
    return q / q.sum()


def pretrain_batches(groups, sizes, n_steps, seed, alpha=0.5):
    """The batches of n_steps steps. Monolingual and bilingual steps alternate when both kinds exist, and a batch
    holds sizes[group] pairs. Each batch comes from one language (or language pair), chosen among its kind with
    sampling_weights. Its pairs are drawn without replacement, or with replacement when the group is smaller than
    the batch."""
    rng = np.random.default_rng(seed)
    kinds = [names for names in ([g for g in groups if g.startswith(kind)] for kind in ('mono:', 'para:')) if names]
    weights = [sampling_weights([len(groups[g]) for g in names], alpha) for names in kinds]
    batches = []
    for step in range(n_steps):
        names, p = kinds[step % len(kinds)], weights[step % len(kinds)]
        name = names[rng.choice(len(names), p=p)]
        group, batch_size = groups[name], sizes[name]
        picked = rng.choice(len(group), size=batch_size, replace=len(group) < batch_size)
        batches.append([group[i] for i in picked])
    return batches


# ----------------------------------------------------------------------------------------
# Translation (VECO's generation task) reads plain text, where line n of one side translates line n of the
# other. The data is WMT14, as in the paper, and the test set is newstest2014:
#   translation/{src}-{tgt}/{train,valid,test}.{src}  and  .{tgt}
# A folder named {tgt}-{src} serves both directions.

def translation_items(tok, data_dir, src, tgt, split, lang_ids, max_len, max_ratio=None):
    """-> [(source, target) Features]: the source `x </s> [src]`, and the target `[tgt] y` labelled `y </s>`.
    Training and valid pairs are skipped when a side is empty or has more than max_len pieces, as the released
    data preparation keeps 1 to 250 pieces. With max_ratio, so are pairs where one side is more than max_ratio
    times as long as the other (en-fr's clean-corpus-n.perl -ratio 1.5). Every test line is kept (cut to fit 512
    positions), so that each line gets a translation."""
    paths = parallel_files(data_dir, src, tgt, split)
    pairs = list(line_pairs(*paths))
    x_lines, y_lines = [x for x, _ in pairs], [y for _, y in pairs]
    longest, test = 512 - 2, split == 'test'
    items, skipped = [], {'with an empty side': 0, f'longer than {max_len} pieces': 0, 'of unlike lengths': 0}
    for x, y in zip(tok.encode_lines(x_lines), tok.encode_lines(y_lines)):
        if not test and not (x and y):
            skipped['with an empty side'] += 1
        elif not test and max(len(x), len(y)) > max_len:
            skipped[f'longer than {max_len} pieces'] += 1
        elif not test and max_ratio and max(len(x), len(y)) > max_ratio * min(len(x), len(y)):
            skipped['of unlike lengths'] += 1
        else:
            x, y = x[:longest], y[:longest]
            items.append((Feature(x + [tok.eos, lang_ids[0]]), Feature([lang_ids[1]] + y, y + [tok.eos])))
    report_skipped(paths[0], len(x_lines), skipped, 'sentence pairs')
    return items


# === Machinery: the file layout and readers, file checks, the token cache, batch machinery, the demo, download ===


# ----------------------------------------------------------------------------------------
# Where each file lives (the layout of XTREME's own preprocessing; docs/data.md).

QA_FILES = {
    'xquad': {'train': 'squad/train-v1.1.json', 'dev': 'squad/dev-v1.1.json', 'test': 'xquad/xquad.{lang}.json',
              'translate-train': 'squad/translate-train/squad.translate.train.en-{lang}.json',
              'round-trip': 'squad/round-trip/squad.round-trip.train.en-{lang}-en.json',
              'pseudo-test': 'xquad/pseudo-test/pseudo-test-{lang}.json'},
    'mlqa': {'train': 'squad/train-v1.1.json', 'dev': 'mlqa/MLQA_V1/dev/dev-context-{lang}-question-{lang}.json',
             'test': 'mlqa/MLQA_V1/test/test-context-{lang}-question-{lang}.json',
             'translate-train': 'squad/translate-train/squad.translate.train.en-{lang}.json',
             'round-trip': 'squad/round-trip/squad.round-trip.train.en-{lang}-en.json'},
    'tydiqa': {'train': 'tydiqa/tydiqa-goldp-v1.1-train/tydiqa.goldp.{lang}.train.json',  # each language's questions
               'test': 'tydiqa/tydiqa-goldp-v1.1-dev/tydiqa.goldp.{lang}.dev.json',  # XTREME tests on GoldP dev
               'translate-train': 'tydiqa/translate-train/tydiqa.translate.train.en-{lang}.json',
               'round-trip': 'tydiqa/round-trip/tydiqa.round-trip.train.en-{lang}-en.json'},
}


def translated(data_dir, task, langs, reader):
    """The languages of langs into which the data folder translates the task's English training data. A warning
    names the others, which the reader (a method's name) trains without."""
    there = [lang for lang in langs if os.path.exists(split_path(data_dir, task, 'translate-train', lang))]
    if there != langs:
        warn(f'{data_dir} translates no {task} training data into '
             f'{", ".join(lang for lang in langs if lang not in there)}: {reader} trains without them')
    return there


def split_path(data_dir, task, split, lang='en'):
    """File of a split: 'train' (English's by default), 'dev', 'test', 'translate-train' (English -> lang),
    'translate-dev' / 'translate-test' (lang -> English) or 'round-trip' (the English training
    data translated into lang and back); None where the benchmark has none."""
    family = TASKS[task].family
    if split.startswith('translate-') and split != 'translate-train':
        s = split[len('translate-'):]
        name = {'classification': f'{s}-{lang}-en-translated.tsv', 'tagging': f'{s}-{lang}-en.tsv',
                'qa': f'{task}.translate.{s}.{lang}-en.json'}.get(family)
    elif family == 'qa':
        name = QA_FILES[task].get(split)
        if name is None or ('{lang}' not in name and lang != 'en'):  # SQuAD's dev set is English only
            return None
        return os.path.join(data_dir, name.format(lang=lang))
    elif family == 'retrieval':
        name = f'{lang}-en.{split}' if task == 'bucc2018' else f'{lang}-en'  # + .{lang} / .en / .gold
    elif split == 'translate-train':
        name = f'en-{lang}-translated.tsv' if family == 'classification' else f'train-en-{lang}.tsv'
    elif split == 'round-trip':
        name = f'train-en-{lang}-en.tsv'
    else:
        name = f'{split}-{lang}.tsv'
    return name and os.path.join(data_dir, task, split if split.startswith(('translate-', 'round-', 'pseudo-')) else '',
                                 name)


def get_translations(task):
    if task in TRANSLATED:
        return f'get XTREME\'s translations with python data.py download --task {task} --translations (docs/data.md)'
    return f'XTREME publishes none for {task}: put your own in the layout of docs/data.md (FILTER\'s, for instance)'


def need(path, what):
    if path is None or not os.path.isfile(path):
        raise DataError(f'{path} not found: {what}')
    return path


DEMO_VERSION = 6  # raised when the demo's files change: a run folder's demo data of another version is made again


def is_demo(data_dir, current=False):
    path = os.path.join(data_dir, 'demo.json')
    if not current or not os.path.exists(path):
        return os.path.exists(path)
    with open(path) as f:
        return json.load(f).get('version') == DEMO_VERSION


def languages(task, demo=False, chosen=None):
    """A task's test languages: XTREME's, or the demo's (retrieval pairs each with English); chosen (--langs): those
    of them, and English, the source, which trains and selects."""
    langs = (DEMO_LANGS if demo else TASKS[task].langs) if task in TASKS else ()
    unknown = sorted(set(chosen or ()) - set(langs))
    if unknown:
        fix = f'choose from {", ".join(langs)}' if langs else 'it is not an XTREME task: drop --langs'
        raise DataError(f'{task} has no language {unknown[0]!r}; {fix}')
    langs = [lang for lang in langs if not chosen or lang in chosen or lang == 'en']
    return tuple(lang for lang in langs if lang != 'en' or TASKS[task].family != 'retrieval')


def tokenizer_file(backbone, data_dir, spm=None, vocab=None, init=None):
    """-> (path, what it is, needed) of a backbone's tokenizer: BERT's vocab.txt (vocab, else the one beside the
    checkpoint init, else data_dir's), XLM-R's sentencepiece model (spm, else the one in the folder init, as Hugging
    Face's folders and FILTER's released models ship it, else data_dir's)."""
    if backbone == 'bert':
        path = vocab or beside(init, 'vocab.txt') or os.path.join(data_dir, 'vocab.txt')
        return path, 'BERT\'s vocab.txt: put it beside --init or pass --vocab', True
    shipped = beside(init, 'sentencepiece.bpe.model') if init and os.path.isdir(init) else None
    return spm or shipped or os.path.join(data_dir, 'sentencepiece.bpe.model'), (
        'XLM-R\'s sentencepiece model: put it there or pass --spm'), True


def beside(checkpoint, name):
    """The file `name` in a checkpoint's folder, or None (fairseq's models ship a dict.txt, BERT's a vocab.txt)."""
    if not checkpoint:
        return None
    path = os.path.join(checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint), name)
    return path if os.path.isfile(path) else None


def pretrain_files(data_dir, mono_only=False):
    """-> {'mono:{lang}': [path], 'para:{a}-{b}': [path a, path b]} of the layout above (mono_only: no 'para:')."""
    root, groups = os.path.join(data_dir, 'pretrain'), {}
    mono, para = os.path.join(root, 'mono'), os.path.join(root, 'parallel')
    for name in sorted(os.listdir(mono)) if os.path.isdir(mono) else []:
        if name.endswith('.txt'):
            groups[f'mono:{name[:-4]}'] = [os.path.join(mono, name)]
    for name in sorted(os.listdir(para)) if os.path.isdir(para) and not mono_only else []:
        pair, _, lang = name.rpartition('.')
        if pair.count('-') == 1 and lang == pair.split('-')[0]:  # {a}-{b}.{a}: its other side is {a}-{b}.{b}
            b = pair.split('-')[1]
            other = need(os.path.join(para, f'{pair}.{b}'),
                         f'{name} has no other side: put its translations in {pair}.{b}')
            groups[f'para:{pair}'] = [os.path.join(para, name), other]
    if not groups:
        raise DataError(f'no pre-training text in {root}: put monolingual documents in mono/<lang>.txt and parallel '
                        'sentences in parallel/<a>-<b>.<a> and .<b> (docs/veco.md), or pass --demo')
    return groups


def parallel_files(data_dir, src, tgt, split):
    """-> (source side, target side) of a split, in translation/{src}-{tgt} or {tgt}-{src}."""
    pairs = [os.path.join(data_dir, 'translation', p) for p in (f'{src}-{tgt}', f'{tgt}-{src}')]
    folder = next((p for p in pairs if os.path.isdir(p)), pairs[0])
    return [need(os.path.join(folder, f'{split}.{lang}'), f'put the {split} set\'s {lang} side there, one sentence '
                 f'a line, aligned with {split}.{src if lang == tgt else tgt} (docs/veco.md)')
            for lang in (src, tgt)]


# ----------------------------------------------------------------------------------------
# Readers. Examples are plain dicts: classification {'a', 'b', 'label'}, tagging {'words', 'tags'} and
# qa {'id', 'question', 'context', 'answers': [{'text', 'answer_start'}]}; labels are None where a file has none
# (XTREME strips test labels).

def read_lines(path):
    """A file's lines, read lazily: UTF-8 with or without a BOM, CRLF as LF; other bytes a DataError naming the line."""
    with open(path, 'rb') as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode('utf-8-sig' if n == 1 else 'utf-8')
                if text:  # empty only for a file that holds a BOM alone: no line
                    yield text[:-2] if text.endswith('\r\n') else text.removesuffix('\n')
            except UnicodeDecodeError as e:
                raise DataError(f'{path}, line {n}: not UTF-8 (byte 0x{raw[e.start]:02x}); '
                                'convert the file to UTF-8 (e.g. iconv -t UTF-8)') from None


def read_text(path):
    return ''.join(line + '\n' for line in read_lines(path))


def runs(lines, ends):
    """The runs of lines between those that end one (ends(line) is true), each a list, none of them empty."""
    run = []
    for line in lines:
        if not ends(line):
            run.append(line)
        elif run:
            yield run
            run = []
    if run:
        yield run


def documents(path):
    """The documents of a file, a blank line between two, as lists of their lines that are not blank."""
    return runs((line for line in read_lines(path) if line.strip() or not line), lambda line: not line)


def line_pairs(a_path, b_path):
    """Line n of one file with line n of the other, read a line at a time."""
    for n, (a, b) in enumerate(zip_longest(read_lines(a_path), read_lines(b_path)), 1):
        if a is None or b is None:
            raise DataError(f'{a_path if b is None else b_path} has more lines than {b_path if b is None else a_path} '
                            f'(line {n}): parallel files align line by line')
        yield a, b


# The warnings of a build under way (write_items), in this thread: kept in its meta.json and given at every load
HEARD = contextvars.ContextVar('heard', default=None)


def warn(message):
    """A warning about the data, given once: by the first process of a run (RANK 0, as torchrun and srun set it)."""
    heard = HEARD.get()
    if heard is not None:
        heard.append(message)
    elif first_process():
        print(f'warning: {message}')


def first_process():
    return int(os.environ.get('RANK', 0)) == 0


def report_skipped(path, total, reasons, what='examples'):
    """One warning per file: how many of its examples were left out, and why ({reason: count})."""
    reasons = {k: v for k, v in reasons.items() if v}
    if reasons:
        why = ', '.join(f'{n} {reason}' for reason, n in reasons.items())
        warn(f'{path}: {sum(reasons.values())} of {total} {what} skipped ({why})')


def bar(iterable=None, quiet=False, **kwargs):
    """A tqdm progress bar, drawn by one process and only on a terminal (a log file would get every redraw)."""
    return tqdm(iterable, disable=quiet or not first_process() or not sys.stderr.isatty(), **kwargs)


def progress(examples, what):
    """A progress bar over a long list (a real training set); none for small ones."""
    return bar(examples, quiet=len(examples) < 5000, desc=what, leave=False)


def read_dictionary(path):
    """The symbols of a fairseq dict.txt, `<symbol> <count>` a line (a #fairseq:overwrite flag may
    follow: a symbol listed again, its later line the one looked up), as fairseq's Dictionary reads them."""
    symbols = []
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            word, _, count = line.rstrip().removesuffix(' #fairseq:overwrite').rpartition(' ')
            if not word or not count.isdigit():
                raise DataError(f'{path} line {n} is not "<symbol> <count>": '
                                'give the dict.txt that came with the checkpoint')
            symbols.append(word)
    return symbols


XNLI_SPELLING = {'contradictory': 'contradiction'}  # XNLI-MT's spelling of a label -> the task's


def check_label(task, label, path, line):
    label = XNLI_SPELLING.get(label, label)
    if label not in TASKS[task].labels:
        raise DataError(f'{path}, line {line}: label {label!r} is not one of {", ".join(TASKS[task].labels)}; '
                        'fix or remove the line')
    return label


def read_pairs(path, task, translated=False):
    """Sentence pairs, tab-separated, no header: 'a b [label]', XTREME's csv quoting (quotes around a field with a '"')
    undone; translation files hold 'a b a' b' [label]': -> (original, translation, line)."""
    width = (4, 5) if translated else (2, 3)
    out, columns, empty = [], None, []
    text = read_text(need(path, f'get the {task} data (python data.py download --task {task})'))
    reader = csv.reader(io.StringIO(text, newline=''), delimiter='\t',
                        quoting=csv.QUOTE_NONE if translated else csv.QUOTE_MINIMAL)
    for row in reader:
        columns = columns or len(row)
        if len(row) not in width or len(row) != columns:
            raise DataError(f'{path}, line {reader.line_num}: {len(row)} tab-separated columns, expected '
                            f'{columns if columns in width else " or ".join(map(str, width))} as in the '
                            'rest of the file; fix or remove the line')
        label = check_label(task, row[-1], path, reader.line_num) if len(row) == width[1] else None
        ex = [{'a': row[i], 'b': row[i + 1], 'label': label} for i in range(0, len(row) - 1, 2)]
        if translated and not all(field.strip() for field in row[:4]):
            empty.append(reader.line_num)  # a translation left blank (PAWS-X has some): nothing to pair
            continue
        out.append((ex[0], ex[1], reader.line_num) if translated else ex[0])
    if empty:
        warn(f'{path}: {len(empty)} rows with an empty sentence skipped (the first at line {empty[0]})')
    return out


def read_tagged(path, task):
    """One word per line ('word<TAB>tag', or just 'word' in test files), a blank line between sentences."""
    out, tagged = [], None
    lines = list(enumerate(read_lines(need(path, f'get the {task} data (python data.py download --task {task})')), 1))
    for sentence in runs(lines, lambda numbered: not numbered[1].strip()):
        words, tags = [], []
        for n, line in sentence:
            cols = line.split('\t')
            tagged = len(cols) == 2 if tagged is None else tagged
            if len(cols) != 1 + tagged or not cols[0]:
                raise DataError(f'{path}, line {n}: expected {"word<TAB>tag" if tagged else "a word alone"} as in the '
                                'rest of the file; fix the line')
            words.append(cols[0])
            if tagged:
                tags.append(check_label(task, cols[1], path, n))
        out.append({'words': words, 'tags': tags if tagged else None})
    return out


def read_squad(path, task='squad', train=False):
    """SQuAD v1.1 json -> one example per question. Blanked test answers (text '') count as none.
    train: questions a model cannot learn from are skipped, and counted per reason."""
    try:
        data = json.loads(read_text(need(path, f'get the {task} data (python data.py download --task {task})')))['data']
        examples = [{'id': qa['id'], 'question': qa['question'], 'context': p['context'],
                     'answers': [a for a in qa.get('answers', []) if a['text']]}
                    for article in data for p in article['paragraphs'] for qa in p['qas']]
        answers = [a for ex in examples for a in ex['answers']]
        if not all(isinstance(a['answer_start'], int) and isinstance(a['text'], str) for a in answers):
            raise TypeError("'answer_start'")
    except json.JSONDecodeError as e:
        raise DataError(f'{path}, line {e.lineno}: not valid JSON ({e.msg}); fix the file') from None
    except (KeyError, TypeError) as e:
        what = 'no' if isinstance(e, KeyError) else 'a malformed'
        raise DataError(f'{path}: not in SQuAD format ({what} {e} field); expected data/paragraphs/qas with id, '
                        'question, answers (text, answer_start)') from None
    if not train:
        return examples
    problems = [unusable_answer(ex) for ex in examples]
    reasons = {r: problems.count(r) for r in ('no answer', 'empty context', 'answer text not at answer_start')}
    report_skipped(path, len(examples), reasons, 'questions')
    return [ex for ex, problem in zip(examples, problems) if not problem]


def unusable_answer(ex):
    """Why a training question cannot be learnt from, as XTREME's processors judge it (None if it can)."""
    if not ex['context'].strip():
        return 'empty context'
    if not ex['answers']:
        return 'no answer'
    a = ex['answers'][0]
    if ex['context'][a['answer_start']:a['answer_start'] + len(a['text'])] != a['text']:
        return 'answer text not at answer_start'
    return None


def suffix(task):
    """The file ending of a task's predictions and labels."""
    return 'json' if TASKS[task].family == 'qa' else 'tsv'


def read_split(data_dir, task, split, lang='en'):
    """Examples of a split (train, dev, test) in one language."""
    languages(task, is_demo(data_dir), [lang])  # a DataError for a language the task has not
    path = split_path(data_dir, task, split, lang)
    family = TASKS[task].family
    if family == 'retrieval':
        raise DataError(f'{task} is a retrieval task: read it with read_retrieval')
    if family == 'qa':
        return read_squad(path, task, train=split == 'train')
    return (read_pairs if family == 'classification' else read_tagged)(path, task)


def read_translations(data_dir, task, split, lang, originals=None):
    """[(original, its translation or None)], one per example of the original file (originals: its examples, if read
    already): split 'train' pairs the English training set with its translation into lang, 'dev' / 'test' lang's
    examples with their English translation. Classification translations carry their original pair and are matched to it
    by that text (released files have had rows out of order), tagging translations align sentence by sentence, QA
    translations by question id. A warning counts what is left unpaired on either side."""
    kind = f'translate-{split}'
    path = need(split_path(data_dir, task, kind, lang), f'{task} needs {kind} files for {lang}; '
                                                        f'{get_translations(task)}')
    family = TASKS[task].family
    if originals is None:
        originals = read_split(data_dir, task, split, 'en' if split == 'train' else lang)
    if family == 'tagging':
        translated = read_tagged(path, task)
        if len(translated) != len(originals):
            raise DataError(f'{path} has {len(translated)} sentences for {len(originals)} in the original: '
                            'translations must be aligned sentence by sentence')
        return list(zip(originals, translated))
    if family == 'qa':
        key = lambda ex: ex['id']
        rows = [(ex, ex, n) for n, ex in enumerate(read_squad(path, task, train=split == 'train'), 1)]
    else:  # the original pair's text, whitespace aside
        key = lambda ex: (' '.join(ex['a'].split()), ' '.join(ex['b'].split()))
        rows = read_pairs(path, task, translated=True)
    waiting = {}  # original's key -> its translations, in file order (a pair may occur twice)
    for original, t, n in rows:
        waiting.setdefault(key(original), []).append((t, n))
    out = [(ex, waiting[key(ex)].pop(0)[0] if waiting.get(key(ex)) else None) for ex in originals]
    unmatched = sorted(n for left in waiting.values() for _, n in left)
    missing = sum(t is None for _, t in out)
    if missing or unmatched:
        where = f' (the first at {"question" if family == "qa" else "line"} {unmatched[0]})' if unmatched else ''
        warn(f'{path}: {missing} of {len(out)} {"questions" if family == "qa" else "examples"} of the original have no '
             f'translation here, {len(unmatched)} translations match no original{where}: those are left unpaired')
    return out


def read_round_trip(data_dir, task, lang, pairs):
    """The English training data translated into lang and back (X-Mixup's scheduled sampling), aligned with pairs =
    read_translations(..., 'train', lang), one per English training example: by line or sentence of the English file, or
    by question id (a question without a usable round trip keeps its original). None when there is no such file."""
    path = split_path(data_dir, task, 'round-trip', lang)
    if path is None or not os.path.exists(path):
        return None
    family = TASKS[task].family
    if family == 'qa':
        by_id = {ex['id']: ex for ex in read_squad(path, task, train=True)}
        return [by_id.get(o['id'], o) for o, _ in pairs]
    rows = read_pairs(path, task) if family == 'classification' else read_tagged(path, task)
    if len(rows) != len(pairs):
        raise DataError(f'{path} has {len(rows)} examples for {len(pairs)} in the English training file: '
                        'they must align line by line')
    return rows


def read_retrieval(data_dir, task, split, lang):
    """bucc2018: ({id: sentence} of lang, {id: sentence} of English, gold pairs or None);
    tatoeba: ([sentences of lang], [English sentences], None)."""
    languages(task, is_demo(data_dir), [lang])  # a DataError for a language the task has not
    stem = split_path(data_dir, task, split, lang)
    get = f'get the {task} data (python data.py download --task {task})'
    src, eng = (need(f'{stem}.{side}', get) for side in (lang, 'en'))
    if task == 'tatoeba':
        return list(read_lines(src)), list(read_lines(eng)), None
    gold = [tuple(line.split('\t')) for line in read_lines(stem + '.gold')] if os.path.exists(stem + '.gold') else None
    return id_sentences(src), id_sentences(eng), gold


def id_sentences(path):
    lines = list(read_lines(path))
    bad = next((n for n, line in enumerate(lines, 1) if '\t' not in line), None)
    if bad:
        raise DataError(f'{path}, line {bad}: expected "id<TAB>sentence"; fix the line')
    return dict(line.split('\t', 1) for line in lines)


# The leaderboard's files, predictions and test labels alike: a label a line (read_labels), a tag a line with a
# blank line between sentences (read_tag_file), or SQuAD's JSON (read_qa_file).

def read_input(path, task, paired=False, translation=None):
    """A file to predict on (train.py --predict) -> (examples, [(English translation, example)] or None). A TSV holds an
    example a line in the task's columns, classification 'a<TAB>b' and tagging a sentence (its words split at spaces), a
    paired method's rows going on with the English translation ('a<TAB>b<TAB>a_en<TAB>b_en'); a last column may hold the
    label (tagging: a tag a word), then scored. QA: XTREME's JSON, a paired method's questions paired by id with
    translation's (XTREME's translate-test JSON) or with themselves. One DataError names every bad line."""
    family = TASKS[task].family
    if family == 'qa':
        examples = read_squad(path, task)
        english = {ex['id']: ex for ex in (read_squad(translation, task) if translation else [])}
        return examples, [(english.get(ex['id'], ex), ex) for ex in examples] if paired else None
    width, labels = (2 if family == 'classification' else 1), set(TASKS[task].labels)
    make = lambda cols, label: ({'a': cols[0], 'b': cols[1], 'label': label} if width == 2 else
                                {'words': cols[0].split(), 'tags': label and label.split()})
    fits = lambda ex: (ex['label'] in labels | {None} if width == 2 else
                       not ex['tags'] or len(ex['tags']) == len(ex['words']) and set(ex['tags']) <= labels)
    rows, bad = [], []
    for n, line in ((n, line) for n, line in enumerate(read_lines(need(path, 'give the file to predict')), 1) if line):
        cols = line.split('\t')
        label = cols.pop() if len(cols) == width * (1 + paired) + 1 else None
        if len(cols) != width * (1 + paired) or not all(map(str.strip, cols)) or not fits(make(cols, label)):
            bad.append(n)
            continue
        rows.append((make(cols, label), make(cols[width:], None) if paired else None))
    if bad:
        columns = '<TAB>'.join((['a', 'b'] if width == 2 else ['words']) * (1 + paired) + ['[label]'])
        raise DataError(f'{path}, line{"s" * (len(bad) > 1)} {", ".join(map(str, bad[:10]))}{" ..." * (len(bad) > 10)}'
                        f': not {columns} with labels of {task}; fix or remove {"them" if len(bad) > 1 else "it"}')
    return [example for example, _ in rows], [(english, example) for example, english in rows] if paired else None


def read_labels(path):
    """One label a line (the leaderboard's classification files), spaces around it dropped."""
    return [line.strip() for line in read_lines(path)]


def read_tag_file(path):
    """One tag a line, a blank line between sentences (as on the leaderboard, blank lines in a row are empty ones)."""
    sentences = [[]]
    for line in read_labels(path):
        if line:
            sentences[-1].append(line)
        else:
            sentences.append([])
    return sentences if sentences[-1] else sentences[:-1]


def read_qa_file(path):
    try:
        obj = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise DataError(f'{path}, line {e.lineno}: not valid JSON ({e.msg}); fix the file') from None
    return obj['data'] if 'data' in obj else obj


# ----------------------------------------------------------------------------------------
# File checks: every file a run reads is there and readable before anything is made.

def check_files(data_dir, task, reader, files, backbone='xlmr'):
    """Every file the run needs is there, or a DataError names the first missing one (the others are
    listed above it); the last, the tokenizer's, reads as the backbone's."""
    data_needed = [path for path, _, needed in files[:-1] if needed]  # the last is the tokenizer's
    lost = [(path, what) for path, what, needed in files if needed and not os.path.isfile(path)]
    if data_needed and all(not os.path.isfile(p) for p in data_needed):
        translated = any('--translations' in what for _, what, _ in files)
        hint = f' ({reader} reads translations too: {get_translations(task)})' if translated else ''
        raise DataError(f'{data_dir} holds no {task} data (no {lost[0][0]}): {lost[0][1]}, or pass --demo{hint}')
    for path, what in lost[1:]:
        print(f'not found: {path}')
    if lost:
        more = f' (and {len(lost) - 1} more, listed above)' if len(lost) > 1 else ''
        raise DataError(f'{lost[0][0]} not found{more}: {lost[0][1]}')
    if files:  # a file that is no tokenizer's stops here, not after a folder is made
        tokenizer(backbone, files[-1][0])


def task_files(data_dir, task, trained=(), round_trip=False, translations=False, train=True, reader='the run',
               trains_on='en', chosen=None):
    """-> [(path, what, needed)] of a task in docs/data.md's layout, in the languages chosen (--langs): the training
    files (train), English's (but in-language's), the translate-train files of the languages `trained` (with their round
    trips, read where they are), or their own training files (needed for one language; for every language those there
    are, UD has none in some); every dev and test file, with translations the translate-dev and -test files of the
    target languages (reader: who reads them, for the message); the test labels. Not needed: read if there."""
    family, langs = TASKS[task].family, languages(task, is_demo(data_dir), chosen)
    source = {'panx': ' --from AmazonPhotos.zip', 'conll': ' --from FOLDER'}.get(task, '')
    get = f'python data.py download --task {task}{source} --out {data_dir}, or run the languages there are (--langs)'
    labels = [(os.path.join(data_dir, 'labels', task, f'test-{lang}.{suffix(task)}'), 'test labels (scored when there)',
               False) for lang in langs]
    if family == 'retrieval':  # BUCC's threshold comes from its dev pairs and their gold alignment
        sides = lambda lang: (('test', (lang, 'en')), ('dev', (lang, 'en', 'gold') if task == 'bucc2018' else ()))
        return [(f'{split_path(data_dir, task, split, lang)}.{side}', get, True) for lang in langs
                for split, names in sides(lang) for side in names] + labels
    files = []
    add = lambda path, what, needed=True: files.append((path, what, needed))
    own, english = TRAINS_ON[trains_on].own, TRAINS_ON[trains_on].english
    if train and (english or not own):  # translations are read beside their English
        add(split_path(data_dir, task, 'train'), get)
    for lang in trained if train and own else ():
        add(split_path(data_dir, task, 'train', lang), f'the training data of {lang} itself ({get}; UD v2.5 has '
            'none in some languages)', not english)
    for lang in trained if train and not own else ():
        add(split_path(data_dir, task, 'translate-train', lang),
            f'{task} needs translate-train files for {lang}; {get_translations(task)}')
        if round_trip:
            add(split_path(data_dir, task, 'round-trip', lang),
                'X-Mixup\'s round trip (the real English where missing)', False)
    for split in ('dev', 'test'):
        for lang in langs:
            path = split_path(data_dir, task, split, lang)
            if path is None or (split == 'dev' and not os.path.exists(path)):
                continue  # no dev set in this language: the run evaluates what there is
            add(path, get)
            if lang != 'en' and translations:
                add(split_path(data_dir, task, f'translate-{split}', lang),
                    f'{reader} needs translate-{split} files for {lang}; {get_translations(task)}')
    return files + labels


def check_labels(task, path, examples):
    """A test label file, where there is one, must be scorable against the test set: one label (or
    tag sentence) per example, from the label set, or every question's answers."""
    if not os.path.exists(path):
        return
    family = TASKS[task].family
    if family == 'qa':
        found = {qa['id'] for article in read_qa_file(path) for p in article.get('paragraphs', [])
                 for qa in p.get('qas', [])}
        lost = [ex['id'] for ex in examples if ex['id'] not in found]
        if lost:
            raise DataError(f'{path} has no answers for {len(lost)} test questions (the first: {lost[0]}): use the '
                            'labels of this test set')
        return
    labels = read_tag_file(path) if family == 'tagging' else read_labels(path)
    if len(labels) != len(examples):
        raise DataError(f'{path} has {len(labels)} labelled examples for {len(examples)} in the test set: use the '
                        'labels of this test set')
    rows = labels if family == 'tagging' else [[label] for label in labels]
    bad = next((n for n, row in enumerate(rows, 1) for label in row if label not in TASKS[task].labels), None)
    if bad:
        raise DataError(f'{path}: example {bad} has a label outside {", ".join(TASKS[task].labels)}; fix the file')


# ----------------------------------------------------------------------------------------
# Training sets on disk: tokenized once, with every core, into flat arrays beside the data, and
# memory-mapped by every process of every later start (one copy a machine, in the page cache).

CACHE_FORMAT = 3  # part of every cache's key: raised when features or their files change for the same data and settings
SLICE = 2000  # examples a worker tokenizes at a time (below progress()'s bar: workers draw none)

TEXT_SLICE = 1000  # documents or parallel lines a worker tokenizes at a time


def feature_set(spec, files, key, sources, width, train=True):
    """Items of the features of sources() ((name, examples, positions of their English) a source at a
    time), tokenized by feature_arrays (stored): each feature alone (width 1), or tuples of width."""
    kept = {}  # each source's English positions, as its jobs are made
    jobs = lambda: training_jobs(sources(), spec.task, spec.max_len, spec.stride, kept, train)
    index_of = lambda done, total: training_index(done, total, kept, width, train)
    meta = {'family': TASKS[spec.task].family}
    build = lambda path: write_items(path, spec.tok, jobs(), feature_arrays, index_of, meta)
    key = key + ['lowered by character'] * spec.tok.lower  # not the caller's list
    return stored(build, files, key, spec.data_dir, spec.cache, quiet=not train)


def stored(build, files, key, data_dir, cache=True, quiet=False):
    """The Items that build(path) writes, kept in <data_dir>/.cache (build_once; files not there are left out of the
    key) or, with cache False, in a temporary folder removed once they are open (open files live on)."""
    folder = os.path.join(data_dir, '.cache') if cache else tempfile.mkdtemp()
    try:
        return Items(build_once(build, [p for p in files if p and os.path.exists(p)], key, folder, quiet))
    finally:
        if not cache:
            shutil.rmtree(folder)


def build_once(build, files, key, folder, quiet=False):
    """folder/<digest_of(files, key)> (key: the settings the set depends on; under DDP hashed by the first process),
    made by build(path) unless there. One process builds, and the others wait and then read it: under DDP the first of
    those that share the folder (builder), at a barrier, as flock may succeed on every node of a cluster's filesystem;
    otherwise, and between runs, the holder of the folder's lock. Leftovers of killed builds are removed first."""
    shared = [None if torch.distributed.is_initialized() and torch.distributed.get_rank() else digest_of(files, key)]
    if torch.distributed.is_initialized():  # hashed by the first process alone (terabytes of pre-training text)
        torch.distributed.broadcast_object_list(shared, group=WAITS)
    path = os.path.join(folder, shared[0])
    if everywhere(os.path.isdir(path) and not torn(path)):  # moved into place whole: read, no build waited for
        return path
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, '.lock'), 'w')
    except OSError as e:
        raise DataError(f'cannot write the feature cache in {folder} ({e.strerror}): '
                        'make it writable or pass --no_cache')
    with lock:
        if not torch.distributed.is_initialized() or builder(folder) == torch.distributed.get_rank():
            locked(lock)  # another run's build of it (on a filesystem without locks, a note)
            built(build, path, folder, quiet)
        barrier()
    return path


def everywhere(true):
    """Is `true` so on every process (under DDP: what each sees of a shared folder may lag on another node)?"""
    if not torch.distributed.is_initialized():
        return true
    missing = torch.tensor([int(not true)])
    torch.distributed.all_reduce(missing, group=WAITS)
    return not missing.item()


def builder(folder):
    """Under DDP, the first process that sees folder as this one does: each leaves a mark there named by a tag of
    this call, then looks its lower ranks' marks up by name (never looked up before, so no filesystem's cache of
    what is absent answers): the first process of all if the folder is shared, else the first of this node."""
    tag, rank = [os.urandom(8).hex()], torch.distributed.get_rank()
    torch.distributed.broadcast_object_list(tag, group=WAITS)
    mark = lambda r: os.path.join(folder, f'.builder-{tag[0]}-{r}')
    open(mark(rank), 'w').close()
    barrier()
    first = next((r for r in range(rank) if os.path.exists(mark(r))), rank)
    barrier()
    os.remove(mark(rank))
    return first


def digest_of(files, key):
    """build_once's folder name: a hash of CACHE_FORMAT, key and each file's path, size, mtime and content."""
    digest = hashlib.sha1(json.dumps([CACHE_FORMAT] + key).encode())
    for path in files:
        stat = os.stat(path)
        digest.update(f'{os.path.abspath(path)} {stat.st_size} {stat.st_mtime_ns}'.encode())
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                digest.update(block)
    return digest.hexdigest()[:16]


def built(build, path, folder, quiet):
    """build(path) unless a whole set is there, the torn set or halfway builds there removed first."""
    if os.path.isdir(path) and (why := torn(path)):
        print(f'the token cache {path} is torn ({why}): building it again')
        shutil.rmtree(path)
    if not os.path.isdir(path):
        for name in (n for n in os.listdir(folder) if '.tmp' in n):
            shutil.rmtree(os.path.join(folder, name))
        if not quiet:
            print(f'tokenizing the training data into {path}')
        build(path)


def locked(file, wait=True):
    """flock(file), held until it closes or its process dies -> False, with a note, on a filesystem without file
    locks (Lustre or BeeGFS mounted without them: ENOSYS). BlockingIOError: another holds it (and not wait)."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
            raise
        print(f'note: {os.path.dirname(os.path.abspath(file.name))} is on a filesystem without file locks: nothing '
              'keeps two runs, or two builds of the token cache, apart')
        return False


def torn(path):
    """Why the set in path cannot be read (a file's size is not its meta.json's: a full disk, a cut copy), or None."""
    try:
        sizes = json.loads(read_text(os.path.join(path, 'meta.json')))['sizes']
    except (OSError, ValueError, KeyError):
        return 'its meta.json is missing or unreadable'
    size = lambda name: os.path.getsize(f'{path}/{name}.bin') if os.path.exists(f'{path}/{name}.bin') else 0
    return next((f'{name}.bin holds {size(name)} bytes, not {n}' for name, n in sizes.items() if size(name) != n), None)


def usable_cores():
    """The cores this process may run on: a Slurm job's or a container's cpuset, not the machine's (macOS: all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def write_items(path, tok, jobs, work, index_of, meta):
    """Items in a new folder moved into place whole (a build killed halfway leaves none): work(tok, job) -> (arrays,
    info) over jobs, (name, job) pairs, each result's arrays appended to flat files as it comes; then index_of([(name,
    features before it, info) of each job], features) -> (item index, more meta). Jobs go to forked workers a window at
    a time, so that a stream of them is never held whole; with work None they are results already (XLA's samples)."""
    tmp, files, done, total, heard = f'{path}.tmp{os.getpid()}', {}, [], 0, []
    hearing = HEARD.set(heard)
    try:  # a build that fails stops hearing the warnings too
        os.makedirs(tmp)
        ends = {'ends': 0, 'word_ends': 0}  # the offsets of each feature's ids and words, from a first 0
        append(tmp, files, {key: np.zeros(1, np.int64) for key in ends})
        jobs = iter(jobs)
        first = list(islice(jobs, 2))  # a set of one job (most evaluation sets) is not worth forking a pool for
        cores = usable_cores() if work and len(first) > 1 else 1
        # forked before any thread starts (the bar's): the workers run sentencepiece and numpy
        fork = multiprocessing.get_context('fork')
        with fork.Pool(cores, start_worker, (tok,)) if cores > 1 else nullcontext() as pool:
            jobs, progress = chain(first, jobs), bar(desc='tokenizing', unit=' jobs', leave=False)
            work = work or (lambda tok, job: job)  # XLA's samples are their arrays already
            while window := list(islice(jobs, 4 * cores)):
                calls = [(work, job) for _, job in window]
                results = pool.imap(in_worker, calls) if pool else (fn(tok, job) for fn, job in calls)
                for (name, _), (arrays, info) in zip(window, results):
                    done.append((name, total, info))
                    total += len(arrays['length'])
                    for key, counts in (('ends', arrays['length']), ('word_ends', arrays.pop('word_count', []))):
                        arrays[key] = ends[key] + np.cumsum(counts, dtype=np.int64)
                        ends[key] += int(np.sum(counts))
                    append(tmp, files, arrays)
                    progress.update()
            progress.close()
        index, more = index_of(done, total)
        append(tmp, files, {'items': index.astype(np.int64, copy=False)})
        for f in files.values():  # on disk before the folder is moved into place
            f.flush()
            os.fsync(f.fileno())
    finally:  # a build that fails leaves its folder for the next one to remove, its files closed
        for f in files.values():
            f.close()
        HEARD.reset(hearing)
    sizes = {name: os.path.getsize(f.name) for name, f in files.items()}  # what torn() checks at every open
    meta = dict(meta, sides=index.shape[1], warnings=heard, sizes=sizes, **more)
    atomic_write(os.path.join(tmp, 'meta.json'), json.dumps(meta))
    shutil.rmtree(path, ignore_errors=True)  # an earlier run's (XLA's samples, made anew in a run's folder)
    os.replace(tmp, path)


def save_items(path, arrays, meta):
    """A set whose features were made elsewhere (XLA's vicinal samples: arrays in feature_arrays' layout, without
    labels), written as write_items writes every set, each feature an item."""
    write_items(path, None, [('items', (arrays, None))], None, lambda done, total: (np.arange(total)[:, None], {}),
                meta)


def is_whole(path):
    """Is the set in path there, every file as long as its meta.json says (not torn)?"""
    return os.path.isdir(path) and not torn(path)


def append(folder, files, arrays):
    for name, values in arrays.items():
        if name not in files:
            files[name] = open(os.path.join(folder, f'{name}.bin'), 'wb')
        values.tofile(files[name])


WORKER = {}  # a forked tokenizing worker's own state: the tokenizer it was started with (start_worker)


def start_worker(tok):
    """A tokenizing worker, forked by write_items: it ends at the pool's SIGTERM whatever handler the trainer set
    (ResumePoints), and keeps the build's tokenizer, which it inherits rather than unpickles."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    WORKER['tok'] = tok


def in_worker(call):
    work, job = call
    return work(WORKER['tok'], job)


flat = lambda lists: np.array([x for values in lists for x in values], np.int32)


def feature_arrays(tok, job):
    """(task, examples, max_len, stride, number of the first example, train) -> (their features as flat int32 arrays:
    every feature's ids one after another, its length, example and label (a class, an answer's start and end, or
    tagging's label per token with each feature's word starts; QA's evaluation windows: each token's span, -1 off the
    context, and max_context); each example's first feature, and the features' count, counted from 0)."""
    task, examples, max_len, stride, base, train = job
    feats = make_features(tok, task, examples, max_len, train, stride)
    arrays = {'ids': flat(f.ids for f in feats), 'length': np.array([len(f.ids) for f in feats], np.int32),
              'example': np.array([base + f.example for f in feats], np.int32)}
    family = TASKS[task].family
    # a label of each feature's own example, or IGNORE in its shape where it has none (a test file, one side of a pair)
    blank = {'tagging': lambda f: [IGNORE] * len(f.ids), 'qa': lambda f: (IGNORE, IGNORE)}.get(family, lambda f: IGNORE)
    labels = [blank(f) if f.label is None else f.label for f in feats]
    arrays.update(label=np.array(labels, np.int32) if family == 'classification' else flat(labels),
                  labelled=np.array([f.label is not None for f in feats], np.int32))
    if family == 'tagging':
        arrays.update(words=flat(f.words for f in feats), word_count=np.array([len(f.words) for f in feats], np.int32))
    if family == 'qa' and not train:
        arrays.update(spans=flat((-1, -1) if span is None else span for f in feats for span in f.spans),
                      max_context=flat(f.max_context for f in feats))
    return arrays, np.searchsorted(arrays['example'] - base, np.arange(len(examples) + 1))


def training_jobs(sources, task, max_len, stride, kept, train=True):
    """The sources' examples a SLICE at a time, for feature_arrays; kept: {source: positions of its English}."""
    base = 0
    for name, examples, positions in sources:
        kept[name] = positions
        for s in range(0, len(examples), SLICE):
            yield name, (task, examples[s:s + SLICE], max_len, stride, base + s, train)
        base += len(examples)


def training_index(done, total, kept, width, train=True):
    """write_items' index_of for a set: each feature alone, or a paired method's tuples (in
    evaluation: of the sources 'en' and 'input', every input feature once)."""
    if width == 1:
        return np.arange(total)[:, None], {}
    joined = lambda parts: np.concatenate([np.zeros(0, np.int64)] + parts)
    sides = {name: (joined([before + first[:-1] for n, before, first in done if n == name]),  # first features
                    joined([np.diff(first) for n, _, first in done if n == name]), positions)  # their counts
             for name, positions in kept.items()}
    if not train:
        return aligned([sides[name][:2] for name in ('en', 'input')], train).astype(np.int64), {}
    return item_index(sides, width), {}


def item_index(sides, width):
    """A paired method's items as feature numbers (items, width): each English example with itself, then each language's
    examples with their English (width 3: and their round trip, else English again), aligned as in training."""
    first, count, _ = sides.pop('en')
    index = [aligned([(first, count)] * width)]
    for name, (lang_first, lang_count, kept) in sides.items():
        if not name.endswith('round trip'):
            english = first[kept], count[kept]
            trip_first, trip_count, _ = sides.get(f'{name} round trip', (*english, None))
            trip = np.where(trip_count > 0, trip_first, english[0]), np.where(trip_count > 0, trip_count, english[1])
            index.append(aligned([english, (lang_first, lang_count), trip][:width]))
    return np.concatenate(index).astype(np.int64)


def aligned(sides, train=True):
    """Feature tuples of examples seen from several sides, given each side's (first feature, feature count) per example:
    as many tuples as the longest side has features (in evaluation the last side's, the target's), a shorter side's last
    feature repeating; none where a side has none."""
    first, count = np.array([f for f, _ in sides]), np.array([c for _, c in sides])  # (sides, examples)
    n = (count.max(0) if train else count[-1]) * (count.min(0) > 0)
    row = np.repeat(np.arange(len(n)), n)
    step = np.arange(len(row)) - np.repeat(np.cumsum(n) - n, n)  # the tuple's number within its example
    return (first[:, row] + np.minimum(step, count[:, row] - 1)).T


class Items:
    """A training set on disk (write_items): items[i] is a Feature, or a paired method's tuple of them, made when read.
    The index, offsets and lengths are memory-mapped; a feature's ids and labels are read from their files (pread) when
    it is made, since mapped pages read at random stay in the process's resident set, 64 KB or so each (the kernel maps
    their neighbours too). The page cache holds one copy for every process either way."""

    def __init__(self, path):
        if why := torn(path):
            raise DataError(f'{path} is torn ({why}): remove it and run again')
        meta = json.loads(read_text(os.path.join(path, 'meta.json')))
        file = lambda name: os.path.join(path, f'{name}.bin')
        there = lambda name: os.path.exists(file(name)) and os.path.getsize(file(name)) > 0
        mapped = lambda name, dtype=np.int64: np.memmap(file(name), dtype, 'r') if there(name) else np.zeros(0, dtype)
        self.family, self.meta, self.length = meta['family'], meta, mapped('length', np.int32)
        self.labelled = mapped('labelled', np.int32)  # whether a feature's own example has a label (none: XLA's)
        self.index = mapped('items').reshape(-1, meta['sides'])
        self.offsets, self.word_offsets = mapped('ends'), mapped('word_ends')
        self.files = {name: os.open(file(name), os.O_RDONLY)
                      for name in ('ids', 'label', 'words', 'example', 'spans', 'max_context') if there(name)}
        for message in meta['warnings']:  # what the readers said when the set was built
            warn(message)

    def __del__(self):
        for fd in getattr(self, 'files', {}).values():
            os.close(fd)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        feats = tuple(self.feature(k) for k in self.index[i])
        return feats if len(feats) > 1 else feats[0]

    def read(self, name, a, b):
        """Values a to b of the int32 array `name`, from its file."""
        if name not in self.files:
            return []
        return np.frombuffer(os.pread(self.files[name], 4 * (b - a), 4 * a), np.int32).tolist()

    def lengths(self, index=None):
        """item_lengths' (items, sides) array: the token count of each side of items[index] (default all)."""
        return self.length[self.index[slice(None) if index is None else index]]

    def feature(self, k):
        a, b, example = int(self.offsets[k]), int(self.offsets[k + 1]), (self.read('example', k, k + 1) or [0])[0]
        words = self.read('words', *map(int, self.word_offsets[k:k + 2])) if self.family == 'tagging' else None
        label = None  # the feature's own example has none, whatever the other side of its pair has
        if k < len(self.labelled) and self.labelled[k]:  # a tag per token, a class, or QA's (start, end)
            label = self.read('label', *{'tagging': (a, b), 'qa': (2 * k, 2 * k + 2)}.get(self.family, (k, k + 1)))
            label = label if self.family == 'tagging' else tuple(label) if self.family == 'qa' else label[0]
        if 'spans' not in self.files:
            return Feature(self.read('ids', a, b), label, example, words)
        spans = self.read('spans', 2 * a, 2 * b)  # QA's evaluation windows
        spans = [None if s < 0 else (s, e) for s, e in zip(spans[::2], spans[1::2])]
        fullest = [bool(x) for x in self.read('max_context', a, b)]
        return Feature(self.read('ids', a, b), label, example, words, spans, fullest)


def slices(iterable, n):
    """Consecutive lists of n of the iterable's items (the last may be shorter), read as they are needed."""
    iterable = iter(iterable)
    while part := list(islice(iterable, n)):
        yield part


def pair_arrays(tok, job):
    """(parallel, documents or line pairs, max_len) -> (the (x, y) pairs' features as flat arrays,
    x then y, and the counts of what each rule used)."""
    parallel, part, max_len = job
    counts = {}
    if not parallel:
        pairs = segment_pairs(tok, part, max_len, counts)
    else:
        kept = [(a, b) for a, b in part if a.strip() and b.strip()]
        longest = min(max_len, PARA_LEN) - 2  # Table 5: bilingual pairs of at most 128 tokens
        whole = list(zip(tok.encode_words([a for a, _ in kept]), tok.encode_words([b for _, b in kept])))
        pairs = [(x[:longest], y[:longest]) for x, y in whole]
        used = sum(len(x) + len(y) for x, y in pairs)
        count(counts, 'parallel lines, a pair each', len(pairs), 2 * len(pairs), used)
        count(counts, 'left out: parallel lines with an empty side', len(part) - len(kept), 0, 0)
        cut = sum(len(x) + len(y) for x, y in whole) - used
        count(counts, f'left out: parallel pieces past {longest} a side', 0, 0, cut)
    sides = [[tok.bos] + side + [tok.eos] for pair in pairs for side in pair]
    return {'ids': flat(sides), 'length': np.array([len(s) for s in sides], np.int32),
            'label': np.full(len(sides), int(parallel), np.int32), 'labelled': np.ones(len(sides), np.int32)}, counts


def pretraining_index(done, total):
    """write_items' index_of for pre-training: items (x, y) of consecutive features, each group's
    items [first, end), and the counts of its slices added up."""
    groups, counts = {}, {}
    for (name, before, slice_counts), end in zip(done, [before for _, before, _ in done[1:]] + [total]):
        groups[name] = [groups.get(name, [before // 2])[0], end // 2]
        for rule, values in slice_counts.items():
            count(counts, rule, *values)
    return np.arange(total).reshape(-1, 2), {'groups': {g: ends for g, ends in groups.items() if ends[1] > ends[0]},
                                            'counts': counts}


def pretraining_table(counts):
    """What each rule of pretraining_set used and what was left out, as printed lines."""
    rows = [f'  {rule:<46}{d:>11,}{s:>11,}{p:>13,}' for rule, (d, s, p) in counts.items() if d or s or p]
    return '\n'.join([f'{"pre-training data":<48}{"docs/lines":>11}{"segments":>11}{"pieces":>13}'] + rows)


# ----------------------------------------------------------------------------------------
# Batch machinery: runs counted in steps, batches in tokens, padding and the largest micro-batch, a GPU's alignment.

def stepped(cut, steps, eval_every, batch_size):
    """A run counted in steps (--steps): the global batches of passes cut(p) one after another, an 'epoch' being
    eval_every of them (None: a pass). -> batches_of(epoch)."""
    per_pass = len(cut(0))
    if not per_pass:
        raise DataError(f'{batch_size} is larger than the training items: lower it')
    eval_every = eval_every or per_pass
    steps_of = lambda epoch: range(epoch * eval_every, min((epoch + 1) * eval_every, steps))
    return lambda epoch: [cut(s // per_pass)[s % per_pass] for s in steps_of(epoch)]


def token_batches(lengths, max_tokens, chunks, seed):
    """Global batches of `chunks` micro-batches of at most max_tokens tokens each, padding included (fairseq's
    --max-tokens; a pair counts its longer side): the items sorted by length (ties in an order fixed by seed), cut
    greedily, and the batches shuffled. An item longer than max_tokens makes a micro-batch of its own."""
    g = torch.Generator().manual_seed(seed)
    longest = np.asarray(lengths).reshape(len(lengths), -1).max(1)
    order = torch.randperm(len(longest), generator=g).numpy()
    order = order[np.argsort(longest[order], kind='stable')]
    batches, start = [], 0
    while start + chunks <= len(order):  # a last batch too small to give every micro-batch an item is dropped
        fits = lambda n: n == 1 or n * longest[order[start + n * chunks - 1]] <= max_tokens  # n items a micro-batch
        low, high = 1, (len(order) - start) // chunks
        while low < high:  # the most that fit: the order is by length, so fits holds up to a point
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        batches.append(order[start:start + low * chunks].tolist())
        start += low * chunks
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def token_sizes(lengths_of, groups, max_tokens, chunks):
    """Pre-training batches in tokens: {group: its pairs a step}, `chunks` micro-batches of as many of the group's
    pairs as its longest pair (both sides) fits in max_tokens. lengths_of(index) -> item_lengths' of those items."""
    longest = {name: int(lengths_of(members).sum(1).max()) for name, members in groups.items()}
    return {name: chunks * max(1, max_tokens // tokens) for name, tokens in longest.items()}


def pad_share(lengths_of, batches, parts):
    """The share of padding tokens in an epoch's micro-batches (each global batch cut into `parts` as the training step
    cuts it, each side padded to its longest item); lengths_of(index) -> item_lengths' of those items."""
    real = padded = 0
    for batch in batches:
        for chunk in (lengths_of(c) for c in np.array_split(np.array(batch), parts) if len(c)):
            real, padded = real + chunk.sum(), padded + len(chunk) * chunk.max(0).sum()
    return 1 - real / max(padded, 1)


def largest_micro_batch(lengths_of, batch, parts):
    """-> (its positions, its tokens padding included) of the largest of batch's micro-batches (cut into `parts`)."""
    padded = lambda chunk: len(chunk) * lengths_of(chunk).max(0).sum()
    return max(((c, padded(c)) for c in np.array_split(np.array(batch), parts) if len(c)), key=lambda c: c[1])


def largest_batch(lengths_of, batches, parts):
    """The batch whose largest micro-batch (each cut into `parts`) holds the most tokens, padding included."""
    return max(batches, key=lambda batch: largest_micro_batch(lengths_of, batch, parts)[1])


ALIGN = 8  # positions: on a GPU the memory-efficient attention wants the rows of its mask aligned to this many


def aligned_for(batch, device):
    """The batch as it goes to `device` (Batch.to): on a GPU, one with padding is padded on to a multiple of ALIGN
    positions. Eager SDPA aligns its mask itself; a graph compiled at one length and reused at an odd one did not
    (torch before the fix of pytorch#163083). No score changes: padding is masked everywhere."""
    more = -batch.ids.size(1) % ALIGN if torch.device(device).type == 'cuda' and batch.padded else 0
    return widened(batch, more) if more else batch


def widened(batch, more):
    """The batch with `more` positions of padding after its last: ids the pad id, masks False, tags IGNORE."""
    pad_id = batch.ids[~batch.mask][0].item()  # a padded batch holds the pad id where its mask is False
    pad = lambda t, value: None if t is None else torch.nn.functional.pad(t, (0, more), value=value)
    tags = batch.labels is not None and batch.labels.shape == batch.ids.shape
    return replace(batch, ids=pad(batch.ids, pad_id), mask=pad(batch.mask, False), first=pad(batch.first, False),
                   labels=pad(batch.labels, IGNORE) if tags else batch.labels)


# ----------------------------------------------------------------------------------------
# Work shared out over the processes (DDP), the results passed through files.

class Ragged:
    """Results of different lengths one after another (Run.sharded's): item i's are
    values[ends[i]:ends[i + 1]]. torch.load(weights_only=True) rebuilds a saved one (allow-listed below)."""

    def __init__(self, values, ends):
        self.values, self.ends = values, ends

    def __len__(self):
        return len(self.ends) - 1

    def __getitem__(self, i):
        return self.values[int(self.ends[i]):int(self.ends[i + 1])]

    def __iter__(self):
        return map(self.__getitem__, range(len(self)))

    @classmethod
    def joined(cls, parts):
        """[(values, counts: each item's number of values)] of blocks in order -> a Ragged of them all."""
        parts = [(v, c) for v, c in parts if len(c)]
        values = torch.cat([v for v, _ in parts]) if parts else torch.zeros(0)
        counts = torch.cat([c for _, c in parts]) if parts else torch.zeros(0, dtype=torch.long)
        return cls(values, torch.cat([counts.new_zeros(1), counts.cumsum(0)]))


torch.serialization.add_safe_globals([Ragged])  # a file may hold one: torch.load(weights_only=True) rebuilds it


WINDOW = 64  # in_windows sorts this many batches by length at a time


def in_windows(fn, lengths, positions, batch_size, desc):
    """fn(batch of positions) -> a tuple of tensors per position, over positions (a range) in
    batches sorted by their lengths WINDOW batches at a time, so that only a window's results are
    Python objects -> each window's [(values, counts) per field], the positions in order."""
    blocks = []
    for start in bar(range(positions.start, positions.stop, WINDOW * batch_size), desc=desc, leave=False):
        window, done = np.arange(start, min(start + WINDOW * batch_size, positions.stop)), {}
        for batch in length_batches(lengths[window], batch_size):
            done.update(zip(window[batch].tolist(), fn(window[batch].tolist())))
        results = zip(*(done[i] for i in window.tolist()))  # field by field
        blocks.append([(torch.cat(r), torch.tensor([len(x) for x in r])) for r in results])
    return blocks


WAITS, PATIENCE = None, datetime.timedelta(hours=2)  # under DDP a gloo group for waits of up to PATIENCE (made by
# train.setup_distributed): one process may tokenize, hash or score long while the others wait, and a stuck one is named
CONNECT = datetime.timedelta(minutes=5)  # for the processes to reach each other when the group is made


def barrier():
    """Every process waits here for the others (under DDP); those that do not come within PATIENCE are named."""
    if torch.distributed.is_initialized():
        try:
            torch.distributed.monitored_barrier(WAITS, PATIENCE, wait_all_ranks=True)
        except RuntimeError as e:  # '[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 7200000 ms'
            raise DataError(f'{str(e).split("]: ")[-1]}: stuck, or stopped by an error of its own') from None


def shared_out(fn, lengths, processes, batch_size, desc, fields=1, everywhere=True):
    """fn(positions) -> a tuple of `fields` tensors per position, over this process's block of positions (in_windows);
    processes: (rank, world, folder), under DDP the blocks pass through files in folder. -> a Ragged per field of every
    position's results, alike for any number of processes, on every process (everywhere=False: on process 0)."""
    rank, world, folder = processes
    path = lambda r: os.path.join(folder, f'.sharded-{r}.pt')
    block = range(len(lengths) * rank // world, len(lengths) * (rank + 1) // world)
    blocks = in_windows(fn, lengths, block, batch_size, desc)
    if world > 1:
        os.makedirs(folder, exist_ok=True)  # a stage's, before it begins
        torch.save(blocks, path(rank))
        barrier()
        read = everywhere or rank == 0
        blocks = [b for r in range(world) for b in torch.load(path(r), weights_only=True)] if read else None
        barrier()
        os.remove(path(rank))
    return None if blocks is None else [Ragged.joined([b[f] for b in blocks]) for f in range(fields)]


# ----------------------------------------------------------------------------------------
# The demo: every task in the layout above, in English and two toy languages, German and Chinese words in their own
# order (verb last; no spaces, place before verb): the tiny model learns in a minute and transfer has a gap to close.

DEMO_LANGS = ('en', 'de', 'zh')
DEMO_WORDS = {  # slot: [(English, toy German, toy Chinese)]
    'first': [('Anna', 'Anna', '安娜'), ('Ben', 'Ben', '本'), ('Clara', 'Klara', '克拉'),
              ('David', 'David', '大卫'), ('Emma', 'Emma', '艾玛'), ('Felix', 'Felix', '菲力'),
              ('Greta', 'Greta', '格蕾'), ('Hugo', 'Hugo', '雨果')],
    'last': [('Smith', 'Schmidt', '史密'), ('Jones', 'Jonas', '琼斯'), ('Brown', 'Braun', '布朗'),
             ('Miller', 'Müller', '米勒')],
    'C': [('Paris', 'Paris', '巴黎'), ('Berlin', 'Berlin', '柏林'), ('Tokyo', 'Tokio', '东京'),
          ('Cairo', 'Kairo', '开罗'), ('Lima', 'Lima', '利马'), ('Oslo', 'Oslo', '奥斯陆')],
    'O': [('Blue Bank', 'Blau Bank', '蓝 银行'), ('Acme Corp', 'Acme Werk', '顶峰 公司'),
          ('Star News', 'Stern Blatt', '星 报社')],
    'V': [('buys', 'kauft', '买'), ('reads', 'liest', '读'), ('writes', 'schreibt', '写'), ('sees', 'sieht', '看'),
          ('finds', 'findet', '找到'), ('sells', 'verkauft', '卖'), ('paints', 'malt', '画'),
          ('likes', 'mag', '喜欢')],
    'A': [('red', 'rot', '红'), ('big', 'groß', '大'), ('old', 'alt', '旧'), ('new', 'neu', '新'),
          ('small', 'klein', '小')],
    'N': [('book', 'Buch', '书'), ('apple', 'Apfel', '苹果'), ('car', 'Wagen', '车'), ('letter', 'Brief', '信'),
          ('song', 'Lied', '歌'), ('house', 'Haus', '房子'), ('ball', 'Ball', '球'),
          ('cake', 'Kuchen', '蛋糕')],
    'D': [('the', 'der', '那')],
}
DEMO_ORDER = {  # sentence kind: word order per language ('S' person, 'O' organisation: two words each)
    'fact': ('S V D A N in C .', 'S in C D N A V .', 'S 在 C V D A N 。'),
    'short': ('S V D N .', 'S D N V .', 'S V D N 。'),
    'never': ('S never V D N .', 'S D N nie V .', 'S 从不 V D N 。'),
    'moved': ('in C , S V D A N .', 'in C S D N A V .', '在 C ， S V D A N 。'),
    'work': ('S works for O in C .', 'S in C für O arbeitet .', 'S 在 C 为 O 工作 。'),
    'who': ('who V D A N ?', 'wer D N A V ?', '谁 V 了 D A N ？'),
    'where': ('where V S D N ?', 'wo S D N V ?', 'S 在 哪里 V D N ？'),
    'which': ('which company does S work for ?', 'für welche Firma arbeitet S ?', 'S 为 哪个 公司 工作 ？'),
}
DEMO_POS = {'S': 'PROPN', 'O': 'PROPN', 'C': 'PROPN', 'V': 'VERB', 'D': 'DET', 'A': 'ADJ', 'N': 'NOUN',
            'in': 'ADP', 'for': 'ADP', 'für': 'ADP', '在': 'ADP', '为': 'ADP', 'never': 'ADV', 'nie': 'ADV',
            '从不': 'ADV',
            'works': 'VERB', 'arbeitet': 'VERB', '工作': 'VERB', 'who': 'PRON', 'wer': 'PRON', '谁': 'PRON',
            'where': 'ADV', 'wo': 'ADV', '哪里': 'ADV', '了': 'PART'}
DEMO_NER = {'S': 'PER', 'O': 'ORG', 'C': 'LOC'}


def demo_fact(rng):
    return {**{slot: rng.randrange(len(DEMO_WORDS[slot])) for slot in ('first', 'last', 'C', 'O', 'V', 'A', 'N')},
            'D': 0}


DEMO_ROUND_TRIP = {'fact': 'moved', 'moved': 'fact'}  # English -> target -> English comes back reordered
DEMO_SIDES = DEMO_LANGS + ('rt',)


def demo_say(kind, fact, lang):
    """-> (text, words, UPOS tags, NER tags, {slot: (first char, end char)}) of one sentence;
    lang 'rt' is English after a round trip through a target language."""
    if lang == 'rt':
        kind, lang = DEMO_ROUND_TRIP.get(kind, kind), 'en'
    k, sep = DEMO_LANGS.index(lang), '' if lang == 'zh' else ' '
    words, pos, ner, chars = [], [], [], {}
    for slot in DEMO_ORDER[kind][k].split():
        if slot == 'S':
            parts = [DEMO_WORDS['first'][fact['first']][k], DEMO_WORDS['last'][fact['last']][k]]
        elif slot in DEMO_WORDS:
            parts = DEMO_WORDS[slot][fact[slot]][k].split()
        else:
            parts = [slot]
        start = len(sep.join(words) + sep) if words else 0
        chars[slot] = (start, start + len(sep.join(parts)))
        words += parts
        pos += [DEMO_POS.get(slot, 'PUNCT')] * len(parts)
        ner += [f'{"BI"[i > 0]}-{DEMO_NER[slot]}' if slot in DEMO_NER else 'O' for i in range(len(parts))]
    return sep.join(words), words, pos, ner, chars


def demo_examples(task, n, rng):
    """n examples of a task, each {lang: example} in the three languages (translations of each
    other) and 'rt', the English example's round trip."""
    out = []
    for _ in range(n):
        f = demo_fact(rng)
        other = dict(f, N=(f['N'] + 1 + rng.randrange(len(DEMO_WORDS['N']) - 1)) % len(DEMO_WORDS['N']),
                     C=(f['C'] + 1) % len(DEMO_WORDS['C']))
        if task in ('xnli', 'pawsx'):  # the second sentence of each label
            label = rng.choice(TASKS[task].labels)
            second = {'entailment': ('short', f), 'contradiction': ('never', f), 'neutral': ('work', f),
                      '1': ('moved', f), '0': ('moved', other)}[label]
            out.append({l: {'a': demo_say('fact', f, l)[0], 'b': demo_say(*second, l)[0], 'label': label}
                        for l in DEMO_SIDES})
        elif TASKS[task].family == 'tagging':  # CoNLL NER: PAN-X's entities, and a noun, as MISC (a name's word)
            kind = rng.choice(['fact', 'work', 'moved'] + (['short', 'never'] if task == 'udpos' else []))
            said = {l: demo_say(kind, f, l) for l in DEMO_SIDES}
            misc = lambda s: ['B-MISC' if pos == 'NOUN' else tag for pos, tag in zip(s[2], s[3])]
            out.append({l: {'words': s[1], 'tags': {'udpos': s[2], 'panx': s[3]}.get(task) or misc(s)}
                        for l, s in said.items()})
        else:  # QA: a fact about one person and where another works; ask who did it, where, or for whom
            g = dict(demo_fact(rng), first=(f['first'] + 1 + rng.randrange(7)) % 8)
            kind = rng.choice(['who', 'where', 'which'])
            said_first = rng.random() < 0.5
            out.append({l: demo_question(f, g, kind, said_first, l, f'demo-{len(out)}') for l in DEMO_SIDES})
    return out


def demo_question(f, g, kind, said_first, lang, qid):
    """A QA example in lang: a context of the fact f and where g's person works, f's said first or
    second, and a question of `kind`: who did f, where, or for which company g's person works."""
    fact, work = demo_say('fact', f, lang), demo_say('work', g, lang)
    sep = '' if lang == 'zh' else ' '
    first, second = (fact, work) if said_first else (work, fact)
    asked = work if kind == 'which' else fact
    a0, a1 = asked[4]['O' if kind == 'which' else 'S' if kind == 'who' else 'C']
    offset = 0 if asked is first else len(first[0]) + len(sep)
    context = first[0] + sep + second[0]
    return {'id': qid, 'question': demo_say(kind, g if kind == 'which' else f, lang)[0], 'context': context,
            'answers': [{'text': context[offset + a0:offset + a1], 'answer_start': offset + a0}]}


def demo_files(task, split, rows):
    """{path: text} of one task and split (rows: [{lang: example}]) in the layout and shapes of the published files:
    test files without labels (their gold in labels/), classification translations with the label (XNLI's translate-test
    rows have it), tagging translations without tags (XTREME publishes none, FILTER's have none), QA translations with
    their answers; translate-train leaves some English examples out, in another order (demo_translated)."""
    family, files, test = TASKS[task].family, {}, split == 'test'

    def text(exs, labelled=True):  # a file of examples as the readers read it
        if family == 'classification':
            return tsv_text((e['a'], e['b']) + ((e['label'],) if labelled else ()) for e in exs)
        return tagged_text(exs, labelled) if family == 'tagging' else squad_text(exs, blank=not labelled)
    for lang in ['en'] if split == 'train' else DEMO_LANGS:
        exs = [r[lang] for r in rows]
        if split_path('', task, split, lang):
            files[split_path('', task, split, lang)] = text(exs, not test)
        if test:
            files[f'labels/{task}/test-{lang}.{suffix(task)}'] = gold_text(family, exs)
        for other in DEMO_LANGS[1:] if split == 'train' else ['en'] * (lang != 'en'):
            # translations: English -> other for train (with the round trip back), lang -> English otherwise
            if split == 'train':
                files[split_path('', task, 'round-trip', other)] = text([r['rt'] for r in rows])
            trans = [r[other] for r in rows]
            path = split_path('', task, f'translate-{split}', other if split == 'train' else lang)
            pairs = demo_translated(task, other, list(zip(exs, trans))) if split == 'train' else list(zip(exs, trans))
            if family == 'classification':  # the original pair, its translation, the label
                files[path] = tsv_text((o['a'], o['b'], t['a'], t['b'], o['label']) for o, t in pairs)
            elif path and (family == 'tagging' or split != 'dev' or task == 'mlqa'):
                files[path] = text([t for _, t in pairs], family == 'qa')
    return files


def demo_translated(task, lang, pairs):
    """translate-train's (English, translation) pairs as published: but for tagging (aligned sentence by sentence), a
    tenth of the English examples untranslated and the rest shuffled, and PAWS-X's blank translations."""
    rng, family = random.Random(f'{task} {lang}'), TASKS[task].family  # the tasks' own draws stay as they were
    if family == 'tagging':
        return pairs
    kept = [p for p in pairs if rng.random() >= 0.1]
    rng.shuffle(kept)
    if task == 'pawsx':
        kept = [(o, dict(t, b='') if rng.random() < 0.02 else t) for o, t in kept]
    return kept


def gold_text(family, examples):
    """Test labels as the leaderboard's files hold them: a label a line, a tag a line (a blank line
    between sentences), or the answers in SQuAD's format."""
    if family == 'classification':
        return tsv_text((e['label'],) for e in examples)
    if family == 'qa':
        return squad_text(examples)
    return '\n'.join(''.join(t + '\n' for t in e['tags']) for e in examples)


def squad_text(examples, blank=False):
    """A QA file in SQuAD's format, a paragraph a question; blank: the answers blanked, as in test files."""
    qa = lambda e: {'id': e['id'], 'question': e['question'],
                    'answers': [{'text': '', 'answer_start': 0}] if blank else e['answers']}
    data = [{'paragraphs': [{'context': e['context'], 'qas': [qa(e)]}]} for e in examples]
    return json.dumps({'version': 'demo', 'data': data}, ensure_ascii=False)


def tagged_text(examples, tags=True):
    """A tagging file: a word (and its tag) a line, a blank line after each sentence."""
    line = lambda w, t: f'{w}\t{t}\n' if tags else f'{w}\n'
    return '\n'.join(''.join(line(w, t) for w, t in zip(e['words'], e['tags'])) for e in examples)


def demo_retrieval(task, split, rng, n=100):
    """bucc2018: id<TAB>sentence files, most sentences with a translation on the other side (gold
    pairs), some without; tatoeba: aligned sentences, the English side sorted."""
    files = {}
    for lang in DEMO_LANGS[1:]:
        facts = [demo_fact(rng) for _ in range(n)]
        src = [demo_say(rng.choice(['fact', 'work']), f, lang)[0] for f in facts]
        eng = [demo_say('fact', f, 'en')[0] for f in facts]
        stem = split_path('', task, split, lang)
        if task == 'tatoeba':
            order = sorted(range(n), key=lambda i: eng[i])
            files[f'{stem}.{lang}'] = ''.join(s + '\n' for s in src)
            files[f'{stem}.en'] = ''.join(eng[i] + '\n' for i in order)
            files[f'labels/{task}/test-{lang}.tsv'] = ''.join(f'{i}\n' for i in order)
            continue
        kept = [i for i in range(n) if i % 5]  # every fifth English sentence is missing: no pair
        files[f'{stem}.{lang}'] = ''.join(f'{lang}-{i:06d}\t{s}\n' for i, s in enumerate(src))
        files[f'{stem}.en'] = ''.join(f'en-{i:06d}\t{eng[i]}\n' for i in kept)
        gold = ''.join(f'{lang}-{i:06d}\ten-{i:06d}\n' for i in kept)
        files[f'{stem}.gold' if split == 'dev' else f'labels/{task}/test-{lang}.tsv'] = gold
    return files


def demo_pretraining(rng, n_docs=300, n_parallel=1500):
    """VECO's pre-training text in the layout above: in each language, documents of 4 to 8
    sentences about one person; parallel sentences for every pair of languages."""
    files = {}
    for lang in DEMO_LANGS:
        docs = []
        for _ in range(n_docs):
            person = demo_fact(rng)
            facts = [dict(demo_fact(rng), first=person['first'], last=person['last']) for _ in range(rng.randint(4, 8))]
            docs.append(''.join(demo_say(rng.choice(list(DEMO_ORDER)), f, lang)[0] + '\n' for f in facts))
        files[f'pretrain/mono/{lang}.txt'] = '\n'.join(docs)
    for i, a in enumerate(DEMO_LANGS):
        for b in DEMO_LANGS[i + 1:]:
            files.update(demo_parallel(rng, n_parallel, f'pretrain/parallel/{a}-{b}', (a, b)))
    return files


def demo_parallel(rng, n, stem, langs):
    """{stem.lang: text} of n sentences of every kind, one a line, said in each of langs (line by line translations)."""
    said = [(rng.choice(list(DEMO_ORDER)), demo_fact(rng)) for _ in range(n)]
    return {f'{stem}.{lang}': ''.join(demo_say(k, f, lang)[0] + '\n' for k, f in said) for lang in langs}


def demo_vocab(sentences, text):
    """The demo's WordPiece vocab.txt in BERT's layout: [PAD] at 0, [UNK] [CLS] [SEP] [MASK] at 100-103 (unused
    slots between), then every character of the demo's files alone and inside a word, then the sentences' words."""
    chars = sorted(set(text) - set(' \t\n'))
    words = {w for s in sentences for w in s.split() if len(w) > 1 and all(char_kind(c) == IN_WORD for c in w)}
    lines = ['[PAD]'] + [f'[unused{i}]' for i in range(99)] + ['[UNK]', '[CLS]', '[SEP]', '[MASK]']
    lines += chars + ['##' + c for c in chars if char_kind(c) == IN_WORD] + sorted(words)
    return ''.join(line + '\n' for line in lines)


def demo_spm(sentences, prefix):
    """The demo's sentencepiece model, a unigram model as XLM-R's, of 600 pieces, seeded with every piece of 2 to 8
    characters of the words, counted: on the demo's few hundred distinct words sentencepiece's own seeding keeps hardly
    more than the characters, and pieces of its default 16 characters would be phrases of the toy Chinese, which has no
    spaces, seen in these sentences alone (its other sentences then read a character at a time)."""
    counts = {}
    for word in (f'\u2581{w}' for sentence in sentences for w in sentence.split()):
        for piece in (word[i:j] for i in range(len(word)) for j in range(i + 2, min(len(word), i + 8) + 1)):
            counts[piece] = counts.get(piece, 0) + 1
    with tempfile.NamedTemporaryFile('w', encoding='utf-8', suffix='.tsv', delete=False) as f:
        f.writelines(f'{piece}\t{n}\n' for piece, n in counts.items())
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=prefix, vocab_size=600,
                                       model_type='unigram', hard_vocab_limit=False, character_coverage=1.0,
                                       seed_sentencepieces_file=f.name, max_sentencepiece_length=8, minloglevel=2,
                                       num_threads=1)
    finally:
        os.remove(f.name)


def make_demo(out_dir, seed=0, n_train=1000, n_eval=150):
    """Write the demo data of every task, a vocab.txt and a sentencepiece model of it, and last the marker demo.json."""
    rng, files = random.Random(seed), {}
    for task in XTREME:
        if task in ('bucc2018', 'tatoeba'):
            for split in ('dev', 'test') if task == 'bucc2018' else ('test',):
                files.update(demo_retrieval(task, split, rng))
            continue
        for split, n in (('train', n_train), ('dev', n_eval), ('test', n_eval)):
            files.update(demo_files(task, split, demo_examples(task, n, rng)))
    files.update(demo_pretraining(random.Random(seed + 1)))  # their own draws: the tasks' data stay as they were
    rng_translation = random.Random(seed + 2)  # VECO's translation task: English -> toy German
    for split, n in (('train', 3 * n_train), ('valid', n_eval), ('test', n_eval)):
        files.update(demo_parallel(rng_translation, n, f'translation/en-de/{split}', ('en', 'de')))
    rng_target = random.Random(seed + 3)  # the target languages' own tagged training text (XLA's unlabelled data)
    for task in ('panx', 'udpos', 'conll'):
        if task == 'conll':  # a task of its own draws, so that XTREME's stay as they were
            rng_target = random.Random(seed + 5)
            for split, n in (('train', n_train), ('dev', n_eval), ('test', n_eval)):
                files.update(demo_files(task, split, demo_examples(task, n, rng_target)))
        rows = demo_examples(task, n_train, rng_target)
        for lang in DEMO_LANGS[1:]:
            files[split_path('', task, 'train', lang)] = tagged_text([r[lang] for r in rows])
    rows = demo_examples('tydiqa', n_train, random.Random(seed + 4))  # TyDiQA's questions in each language
    for lang in DEMO_LANGS[1:]:
        files[split_path('', 'tydiqa', 'train', lang)] = squad_text([r[lang] for r in rows])
    for path, text in files.items():
        atomic_write(os.path.join(out_dir, path), text)
    sentences = [demo_say(kind, demo_fact(rng), lang)[0] for kind in DEMO_ORDER for lang in DEMO_LANGS
                 for _ in range(100)]
    atomic_write(os.path.join(out_dir, 'vocab.txt'), demo_vocab(sentences, ''.join(files.values())))
    demo_spm(sentences, os.path.join(out_dir, 'sentencepiece.bpe'))
    marker = {'languages': DEMO_LANGS, 'seed': seed, 'version': DEMO_VERSION}
    atomic_write(os.path.join(out_dir, 'demo.json'), json.dumps(marker))
    return out_dir


# ----------------------------------------------------------------------------------------
# Download from the official sources (the files XTREME's scripts/download_data.sh fetches),
# converted to the layout above. Test labels that are public go to labels/<task>/.

SQUAD = 'https://raw.githubusercontent.com/rajpurkar/SQuAD-explorer/master/dataset/'
SOURCES = {
    'xnli': ['https://dl.fbaipublicfiles.com/XNLI/XNLI-1.0.zip', 'https://dl.fbaipublicfiles.com/XNLI/XNLI-MT-1.0.zip'],
    'pawsx': ['https://storage.googleapis.com/paws/pawsx/x-final.tar.gz'],
    'udpos': ['https://lindat.mff.cuni.cz/repository/xmlui/bitstream/handle/11234/1-3105/ud-treebanks-v2.5.tgz'],
    'xquad': [SQUAD + 'train-v1.1.json', SQUAD + 'dev-v1.1.json'] + [
        f'https://raw.githubusercontent.com/deepmind/xquad/master/xquad.{lang}.json' for lang in TASKS['xquad'].langs],
    'mlqa': [SQUAD + 'train-v1.1.json', SQUAD + 'dev-v1.1.json', 'https://dl.fbaipublicfiles.com/MLQA/MLQA_V1.zip'],
    'tydiqa': ['https://storage.googleapis.com/tydiqa/v1.1/tydiqa-goldp-v1.1-train.json',
               'https://storage.googleapis.com/tydiqa/v1.1/tydiqa-goldp-v1.1-dev.tgz'],
    'bucc2018': [f'https://comparable.limsi.fr/bucc2018/bucc2018-{lang}-en.{part}-gold.tar.bz2'
                 for lang in TASKS['bucc2018'].langs for part in ('sample', 'training')],
    'tatoeba': ['https://github.com/facebookresearch/LASER/archive/main.zip'],
}
TATOEBA_ISO3 = {'ar': 'ara', 'he': 'heb', 'vi': 'vie', 'id': 'ind', 'jv': 'jav', 'tl': 'tgl', 'eu': 'eus', 'ml': 'mal',
                'ta': 'tam', 'te': 'tel', 'af': 'afr', 'nl': 'nld', 'de': 'deu', 'el': 'ell', 'bn': 'ben', 'hi': 'hin',
                'mr': 'mar', 'ur': 'urd', 'fa': 'pes', 'fr': 'fra', 'it': 'ita', 'pt': 'por', 'es': 'spa', 'bg': 'bul',
                'ru': 'rus', 'ja': 'jpn', 'ka': 'kat', 'ko': 'kor', 'th': 'tha', 'sw': 'swh', 'zh': 'cmn', 'kk': 'kaz',
                'tr': 'tur', 'et': 'est', 'fi': 'fin', 'hu': 'hun'}


def fetch(url, folder, fix='without network, download on a machine that has it and copy the folder here'):
    """Download url into folder (kept if already there) and unpack archives; -> the local path."""
    path = os.path.join(folder, urllib.parse.unquote(url.rsplit('/', 1)[1]))
    if not os.path.exists(path):
        print(f'downloading {url}')
        os.makedirs(folder, exist_ok=True)
        try:
            with urllib.request.urlopen(url, timeout=30) as r, open(path + '.part', 'wb') as f:
                shutil.copyfileobj(r, f)
            os.replace(path + '.part', path)
        except OSError as e:
            raise DataError(f'cannot download {url} ({getattr(e, "reason", e)}): {fix}')
        finally:  # a failed or interrupted download leaves no part file
            if os.path.exists(path + '.part'):
                os.remove(path + '.part')
    if path.endswith(('.zip', '.tar.gz', '.tgz', '.tar.bz2')):
        shutil.unpack_archive(path, os.path.join(folder, 'raw'))
    return path


# XTREME's translations: a public bucket, read over HTTPS (its JSON listing, then each object) as gsutil would copy
# it; a bucket folder's translate-* folders go under the task's own folder of the layout.
STORAGE = 'https://storage.googleapis.com'  # Cloud Storage's public endpoint
TRANSLATED = {'xnli': {'XNLI': 'xnli'}, 'pawsx': {'PAWSX': 'pawsx'}, 'xquad': {'SQuAD': 'squad', 'XQuAD': 'xquad'},
              'mlqa': {'SQuAD': 'squad', 'MLQA': 'mlqa'}, 'tydiqa': {'TyDiQA-GoldP': 'tydiqa'}}


def bucket_objects(prefix):
    """Names of the objects under prefix in XTREME's bucket, every page of the listing."""
    names, page = [], ''
    while page is not None:
        url = f'{STORAGE}/storage/v1/b/xtreme_translations/o?prefix={urllib.parse.quote(prefix)}{page}'
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                listing = json.load(r)
        except (OSError, ValueError) as e:
            raise DataError(f'cannot list gs://xtreme_translations/{prefix} ({getattr(e, "reason", e)}): without '
                            f'network, gsutil -m cp -r gs://xtreme_translations/{prefix} . on a machine that has it')
        names += [item['name'] for item in listing.get('items', [])]
        token = listing.get('nextPageToken')
        page = token and f'&pageToken={urllib.parse.quote(token)}'
    return names


def download_translations(task, out):
    """XTREME's published translate-train, translate-dev and translate-test files of task into the layout, and its
    pseudo test sets (XNLI's and XQuAD's English test set translated into the other languages, its README says:
    a bucket folder of 'pseudo' in its name, a file a language) as pseudo-test files."""
    if task not in TRANSLATED:
        raise DataError(f'XTREME publishes no translations of {task} (only of {", ".join(TRANSLATED)}): drop '
                        '--translations')
    for folder, ours in TRANSLATED[task].items():
        for name in bucket_objects(folder + '/'):
            parts = name.split('/')
            pseudo = len(parts) == 3 and 'pseudo' in parts[1].lower() and task in ('xnli', 'xquad') and ours == task
            if not (len(parts) == 3 and parts[2] and (parts[1].startswith('translate-') or pseudo)):
                continue  # the bucket's other files
            fix = (f'get it with gsutil cp gs://xtreme_translations/{name} {os.path.join(out, ours, parts[1])}/ '
                   '(or run this again: what was fetched is kept)')
            path = fetch(f'{STORAGE}/xtreme_translations/{urllib.parse.quote(name)}', os.path.join(out, ours, parts[1]),
                         fix)
            if pseudo:
                pseudo_test(task, out, path)
    print(f'XTREME\'s translations of {task} are in {out}')


def pseudo_test(task, out, path):
    """A pseudo test file of XTREME's bucket into the layout: the language its name gives (en-{lang}, or .{lang}.),
    XNLI's rows (premise, hypothesis, label, as its processor's get_pseudo_test_examples reads them) checked."""
    name = os.path.basename(path)
    found = re.search(r'en-([a-z]{2})\b', name) or re.search(r'\.([a-z]{2})\.json$', name)
    if not found or found.group(1) not in TASKS[task].langs:
        return warn(f'{path}: no language of {task} in its name: not read as a pseudo test set')
    target = split_path(out, task, 'pseudo-test', found.group(1))
    if task == 'xquad':
        return atomic_write(target, read_text(path))
    rows = [line.split('\t') for line in read_lines(path) if line.strip()]
    bad = next((n for n, r in enumerate(rows, 1) if len(r) < 3), None)
    if bad:
        raise DataError(f'{path}, line {bad}: expected premise, hypothesis and label, tab-separated')
    atomic_write(target, tsv_text([r[0], r[1], XNLI_SPELLING.get(r[2].strip(), r[2].strip())] for r in rows))


def tsv_text(rows):
    out = io.StringIO()
    csv.writer(out, delimiter='\t', lineterminator='\n').writerows(rows)
    return out.getvalue()


def convert_pairs(task, out, split, lang, rows):
    """rows of (a, b, label) -> the split file; test labels also to labels/."""
    kept = (r[:2] if split == 'test' else r for r in rows)  # test files carry no label
    atomic_write(os.path.join(out, task, f'{split}-{lang}.tsv'), tsv_text(kept))
    if split == 'test':
        atomic_write(os.path.join(out, 'labels', task, f'test-{lang}.tsv'), ''.join(r[2] + '\n' for r in rows))


def panx_rows(raw):
    """One PAN-X file ('lang:word<TAB>TAG' lines) -> [(word, tag), or None for a sentence's end] as XTREME's
    panx_preprocess reads it: the word after its first ':' (a line without one is dropped), any line not of two
    columns a sentence's end, a last blank line dropped. An empty word is dropped too: XTREME writes it as an empty
    line in a test file, which would cut its sentence in two there and not in the tags."""
    lines = io.TextIOWrapper(io.BytesIO(raw), encoding='utf-8').readlines()  # its lines as open().readlines() splits
    rows = []
    for line in lines[:-1] if lines and not lines[-1].strip() else lines:
        items = line.strip().split('\t')
        word = items[0].partition(':')[2].strip()
        if len(items) != 2:
            rows.append(None)
        elif word:  # after the first ':': none without one
            rows.append((word, items[1].strip()))
    return rows


def panx_archives(source):
    """-> {lang: a function reading the bytes of its {lang}.tar.gz} for XTREME's PAN-X languages (40 of Pan et al.'s
    282) in AmazonPhotos.zip, its panx_dataset folder or one {lang}.tar.gz, read one at a time."""
    import zipfile
    lang_of = lambda name: os.path.basename(name)[:-len('.tar.gz')]
    read = lambda path: lambda: open(path, 'rb').read()
    if os.path.isdir(source):
        found = {lang_of(p): read(p) for p in glob_files(source, '*.tar.gz') if lang_of(p) in TASKS['panx'].langs}
    elif zipfile.is_zipfile(source):
        try:
            z = zipfile.ZipFile(source)  # open while the archives are read
        except zipfile.BadZipFile as e:
            raise DataError(f'{source} is damaged ({e}): download AmazonPhotos.zip again') from None
        found = {lang_of(n): functools.partial(z.read, n) for n in z.namelist() if lang_of(n) in TASKS['panx'].langs
                 and n.endswith('.tar.gz')}
    elif os.path.isfile(source) and source.endswith('.tar.gz') and lang_of(source) in TASKS['panx'].langs:
        found = {lang_of(source): read(source)}
    else:
        raise DataError(f'{source} is not AmazonPhotos.zip, its panx_dataset folder or a {{lang}}.tar.gz: pass one '
                        'of these to --from')
    if not found:
        raise DataError(f'{source} holds no {{lang}}.tar.gz of XTREME\'s PAN-X languages: pass AmazonPhotos.zip, '
                        'its panx_dataset folder or one of its archives to --from')
    return found


def convert_panx(source, out):
    """PAN-X archives -> panx/{split}-{lang}.tsv as XTREME writes them (test files: the words alone, their tags in
    labels/panx/); each {lang}.tar.gz holds the files train, dev and test."""
    import tarfile
    import zipfile
    for lang, read in sorted(panx_archives(source).items()):
        try:
            with tarfile.open(fileobj=io.BytesIO(read())) as tar:
                files = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
                rows = {split: panx_rows(tar.extractfile(files[split]).read()) for split in ('train', 'dev', 'test')}
        except (tarfile.TarError, KeyError, EOFError, UnicodeDecodeError, zlib.error, zipfile.BadZipFile) as e:
            raise DataError(f'{lang}.tar.gz in {source} is not PAN-X\'s (a gzipped tar of train, dev and test in '
                            f'UTF-8: {e}); use the archive as AmazonPhotos.zip ships it') from None
        for split, split_rows in rows.items():
            write_tagged(out, 'panx', split, lang, split_rows)
        print(f'panx: {lang} converted')


# CoNLL NER as the released UXLA code (sbmaruf/UXLA ae1c3c0) reads it: utils_ner.py's read_examples_from_file (the
# word first, the tag last, -DOCSTART- a sentence's end), after convert_iob1_to_iob2.py's update_tag_scheme.
CONLL_STEMS = {'eng': 'en', 'esp': 'es', 'ned': 'nl', 'deu': 'de', 'ara': 'ar', 'fin': 'fi'}  # CoNLL's file names
CONLL_SPLITS = {'train': 'train', 'testa': 'dev', 'testb': 'test'}


def iob2(tags):
    """IOB1 -> IOB2 as UXLA's iob2: an I- tag beginning an entity (first, after O or another type) becomes B-."""
    return ['B' + tag[1:] if tag.startswith('I-') and (before is None or before[2:] != tag[2:]) else tag
            for before, tag in zip([None] + tags, tags)]


def conll_rows(path):
    """A CoNLL-2002/2003 column file -> rows [(word, IOB2 tag), or None for a sentence's end]; UTF-8, else Latin-1
    (CoNLL's original German, Spanish and Dutch files); a tag outside the task's stops in one line."""
    raw = open(path, 'rb').read()
    try:
        text = raw.decode('utf-8-sig')
    except UnicodeDecodeError:
        text = raw.decode('latin-1')
    rows, lines = [], enumerate(text.replace('\r\n', '\n').split('\n'), 1)
    for sentence in runs(lines, lambda numbered: not numbered[1].split() or numbered[1].startswith('-DOCSTART-')):
        words = [(n, line.split()) for n, line in sentence]  # a word alone, or tagged X (UXLA's own samples), is O
        tags = iob2([cols[-1] if len(cols) > 1 and cols[-1] != 'X' else 'O' for _, cols in words])
        rows += [(cols[0], check_label('conll', tag, path, n)) for (n, cols), tag in zip(words, tags)] + [None]
    return rows[:-1]


def convert_conll(source, out):
    """The CoNLL NER files under the folder source ({stem}.{train,testa,testb}, the stem CoNLL's eng, esp, ned, deu
    or a language's code, ara and fin too; UXLA's .iob2 copies as well) -> conll/{split}-{lang}.tsv, testa the dev
    set and testb the test set, the test tags in labels/conll/."""
    stems = {**CONLL_STEMS, **{lang: lang for lang in TASKS['conll'].langs}}
    found = {}
    for path in glob_files(source, '*') if os.path.isdir(source) else ():
        stem, _, split = os.path.basename(path).removesuffix('.iob2').partition('.')
        if stem in stems and split in CONLL_SPLITS:
            found[stems[stem], CONLL_SPLITS[split]] = path
    if not found:
        raise DataError(f'{source} holds no CoNLL NER files (eng.train, esp.testa, ned.testb, deu.train, or en.train, '
                        '... ar.testb): pass the folder that holds them to --from')
    for (lang, split), path in sorted(found.items()):
        write_tagged(out, 'conll', split, lang, conll_rows(path))
    print(f'conll: {", ".join(f"{lang} {split}" for lang, split in sorted(found))} converted')


def write_tagged(out, task, split, lang, rows):
    """rows [(word, tag), or None for a sentence's end] -> the split's file; a test file's tags go to labels/. Blank
    lines in a row are one, as the readers of a test file and of its tags would count them apart."""
    rows = [r for n, r in enumerate(rows) if r is not None or 0 < n < len(rows) - 1 and rows[n + 1] is not None]
    text = lambda cell: ''.join('\n' if r is None else cell(*r) + '\n' for r in rows)
    atomic_write(split_path(out, task, split, lang), text(lambda w, t: w if split == 'test' else f'{w}\t{t}'))
    if split == 'test':
        atomic_write(os.path.join(out, 'labels', task, f'test-{lang}.tsv'), text(lambda w, t: t))


def download(task, out, sources=(), translations=None, rest=False):
    """Fetch a task from its official sources (PAN-X, CoNLL: convert the archive the user holds, sources; UD's
    archive too; translations: 'xtreme', 'filter' or 'xmixup', those translations of it instead) and write it in the
    layout this package reads; rest: then what every method of the task reads (the_rest)."""
    if translations:
        convert = {'filter': download_filter, 'xmixup': download_xmixup}.get(translations)
        return convert(task, out, sources) if convert else download_translations(task, out)
    if task in HELD or sources and task != 'udpos':
        convert_held(task, sources[0] if sources else None, out)
        return the_rest(task, out, fetch=False)
    raw = os.path.join(out, 'downloads', task)
    made = [p for p in (out, os.path.dirname(raw), raw) if not os.path.exists(p)]
    os.makedirs(raw, exist_ok=True)
    try:
        if sources:  # ud-treebanks-v2.5.tgz, held
            unpack(sources[0], raw, 'ud-treebanks-v2.5.tgz or its folder')
        files = [] if sources else [fetch(url, raw) for url in SOURCES[task]]
    except DataError:
        for folder in reversed(made):  # a failed download leaves no empty folders behind
            if not os.listdir(folder):
                os.rmdir(folder)
        raise
    unpacked = os.path.join(raw, 'raw')
    rows_of = lambda path: list(csv.reader(open(path, encoding='utf-8'), delimiter='\t', quoting=csv.QUOTE_NONE))[1:]
    if task == 'xnli':
        train = rows_of(os.path.join(unpacked, 'XNLI-MT-1.0', 'multinli', 'multinli.train.en.tsv'))
        convert_pairs(task, out, 'train', 'en', [(a, b, XNLI_SPELLING.get(c, c)) for a, b, c in train])
        for split in ('dev', 'test'):
            rows = rows_of(os.path.join(unpacked, 'XNLI-1.0', f'xnli.{split}.tsv'))
            for lang in TASKS[task].langs:
                convert_pairs(task, out, split, lang, [(r[6], r[7], r[1]) for r in rows if r[0] == lang])
    elif task == 'pawsx':
        for lang in TASKS[task].langs:
            for split, name in (('train', 'train'), ('dev', 'dev_2k'), ('test', 'test_2k')):
                if split != 'train' or lang == 'en':
                    rows = rows_of(os.path.join(unpacked, 'x-final', lang, f'{name}.tsv'))
                    convert_pairs(task, out, split, lang, [(r[1], r[2], r[3]) for r in rows if len(r) == 4])
    elif task == 'udpos':
        convert_ud(glob_files(unpacked, '*.conllu'), out)
    elif task in ('xquad', 'mlqa', 'tydiqa'):
        convert_qa(task, files, unpacked, out)
    elif task == 'bucc2018':
        for path in glob_files(unpacked, '*-en.*'):  # {lg}-en.{sample|training}.{lg|en|gold}
            name = os.path.basename(path).replace('.sample.', '.dev.').replace('.training.', '.test.')
            target = (os.path.join(out, 'labels', task, f'test-{name[:2]}.tsv') if name.endswith('test.gold')
                      else os.path.join(out, task, name))
            atomic_write(target, open(path, encoding='utf-8').read())
    else:  # tatoeba: LASER's aligned files; the English side sorted, as XTREME does
        for lang, iso in TATOEBA_ISO3.items():
            stem = glob_files(unpacked, f'tatoeba.{iso}-eng.{iso}')[0][:-len(iso) - 1]
            src, eng = list(read_lines(f'{stem}.{iso}')), list(read_lines(f'{stem}.eng'))
            order = sorted(range(len(eng)), key=lambda i: eng[i])
            atomic_write(os.path.join(out, task, f'{lang}-en.{lang}'), ''.join(s + '\n' for s in src))
            atomic_write(os.path.join(out, task, f'{lang}-en.en'), ''.join(eng[i] + '\n' for i in order))
            atomic_write(os.path.join(out, 'labels', task, f'test-{lang}.tsv'), ''.join(f'{i}\n' for i in order))
    print(f'{task} is ready in {out}')
    the_rest(task, out, fetch=rest)


def the_rest(task, out, fetch=True):
    """What the methods of task read besides it: XTREME's translations and pseudo test sets and FILTER's data, fetched
    now (fetch) or else a line of what to run; X-Mixup's data (a Google Drive folder), that line alone."""
    for what, name, get in (('XTREME\'s translations', 'xtreme', download_translations),
                            ('FILTER\'s data', 'filter', download_filter)):
        if task not in (TRANSLATED if name == 'xtreme' else FILTER_URLS):
            continue
        command = f'python data.py download --task {task} --translations {name} --out {out}'
        if not fetch:
            print(f'{what} of {task}: {command}')
            continue
        try:
            get(task, out)
        except DataError as e:
            print(f'{what} of {task} not fetched ({e}): {command}')
    if task in FILTER_URLS:  # X-Mixup ran on the tasks FILTER did
        print(f'X-Mixup\'s data of {task}: download the folder its README\'s Step 2 gives, then python data.py '
              f'download --task {task} --translations xmixup --from FOLDER --out {out}')


# FILTER's data as its download_data.sh gathers it (yuwfan/FILTER 6dac390): the datasets' own translations of the
# training sets (XNLI-MT-1.0, PAWS-X's translated_train.tsv) and its own archives (its Microsoft Translator
# translations of every test set; of POS and NER training data too), made into a data folder of their own beside
# XTREME's, OUT/filter, which train.py --method filter reads: its translations, and links to the rest of OUT.
FILTER_ARCHIVES = 'https://convaisharables.blob.core.windows.net/filter/data/translations/{task}.zip'
FILTER_URLS = {'xnli': [SOURCES['xnli'][1], FILTER_ARCHIVES], 'pawsx': [SOURCES['pawsx'][0], FILTER_ARCHIVES],
               'udpos': [FILTER_ARCHIVES], 'panx': [FILTER_ARCHIVES], 'tydiqa': [FILTER_ARCHIVES], 'xquad': [],
               'mlqa': []}  # XQuAD and MLQA: the benchmarks' own English


def download_filter(task, out, sources=()):
    """OUT/filter, a data folder: FILTER's translations of task (from the archives or folders in sources, else
    downloaded), everything else of task and OUT linked (XTREME's QA translate-train among it, which FILTER read)."""
    if task not in FILTER_URLS:
        raise DataError(f'FILTER has no data of {task} (its runners read {", ".join(FILTER_URLS)}): '
                        'drop --translations')
    if not os.path.isdir(os.path.join(out, task)) or task in ('xquad', 'mlqa') and not os.path.isdir(out + '/squad'):
        raise DataError(f'{out} has no {task} data to pair FILTER\'s translations with: first python data.py '
                        f'download --task {task} --out {out}')
    raw = os.path.join(out, 'downloads', 'filter', task)
    if sources:  # what other archives left unpacked there is not read
        shutil.rmtree(os.path.join(raw, 'raw'), ignore_errors=True)
    for source in sources:
        unpack(source, raw, 'XNLI-MT-1.0.zip, x-final.tar.gz or FILTER\'s <task>.zip, or their folders')
    for url in [] if sources else FILTER_URLS[task]:
        fetch(url.format(task=task), raw)  # unpacked into raw/raw
    files = filter_translations(task, out, os.path.join(raw, 'raw'))
    translations_folder(out, 'filter', {os.path.join(task, name): text for name, text in files.items()})
    print(f'FILTER\'s translations of {task} are in {os.path.join(out, "filter")}: train.py --method filter reads them')


def translations_folder(out, name, files):
    """OUT/name, a data folder of a release's own files ({path: text}, paths in the layout), each task folder they
    touch made whole before it replaces the last one, the rest of that folder and every other entry of OUT linked
    (the links are made now: a task downloaded into OUT later is linked by the next conversion)."""
    for task in sorted({path.split(os.sep)[0] for path in files}):
        ours, tmp = os.path.join(out, name, task), os.path.join(out, name, task + '.part')
        shutil.rmtree(tmp, ignore_errors=True)
        for path in (p for p in files if p.split(os.sep)[0] == task):
            atomic_write(os.path.join(out, name, path.replace(task, task + '.part', 1)), files[path])
        theirs = os.path.join(out, task)
        for entry in (e for e in os.listdir(theirs) if not os.path.exists(os.path.join(tmp, e))):
            link(os.path.join(theirs, entry), os.path.join(tmp, entry))  # the rest of the task's folder: XTREME's
        if os.path.islink(ours):  # linked by another task's conversion
            os.remove(ours)
        shutil.rmtree(ours, ignore_errors=True)
        os.replace(tmp, ours)
    for entry in sorted(set(os.listdir(out)) - {'filter', 'xmixup', 'downloads', '.cache'}):
        if not os.path.lexists(os.path.join(out, name, entry)):  # the other tasks, labels/, the tokenizer's files
            link(os.path.join(out, entry), os.path.join(out, name, entry))


def link(target, at):
    """A relative symbolic link at `at` to target: the data folder can move."""
    os.symlink(os.path.relpath(target, os.path.dirname(at)), at)


def unpack(source, raw, what):
    """An archive (zip, tar) unpacked into raw/raw, a folder linked there; what: the sources expected."""
    if not os.path.exists(source):
        raise DataError(f'{source} not found: give {what}')
    os.makedirs(os.path.join(raw, 'raw'), exist_ok=True)
    if os.path.isdir(source):
        at = os.path.join(raw, 'raw', os.path.basename(os.path.normpath(source)))
        if not os.path.lexists(at):
            link(os.path.abspath(source), at)
    else:
        shutil.unpack_archive(source, os.path.join(raw, 'raw'))


def filter_translations(task, out, unpacked):
    """{file of the task's folder in the layout: its text}: FILTER's translations of task."""
    family = TASKS[task].family
    files = xnli_mt(unpacked) if task == 'xnli' else pawsx_translated(unpacked) if task == 'pawsx' else {}
    for lang in (lang for lang in TASKS[task].langs if lang != 'en') if task not in ('xquad', 'mlqa') else ():
        for split in ('train', 'dev', 'test') if family == 'tagging' else ('dev', 'test'):
            name, target = archive_name(task, split, lang), split_path('', task, f'translate-{split}', lang)
            skipped = task == 'udpos' and split == 'train' and lang in ('ja', 'th', 'zh')  # run_xtag.py leaves them
            found = glob_files(unpacked, name) if name and not skipped else []
            if found:
                files[os.path.relpath(target, task)] = filter_file(task, out, split, lang, found[0])
            elif split != 'train' and family != 'qa' and os.path.exists(split_path(out, task, split, lang)):
                files[os.path.relpath(target, task)] = untranslated(task, out, split, lang)
    if task in ('xquad', 'mlqa'):  # FILTER pairs each question with the benchmark's own English one, by id
        files.update({os.path.relpath(name, task): text for name, text in english_originals(task, out).items()})
    if not files:
        raise DataError(f'no FILTER translations of {task} in {unpacked}: give its archive ({task}.zip) with --from')
    return files


def english_originals(task, out):
    """XQuAD's and MLQA's translate-dev and -test files as FILTER's and X-Mixup's runners pair them: each question with
    the benchmark's own English one (its file, which they align by question id)."""
    files = {}
    for split in ('dev', 'test') if task == 'mlqa' else ('test',):
        english = read_text(split_path(out, task, split, 'en'))  # read once, every language's translation
        for lang in (lang for lang in TASKS[task].langs if lang != 'en'):
            files[split_path('', task, f'translate-{split}', lang)] = english
    return files


def archive_name(task, split, lang):
    """The file of FILTER's archive that translates lang's split, as its runners name it (None: none)."""
    family = TASKS[task].family
    if family == 'tagging':
        return f'train-en-{lang}.tsv' if split == 'train' else f'{split}-{lang}-en.tsv'
    if family == 'qa':
        return f'tydiqa.translate.test.{lang}-en.json' if split == 'test' else None
    return f'xtreme.msft.{lang}-en.{split}'


def untranslated(task, out, split, lang):
    """A split FILTER left untranslated (eu, jv, ka, my, tl, yo): its runners pair each input with itself."""
    originals = read_split(out, task, split, lang)
    if TASKS[task].family == 'tagging':
        return '\n'.join(''.join(word + '\n' for word in ex['words']) for ex in originals)
    return ''.join('\t'.join([ex['a'], ex['b']] * 2 + [ex['label']] * bool(ex['label'])) + '\n' for ex in originals)


def xnli_mt(unpacked):
    """XNLI-MT-1.0's multinli.train.{lang}.tsv, line i translating line i of multinli.train.en.tsv (a header
    premise, hypo, label; 'contradictory' for contradiction) -> translate-train files."""
    rows = {lang: mt_rows(unpacked, f'multinli.train.{lang}.tsv', ['premise', 'hypo', 'label'])
            for lang in TASKS['xnli'].langs}
    return {f'translate-train/en-{lang}-translated.tsv': line_aligned(rows['en'], rows[lang], lang)
            for lang in TASKS['xnli'].langs if lang != 'en'}


PAWSX_HEADER = ['id', 'sentence1', 'sentence2', 'label']  # the header of PAWS-X's train.tsv and translated_train.tsv


def pawsx_translated(unpacked):
    """PAWS-X's {lang}/translated_train.tsv (a header id, sentence1, sentence2, label), each row the translation of
    the English train.tsv row of its id -> translate-train files."""
    english = {r[0]: r for r in mt_rows(unpacked, os.path.join('en', 'train.tsv'), PAWSX_HEADER)}
    files = {}
    for lang in (lang for lang in TASKS['pawsx'].langs if lang != 'en'):
        rows = mt_rows(unpacked, os.path.join(lang, 'translated_train.tsv'), PAWSX_HEADER)
        pairs = [(english[r[0]][1:3], r[1:3], r[3]) for r in rows if r[0] in english]
        files[f'translate-train/en-{lang}-translated.tsv'] = ''.join('\t'.join([*a, *b, label]) + '\n'
                                                                      for a, b, label in pairs)
    return files


def mt_rows(unpacked, name, header):
    """The rows of the one file under unpacked named name, its header checked and dropped."""
    found = glob_files(unpacked, name)
    if not found:
        raise DataError(f'{name} not found in {unpacked}: give the archive or folder that holds it with --from')
    rows = [line.split('\t') for line in read_lines(found[0])]
    if not rows or [c.strip() for c in rows[0]] != header:
        raise DataError(f'{found[0]} does not begin with the header {" ".join(header)}: not the released file')
    bad = next((n for n, r in enumerate(rows, 1) if len(r) != len(header)), None)
    if bad:
        raise DataError(f'{found[0]}, line {bad}: {len(rows[bad - 1])} columns, expected {len(header)}')
    return rows[1:]


def line_aligned(english, translated, lang):
    """XNLI-MT's translation file text: each English row with the row of the same line of translated."""
    if len(english) != len(translated):
        raise DataError(f'the {lang} translations have {len(translated)} rows for {len(english)} English ones: '
                        'they must be aligned line by line')
    return ''.join('\t'.join([*e[:2], *t[:2], XNLI_SPELLING.get(e[2], e[2])]) + '\n'
                   for e, t in zip(english, translated))


def filter_file(task, out, split, lang, path):
    """One of FILTER's archive files in the layout, aligned with OUT's original split: XNLI's and PAWS-X's
    xtreme.msft.{lang}-en.{dev,test} (a b [label]; PAWS-X: a header, id a b label) in the split's order; tagging's
    sentences a line, split at spaces (an empty line: the original's words); TyDiQA's translate-test JSON as it is."""
    family = TASKS[task].family
    if family == 'qa':
        return read_text(path)
    originals = read_split(out, task, 'train' if split == 'train' else split, 'en' if split == 'train' else lang)
    lines = list(read_lines(path))[task == 'pawsx':]
    if len(lines) != len(originals):
        raise DataError(f'{path} has {len(lines)} lines for the {len(originals)} examples of {task} {split} '
                        f'{"en" if split == "train" else lang} in {out}: they must be aligned line by line')
    if family == 'tagging':
        words = [line.split() if line.strip() else ex['words'] for line, ex in zip(lines, originals)]
        return '\n'.join(''.join(word + '\n' for word in sentence) for sentence in words)
    cols = [line.split('\t')[1:3] if task == 'pawsx' else line.split('\t')[:2] for line in lines]
    return ''.join('\t'.join([ex['a'], ex['b'], *c] + [ex['label']] * bool(ex['label'])) + '\n'
                   for ex, c in zip(originals, cols))


# X-Mixup's data as its README's "Step 2" gives it (yhy1117/X-Mixup 81fa15d: a Google Drive folder, laid out as the
# README's Structure; read as its readers read it, xmixup/data/datasets at b9730dc): each task's round trips
# (translate-train-en, for scheduled sampling), and for tagging its Google translations of the English training data
# with the English model's tag distributions (translate-train-logits) and the dev and test sets translated into
# English (translate-*-token); XNLI and PAWS-X train on the datasets' own translations, as FILTER's.
XMIXUP_TRIPS = {'xnli': 'multinli.train.{lang}-en.tsv', 'pawsx': 'translated_train.{lang}-en.tsv',
                'xquad': 'squad.translate.train.en-{lang}-en.json', 'mlqa': 'squad.translate.train.en-{lang}-en.json',
                'tydiqa': 'tydiqa.translate.train.en-{lang}-en.json', 'udpos': '{lang}.txt', 'panx': '{lang}.txt'}


def download_xmixup(task, out, sources):
    """OUT/xmixup, a data folder: X-Mixup's data of task from its folder (sources), aligned with OUT's and checked,
    XNLI-MT and PAWS-X's translations from OUT's download of the task, everything else of OUT linked."""
    if not sources:
        raise DataError('X-Mixup\'s data is a Google Drive folder (its README, Step 2): download it, then give it: '
                        f'python data.py download --task {task} --translations xmixup --from FOLDER --out {out}')
    home = QA_FILES[task]['train'].split('/')[0] if task in QA_FILES else task  # SQuAD's for XQuAD and MLQA
    if not os.path.isdir(os.path.join(out, home)) or not os.path.isdir(os.path.join(out, task)):
        raise DataError(f'{out} has no {task} data to pair X-Mixup\'s with: first python data.py download --task '
                        f'{task} --out {out}')
    raw = os.path.join(out, 'downloads', 'xmixup', task)
    shutil.rmtree(os.path.join(raw, 'raw'), ignore_errors=True)
    for source in sources + [p for p in [os.path.join(out, 'downloads', task, 'raw')] if os.path.isdir(p)]:
        unpack(source, raw, 'X-Mixup\'s data folder (its README\'s Structure)')
    unpacked, family = os.path.join(raw, 'raw'), TASKS[task].family
    files = {} if family != 'classification' else {os.path.join(task, name): text for name, text in (
        xnli_mt if task == 'xnli' else pawsx_translated)(unpacked).items()}
    squad = home == 'squad'  # SQuAD's round trips serve XQuAD and MLQA: both's languages, whichever converts
    english = read_split(out, task, 'train')  # read once: every language's round trip is aligned with it
    for lang in sorted(set(TASKS[task].langs + (TASKS['xquad'].langs + TASKS['mlqa'].langs) * squad) - {'en'}):
        found = glob_files(unpacked, os.path.join(home, 'translate-train-logits' if family == 'tagging' else
                                                  'translate-train-en', XMIXUP_TRIPS[task].format(lang=lang)))
        if found:
            files.update(xmixup_files(task, out, unpacked, lang, found[0], english))
    if not any('round-trip' in name for name in files):
        raise DataError(f'no X-Mixup data of {task} in {", ".join(sources)}: give its data folder, laid out as its '
                        'README\'s Structure says')
    for each in ('xquad', 'mlqa') * squad:  # their runner pairs a question with the benchmark's English one, by id
        files.update(english_originals(each, out) if os.path.isdir(os.path.join(out, each)) else {})
    translations_folder(out, 'xmixup', files)
    print(f'X-Mixup\'s data of {task} is in {os.path.join(out, "xmixup")}: train.py --method xmixup reads it')


def xmixup_files(task, out, unpacked, lang, path, english):
    """{path in the layout: text} of X-Mixup's data of task in lang, path its round trip (tagging: its translation
    with tag distributions): each aligned with OUT's English training data, english (XNLI by line; PAWS-X by the id of
    its translated_train.tsv row; QA by question id; tagging by sentence), a file that is not refused in one line."""
    family, trip = TASKS[task].family, split_path('', task, 'round-trip', lang)
    if family == 'qa':
        ids, theirs = {ex['id'] for ex in english}, read_squad(path, task, train=True)
        if not ids >= {ex['id'] for ex in theirs}:
            raise DataError(f'{path}: questions of ids not in SQuAD\'s English training set: not X-Mixup\'s round trip')
        return {trip: read_text(path)}
    if family == 'classification':
        rows = [line.split('\t') for line in list(read_lines(path))[1:]]  # a header, as its readers skip
        texts = [r[:2] for r in rows]  # XNLI's: premise, hypothesis; line i round-trips English line i
        if task == 'pawsx':  # id, sentence1, sentence2, in the order of PAWS-X's translated_train.tsv
            ids = [r[0] for r in mt_rows(unpacked, os.path.join(lang, 'translated_train.tsv'), PAWSX_HEADER)]
            english_ids = [r[0] for r in mt_rows(unpacked, os.path.join('en', 'train.tsv'), PAWSX_HEADER)]
            by_id = dict(zip(ids, (r[1:3] for r in rows))) if len(ids) == len(rows) else {}
            texts = [by_id.get(i, [ex['a'], ex['b']]) for i, ex in zip(english_ids, english)] if by_id and len(
                english_ids) == len(english) else []  # an English pair without a translation: its own text
        if len(texts) != len(english) or any(len(t) != 2 for t in texts):
            raise DataError(f'{path} has {len(rows)} rows of two sentences for {len(english)} English training '
                            f'examples in {out}: they must be aligned as X-Mixup\'s readers align them')
        return {trip: tsv_text([*t, ex['label']] for t, ex in zip(texts, english))}
    return xmixup_tagging(task, out, unpacked, lang, path, english)


def xmixup_tagging(task, out, unpacked, lang, path, english):
    """X-Mixup's tagging data in lang: its translation of the English training sentences, word by word with the
    English model's tag distribution ('word<TAB>p;p;...' in labels.txt's order), into translate-train and
    translate-train-soft (one word's distribution a line, in TASKS' order); its round trip (translate-train-en-token)
    and the dev and test sets translated into English (translate-*-token), the words of each sentence."""
    theirs = glob_files(unpacked, os.path.join(task, 'labels.txt'))
    order = [t for t in read_lines(theirs[0]) if t] if theirs else sorted(TASKS[task].labels)  # XTREME's, sorted
    if sorted(order) != sorted(TASKS[task].labels):
        raise DataError(f'{theirs[0]} lists other tags than {task}\'s: {", ".join(order)}')
    sentences = xmixup_sentences(path, len(english), 'English training sentences')
    at = [order.index(tag) for tag in TASKS[task].labels]
    soft = [[[float(p) for p in probs.split(';')] for _, probs in sentence] for sentence in sentences]
    if any(len(p) != len(order) for sentence in soft for p in sentence):
        raise DataError(f'{path}: a word\'s distribution has not the {len(order)} tags of {task}')
    text = lambda rows: '\n'.join(''.join(row + '\n' for row in rows_) for rows_ in rows)
    files = {split_path('', task, 'translate-train', lang): text([w for w, _ in s] for s in sentences),
             soft_path('', task, lang): text([' '.join(f'{p[i]:g}' for i in at) for p in s] for s in soft)}
    for split, folder in (('round-trip', 'translate-train-en-token'), ('dev', 'translate-dev-token'),
                          ('test', 'translate-test-token')):
        found = glob_files(unpacked, os.path.join(task, folder, f'{lang}.txt'))
        originals = english if split == 'round-trip' else read_split(out, task, split, lang) if os.path.exists(
            split_path(out, task, split, lang)) else None
        if found and originals is not None:
            words = xmixup_sentences(found[0], len(originals), f'{split} sentences of {lang}')
            name = split_path('', task, split if split == 'round-trip' else f'translate-{split}', lang)
            files[name] = text([w for w, _ in s] for s in words)
    return files


def xmixup_sentences(path, n, what):
    """A file of X-Mixup's tagging data, n sentences of (word, its second column): a word a line, 'word<TAB>...';
    a line of fewer than two columns ends a sentence, as its read_tagging_file reads it."""
    sentences = [[line.split('\t')[:2] for line in run]
                 for run in runs(read_lines(path), lambda line: '\t' not in line)]
    if len(sentences) != n:
        raise DataError(f'{path} has {len(sentences)} sentences for the {n} {what} here: they must be aligned '
                        'sentence by sentence')
    return sentences


def soft_path(data_dir, task, lang):
    """X-Mixup's tag distributions of its translation of the English training data into lang (download_xmixup)."""
    return os.path.join(data_dir, task, 'translate-train-soft', f'train-en-{lang}.tsv')


def soft_labels(spec, langs):
    """X-Mixup's tag distributions of its tagging translations into langs, for each feature tagging_features makes
    of them as the run does (spec): {its token ids: (tokens, tags) array, a word's distribution on its first piece}.
    Features of the same tokens take the first one's: its model gave the same text the same distributions."""
    found, tags = {}, len(TASKS[spec.task].labels)
    for lang in langs:
        sentences = read_tagged(split_path(spec.data_dir, spec.task, 'translate-train', lang), spec.task)
        path = soft_path(spec.data_dir, spec.task, lang)
        soft = [[[float(p) for p in line.split()] for line in run]
                for run in runs(read_lines(path), lambda line: not line.strip())]
        widths = {len(row) for sentence in soft for row in sentence}
        if [len(s) for s in soft] != [len(s['words']) for s in sentences] or widths - {tags}:
            raise DataError(f'{path} does not give a distribution over the {tags} tags of every word of the '
                            f'translations beside it: convert X-Mixup\'s data again')
        seen = {}  # the words of each sentence in its earlier features
        for feat in tagging_features(spec.tok, spec.task, sentences, spec.max_len):
            first, p = seen.get(feat.example, 0), np.zeros((len(feat.ids), tags), np.float32)
            p[feat.words] = np.array(soft[feat.example][first:first + len(feat.words)], np.float32)
            seen[feat.example] = first + len(feat.words)
            found.setdefault(tuple(feat.ids), p)
    return found


HELD = {  # the tasks without a download: converted from the files a user holds
    'panx': 'PAN-X alone is converted from a file you hold: get AmazonPhotos.zip as XTREME\'s README says, then '
            'python data.py download --task panx --from AmazonPhotos.zip --out DIR',
    'conll': 'CoNLL NER is converted from the files you hold (CoNLL-2003\'s, from LDC; CoNLL-2002\'s; Bari et al.\'s '
             'ar and fi): python data.py download --task conll --from FOLDER --out DIR'}


def convert_held(task, source, out):
    if task not in HELD or not source:
        raise DataError(HELD.get(task, f'--from is for PAN-X and CoNLL NER; {task} downloads from its sources'))
    return (convert_panx if task == 'panx' else convert_conll)(source, out)


def glob_files(folder, pattern):
    import glob
    return sorted(glob.glob(os.path.join(folder, '**', pattern), recursive=True))


# UD-POS as XTREME makes it (scripts/download_data.sh at google-research/xtreme 838c13b): each treebank through
# third_party/ud-conversion-tools' conllu_to_conll.py --replace_subtokens_with_fused_forms, then utils_preprocess.py's
# udpos_preprocess. The tool keeps a multi-word token as one word, its fused form, with the part of speech of its
# highest subtoken; a tie goes to the first in the language's precedence list (the tool's POSRANKPRECEDENCEDICT).
UD_PRECEDENCE = {'es': 'VERB AUX PRON ADP DET', 'fr': 'VERB AUX PRON NOUN ADJ ADV ADP DET PART SCONJ CONJ',
                 'it': 'VERB AUX ADV PRON ADP DET INTJ', None: 'VERB NOUN PROPN PRON ADJ NUM ADV INTJ AUX ADP DET '
                 'PART CCONJ SCONJ X PUNCT'}


def ancestors(heads, node):
    """How many nodes reach node over the edges {dependent: [heads]} (networkx's ancestors, which the tool counts)."""
    seen, todo = set(), [node]
    while todo:
        for head in heads.get(todo.pop(), ()):
            if head not in seen:
                seen.add(head)
                todo.append(head)
    return len(seen - {node})


def ud_words(lines, lang):
    """One CoNLL-U sentence -> [(form, UPOS)] as the tool writes it: comments and empty nodes (5.1) dropped; of a
    multi-word token's subtokens the one with the fewest ancestors over the HEAD and enhanced DEPS edges (numeric
    heads only) stays, its form the fused one; a tie goes to the earlier part of speech in the precedence list (one
    outside it last, where the tool would stop), then to the earlier subtoken."""
    words, heads, spans = {}, {}, []
    for cols in (line.split('\t') for line in lines if not line.startswith('#')):
        if '-' in cols[0]:
            spans.append((*map(int, cols[0].split('-')), cols[1]))
        elif '.' not in cols[0]:
            deps = [] if cols[8] == '_' else [d.split(':')[0] for d in cols[8].split('|')]
            heads[int(cols[0])] = [int(h) for h in [cols[6]] + deps if h.isdigit()]
            words[int(cols[0])] = [cols[1], cols[3]]
    order = UD_PRECEDENCE.get(lang, UD_PRECEDENCE[None]).split()
    rank = lambda i: order.index(words[i][1]) if words[i][1] in order else len(order)
    dropped = set()
    for first, last, form in spans:
        span = range(first, last + 1)
        depth = {i: ancestors(heads, i) for i in span}
        head = min((i for i in span if depth[i] == min(depth.values())), key=lambda i: (rank(i), i))
        words[head][0] = form
        dropped |= set(span) - {head}
    return [tuple(words[i]) for i in sorted(words) if i not in dropped]


def convert_ud(paths, out):
    """UD treebanks (CoNLL-U) -> udpos/{split}-{lang}.tsv as XTREME makes them: a treebank's language is its file name's
    prefix ({lang}_{name}-ud-{split}.conllu), a language's treebanks joined in file name order; a sentence whose words
    are all or all but one '_' (treebanks shipped without their text) dropped; U+200C and spaces removed from words."""
    sentences = {}  # (split, lang) -> [[(word, tag)]]
    for path in sorted(paths, key=os.path.basename):
        name = os.path.basename(path)
        lang, split = name.split('_')[0], next((s for s in ('train', 'dev', 'test') if s in name), None)
        if lang not in TASKS['udpos'].langs or split is None:
            continue
        for lines in documents(path):
            bad = next((line for line in lines if not line.startswith('#') and line.count('\t') != 9), None)
            if bad is not None:
                raise DataError(f'{path}: {bad[:60]!r} is not a CoNLL-U line of 10 columns: use the UD release as '
                                'shipped')
            try:
                words = ud_words(lines, lang)
            except (KeyError, ValueError) as e:
                raise DataError(f'{path}: a sentence\'s ids do not add up ({e!r}, near {lines[0][:60]!r}): use the UD '
                                'release as shipped') from None
            blank = sum(w == '_' for w, _ in words)
            if words and (blank == 0 or blank < len(words) - 1):
                sentences.setdefault((split, lang), []).append([(w.replace('\u200c', '').replace(' ', ''), t)
                                                                for w, t in words])
    for (split, lang), sents in sentences.items():
        write_tagged(out, 'udpos', split, lang, [row for s in sents for row in s + [None]][:-1])


def convert_qa(task, files, unpacked, out):
    """SQuAD files to their places; a test file's answers are blanked (as XTREME's) and kept in labels/<task>/."""
    load = lambda path: json.load(open(path, encoding='utf-8'))
    save = lambda path, obj: atomic_write(path, json.dumps(obj, ensure_ascii=False))
    def test_file(lang, obj):
        save(os.path.join(out, 'labels', task, f'test-{lang}.json'), obj)
        for qa in [qa for article in obj['data'] for p in article['paragraphs'] for qa in p['qas']]:
            qa['answers'] = [{'text': '', 'answer_start': 0}]
        save(split_path(out, task, 'test', lang), obj)
    if task in ('xquad', 'mlqa'):
        for path in files[:2]:
            save(os.path.join(out, 'squad', os.path.basename(path)), load(path))
    if task == 'xquad':
        for lang, path in zip(TASKS[task].langs, files[2:]):
            test_file(lang, load(path))
    elif task == 'mlqa':
        for lang in TASKS[task].langs:
            name = f'context-{lang}-question-{lang}.json'
            save(split_path(out, task, 'dev', lang), load(glob_files(unpacked, 'dev-' + name)[0]))
            test_file(lang, load(glob_files(unpacked, 'test-' + name)[0]))
    else:  # tydiqa: each language's training questions (ids start with its name); dev sets are XTREME's tests
        names = {'ar': 'arabic', 'bn': 'bengali', 'en': 'english', 'fi': 'finnish', 'id': 'indonesian',
                 'ko': 'korean', 'ru': 'russian', 'sw': 'swahili', 'te': 'telugu'}
        train = load(files[0])
        for lang, name in names.items():
            own = lambda p: {**p, 'qas': [qa for qa in p['qas'] if qa['id'].startswith(name + '-')]}
            articles = [{**a, 'paragraphs': [own(p) for p in a['paragraphs'] if own(p)['qas']]} for a in train['data']]
            save(split_path(out, task, 'train', lang), {**train, 'data': [a for a in articles if a['paragraphs']]})
            test_file(lang, load(glob_files(unpacked, f'tydiqa-goldp-dev-{name}.json')[0]))


DOWNLOAD_HELP = """Fetch one XTREME task from its official sources (the files XTREME's download_data.sh
fetches) and write it in the layout train.py reads (docs/data.md), test labels
under labels/ where they are public. Archives are kept in OUT/downloads/TASK, so a second run
does not fetch them again. PAN-X has no download left: convert the AmazonPhotos.zip you hold
(XTREME's README), its panx_dataset folder or one {lang}.tar.gz with --from; CoNLL NER (--task conll,
XLA's Table 1), the folder of its files likewise. A task's download fetches what its methods
read besides, XTREME's translations and pseudo test sets and FILTER's data, and names what it
cannot fetch; --translations NAME fetches one of them alone, and --translations xmixup --from
FOLDER converts X-Mixup's data folder (docs/data.md).

example:
  python data.py download --task xnli --out data/
  python data.py download --task panx --from AmazonPhotos.zip --out data/"""


def main(argv=None):
    parser = Parser(description='XTREME data in the layout train.py reads, or the generated demo data.')
    sub = parser.add_subparsers(dest='cmd', required=True, metavar='{download,demo}')
    get = sub.add_parser('download', help='fetch a task from its official sources into the layout read here',
                         description=DOWNLOAD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    get.add_argument('--task', required=True, choices=list(TASKS), help=f'one of {", ".join(TASKS)}')
    get.add_argument('--out', required=True, help='the data folder (train.py --data_dir), e.g. data/')
    get.add_argument('--from', dest='sources', metavar='PATH', action='append', default=[],
                     help='PAN-X: AmazonPhotos.zip, its panx_dataset folder or one {lang}.tar.gz; CoNLL NER: the '
                          'folder of its files; UD-POS: ud-treebanks-v2.5.tgz; with --translations filter: '
                          'XNLI-MT-1.0.zip, x-final.tar.gz and FILTER\'s <task>.zip (or their folders), once each; '
                          'with --translations xmixup: X-Mixup\'s data folder')
    get.add_argument('--translations', nargs='?', const='xtreme', choices=('xtreme', 'filter', 'xmixup'),
                     help='translations of the task instead of the task: XTREME\'s published ones (translate-train, '
                          '-dev, -test, the pseudo test sets; the default), FILTER\'s data into OUT/filter or '
                          'X-Mixup\'s (--from its data folder) into OUT/xmixup, which train.py\'s --method filter and '
                          '--method xmixup read')
    demo = sub.add_parser('demo', help='write the generated demo data of every task', description='Write the '
                          'demo\'s generated data of all nine tasks, with its sentencepiece model, in the same layout '
                          '(train.py --demo makes it in the run folder by itself).')
    demo.add_argument('--out', required=True, help='the folder to write, e.g. demo/')
    demo.add_argument('--seed', type=int, default=0, help='the generator\'s seed (default 0, the demo\'s)')
    args = parser.parse_args(argv)
    try:
        if args.cmd == 'download':
            download(args.task, args.out, args.sources, args.translations, rest=not args.sources)
        else:
            print(make_demo(args.out, args.seed))
    except (DataError, OSError) as e:
        raise SystemExit(f'error: {e}')
    except KeyboardInterrupt:
        raise SystemExit('error: interrupted: run the same command again (what was fetched is kept)')


if __name__ == '__main__':
    main()
