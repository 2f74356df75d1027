"""XTREME's scores, computed exactly as its leaderboard computes them, and the code that produces predictions.

The leaderboard is google-research/xtreme's evaluate.py. It uses accuracy; seqeval 1.2.2 chunk F1 in its default
mode for both tagging tasks (POS too); the SQuAD v1.1 script for XQuAD and TyDiQA; the MLQA script (language-aware)
for MLQA; and set-based F1 for BUCC. Their quirks are kept on purpose, so that the same predictions get the same
numbers to the last digit.

    python eval.py --predictions DIR --labels DIR --out scores.json
    python eval.py --collect RUN [RUN ...] --out DIR [--labels DIR]
    python eval.py --plot RUN [RUN ...] [--out DIR]         # or --analyse NAME RUN [RUN ...]: the papers' analyses
    python eval.py --bleu HYP --ref REF [--tokenized] [--out bleu.json]
"""
import json
import math
import os
import re
import shutil
import string
import sys
import unicodedata
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

import data
import layers
from data import (GROUPS, TASKS, XTREME, DataError, Feature, collate, is_demo, item_lengths, languages,
                  length_batches, read_labels, read_lines, read_qa_file, read_retrieval, read_tag_file, read_text,
                  suffix, word_predictions)
from layers import Parser, atomic_write, mean_pool


# ----------------------------------------------------------------------------------------
# Metrics. Each takes the gold labels first and returns {metric: value in 0-100}.

def accuracy(labels, preds):
    return {'accuracy': sum(p == g for p, g in zip(preds, labels)) / len(preds) * 100}


def tag_chunks(sentences):
    """The chunks of the sentences, as seqeval 1.2.2's get_entities finds them in its default mode. The sentences are
    joined with an 'O' after each. A tag's first character is its B/I/E/S/O prefix and the rest (after a '-') is its
    type, so POS tags form chunks too: 'NOUN' has the prefix 'N' and the type 'OUN', and a run of NOUNs is one chunk."""
    seq = [tag for sentence in sentences for tag in sentence + ['O']] + ['O']
    found, prev_tag, prev_type, begin = set(), 'O', '', 0
    for i, chunk in enumerate(seq):
        tag, type_ = chunk[0], chunk[1:].split('-', 1)[-1] or '_'
        ends = (prev_tag in 'ES' or (prev_tag in 'BI' and tag in 'BSO')
                or (prev_tag not in 'O.' and prev_type != type_))
        starts = (tag in 'BS' or (prev_tag in 'ESO' and tag in 'EI') or (tag not in 'O.' and prev_type != type_))
        if ends:
            found.add((prev_type, begin, i - 1))
        if starts:
            begin = i
        prev_tag, prev_type = tag, type_
    return found


def chunk_f1(labels, preds, items=tag_chunks):
    """Micro precision, recall and F1 over all chunks of a file, as seqeval's defaults (0 when undefined).
    items() turns a file's labels into a set (for bucc_f1, its pairs, each counted once)."""
    gold, pred = items(labels), items(preds)
    tp = len(gold & pred)
    p = tp / len(pred) if pred else 0.0
    r = tp / len(gold) if gold else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return {'f1': f * 100, 'precision': p * 100, 'recall': r * 100}


def bucc_f1(labels, preds):
    return chunk_f1(labels, preds, lambda lines: {tuple(x.split('\t')) for x in lines})


SQUAD_PUNCT = set(string.punctuation)


# MLQA removes every Unicode punctuation character plus ASCII's, and articles that depend on the language.
MLQA_PUNCT = ({chr(i) for i in range(sys.maxunicode) if unicodedata.category(chr(i)).startswith('P')}
              | set(string.punctuation))


# In MLQA's Arabic regex only the second branch can match, so every 'ال' is removed, even mid-word
MLQA_ARTICLES = {'en': r'\b(a|an|the)\b', 'es': r'\b(un|una|unos|unas|el|la|los|las)\b',
                 'de': r'\b(ein|eine|einen|einem|eines|einer|der|die|das|den|dem|des)\b',
                 'vi': r'\b(của|là|cái|chiếc|những)\b', 'hi': None, 'zh': None,
                 'ar': r'\sال^|ال'}


def normalize_answer(s, lang=None):
    """SQuAD v1.1's normalisation (lang=None, for XQuAD and TyDiQA), or MLQA's for `lang`. It lower-cases, drops
    punctuation and articles, and splits into tokens (in Chinese, one token per CJK character)."""
    if lang is not None and lang not in MLQA_ARTICLES:
        raise EvalError(f'MLQA has no normalisation for language {lang!r}')
    punct, articles = (SQUAD_PUNCT, r'\b(a|an|the)\b') if lang is None else (MLQA_PUNCT, MLQA_ARTICLES[lang])
    s = ''.join(c for c in s.lower() if c not in punct)
    if articles:
        s = re.sub(articles, ' ', s)
    if lang == 'zh':  # MLQA's mixed segmentation: each CJK character (U+4E00-U+9FA5) alone, the rest split at spaces
        return ' '.join(re.findall(r'[\u4e00-\u9fa5]|[^\s\u4e00-\u9fa5]+', s))
    return ' '.join(s.split())


def qa_f1(pred, gold, lang=None):
    p, g = normalize_answer(pred, lang).split(), normalize_answer(gold, lang).split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def qa_scores(dataset, predictions, lang=None):
    """Exact match and F1 over every question of a SQuAD-format dataset (the 'data' list). An unanswered question
    scores 0. EM and F1 each take the best of the gold answers."""
    qas = [qa for article in dataset for paragraph in article['paragraphs'] for qa in paragraph['qas']]
    em = f1 = 0
    for qa in qas:
        if qa['id'] in predictions:
            golds, pred = [a['text'] for a in qa['answers']], predictions[qa['id']]
            em += max(normalize_answer(pred, lang) == normalize_answer(g, lang) for g in golds)
            f1 += max(qa_f1(pred, g, lang) for g in golds)
    return {'exact_match': 100.0 * em / len(qas), 'f1': 100.0 * f1 / len(qas)}


# ----------------------------------------------------------------------------------------
# BLEU. bleu() gives the same numbers as sacreBLEU 2.x's default, sacrebleu.corpus_bleu(hyps, [refs]), with 13a
# tokens, 'exp' smoothing and one reference per line (tests/test_bleu.py compares the two).
# tokenized_bleu() is multi-bleu.perl -lc, for text that is already tokenised.

# mteval-v13a's rules, applied in this order to the line with a space added at each end. Each pattern consumes the
# neighbour it tests, as mteval's do, so overlapping matches are skipped ('..5' gives '. .5', where lookarounds would
# give '. . 5'). The patterns use [0-9], not \d, because only ASCII digits count.
V13A_SYMBOL = re.compile(r'([{-~\[-` -&(-+:-@/])')  # ASCII punctuation except ' , - . becomes a token
V13A_POINT_AFTER = re.compile(r'([^0-9])([.,])')     # '.' and ',' split off unless a digit comes before
V13A_POINT_BEFORE = re.compile(r'([.,])([^0-9])')    # ... or after (3.5 and 1,000 stay whole)
V13A_DASH = re.compile(r'([0-9])(-)')                # '-' after a digit splits (1990-2000)


def tokenize_13a(line):
    """sacreBLEU's default tokenizer (mteval-v13a) -> the tokens joined by single spaces."""
    line = line.replace('<skipped>', '').replace('-\n', '').replace('\n', ' ')
    if '&' in line:  # this order turns '&amp;lt;' into '<' but leaves '&amp;quot;' as '&quot;'
        for entity, char in (('&quot;', '"'), ('&amp;', '&'), ('&lt;', '<'), ('&gt;', '>')):
            line = line.replace(entity, char)
    line = V13A_SYMBOL.sub(r' \1 ', f' {line} ')
    line = V13A_POINT_AFTER.sub(r'\1 \2 ', line)
    line = V13A_POINT_BEFORE.sub(r' \1 \2', line)
    return ' '.join(V13A_DASH.sub(r'\1 \2 ', line).split())


def ngrams(tokens, n):
    return Counter(zip(*(tokens[i:] for i in range(n))))


def bleu_scores(hyps, refs, split, smooth, signature):
    """BLEU from the clipped n-gram matches, the n-gram totals (n = 1..4) and both lengths, summed over a corpus of
    lines that split() cuts into tokens. smooth turns on sacreBLEU's 'exp' smoothing; otherwise there is none."""
    if len(hyps) != len(refs):
        raise EvalError(f'{len(hyps)} hypotheses for {len(refs)} references: BLEU needs one reference per hypothesis')
    counts, totals, sys_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hyps, refs):
        h, r = split(hyp), split(ref)
        sys_len, ref_len = sys_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            counts[n - 1] += sum((ngrams(h, n) & ngrams(r, n)).values())  # & keeps the smaller count (clipping)
            totals[n - 1] += max(len(h) - n + 1, 0)
    bp = 1.0 if sys_len >= ref_len else math.exp(1 - ref_len / sys_len) if sys_len else 0.0
    precisions, halving = [], 1
    for c, t in zip(counts, totals):
        if c:
            precisions.append(100 * c / t)
        elif smooth and t and any(counts):  # 'exp' gives the k-th order without a match 1 / 2^k matches
            halving *= 2
            precisions.append(100 / (halving * t))
        else:  # no n-grams of this order, or no match at all: sacreBLEU gives 0 instead of smoothing
            precisions.append(0.0)
    score = bp * math.exp(sum(math.log(p) for p in precisions) / 4) if all(precisions) else 0.0
    return {'bleu': score, 'precisions': precisions, 'bp': bp, 'sys_len': sys_len, 'ref_len': ref_len,
            'counts': counts, 'totals': totals, 'signature': signature}


def bleu(hyps, refs, lowercase=False):
    """Corpus BLEU (0-100) of detokenised hypotheses with one reference each, together with its n-gram precisions
    (percent), brevity penalty, lengths, counts and a sacreBLEU-style signature."""
    split = lambda line: tokenize_13a((line.lower() if lowercase else line).rstrip()).split()
    # sacreBLEU 2.x's signature for the same numbers, with our marker in place of its version
    signature = f'nrefs:1|case:{"lc" if lowercase else "mixed"}|eff:no|tok:13a|smooth:exp|version:xlt'
    return bleu_scores(hyps, refs, split, smooth=True, signature=signature)


def tokenized_bleu(hyps, refs):
    """BLEU as multi-bleu.perl -lc computes it: lower case, whitespace tokens, no smoothing (a zero precision gives
    0). Python lowercases every script, while the Perl script reads bytes and lowercases ASCII only."""
    split = lambda line: line.lower().split()
    return bleu_scores(hyps, refs, split, smooth=False, signature='multi-bleu.perl -lc (whitespace tokens)')


def translation_scores(hyps, refs):
    """The test scores of a translation run: sacreBLEU's BLEU of the detokenised text, and the tokenised BLEU of its
    13a tokens (multi-bleu.perl -lc)."""
    tokens = lambda lines: [tokenize_13a(line) for line in lines]
    return {'bleu': bleu(hyps, refs), 'tokenized_bleu': tokenized_bleu(tokens(hyps), tokens(refs))}


# ----------------------------------------------------------------------------------------
# From model outputs to predictions and their scores.

def predictions(task, feats, outputs, examples):
    """Model outputs -> predictions in the leaderboard's form."""
    info = TASKS[task]
    if info.family == 'classification':
        return [info.labels[o.argmax().item()] for o in outputs]
    if info.family == 'tagging':
        words = word_predictions(feats, [o.argmax(-1).tolist() for o in outputs], len(examples))
        return [[info.labels[i] for i in w] for w in words]
    return decode_qa(feats, [o[:, 0] for o in outputs], [o[:, 1] for o in outputs], examples)


def labelled(examples):
    """Whether every example carries its label (its tags, its answers), so predictions can be scored against them."""
    return all(ex.get('label', ex.get('tags', ex.get('answers'))) for ex in examples)


def scores_of(task, lang, examples, preds):
    """Score predictions against the examples' own labels. -> {metric: value}, plus 'score'"""
    family = TASKS[task].family
    if family == 'classification':
        s = accuracy([ex['label'] for ex in examples], preds)
    elif family == 'tagging':
        s = chunk_f1([ex['tags'] for ex in examples], preds)
    else:
        s = qa_scores([{'paragraphs': [{'qas': examples}]}], preds, lang if task == 'mlqa' else None)
    return dict(s, score=main_score(s))


def decode_qa(windows, start_logits, end_logits, examples, max_answer_len=30, probability=False):
    """The best answer to each question over all its windows -> {question id: answer text}. With probability, each
    answer is (text, its start probability times its end probability in its window).
    A span (i, j) is valid when both ends are context tokens, i <= j < i + max_answer_len, and token i has its
    fullest context in this window. The valid span with the highest start + end score wins across windows, and it is
    cut from the original context by character offsets. The reference scripts search only the 20 best starts x 20
    best ends; here every valid span is scored at once. windows are the features of the examples from
    data.qa_features, and the logits are one (T,) tensor per window."""
    best = {}
    for w, s, e in zip(windows, start_logits, end_logits):
        qid, text = examples[w.example]['id'], examples[w.example]['context']
        best.setdefault(qid, (float('-inf'), '', 0.0))  # a question with no valid span (no context) answers ''
        T = len(w.ids)
        s, e = s[:T].float(), e[:T].float()
        context = torch.tensor([span is not None for span in w.spans])
        valid = (context & torch.tensor(w.max_context))[:, None] & context[None, :]
        valid &= torch.ones(T, T, dtype=torch.bool).triu().tril(max_answer_len - 1)
        score, k = (s[:, None] + e[None, :]).masked_fill(~valid, float('-inf')).flatten().max(0)
        i, j = divmod(k.item(), T)
        if score.item() > best[qid][0]:
            p = (s.softmax(0)[i] * e.softmax(0)[j]).item() if probability else None
            best[qid] = (score.item(), text[w.spans[i][0]:w.spans[j][1]], p)
    return {qid: (text, p) if probability else text for qid, (score, text, p) in best.items()}


# ----------------------------------------------------------------------------------------
# Retrieval (BUCC, Tatoeba): mean-pooled states, nearest neighbours, XTREME's margin mining. Also CKA (X-Mixup Eq. 1).

@torch.no_grad()
def embed_texts(encoder, tok, texts, which, batch_size, device, pool='mean'):
    """Embed each text (<s> text </s>) as its mean-pooled hidden states after which = (l,) blocks (0: the embeddings).
    With which = (a, b), the states after a, ..., b blocks are put side by side; with pool 'cls', the first token's
    state is used (XTREME's Table 14). The result stays on the device, where knn searches the nearest neighbours."""
    feats = [Feature(tok.encode_pair(ids[:encoder.longest - 2])) for ids in (tok.encode(t) for t in texts)]
    first, last = which[0], which[-1]
    out = torch.zeros(len(texts), encoder.cfg.dim * (last - first + 1), device=device)
    encoder.eval()
    for index in length_batches(item_lengths(feats)[:, 0], batch_size):
        b = collate([feats[i] for i in index], pad_id=tok.pad).to(device)
        states = [encoder.run(encoder.embed(b.ids), b.mask, 0, first)]
        for k in range(first, last):
            states.append(encoder.run(states[-1], b.mask, k, k + 1))
        out[index] = torch.cat([h[:, 0] if pool == 'cls' else mean_pool(h, b.mask) for h in states], -1).float()
    return out


def retrieve(data_dir, task, embed, mining='margin', chosen=None):
    """The bucc2018 or tatoeba test predictions {lang: ...} in the chosen languages, from embed(texts) (mean-pooled
    states). Tatoeba takes the cosine nearest neighbours. BUCC takes the mined candidates (bucc_candidates) above the
    threshold that is best on each language's dev gold pairs (XTREME's bucc_optimize)."""
    preds = {}
    for lang in languages(task, is_demo(data_dir), chosen):
        src, eng, _ = read_retrieval(data_dir, task, 'test', lang)
        if task == 'tatoeba':  # for every English sentence, the line of its source sentence
            preds[lang] = nearest(embed(eng), embed(src))[0].tolist()
            continue
        dev_src, dev_eng, gold = read_retrieval(data_dir, task, 'dev', lang)  # BUCC: the best threshold on dev
        dev_pairs, dev_scores = bucc_candidates(embed, dev_src, dev_eng, mining)
        threshold = best_threshold(dev_scores, dev_pairs, set(gold))
        pairs, scores = bucc_candidates(embed, src, eng, mining)
        preds[lang] = [p for p, s in zip(pairs, scores) if s >= threshold]
    return preds


def nearest(queries, keys):
    """Cosine nearest neighbour of each query among keys -> (indices, similarities)."""
    similarity, index = knn(F.normalize(queries.float(), dim=-1), F.normalize(keys.float(), dim=-1), 1)
    return index[:, 0], similarity[:, 0]


def knn(x, y, k, block=256):
    """The k largest inner products of each row of x with the rows of y -> (values, indices), each (len(x), k).
    It works a block of rows at a time, so BUCC's 400k x 400k similarities are never held whole."""
    parts = [(x[i:i + block] @ y.T).topk(min(k, len(y)), dim=1) for i in range(0, len(x), block)]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


def margin_mine(x, y, k=4):
    """XTREME's bitext mining with the defaults of utils_retrieve.mine_bitext. It uses cosine similarities and the
    ratio margin score(x, y) = cos(x, y) / ((mean of x's k nearest y + mean of y's k nearest x) / 2). Each sentence
    proposes the best of its k nearest candidates, in both directions ('max' retrieval). The pairs are taken in
    falling score while neither side is taken yet. -> [(x row, y row, score)], with scores above 0."""
    x, y = F.normalize(x.float(), dim=-1), F.normalize(y.float(), dim=-1)
    (x2y, x2y_at), (y2x, y2x_at) = knn(x, y, k), knn(y, x, k)
    x2y_mean, y2x_mean = x2y.mean(1), y2x.mean(1)
    forward = x2y / ((x2y_mean[:, None] + y2x_mean[x2y_at]) / 2)  # each x with its k nearest y
    backward = y2x / ((y2x_mean[:, None] + x2y_mean[y2x_at]) / 2)
    (f_score, f_best), (b_score, b_best) = forward.max(1), backward.max(1)
    rows_x, rows_y = torch.arange(len(x), device=x.device), torch.arange(len(y), device=x.device)
    src, tgt = torch.cat([rows_x, y2x_at[rows_y, b_best]]), torch.cat([x2y_at[rows_x, f_best], rows_y])
    scores = torch.cat([f_score, b_score])
    order = scores.argsort(descending=True, stable=True)
    taken_x, taken_y, out = set(), set(), []
    for i, j, score in zip(src[order].tolist(), tgt[order].tolist(), scores[order].tolist()):
        if i not in taken_x and j not in taken_y:
            taken_x.add(i)
            taken_y.add(j)
            if score > 0:
                out.append((i, j, score))
    return out


def best_threshold(scores, pairs, gold):
    """The similarity threshold that maximises the BUCC F1 of `pairs` (sorted by falling score) against the gold
    pairs. It is chosen on the dev split's own gold and then applied to test."""
    order = sorted(range(len(pairs)), key=lambda k: -scores[k])
    hits, best_f1, threshold = 0, -1.0, float('inf')
    for rank, k in enumerate(order, 1):
        hits += pairs[k] in gold
        f1 = 2 * hits / (rank + len(gold))
        if f1 > best_f1:
            nxt = scores[order[rank]] if rank < len(order) else scores[k] - 1
            best_f1, threshold = f1, (scores[k] + nxt) / 2
    return threshold


def bucc_candidates(embed, src, eng, mining='margin'):
    """({id: sentence} of each side) -> ([(source id, English id)], [score]). 'margin' runs margin_mine over the
    distinct sentences, as XTREME's release does: duplicates are embedded once, and a sentence under several ids in
    its file names no pair, as its read_sent2id drops it. 'cosine' pairs each source sentence with its nearest
    English sentence."""
    if mining == 'cosine':
        index, score = nearest(embed(list(src.values())), embed(list(eng.values())))
        eng_ids = list(eng)
        return [(s, eng_ids[j]) for s, j in zip(src, index.tolist())], score.tolist()
    ids = [{}, {}]  # for each side, sentence -> its ids
    for side, sentences in zip(ids, (src, eng)):
        for key, sentence in sentences.items():
            side.setdefault(sentence, []).append(key)
    (x_text, x_ids), (y_text, y_ids) = (zip(*side.items()) for side in ids)
    mined = margin_mine(embed(list(x_text)), embed(list(y_text)))
    kept = [((x_ids[i][0], y_ids[j][0]), score) for i, j, score in mined if len(x_ids[i]) == len(y_ids[j]) == 1]
    return [p for p, _ in kept], [s for _, s in kept]


def linear_cka(x, y):
    """Linear CKA between representations x (n, d1) and y (n, d2) of the same n inputs (X-Mixup Eq. 1):
    ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F), computed on centred features."""
    x, y = x.double() - x.double().mean(0), y.double() - y.double().mean(0)
    return float((y.T @ x).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm()))


# === Machinery: the leaderboard's files, tables, collecting runs, plots, the command line ===


# ----------------------------------------------------------------------------------------
# The leaderboard layout: <folder>/<task>/test-<lang>.<tsv|json>.

class EvalError(ValueError):
    """Predictions that cannot be scored; the message is one line that says why."""


def score_file(task, pred_path, label_path, lang):
    family = TASKS[task].family
    for path in (pred_path, label_path):
        if not os.path.isfile(path):
            raise EvalError(f'{path} is not there: every language of {task} needs a file '
                            f'({", ".join(TASKS[task].langs)})')
    if family == 'qa':
        return qa_scores(read_qa_file(label_path), read_qa_file(pred_path), lang if task == 'mlqa' else None)
    read = read_tag_file if family == 'tagging' else read_labels
    labels, preds = read(label_path), read(pred_path)
    if task == 'bucc2018':
        return bucc_f1(labels, preds)
    if len(labels) != len(preds):
        raise EvalError(f'{pred_path} has {len(preds)} {"sentences" if family == "tagging" else "lines"}, {label_path} '
                        f'has {len(labels)}: write one per test example')
    if family == 'tagging':
        if (bad := next((i for i, (g, p) in enumerate(zip(labels, preds)) if len(g) != len(p)), None)) is not None:
            raise EvalError(f'{pred_path}: sentence {bad + 1} has {len(preds[bad])} tags for {len(labels[bad])} words: '
                            'write one tag per word')
        return chunk_f1(labels, preds)
    return accuracy(labels, preds)


def main_score(scores):
    """The one number the leaderboard ranks a task by: QA's mean of EM and F1, else F1 or accuracy."""
    if 'exact_match' in scores:
        return (scores['exact_match'] + scores['f1']) / 2
    return scores['f1'] if 'f1' in scores else scores['accuracy']


def task_scores(per_lang):
    """{lang: {metric: v}} -> the leaderboard's task entry: {metric: {lang: v}}, avg_<metric> and avg_metric."""
    metrics = next(iter(per_lang.values()))  # a task's files all give the same metrics
    out = {m: {lang: scores[m] for lang, scores in per_lang.items()} for m in metrics}
    averages = {m: sum(v.values()) / len(v) for m, v in out.items()}
    return {**out, **{f'avg_{m}': v for m, v in averages.items()}, 'avg_metric': main_score(averages)}


def score_folder(pred_dir, label_dir, demo=False, tasks=XTREME):
    """The leaderboard's JSON: each task of `tasks` in both folders, then all_task and each group with all its tasks."""
    detailed = {}
    for task in XTREME:
        if task in tasks and all(os.path.isdir(os.path.join(d, task)) for d in (pred_dir, label_dir)):
            name = lambda d, lang: os.path.join(d, task, f'test-{lang}.{suffix(task)}')
            detailed[task] = task_scores({lang: score_file(task, name(pred_dir, lang), name(label_dir, lang), lang)
                                          for lang in languages(task, demo)})
    overall = {group: sum(detailed[t]['avg_metric'] for t in members) / len(members)
               for group, members in {'all_task': XTREME, **GROUPS}.items() if all(t in detailed for t in members)}
    return {**overall, **detailed}


def write_predictions(folder, task, lang, preds, split='test'):
    """One language's predictions written atomically in the submission layout (split 'dev': beside the test's): labels,
    tag lists, {question id: answer} (QA), (source id, English id) pairs (bucc2018) or English indices (tatoeba)."""
    path = os.path.join(folder, task, f'{split}-{lang}.{suffix(task)}')
    atomic_write(path, prediction_text(task, preds))
    return path


def prediction_text(task, preds):
    if TASKS[task].family == 'qa':
        return json.dumps(preds, ensure_ascii=False, indent=1)
    if TASKS[task].family == 'tagging':
        return '\n\n'.join('\n'.join(tags) for tags in preds) + '\n'
    return ''.join(f'{s}\t{t}\n' for s, t in preds) if task == 'bucc2018' else ''.join(f'{p}\n' for p in preds)


def with_probabilities(task, feats, outputs, examples):
    """-> (predictions(), the softmax probability of each and its distribution over the labels, a word's from its
    first piece); for QA decode_qa's {question id: its answer's start times end probability in its window}, None."""
    if TASKS[task].family == 'qa':
        found = decode_qa(feats, [o[:, 0] for o in outputs], [o[:, 1] for o in outputs], examples, probability=True)
        return {qid: text for qid, (text, _) in found.items()}, {qid: p for qid, (_, p) in found.items()}, None
    preds, dists = predictions(task, feats, outputs, examples), [o.float().softmax(-1) for o in outputs]
    rounded = [d.double().mul(1e4).round().div(1e4).tolist() for d in dists]  # four decimals keep the file small
    if TASKS[task].family == 'classification':
        return preds, [d.max().item() for d in dists], rounded
    return (preds, word_predictions(feats, [d.max(-1).values.tolist() for d in dists], len(examples)),
            word_predictions(feats, rounded, len(examples)))


def write_predicted(stem, task, feats, outputs, examples):
    """train.py --predict's files: stem.<tsv|json> in the leaderboard's format, and stem.scores.json, each prediction
    with its probability and distribution, and the scores where the examples have labels -> those scores."""
    preds, probs, dists = with_probabilities(task, feats, outputs, examples)
    family = TASKS[task].family
    scores = scores_of(task, None, examples, preds) if examples and labelled(examples) else None
    if family == 'qa':
        each = {qid: {'answer': answer, 'probability': probs[qid]} for qid, answer in preds.items()}
    else:
        each = [{'tags' if family == 'tagging' else 'label': p, 'probability': q, 'distribution': d}
                for p, q, d in zip(preds, probs, dists)]
    atomic_write(f'{stem}.{suffix(task)}', prediction_text(task, preds))
    atomic_write(f'{stem}.scores.json', json.dumps({'task': task, 'scores': scores, 'predictions': each}, indent=1,
                                                   ensure_ascii=False))
    return scores


def score_predictions(folder, labels, task, preds):
    """Write test predictions {lang: predictions} into folder, scored where labels/ has the file -> {lang: scores}."""
    scores = {}
    for lang, p in preds.items():
        path = write_predictions(folder, task, lang, p)
        gold = os.path.join(labels, task, f'test-{lang}.{suffix(task)}')
        if os.path.exists(gold):
            scores[lang] = dict(s := score_file(task, path, gold, lang), score=main_score(s))
    return scores


# ----------------------------------------------------------------------------------------
# What a run prints and keeps: its epoch lines, per-language tables.

def epoch_line(state, epochs, epoch_loss, dev, select, seconds):
    """The line printed at an epoch's end: its training loss (epoch_loss: a log line's (mean, steps)), dev and best."""
    loss = sum(l * n for l, n in epoch_loss) / max(1, sum(n for _, n in epoch_loss))
    line = f'epoch {state["epoch"]}/{epochs}  step {state["step"]}  train loss {loss:.4f}'
    if dev and select == 'loss':
        line += f'  held-out loss {-np.mean([s["score"] for s in dev.values()]):.4f}  best {-state["best"]:.4f}'
    elif dev:
        average = np.mean([s['score'] for s in dev.values()])
        by_lang = select in dev  # English, or an in-language run's own
        line += f'  dev avg {average:.1f}' + (f'  dev {select} {dev[select]["score"]:.1f}' if by_lang else '')
        line += f'  best {state["best"]:.1f} ({select if by_lang else "avg"})'
    return line + f'  {clock(seconds)}'


def clock(seconds):
    s = int(seconds)
    return f'{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}'


def summarize(per_lang, source='en'):
    """{lang: score} -> {lang: score, 'avg': mean, 'gap': source minus the mean of the others}."""
    others = [v for k, v in per_lang.items() if k != source]
    out = dict(per_lang, avg=sum(per_lang.values()) / len(per_lang))
    if source in per_lang and others:
        out['gap'] = per_lang[source] - sum(others) / len(others)
    return out


def summary(scores):
    """{lang: scores} -> per-language main scores with their average and transfer gap."""
    return summarize({lang: s['score'] for lang, s in scores.items()}) if scores else {}


def statistic(results, stat='mean'):
    """The per-language mean (or 'std': np.std) of several runs' {'dev': summary, 'test': summary}."""
    f = {'mean': np.mean, 'std': np.std}[stat]
    return {split: {k: float(f([r[split][k] for r in results])) for k in results[0][split]} if results[0][split] else {}
            for split in ('dev', 'test')}


def seed_table(runs):
    """The mean ± std (np.std) over one command's runs (its seeds) of each test row they all hold, per language."""
    rows = [{'the run': r, **r.get('runs', {})} for r in (json.loads(read_text(f'{run}/results.json')) for run in runs)]
    lines = []
    for name in (n for n in rows[0] if all(n in r for r in rows)):
        mean, std = (statistic([r[name] for r in rows], stat)['test'] for stat in ('mean', 'std'))
        lines.append(f'  {name}: ' + ', '.join(f'{k} {mean[k]:.1f} ± {std[k]:.1f}' for k in mean))
    return '\n'.join(lines)


def results(settings, dev, test, selected_by=None, runs=None, name=None):
    """A run's results.json and its table; settings: the run's task, method, stage and --langs; runs: other rows
    {name: {'dev': summary, 'test': summary}} (XLA's models), first, the run's then named `name`; QA adds EM and F1."""
    task, stage, langs = settings['task'], settings.get('stage'), settings.get('langs')
    out = {'task': task, 'method': settings['method'], 'selected_by': selected_by, 'dev': summary(dev),
           'test': summary(test), 'test_metrics': test, 'dev_metrics': dev, **({'runs': runs} if runs else {}),
           **({'langs': list(langs)} if langs else {}),
           **({'translations': settings['translations']} if settings.get('translations', 'xtreme') != 'xtreme' else {})}
    rows = {f'{split} {name}': r[split] for split in ('dev', 'test') for name, r in (runs or {}).items() if r[split]}
    label = ', '.join([task] + [part for part in (stage, name) if part])
    rows.update({f'{split} ({label})': out[split] for split in ('dev', 'test') if out[split]})
    qa = task in TASKS and TASKS[task].family == 'qa'
    for split, scores in (('dev', dev), ('test', test)) if qa else ():  # the score's two halves
        rows.update({f'{split} {name}': summarize({lang: s[metric] for lang, s in scores.items()})
                     for metric, name in (('exact_match', 'EM'), ('f1', 'F1')) if scores})
    table = format_table(rows) if rows else 'no labels to score against: predictions written only'
    chosen = f'\n--langs {",".join(langs)}: these and English alone (a submission needs all)' if langs else ''
    return out, table + ('\nQA: each score is the mean of exact match (EM) and F1' if qa and rows else '') + chosen


def format_table(rows):
    """rows: {row name: {column: value}} -> a plain text table (values to 1 decimal)."""
    cols = list(dict.fromkeys(c for r in rows.values() for c in r if c not in ('avg', 'gap')))
    cols += [c for c in ('avg', 'gap') if any(c in r for r in rows.values())]
    width, widths = max(len(n) for n in rows) + 2, {c: max(7, len(c) + 2) for c in cols}
    lines = [f'{name:<{width}}' + ''.join(f'{r[c]:{widths[c]}.1f}' if c in r else ' ' * widths[c] for c in cols)
             for name, r in rows.items()]
    return '\n'.join([' ' * width + ''.join(f'{c:>{widths[c]}}' for c in cols)] + lines)


def held_out_table(losses):
    """The table VECO's pre-training prints: its held-out losses {kind: {term: loss}}, a row a kind of pair."""
    names = sorted({k for row in losses.values() for k in row} - {'score'})
    rows = [f'{kind:<10}' + ''.join(f'{row[n]:13.3f}' if n in row else ' ' * 13 for n in names)
            for kind, row in losses.items()]
    return '\n'.join([f'{"held out":<10}' + ''.join(f'{n:>13}' for n in names)] + rows)


def translation_table(title, scores):
    """The table a translation run prints: sacreBLEU with its signature, then tokenised BLEU."""
    sacre, tokenized = scores['bleu'], scores['tokenized_bleu']
    return (f'{title}\n  sacreBLEU       {sacre["bleu"]:6.2f}  {sacre["signature"]}\n'
            f'  tokenized BLEU  {tokenized["bleu"]:6.2f}  (13a tokens, lower case, no smoothing: multi-bleu.perl -lc)')


METRIC_NAMES = {'accuracy': 'accuracy', 'f1': 'F1', 'em_f1': 'mean of EM and F1'}


def xtreme_table(scores, demo=False):
    """score_folder's JSON as the leaderboard shows it: each task's languages and average, the groups, the score."""
    lines = []
    for task in (t for t in TASKS if t in scores):
        s = scores[task]
        metrics = [m for m, v in s.items() if isinstance(v, dict)]
        lines.append(f'{task} ({METRIC_NAMES[TASKS[task].metric]}): {s["avg_metric"]:.1f}'
                     + (f' (EM {s["avg_exact_match"]:.1f}, F1 {s["avg_f1"]:.1f})' if 'exact_match' in s else ''))
        langs = [lang for lang in languages(task, demo) if lang in s[metrics[0]]]
        for row in (langs[i:i + 14] for i in range(0, len(langs), 14)):  # rows of 14 languages fit 100 columns
            lines.append('  ' + ''.join(f'{lang:>7}' for lang in row))
            lines.append('  ' + ''.join(f'{main_score({m: s[m][lang] for m in metrics}):7.1f}' for lang in row))
    groups = [f'{g} {scores[g]:.1f}' for g in (*GROUPS, 'all_task') if g in scores]
    if groups:
        lines.append('groups: ' + ', '.join(groups).replace('all_task', 'XTREME score'))
    return '\n'.join(lines)


# ----------------------------------------------------------------------------------------
# Runs gathered into one submission (--collect), and their figures (--plot, matplotlib).

def finished_task(run):
    """The task of a finished run folder (its results.json), whose test predictions it holds."""
    path = os.path.join(run, 'results.json')
    if not os.path.isfile(path):
        raise EvalError(f'{run} is not a finished run (no results.json): pass the --out folders of finished runs')
    task = json.loads(read_text(path)).get('task')
    if task not in XTREME or not os.path.isdir(os.path.join(run, 'predictions', task)):
        raise EvalError(f'{run} holds no test predictions of an XTREME task (predictions/<task>/): '
                        'it cannot be submitted')
    config = os.path.join(run, 'config.json')
    if TASKS[task].family == 'qa' and os.path.isfile(config) and json.loads(read_text(config)).get('translate_test'):
        raise EvalError(f'{run} is a translate-test run: its answers are English, which the leaderboard does not score')
    return task


def run_is_demo(run):
    """Was the run on the demo's data (its --data_dir, or the demo data in its folder)?"""
    config = json.loads(read_text(p)) if os.path.isfile(p := os.path.join(run, 'config.json')) else {}
    return is_demo(config.get('data_dir', '')) or is_demo(os.path.join(run, 'demo-data'))


def collect(runs, out, demo=False):
    """Gathers finished runs' test predictions (of a task's, the run with the best dev average) into one submission
    folder, written whole and moved into place -> the gaps: a task no run gives, a language with no file."""
    out, found = os.path.normpath(out), {}
    dev = lambda run: json.loads(read_text(os.path.join(run, 'results.json'))).get('dev', {}).get('avg', float('-inf'))
    for run in runs:
        task = finished_task(run)
        ran = json.loads(read_text(os.path.join(run, 'results.json'))).get('langs') or languages(task, demo)
        if missed := [lang for lang in languages(task, demo) if lang not in ran and lang != 'en']:
            more = f' and {len(missed) - 1} more' if len(missed) > 1 else ''
            raise EvalError(f'{run} ran {task} in {", ".join(ran)} alone (--langs), not in {missed[0]}{more}: a '
                            'submission needs every language; run it without --langs')
        if task not in found or dev(run) > dev(found[task]):
            found[task] = run
    if os.path.exists(out) and (not os.path.isdir(out) or set(os.listdir(out)) - set(XTREME)):
        raise EvalError(f'{out} exists and is not a submission folder (only task folders): give a new --out')
    gaps, tmp = [], f'{out}.tmp{os.getpid()}'
    for task in XTREME:
        if task not in found:
            gaps.append(f'{task}: no run holds its predictions')
            continue
        os.makedirs(os.path.join(tmp, task))
        for lang in languages(task, demo):
            name = f'test-{lang}.{suffix(task)}'
            if os.path.isfile(src := os.path.join(found[task], 'predictions', task, name)):
                shutil.copyfile(src, os.path.join(tmp, task, name))
            else:
                gaps.append(f'{task}: no {lang} predictions ({src} not found)')
    if os.path.exists(out):  # the old submission goes only once the new one is complete
        os.replace(out, f'{out}.old{os.getpid()}')
    os.replace(tmp, out)
    shutil.rmtree(f'{out}.old{os.getpid()}', ignore_errors=True)
    return gaps


def collect_figure(runs, out):
    """The runs' test scores by language (a panel a task, a bar a run) as OUT.png beside the submission -> a line."""
    if (plt := pyplot()) is None:
        return 'no figure of the scores by language: it needs matplotlib (pip install matplotlib)'
    panels = {}
    for run in runs:
        test = json.loads(read_text(os.path.join(run, 'results.json'))).get('test', {})
        scores = {lang: score for lang, score in test.items() if isinstance(score, (int, float)) and lang != 'gap'}
        panels.setdefault(finished_task(run), {})[os.path.normpath(run)] = scores
    fig = bar_panels(plt, panels, 'test score')
    save_figure(fig, f'{os.path.normpath(out)}.png')
    plt.close(fig)
    return f'the test scores by language: {os.path.normpath(out)}.png'


def plot(runs, out):
    """PNG figures of finished runs, overlaid: loss.png (training loss by step), dev.png (each epoch's dev scores per
    language, averaged over several runs, or held-out losses), test.png (test scores per language) -> those files."""
    if (plt := pyplot()) is None:
        raise EvalError('--plot draws with matplotlib, which is not installed: pip install matplotlib')
    names = [os.path.basename(os.path.normpath(r)) for r in runs]
    names = names if len(set(names)) == len(names) else [os.path.normpath(r) for r in runs]
    logs = [[json.loads(line) for line in read_lines(p)] if os.path.exists(p := os.path.join(r, 'log.jsonl')) else []
            for r in runs]
    results = [json.loads(read_text(p)) if os.path.exists(p := os.path.join(r, 'results.json')) else {} for r in runs]
    if not any(logs) and not any(r.get('test') for r in results):
        raise EvalError(f'nothing to plot in {", ".join(runs)}: no log.jsonl or results.json there (a finished '
                        'run\'s --out)')
    os.makedirs(out, exist_ok=True)
    written = []
    for name, draw in (('loss.png', plot_loss), ('dev.png', plot_dev), ('test.png', plot_test)):
        fig, ax = plt.subplots(figsize=(7, 4))
        if draw(ax, names, logs, results):
            ax.grid(alpha=0.3)
            ax.legend(fontsize='small')
            written.append(save_figure(fig, os.path.join(out, name)))
        plt.close(fig)
    for run in (run for run, log in zip(runs, logs) if not log):
        print(f'{run}: no log.jsonl (an evaluation, or a run of stages such as XLA, whose logs are in its stage '
              'folders): no training figures from it')
    return written


def plot_loss(ax, names, logs, results):
    for name, log in zip(names, logs):
        ax.plot([r['step'] for r in log if 'loss' in r], [r['loss'] for r in log if 'loss' in r], label=name)
    ax.set(xlabel='step', ylabel='training loss')
    return any('loss' in r for log in logs for r in log)


def plot_dev(ax, names, logs, results):
    """Pre-training and translation log held-out losses per kind of pair: {kind: {..., score: -loss}}."""
    dev = [[(r['epoch'], {k: v if isinstance(v, (int, float)) else -v['score'] for k, v in r['dev'].items()})
            for r in log if r.get('dev')] for log in logs]
    one = len(names) == 1
    for name, epochs in zip(names, dev):
        for lang in dict.fromkeys(k for _, d in epochs for k in d) if one else ():
            ax.plot([e for e, d in epochs if lang in d], [d[lang] for e, d in epochs if lang in d], marker='o',
                    lw=2 if lang == 'en' else 1, label=lang)
        ax.plot([e for e, _ in epochs], [sum(d.values()) / len(d) for _, d in epochs], 'k--' if one else '-',
                marker='s', label='average' if one else name)
    loss = any(isinstance(v, dict) for log in logs for r in log for v in r.get('dev', {}).values())
    ax.set(xlabel='epoch', ylabel='held-out loss' if loss else 'dev score per language' if one else
           'dev score, average over languages')
    ax.xaxis.get_major_locator().set_params(integer=True)
    return any(dev)


def plot_test(ax, names, logs, results):
    tests = [{k: v for k, v in r.get('test', {}).items() if k not in ('avg', 'gap') and isinstance(v, (int, float))}
             for r in results]
    langs = sorted(dict.fromkeys(lang for t in tests for lang in t), key=lambda lang: lang != 'en')  # English first
    ax.figure.set_figwidth(max(7, 0.35 * len(langs) * len(names)))
    width = 0.8 / len(names)
    for i, (name, t, r) in enumerate(zip(names, tests, results)):
        bars = ax.bar([x + i * width for x in range(len(langs))], [t.get(lang, 0) for lang in langs], width,
                      label=name + (f' (gap {r["test"]["gap"]:.1f})' if 'gap' in r.get('test', {}) else ''))
        if 'en' in t:
            ax.axhline(t['en'], color=bars.patches[0].get_facecolor(), ls='--', lw=1)  # English's score
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(langs))], langs)
    ax.set(xlabel='language', ylabel='test score')
    ax.set_title('test per language; dashed: English, gap: English minus the other languages\' mean', fontsize='small')
    return any(tests)


# ----------------------------------------------------------------------------------------
# The papers' analyses of a run's predictions (--analyse NAME RUN ...): a table as JSON and text, and a figure.

def analyse(name, runs, out=None):
    """The analysis NAME (ANALYSES) of finished runs, written into out (default: the first run's analyses/): NAME.json
    (each run's table and the counts behind it), NAME.txt and, with matplotlib, NAME.png -> the paths written."""
    if name not in ANALYSES:
        raise EvalError(f'unknown analysis {name!r}: choose one of {", ".join(ANALYSES)}')
    tasks, compute, draw = ANALYSES[name]
    found = {}
    for run in runs:
        config = analysed_config(run)
        if tasks and config['task'] not in tasks:
            raise EvalError(f'{run} is a run of {config["task"]}: --analyse {name} reads runs of {" or ".join(tasks)}')
        table, counts, *points = compute(run, config)
        found[run] = {'table': table, 'counts': counts, **({'points': points[0]} if points else {})}
    stem = os.path.join(out or os.path.join(runs[0], 'analyses'), name)
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    tables = {run: result['table'] for run, result in found.items()}
    atomic_write(f'{stem}.json', json.dumps({'analysis': name, 'runs': found}, indent=1, ensure_ascii=False))
    atomic_write(f'{stem}.txt', '\n\n'.join(f'{run}\n{format_table(table)}' for run, table in tables.items()) + '\n')
    if (plt := pyplot()) is None:
        print(f'no {name}.png: a figure needs matplotlib (pip install matplotlib); the numbers are there')
        return [f'{stem}.json', f'{stem}.txt']
    fig = draw(plt, name, found)
    save_figure(fig, f'{stem}.png')
    plt.close(fig)
    return [f'{stem}.json', f'{stem}.txt', f'{stem}.png']


def analysed_config(run):
    """A finished run's config.json, its data folder found (the one it names, or the demo's in the run's folder) and
    its languages listed, English first."""
    if not os.path.isfile(os.path.join(run, 'results.json')):
        raise EvalError(f'{run} is not a finished run (no results.json): give the --out folder of a finished run')
    config = json.loads(read_text(os.path.join(run, 'config.json')))
    if not os.path.isdir(config.get('data_dir', '')) and os.path.isdir(os.path.join(run, 'demo-data')):
        config['data_dir'] = os.path.join(run, 'demo-data')
    if config['task'] in TASKS:  # the translation runs have a pair of languages, not a task's
        langs = config.get('langs') or languages(config['task'], is_demo(config['data_dir']))  # --langs, or every one
        config['langs'] = ['en'] + [lang for lang in langs if lang != 'en']  # English first: the others compare to it
    return config


def run_predictions(run, task, split, lang):
    """A run's dev or test predictions of one language (its dev ones where its dev sets are the task's own)."""
    path = os.path.join(run, 'predictions', task, f'{split}-{lang}.{suffix(task)}')
    if not os.path.isfile(path):
        raise EvalError(f'{path} is not there: the analysis reads the {split} predictions that a run of this version '
                        'writes; run it again')
    read = {'tagging': read_tag_file, 'qa': read_qa_file}.get(TASKS[task].family, read_labels)
    return read(path)


def tag_ngram_accuracy(english, gold, predicted, n):
    """XTREME's Table 4 and 10 (ours in detail, as its release has no code for it): over every window of n
    consecutive words in the dev sentences, whether its n predicted tags are all the gold ones, apart for the windows
    whose gold tag n-gram occurs in English's training sentences (seen) and those whose does not (unseen).
    -> {'seen': (right, windows), 'unseen': (right, windows)}"""
    seen = {tuple(tags[i:i + n]) for tags in english for i in range(len(tags) - n + 1)}
    counts = {'seen': [0, 0], 'unseen': [0, 0]}
    for tags, guess in zip(gold, predicted):
        for i in range(len(tags) - n + 1):
            kind = counts['seen' if tuple(tags[i:i + n]) in seen else 'unseen']
            kind[0] += tags[i:i + n] == guess[i:i + n]
            kind[1] += 1
    return {kind: tuple(count) for kind, count in counts.items()}


def pos_ngrams(run, config, orders=(3, 4)):
    """Table 4 and 10 of XTREME for a POS run: the accuracy on tag trigrams and 4-grams seen and unseen in English's
    training data, in each language from the run's dev predictions; avg: the other languages' mean, gap: English's
    score less that mean (the tables' 'difference'). -> ({row: {language: accuracy}}, {row: {language: windows}})"""
    data_dir = config['data_dir']
    english = [ex['tags'] for ex in data.read_split(data_dir, 'udpos', 'train', 'en')]
    table = {f'{n}-gram, {kind}': {} for n in orders for kind in ('seen', 'unseen')}
    counts = {row: {} for row in table}
    for lang in config['langs']:
        gold = [ex['tags'] for ex in data.read_split(data_dir, 'udpos', 'dev', lang)]
        predicted = run_predictions(run, 'udpos', 'dev', lang)
        for n in orders:
            for kind, (right, windows) in tag_ngram_accuracy(english, gold, predicted, n).items():
                counts[f'{n}-gram, {kind}'][lang] = windows
                if windows:
                    table[f'{n}-gram, {kind}'][lang] = 100 * right / windows
    for row in table.values():
        others = [score for lang, score in row.items() if lang != 'en']
        if others:
            row['avg'] = sum(others) / len(others)
        if others and 'en' in row:
            row['gap'] = row['en'] - row['avg']
    return table, counts


def shared_errors(run, config):
    """XTREME's Section 5 for a run of a task whose other languages translate English's examples: in each language,
    the share of the examples that English gets right that the language gets right too, and of those English gets
    wrong; for classification (XNLI, PAWS-X: the dev predictions) also the share on which the language predicts what
    English predicts (consistent). QA (XQuAD: the test predictions, scored by the data folder's labels) counts an
    answer right on an exact match. -> ({row: {language: percent}}, {language: the examples compared})"""
    task = config['task']
    right_en, predicted_en = judged(run, config, 'en')
    table = {'right where English is right': {}, 'right where English is wrong': {}, 'consistent with English': {}}
    counts = {'en': len(right_en)}
    for lang in config['langs'][1:]:
        right, predicted = judged(run, config, lang)
        counts[lang] = len(right)
        if right.keys() != right_en.keys():
            raise EvalError(f'{run}: the {task} examples of {lang} are not those of English: the analysis compares '
                            'parallel sets, whole')
        for row, where in (('right where English is right', True), ('right where English is wrong', False)):
            pairs = [right[key] for key in right_en if right_en[key] == where]
            if pairs:
                table[row][lang] = 100 * sum(pairs) / len(pairs)
        if predicted is not None:  # a QA answer is in its own language, and cannot match English's
            table['consistent with English'][lang] = 100 * sum(
                predicted[key] == predicted_en[key] for key in predicted) / len(predicted)
    for row in table.values():
        if row:
            row['avg'] = sum(row.values()) / len(row)
    return {row: scores for row, scores in table.items() if scores}, counts


def judged(run, config, lang):
    """-> ({example: right or not}, {example: prediction}, None for QA): dev examples by position, QA's by id."""
    task, data_dir = config['task'], config['data_dir']
    if TASKS[task].family != 'qa':
        gold = [ex['label'] for ex in data.read_split(data_dir, task, 'dev', lang)]
        predicted = dict(enumerate(run_predictions(run, task, 'dev', lang)))
        if len(predicted) != len(gold):
            raise EvalError(f'{run}: {len(predicted)} {lang} dev predictions for {len(gold)} examples: run it again')
        return {i: predicted[i] == label for i, label in enumerate(gold)}, predicted
    predicted = run_predictions(run, task, 'test', lang)
    labels = os.path.join(data_dir, 'labels', task, f'test-{lang}.{suffix(task)}')
    if not os.path.isfile(labels):
        raise EvalError(f'{labels} is not there: the analysis scores {task}\'s test answers against its labels')
    qas = [qa for article in read_qa_file(labels) for paragraph in article['paragraphs'] for qa in paragraph['qas']]
    right = {}
    for qa in qas:  # an exact match, after SQuAD's normalisation, with one of the gold answers
        answers = {normalize_answer(answer['text']) for answer in qa['answers']}
        right[qa['id']] = normalize_answer(predicted.get(qa['id'], '')) in answers
    return right, None


def ner_entities(run, config):
    """XTREME's Table 11 for a NER run (PAN-X): in each language, the accuracy on the dev entities (an entity is right
    when the run predicts its span and its type) that are (a) seen in English's training data, (b) not seen, (c) of
    at most two words, (d) of Latin letters alone, and (e) found at least twice in the language's dev data; then
    (a) - (b), and the least of (a) - (c), (a) - (d) and (a) - (e). The paper gives no code: an entity counts as
    seen here when its words are an English training entity's, or when at least two of its words are words of one.
    -> ({row: {language: accuracy}}, {set: {language: entities}})"""
    data_dir, task = config['data_dir'], 'panx'
    english = [tuple(ex['words'][begin:end + 1]) for ex in data.read_split(data_dir, task, 'train', 'en')
               for _, begin, end in tag_chunks([ex['tags']])]
    holding = {}  # a word -> the English entities that hold it
    for number, words in enumerate(english):
        for word in set(words):
            holding.setdefault(word, set()).add(number)
    exact = set(english)

    def seen(words):  # its words are an English entity's, or at least two of them are words of one
        shared = Counter(number for word in set(words) for number in holding.get(word, ()))
        return words in exact or max(shared.values(), default=0) >= 2
    sets = ('(a) seen', '(b) not seen', '(c) short', '(d) Latin', '(e) frequent')
    table, counts = {row: {} for row in sets + ('(a) - (b)', 'min((a) - (c-e))')}, {row: {} for row in sets}
    for lang in config['langs']:
        found = judged_entities(run, data_dir, lang)
        frequency = Counter(words for words, _ in found)
        member = {'(a) seen': seen, '(b) not seen': lambda words: not seen(words),
                  '(c) short': lambda words: len(words) <= 2, '(d) Latin': latin,
                  '(e) frequent': lambda words: frequency[words] >= 2}
        for row in sets:
            chosen = [right for words, right in found if member[row](words)]
            counts[row][lang] = len(chosen)
            if chosen:
                table[row][lang] = 100 * sum(chosen) / len(chosen)
        if lang in table['(a) seen'] and lang in table['(b) not seen']:
            table['(a) - (b)'][lang] = table['(a) seen'][lang] - table['(b) not seen'][lang]
        apart = [table['(a) seen'][lang] - table[row][lang] for row in sets[2:] if lang in table[row]]
        if lang in table['(a) seen'] and apart:
            table['min((a) - (c-e))'][lang] = min(apart)
    return {row: scores for row, scores in table.items() if scores}, counts


def judged_entities(run, data_dir, lang):
    """-> [(an entity's words, whether the run predicted its span and type)] of every entity in lang's dev data."""
    examples, predicted = data.read_split(data_dir, 'panx', 'dev', lang), run_predictions(run, 'panx', 'dev', lang)
    if len(predicted) != len(examples):
        raise EvalError(f'{run}: {len(predicted)} {lang} dev predictions for {len(examples)} sentences: run it again')
    found = []
    for ex, guess in zip(examples, predicted):
        guessed = tag_chunks([guess])
        found += [(tuple(ex['words'][chunk[1]:chunk[2] + 1]), chunk in guessed) for chunk in tag_chunks([ex['tags']])]
    return found


def latin(words):
    """Are all the letters of words Latin ones (and is there one)?"""
    letters = [c for word in words for c in word if unicodedata.category(c).startswith('L')]
    return bool(letters) and all('LATIN' in unicodedata.name(c, '') for c in letters)


def xla_epochs(run, config):
    """XLA's Figure 2: each model's --train_lang dev score after its warm-up and at the end of each co-teaching epoch,
    from the results.json of each of its trainings (epoch<e>/model<l>-by<k><j>/), in the order the epoch trains
    them (XLA.co_teaching). A training that was not better leaves the score it found.
    -> ({model: {stage: score}}, {model: the trainings read})"""
    if config.get('method') != 'xla':
        raise EvalError(f'{run} is a run of {config.get("method")}: --analyse xla-epochs reads XLA runs')
    epochs = sorted(int(name[5:]) for name in os.listdir(run) if re.fullmatch(r'epoch\d+', name))
    table, counts = {}, {}
    for e in epochs:
        folder = os.path.join(run, f'epoch{e}')
        # a model's trainings in name order are those of the epoch: by<k><j> before by<j><k> for k < j (--single: one)
        for name in sorted(name for name in os.listdir(folder) if re.fullmatch(r'model\d-by\d\d', name)):
            path, model = os.path.join(folder, name, 'results.json'), f'model {name[5]}'
            if not os.path.isfile(path):
                continue
            result, scores = json.loads(read_text(path)), table.setdefault(model, {})
            if result['dev_before'] is not None:
                scores.setdefault('warm-up', result['dev_before'])  # a model's first training starts from it
            if (score := result['dev_after'] if result['better'] else result['dev_before']) is not None:
                scores[f'epoch {e}'] = score
            counts[model] = counts.get(model, 0) + 1
    if not table:
        raise EvalError(f'{run} holds no XLA training\'s results (epoch<e>/model<l>-by<k><j>/results.json): give a '
                        'finished XLA run')
    return dict(sorted(table.items())), counts


# XTREME's Table 5, as the paper prints it: each language's Wikipedia articles (millions), script and family.
LANGUAGE_FACTS = {
    'af': (0.09, 'Latin', 'IE: Germanic'), 'ar': (1.02, 'Arabic', 'Afro-Asiatic'), 'eu': (0.34, 'Latin', 'Basque'),
    'bn': (0.08, 'Brahmic', 'IE: Indo-Aryan'), 'bg': (0.26, 'Cyrillic', 'IE: Slavic'),
    'en': (5.98, 'Latin', 'IE: Germanic'), 'my': (0.05, 'Brahmic', 'Sino-Tibetan'),
    'nl': (1.99, 'Latin', 'IE: Germanic'), 'et': (0.20, 'Latin', 'Uralic'), 'fi': (0.47, 'Latin', 'Uralic'),
    'fr': (2.16, 'Latin', 'IE: Romance'), 'ka': (0.13, 'Georgian', 'Kartvelian'), 'de': (2.37, 'Latin', 'IE: Germanic'),
    'el': (0.17, 'Greek', 'IE: Greek'), 'he': (0.25, 'Hebrew', 'Afro-Asiatic'),
    'hi': (0.13, 'Devanagari', 'IE: Indo-Aryan'), 'hu': (0.46, 'Latin', 'Uralic'),
    'id': (0.51, 'Latin', 'Austronesian'), 'it': (1.57, 'Latin', 'IE: Romance'), 'ja': (1.18, 'Ideograms', 'Japonic'),
    'jv': (0.06, 'Brahmic', 'Austronesian'), 'kk': (0.23, 'Arabic', 'Turkic'), 'ko': (0.47, 'Hangul', 'Koreanic'),
    'ms': (0.33, 'Latin', 'Austronesian'), 'ml': (0.07, 'Brahmic', 'Dravidian'),
    'zh': (1.09, 'Chinese ideograms', 'Sino-Tibetan'), 'mr': (0.06, 'Devanagari', 'IE: Indo-Aryan'),
    'fa': (0.70, 'Perso-Arabic', 'IE: Iranian'), 'pt': (1.02, 'Latin', 'IE: Romance'),
    'ru': (1.58, 'Cyrillic', 'IE: Slavic'), 'es': (1.56, 'Latin', 'IE: Romance'), 'sw': (0.05, 'Latin', 'Niger-Congo'),
    'tl': (0.08, 'Brahmic', 'Austronesian'), 'ta': (0.12, 'Brahmic', 'Dravidian'), 'te': (0.07, 'Brahmic', 'Dravidian'),
    'th': (0.13, 'Brahmic', 'Kra-Dai'), 'tr': (0.34, 'Latin', 'Turkic'), 'ur': (0.15, 'Perso-Arabic', 'IE: Indo-Aryan'),
    'vi': (1.24, 'Latin', 'Austro-Asiatic'), 'yo': (0.03, 'Arabic', 'Niger-Congo')}


def run_scores(run, config):
    """A finished run's test score in each of its languages that XTREME's Table 5 lists (results.json)."""
    test = json.loads(read_text(os.path.join(run, 'results.json'))).get('test', {})
    return {lang: test[lang] for lang in config['langs'] if lang in LANGUAGE_FACTS and lang in test}


def wikipedia(run, config):
    """XTREME's Figure 2 and Table 9: a run's test score in each language beside its Wikipedia articles, and
    Pearson's rho of the two. -> ({task: {language: score}}, {'articles': {language: millions}, 'rho': rho})"""
    scores = run_scores(run, config)
    articles = {lang: LANGUAGE_FACTS[lang][0] for lang in scores}
    rho = float(np.corrcoef(list(scores.values()), list(articles.values()))[0, 1]) if len(scores) > 2 else None
    return {config['task']: scores}, {'articles': articles, 'rho': rho}


def families(run, config):
    """XTREME's Figures 3 and 6: a run's mean test score in each family and script, named with its number of
    languages and ordered by their mean Wikipedia articles (low-resource first). -> (table, {group: languages})"""
    table, counts, scores = {}, {}, run_scores(run, config)
    for kind, column in (('family', 2), ('script', 1)):
        groups = {}
        for lang, score in scores.items():
            groups.setdefault(LANGUAGE_FACTS[lang][column], []).append((LANGUAGE_FACTS[lang][0], score, lang))
        ordered = sorted(groups.items(), key=lambda group: np.mean([articles for articles, _, _ in group[1]]))
        table[kind] = {f'{name} ({len(rows)})': np.mean([score for _, score, _ in rows]) for name, rows in ordered}
        counts[kind] = {name: [lang for _, _, lang in rows] for name, rows in ordered}
    return table, counts


def draw_wikipedia(plt, name, found):
    """Figure 2: each run's scores against the languages' Wikipedia articles (log scale), with its linear fit."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, result in found.items():
        (task, scores), = result['table'].items()
        x, y = np.array([result['counts']['articles'][lang] for lang in scores]), np.array(list(scores.values()))
        rho = result['counts']['rho']
        dots = ax.scatter(x, y, label=f'{task} ({os.path.basename(os.path.normpath(run))})' + (
            '' if rho is None else f', rho {rho:.2f}'))
        for lang, at, score in zip(scores, x, y):
            ax.annotate(lang, (at, score), fontsize='x-small')
        if len(x) > 1:
            line = np.linspace(x.min(), x.max(), 50)
            ax.plot(line, np.polyval(np.polyfit(x, y, 1), line), color=dots.get_facecolor()[0], lw=1)
    ax.set(xscale='log', xlabel='Wikipedia articles (millions, XTREME\'s Table 5)', ylabel='test score', title=name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize='small')
    return fig


def draw_families(plt, name, found):
    """Figures 3 and 6: a panel a grouping (family, script), a bar a run, the groups along x."""
    panels = {f'{name}: by {kind}': {os.path.normpath(run): found[run]['table'][kind] for run in found}
              for kind in ('family', 'script')}
    return bar_panels(plt, panels, 'mean test score')


def representations(run, config):
    """X-Mixup's Figures 1 and 4: the test sets' sentence representations (best.pt's encoder) reduced to two
    dimensions by one PCA over all the run's languages: each centroid, its distance to English's in the full space,
    and the points of Figure 1's four languages (en, es, ar, sw) or the run's own. -> (table, counts, points)"""
    encoder, tok, settings, device = run_encoder(run)
    settings['data_dir'] = config['data_dir']  # the demo's data, found in the run's folder
    embedded = {lang: encoded(encoder, tok, settings, device, lang) for lang in config['langs']}
    together = np.concatenate(list(embedded.values()))
    mean, axes = pca(together)
    centre = {lang: x.mean(0) for lang, x in embedded.items()}
    flat = {lang: (c - mean) @ axes for lang, c in centre.items()}  # each centroid on the two axes
    table = {'centroid, first axis': {lang: float(c[0]) for lang, c in flat.items()},
             'centroid, second axis': {lang: float(c[1]) for lang, c in flat.items()},
             'distance to English': {lang: float(np.linalg.norm(c - centre['en'])) for lang, c in centre.items()}}
    figure_1 = [lang for lang in ('en', 'es', 'ar', 'sw') if lang in flat]
    shown = (figure_1 + [lang for lang in flat if lang not in figure_1])[:4]  # the run's others where it lacks some
    points = {'points': {lang: ((embedded[lang] - mean) @ axes).round(3).tolist() for lang in shown},
              'centroids': {lang: c.round(3).tolist() for lang, c in flat.items()}}
    return table, {lang: len(x) for lang, x in embedded.items()}, points


def pca(x, dims=2):
    """-> (the mean of x's rows, its `dims` directions of largest variance as columns, each signed so that its
    largest entry is positive: the same axes every time)."""
    mean = x.mean(0)
    values, vectors = np.linalg.eigh(np.cov(x - mean, rowvar=False))
    axes = vectors[:, np.argsort(values)[::-1][:dims]]
    return mean, axes * np.sign(axes[np.abs(axes).argmax(0), range(dims)])


def draw_points(plt, name, found):
    """Figures 1 and 4 (and XLA's 3): a panel a run, each group's points and its centroid (a labelled cross)."""
    fig, axes = plt.subplots(1, len(found), figsize=(5 * len(found), 4.5), squeeze=False)
    for ax, (run, result) in zip(axes[0], found.items()):
        for group, xy in result['points']['points'].items():
            ax.scatter(*np.array(xy).reshape(-1, 2).T, s=3, alpha=0.3, label=group)
        for group, (x, y) in result['points']['centroids'].items():
            ax.scatter(x, y, marker='x', color='black')
            ax.annotate(group, (x, y), fontsize='small')
        ax.set(title=f'{name}: {os.path.normpath(run)}', xlabel='first axis', ylabel='second axis')
        ax.legend(fontsize='small', markerscale=3)
    return fig


def bleu_curve(run, config):
    """VECO's Figure 4 (right): the test BLEU of each kept checkpoint (results.json's curve, made by --curve)."""
    curve = json.loads(read_text(os.path.join(run, 'results.json'))).get('curve')
    if config.get('task') != 'translate' or not curve:
        raise EvalError(f'{run} has no BLEU curve: give a VECO translation run made with --curve')
    return {'BLEU': curve}, {'checkpoints': len(curve)}


def draw_curves(plt, name, found):
    """A line a run: its table's row against the steps."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, result in found.items():
        (row, values), = result['table'].items()
        ax.plot([int(step) for step in values], list(values.values()), marker='o', label=os.path.normpath(run))
        ax.set(xlabel='step', ylabel=f'test {row}', title=name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize='small')
    return fig


def xla_losses(run, config, kept=0.8):
    """XLA's Figures 4 to 6 from a warm-up's labels of each target training set (train.py --predict train-<lang>):
    a sentence's loss is the mean of -log p of its predicted tags (DISTIL's), accurate-2 means at most two wrong
    tags, and DISTIL keeps the `kept` most confident share (Table 8's first epoch). -> (table, counts, points)"""
    table, counts, points = {}, {}, {}
    for lang in config['langs'][1:]:
        found = predicted_with_gold(run, config, 'train', lang)
        if not found:
            continue
        probs = [np.array(p['probability']) for p, _ in found]
        loss, length = np.array([-np.log(p).mean() for p in probs]), np.array([len(p) for p in probs])
        wrong = np.array([sum(t != g for t, g in zip(p['tags'], gold)) for p, gold in found])
        confidence, clean = np.array([p.mean() for p in probs]), wrong <= 2
        keep = np.zeros(len(found), bool)
        keep[np.argsort(-confidence, kind='stable')[:math.floor(round(kept * len(found), 6))]] = True
        points[lang] = {'loss': loss.tolist(), 'length': length.tolist(), 'wrong': wrong.tolist(),
                        'accurate-2': clean.tolist(), 'kept': keep.tolist()}
        for row, value in (('accurate-2, % of sentences', 100 * clean.mean()),
                           ('loss, accurate-2', loss[clean].mean() if clean.any() else None),
                           ('loss, noisy', loss[~clean].mean() if (~clean).any() else None),
                           ('length, all', length.mean()), ('length, kept', length[keep].mean())):
            if value is not None:
                table.setdefault(row, {})[lang] = float(value)
        counts[lang] = len(found)
    if not points:
        raise EvalError(f'{run} holds no predicted/train-<lang>.scores.json: label the target training sets first '
                        f'(python train.py --out {run} --predict train-<lang>)')
    return table, counts, points


def predicted_with_gold(run, config, split, lang):
    """A run's --predict output of a tagging split, each sentence's prediction with its gold tags, or [] without it."""
    path = os.path.join(run, 'predicted', f'{split}-{lang}.scores.json')
    if not os.path.isfile(path):
        return []
    predicted = json.loads(read_text(path))['predictions']
    gold = [ex['tags'] for ex in data.read_split(config['data_dir'], config['task'], split, lang)]
    if len(gold) != len(predicted):
        raise EvalError(f'{path} holds {len(predicted)} sentences and {lang}\'s {split} set {len(gold)}: predict the '
                        'split of the run\'s data folder')
    return list(zip(predicted, gold))


def draw_losses(plt, name, found):
    """Figures 4 to 6, a row a run and language: the losses of accurate-2 and noisy sentences, the loss against
    the length, and the lengths of all sentences and of those kept."""
    rows = [(run, lang, each) for run, result in found.items() for lang, each in result['points'].items()]
    fig, axes = plt.subplots(len(rows), 3, figsize=(13, 3.4 * len(rows)), squeeze=False)
    for (run, lang, each), (hist, scatter, lengths) in zip(rows, axes):
        loss, clean = np.array(each['loss']), np.array(each['accurate-2'])
        hist.hist([loss[clean], loss[~clean]], bins=30, label=['accurate-2', 'noisy'])
        scatter.scatter(each['length'], loss, s=3, alpha=0.4, c=np.where(clean, 'tab:blue', 'tab:orange'))
        lengths.hist([np.array(each['length']), np.array(each['length'])[each['kept']]], bins=30, label=['all', 'kept'])
        hist.set(title=f'losses: {os.path.normpath(run)}, {lang}', xlabel='loss')
        scatter.set(title='loss against length', xlabel='words', ylabel='loss')
        lengths.set(title='lengths, all and kept', xlabel='words')
        hist.legend(fontsize='small')
        lengths.legend(fontsize='small')
    return fig


def xla_logits(run, config):
    """XLA's Figure 3 from a warm-up's labels of a target dev set (train.py --predict dev-<lang>): each word's
    log-probabilities reduced by PCA (the paper: t-SNE) and grouped by gold tag, and each tag's accuracy."""
    for lang in config['langs'][1:]:
        if found := predicted_with_gold(run, config, 'dev', lang):
            logp = np.log(np.maximum([d for p, _ in found for d in p['distribution']], 1e-6))
            gold = [tag for _, tags in found for tag in tags]
            right = np.array([t == g for p, tags in found for t, g in zip(p['tags'], tags)])
            mean, axes = pca(logp)
            flat = (logp - mean) @ axes
            tags = sorted(set(gold), key=gold.index)
            rows = {tag: np.array([g == tag for g in gold]) for tag in tags}
            table = {f'accuracy by gold tag, {lang}': {tag: 100 * right[rows[tag]].mean() for tag in tags}}
            return table, {lang: len(gold)}, {'points': {tag: flat[rows[tag]].round(3).tolist() for tag in tags},
                                               'centroids': {tag: flat[rows[tag]].mean(0).round(3).tolist()
                                                             for tag in tags}}
    raise EvalError(f'{run} holds no predicted/dev-<lang>.scores.json: label a target dev set first '
                    f'(python train.py --out {run} --predict dev-<lang>)')


def draw_bars(plt, name, found):
    """Each run's table as grouped bars, a panel a run: the columns along x (languages, most often), a bar a row."""
    panels = {f'{name}: {os.path.normpath(run)}': result['table'] for run, result in found.items()}
    return bar_panels(plt, panels, '%')


def bar_panels(plt, panels, ylabel):
    """panels {title: {bar: {x: value}}} as grouped bars, a panel a title -> the figure."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), squeeze=False)
    for ax, (title, table) in zip(axes[:, 0], panels.items()):
        xs = list(dict.fromkeys(x for row in table.values() for x in row if x != 'gap'))
        width = 0.8 / max(1, len(table))
        for i, (row, values) in enumerate(table.items()):
            ax.bar([x + i * width for x in range(len(xs))], [values.get(x, 0) for x in xs], width, label=row)
        ax.set_xticks([x + width * (len(table) - 1) / 2 for x in range(len(xs))], xs,
                      rotation=30 if max(map(len, xs), default=0) > 4 else 0, fontsize='small')
        ax.set(title=title, ylabel=ylabel)
        ax.grid(alpha=0.3, axis='y')
        ax.legend(fontsize='small', loc='lower right')
    return fig


# each analysis: the tasks of the runs it reads (None: any), the function that computes its tables, and its figure
ANALYSES = {'pos-ngrams': (('udpos',), pos_ngrams, draw_bars),
            'ner-entities': (('panx',), ner_entities, draw_bars),
            'shared-errors': (('xnli', 'pawsx', 'xquad'), shared_errors, draw_bars),
            'xla-epochs': (('conll', 'panx', 'xnli', 'pawsx'), xla_epochs, draw_bars),
            'wikipedia': (XTREME, wikipedia, draw_wikipedia),
            'families': (XTREME, families, draw_families),
            'representations': (('xnli', 'pawsx', 'udpos', 'panx'), representations, draw_points),
            'bleu-curve': (('translate',), bleu_curve, draw_curves),
            'xla-losses': (('conll', 'panx'), xla_losses, draw_losses),
            'xla-logits': (('conll', 'panx'), xla_logits, draw_points)}


def pyplot():
    """matplotlib's pyplot, drawing into files alone (no window), or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path):
    """The figure as a PNG at path, written whole (a temporary file moved into place) -> path."""
    fig.tight_layout()
    fig.savefig(f'{path}.tmp.png', dpi=120)
    os.replace(f'{path}.tmp.png', path)
    return path


# ----------------------------------------------------------------------------------------
# The command line.

def bleu_line(s):
    """The one-line summary sacreBLEU prints."""
    ratio = s['sys_len'] / s['ref_len'] if s['ref_len'] else 0
    return (f"BLEU = {s['bleu']:.2f} {'/'.join(f'{p:.1f}' for p in s['precisions'])} (BP = {s['bp']:.3f} "
            f"ratio = {ratio:.3f} hyp_len = {s['sys_len']} ref_len = {s['ref_len']})")


def main(argv=None):
    parser = Parser(description='Score a prediction folder in the XTREME submission layout, gather finished runs into '
                                'one (--collect), plot runs (--plot), or BLEU of a text file (--bleu).')
    parser.add_argument('--predictions', help='folder with <task>/test-<lang>.<tsv|json>')
    parser.add_argument('--labels', help='gold labels in the same layout (with --collect: optional)')
    parser.add_argument('--out', help='scores.json, with the leaderboard\'s keys (--collect: the submission folder; '
                                      '--plot: the figures\' folder, default RUN/plots; --bleu: optional, BLEU\'s)')
    parser.add_argument('--collect', nargs='+', metavar='RUN', help='finished run folders, one per task: their test '
                                                                     'predictions become one submission folder (--out)')
    parser.add_argument('--plot', nargs='+', metavar='RUN', help='PNG figures of these runs (several: overlaid); '
                                                                  'needs matplotlib')
    parser.add_argument('--demo', action='store_true', help='score the demo\'s languages instead of XTREME\'s '
                                                            '(--collect: the default when every run is a demo run)')
    parser.add_argument('--bleu', metavar='HYP', help='BLEU of this text file (one sentence per line) against --ref')
    parser.add_argument('--ref', help='the references of --bleu, one per line')
    parser.add_argument('--tokenized', action='store_true', help='--bleu of tokenised files as multi-bleu.perl -lc')
    parser.add_argument('--cka', metavar='RUN', help='X-Mixup\'s CKA of a finished XNLI or PAWS-X run\'s English and '
                                                     'target representations, per language, and its Spearman\'s rho '
                                                     'with the run\'s test scores (--out: optional, a JSON)')
    parser.add_argument('--eval_batch_size', type=int, default=64, help='--cka: examples a batch')
    parser.add_argument('--analyse', nargs='+', metavar='NAME_AND_RUNS', help='NAME RUN [RUN ...]: a paper\'s '
                        f'analysis of finished runs ({", ".join(ANALYSES)}; docs/evaluation.md), written to --out '
                        '(default: RUN/analyses) as NAME.json, NAME.txt and NAME.png')
    args = parser.parse_args(argv)
    modes = [name for name in ('analyse', 'bleu', 'cka', 'collect', 'plot', 'predictions') if getattr(args, name)]
    if len(modes) > 1:
        sys.exit(f'error: --{" and --".join(modes)} are different modes: give one')
    try:
        if args.bleu or args.ref or args.tokenized:
            return bleu_main(args)
        if args.cka:
            return cka_main(args)
        if args.analyse and len(args.analyse) < 2:
            sys.exit(f'error: --analyse takes NAME RUN [RUN ...]: an analysis ({", ".join(ANALYSES)}) and finished '
                     'runs')
        if args.analyse or args.plot:
            paths = (analyse(args.analyse[0], args.analyse[1:], args.out) if args.analyse else
                     plot(args.plot, args.out or os.path.join(args.plot[0], 'plots')))
            for path in paths:
                print(f'wrote {path}')
            return
        if args.collect:
            return collect_main(args)
        if missing := [f'--{name}' for name in ('predictions', 'labels', 'out') if not getattr(args, name)]:
            sys.exit(f'error: {", ".join(missing)} missing: give --predictions DIR --labels DIR --out FILE, '
                     '--collect RUN [RUN ...] --out DIR, --plot RUN [RUN ...] or --bleu HYP --ref REF')
        if not (scores := score_folder(args.predictions, args.labels, args.demo)):
            sys.exit(f'error: no task folder is in both {args.predictions} and {args.labels}: '
                     'expected e.g. xnli/test-en.tsv')
        atomic_write(args.out, json.dumps(scores, indent=2, ensure_ascii=False))
    except (EvalError, DataError, OSError) as e:
        sys.exit(f'error: {e}')
    print(xtreme_table(scores, args.demo))


def cka_main(args):
    """--cka RUN: X-Mixup's linear CKA (Eq. 1, Tables 2 and 7, Fig. 3) between English's and each language's
    representations of the task's parallel test sets (row i of each translates row i of English's: XNLI, PAWS-X)
    with RUN's fine-tuned encoder (best.pt), the mean of a text pair's states after the last layer (the paper's
    sentence representation, its Figure 1), and Spearman's rho between the languages' CKA and RUN's test scores."""
    encoder, tok, settings, device = run_encoder(args.cka, args.eval_batch_size)
    task, data_dir = settings['task'], settings['data_dir']
    if task not in TASKS or TASKS[task].family != 'classification':
        raise EvalError(f'--cka compares the parallel test sets of XNLI and PAWS-X, not {task}\'s: give such a run')
    embed = lambda lang: encoded(encoder, tok, settings, device, lang)
    english, scores, ckas = embed('en'), json.loads(read_text(os.path.join(args.cka, 'results.json')))['test'], {}
    for lang in (lang for lang in languages(task, is_demo(data_dir)) if lang != 'en'):
        target = embed(lang)
        if len(target) != len(english):
            raise EvalError(f'{task}\'s test set has {len(target)} examples in {lang} and {len(english)} in English: '
                            '--cka needs the parallel test sets as XTREME ships them')
        ckas[lang] = linear_cka(torch.from_numpy(english), torch.from_numpy(target))
    rho = spearman([ckas[lang] for lang in ckas], [scores[lang] for lang in ckas]) if set(ckas) <= set(scores) else None
    out = {'run': args.cka, 'task': task, 'cka': ckas, 'test': {lang: scores.get(lang) for lang in ckas}, 'rho': rho}
    if args.out:
        atomic_write(args.out, json.dumps(out, indent=2))
    print(format_table({'CKA with English': {k: 100 * v for k, v in ckas.items()}, 'test': out['test']}))
    print(f'Spearman\'s rho of CKA and test score over {len(ckas)} languages: ' + ('no test scores (no labels)'
                                                                                  if rho is None else f'{rho:.3f}'))


def run_encoder(run, batch_size=64):
    """A finished run's fine-tuned encoder (best.pt) on the GPU where there is one -> (the encoder, its tokenizer,
    the run's settings with batch_size, the device)."""
    ckpt = layers.load_checkpoint(os.path.join(run, 'best.pt'))
    meta, settings = ckpt['meta'], {**ckpt['meta']['settings'], 'batch_size': batch_size}
    cfg = layers.stored_config(ckpt['config'])
    tok = data.tokenizer(cfg.backbone, meta['tokenizer'][0], meta['lower'], (meta['tokenizer'][1:] or [None])[0])
    encoder = layers.Encoder(cfg)
    encoder.load_state_dict(ckpt['encoder'])
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    return encoder.to(device), tok, settings, device


def encoded(encoder, tok, settings, device, lang):
    """The sentence representations of a language's test set (states) as a float64 array, a row an example."""
    task = settings['task']
    examples = data.read_split(settings['data_dir'], task, 'test', lang)
    feats = data.make_features(tok, task, examples, settings.get('max_len'))
    return states(encoder, feats, tok.pad, settings['batch_size'], device).double().numpy()


@torch.no_grad()
def states(encoder, feats, pad, batch_size, device):
    """Each feature's (a text pair as the run read it) mean state after the last layer, on the CPU."""
    out = torch.zeros(len(feats), encoder.cfg.dim)
    for index in length_batches(item_lengths(feats)[:, 0], batch_size):
        b = collate([feats[i] for i in index], pad_id=pad).to(device)
        out[index] = mean_pool(encoder.eval()(b.ids, b.mask), b.mask).float().cpu()
    return out


def spearman(x, y):
    """Spearman's rank correlation: Pearson's of the ranks, tied values given their mean rank."""
    def ranks(v):
        v = np.asarray(v, float)
        return np.array([np.flatnonzero(np.sort(v) == value).mean() for value in v])
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def bleu_main(args):
    """--bleu: BLEU of two UTF-8 text files, line i against line i (an empty line is an empty sentence)."""
    if not (args.bleu and args.ref) or args.predictions or args.labels:
        sys.exit('error: BLEU takes --bleu HYP --ref REF [--tokenized] [--out FILE], without --predictions/--labels')
    for path in (args.bleu, args.ref):
        if not os.path.isfile(path):
            raise EvalError(f'{path} is not there')
    hyps, refs = list(read_lines(args.bleu)), list(read_lines(args.ref))
    if len(hyps) != len(refs):
        raise EvalError(f'{args.bleu} has {len(hyps)} lines, {args.ref} has {len(refs)}: '
                        'write one hypothesis per reference line')
    scores = (tokenized_bleu if args.tokenized else bleu)(hyps, refs)
    if args.out:
        atomic_write(args.out, json.dumps(scores, indent=2))
    print(bleu_line(scores))
    print(scores['signature'])


def collect_main(args):
    """--collect: the submission folder, its gaps (a line each) and, given --labels, its XTREME table."""
    if not args.out:
        sys.exit('error: --collect needs --out DIR, the submission folder to write')
    if len(kinds := {run_is_demo(run) for run in args.collect}) > 1:
        sys.exit('error: some runs are on the demo\'s data and some on XTREME\'s: collect one kind')
    demo = args.demo or kinds == {True}
    gaps = collect(args.collect, args.out, demo)
    for gap in gaps:
        print(f'missing: {gap}')
    incomplete = {g.split(':')[0] for g in gaps}  # each gap begins '<task>:'
    print(f'submission in {args.out}: {len(XTREME) - len(incomplete)} of {len(XTREME)} tasks complete')
    print(collect_figure(args.collect, args.out))
    groups = {}  # runs of one command differ in --seed and in options that leave results alike (--out, ...)
    for run in args.collect:
        config = json.loads(read_text(f'{run}/config.json')) if os.path.isfile(f'{run}/config.json') else {}
        same = set(config.get('changes_nothing', ['out'])) | {'seed', 'changes_nothing'}  # recorded by Folder.begin
        command = json.dumps({k: v for k, v in config.items() if k not in same}, sort_keys=True)
        groups.setdefault((finished_task(run), command), []).append((run, config.get('seed')))
    for (task, command), runs in ((k, r) for k, r in groups.items() if len(r) > 1):  # the papers' ± std over seeds
        print(f'{task}, {json.loads(command).get("method")}, test, mean ± std over {len(runs)} runs (--seed '
              f'{", ".join(str(seed) for _, seed in runs)}):\n{seed_table([run for run, _ in runs])}')
    if args.labels:
        scores = score_folder(args.out, args.labels, demo, [t for t in XTREME if t not in incomplete])
        print(xtreme_table(scores, demo) if scores else f'no labels in {args.labels} for the complete tasks')


if __name__ == '__main__':
    main()
